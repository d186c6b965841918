"""Counter-based ``Exp(1)`` noise for sampling.

A row's noise is a pure function of (key, position of the token being drawn, vocabulary
index). A seeded request's key comes from its seed, so its tokens depend on nothing else:
not on the other rows of the batch, nor on how many steps ran before, and they repeat
exactly when a preempted request is recomputed. An unseeded row's key comes from the
sampler's call count (``effective_keys``), so it draws afresh at every step. The hash is
integer arithmetic on int64 tensors, so CPU and GPU give the same bits; the race kernel
(kernels/sampling_race.py) computes the same hash in uint32.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: products of a 32-bit value stay below 2**63, so the int64
# arithmetic never overflows and CPU and GPU agree bit for bit.
_MUL_A = 0x7FEB352D
_MUL_B = 0x2C1B3C6D
VOCAB_SALT = 0x5BD1E995


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) on int64 tensors holding [0, 2**32)."""
    x = x ^ (x >> 16)  # a new tensor: the input stays as it was
    # In place from here: a whole row of noise on the CPU is memory bound (7.0 -> 4.1 ms for
    # 8 x 151,936 values).
    x.mul_(_MUL_A).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MUL_B).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def mix32_int(x: int) -> int:
    """``mix32`` of one Python int."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * _MUL_A) & _MASK32
    x ^= x >> 15
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A 64-bit (or negative) request seed folded into a 32-bit key."""
    seed &= (1 << 64) - 1
    return mix32_int(mix32_int(seed) ^ (seed >> 32))


def effective_keys(keys: torch.Tensor, call_key: int) -> torch.Tensor:
    """Each row's noise key: its seed's key, or where that is -1 (no seed) a key of the
    sampler's call (``call_key``, below 2**31) and the row's index."""
    index = torch.arange(keys.shape[0], dtype=torch.int64, device=keys.device)
    return torch.where(keys >= 0, keys, mix32((index ^ call_key) & _MASK32))


_salts: dict[tuple[int, torch.device], torch.Tensor] = {}


def vocab_salt(vocab: int, device: torch.device) -> torch.Tensor:
    """``[vocab]`` int64: each vocabulary index's share of the hash (made once per device;
    callers must not write to it)."""
    key = (vocab, torch.device(device))
    salt = _salts.get(key)
    if salt is None:
        index = torch.arange(vocab, dtype=torch.int64, device=device)
        salt = _salts[key] = mix32(index ^ VOCAB_SALT)
    return salt


def seeded_exponentials(
    keys: torch.Tensor, positions: torch.Tensor, salt: torch.Tensor
) -> torch.Tensor:
    """``Exp(1)`` noise, a pure function of (key, position, vocabulary index).

    ``salt``: ``vocab_salt`` ``[vocab]`` for every entry of each row (the result is
    ``[len(keys), vocab]``), or ``[len(keys), K]``, the salts of each row's own K
    vocabulary indices (the same noise those entries get in the full row)."""
    row = mix32(keys ^ mix32(positions & _MASK32)).unsqueeze(1)
    bits = mix32(row ^ (salt.unsqueeze(0) if salt.dim() == 1 else salt))
    # 23 bits -> a float32 uniform strictly inside (0, 1). (With 24, the top value rounds to
    # 1.0: its E is 0 and its -log E infinite, so that token would win the race whatever
    # its score, or tie a masked -inf score into a NaN.)
    uniform = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(uniform)
