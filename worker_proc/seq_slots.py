"""Persistent per-sequence state on the device, one row ("slot") per live sequence.

- ``block_tables [capacity + 1, max_blocks_per_seq] int32``: each sequence's physical KV
  blocks. Plans send only the blocks a sequence gains, so the table is updated in place
  from those diffs, and a step's block tables are a device gather of its rows, instead of a
  host-built ``[batch, max_blocks]`` array uploaded every step.
- ``last_token [capacity + 1] int64``: the token each sequence sampled last. Step N writes
  it on the device and step N+1 reads its decode inputs from it, so step N+1 can be built
  and launched before step N's tokens reach the host (overlapped scheduling).

The last row is a scratch slot that no sequence owns: padding rows of a CUDA-graph batch
point at it (its block table row stays all zeros). The table grows by doubling when more
sequences are live than it has rows; the scratch slot moves to the new last row.
"""

from __future__ import annotations

import torch


class SlotTable:
    def __init__(self, capacity: int, max_blocks_per_seq: int, device: torch.device) -> None:
        if capacity < 1 or max_blocks_per_seq < 1:
            raise ValueError("a slot table needs at least one slot and one block per slot")
        self.device = device
        self.max_blocks_per_seq = max_blocks_per_seq
        self.capacity = capacity
        self.block_tables = torch.zeros(
            (capacity + 1, max_blocks_per_seq), dtype=torch.int32, device=device
        )
        self.last_token = torch.zeros(capacity + 1, dtype=torch.int64, device=device)
        # Popped from the end: low slots first, which keeps the live rows compact.
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def scratch_slot(self) -> int:
        return self.capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            self._grow(2 * self.capacity)
        return self._free.pop()

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise ValueError(f"slot {slot} is outside [0, {self.capacity})")
        self._free.append(slot)

    def _grow(self, capacity: int) -> None:
        # Copies are queued on the stream behind any kernel still reading the old tensors.
        old = self.capacity
        tables = torch.zeros(
            (capacity + 1, self.max_blocks_per_seq), dtype=torch.int32, device=self.device
        )
        tables[:old].copy_(self.block_tables[:old])
        last = torch.zeros(capacity + 1, dtype=torch.int64, device=self.device)
        last[:old].copy_(self.last_token[:old])
        self.block_tables, self.last_token = tables, last
        self.capacity = capacity
        self._free.extend(range(capacity - 1, old - 1, -1))
        self._free.sort(reverse=True)

    def write_blocks(self, flat_index: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Scatter new block ids: ``flat_index = slot * max_blocks_per_seq + column``."""
        if flat_index.numel():
            self.block_tables.view(-1).index_copy_(0, flat_index, block_ids)
