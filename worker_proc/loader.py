"""Builds the model on its device and streams the checkpoint into it.

Parameters are created directly on the target device in the target dtype (no host copy of
the whole model), and safetensors shards are read tensor by tensor, each handed to the
model's ``load_weights`` and released before the next, so peak extra memory is one tensor.

Each tensor reaches its layer's ``weight_loader`` unread, as a ``WeightSlice``: a sharded
layer narrows it to its tensor-parallel rank's range, and only that range is read from the
file, so each rank reads its own slice of every sharded tensor (weight_slice.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

from worker_proc.model_config import ModelConfig
from worker_proc.models.registry import build_model
from worker_proc.pinned_reader import PinnedReader, SafetensorsFile
from worker_proc.weight_slice import TORCH_DTYPES, WeightSlice

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_path: str) -> list[str]:
    """The safetensors shards of a checkpoint: from the index if there is one, else the
    single ``model.safetensors``, else every ``*.safetensors`` in the directory."""
    index = os.path.join(model_path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map") or {}
        files = sorted(set(weight_map.values()))
        paths = [os.path.join(model_path, name) for name in files]
        absent = [p for p in paths if not os.path.isfile(p)]
        if absent:
            raise FileNotFoundError(f"{INDEX_FILE} names missing shards: {absent[:4]}")
        return paths
    single = os.path.join(model_path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not found:
        raise FileNotFoundError(f"{model_path} holds no .safetensors checkpoint")
    return found


def iterate_weights(model_path: str, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, read onto ``device``."""
    target = str(device) if device.type != "cpu" else "cpu"
    for path in checkpoint_files(model_path):
        with safe_open(path, framework="pt", device=target) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def iterate_weight_slices(
    model_path: str, device: torch.device
) -> Iterator[tuple[str, WeightSlice]]:
    """Yield ``(name, WeightSlice)`` for every tensor of the checkpoint; nothing is read
    until the consumer narrows or materializes the slice (while the file is still open).

    On a GPU, row ranges and whole tensors are read through pinned staging buffers
    (worker_proc/pinned_reader.py), tensors in file order; other indexing goes through
    safetensors."""
    if device.type != "cuda":
        yield from _safetensors_slices(model_path, device)
        return
    with PinnedReader(device) as reader:
        for path in checkpoint_files(model_path):
            table = SafetensorsFile(path)
            try:
                with safe_open(path, framework="pt", device=str(device)) as f:
                    for name in table.names_in_file_order():
                        yield name, _pinned_slice(f, table, name, reader)
            finally:
                table.close()


def _pinned_slice(f, table: SafetensorsFile, name: str, reader: PinnedReader) -> WeightSlice:
    entry = table.entries[name]
    dtype = TORCH_DTYPES.get(entry.dtype)

    def read_all() -> torch.Tensor:
        return f.get_tensor(name)

    def read_rows(start: int, length: int) -> torch.Tensor:
        row = entry.row_bytes
        data = reader.read(table.fd, entry.begin + start * row, length * row)
        return data.view(dtype).view(length, *entry.shape[1:])

    fast = dtype is not None and len(entry.shape) > 0
    return WeightSlice(
        name, f.get_slice(name), read_all, reader.device, read_rows if fast else None
    )


def _safetensors_slices(model_path: str, device: torch.device) -> Iterator[tuple[str, WeightSlice]]:
    target = str(device) if device.type != "cpu" else "cpu"
    for path in checkpoint_files(model_path):
        with safe_open(path, framework="pt", device=target) as f:
            for name in f.keys():

                def read_all(f=f, name=name) -> torch.Tensor:
                    return f.get_tensor(name)

                yield name, WeightSlice(name, f.get_slice(name), read_all, device)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_config: ModelConfig,
    model_path: str,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int = 0,
) -> nn.Module:
    """Build the registered model for ``model_config`` and load its weights.

    The rotary cache covers ``max(max_position_embeddings, max_model_len)`` positions, so a
    user who raises the context length past the config's figure gets a cache that fits.
    """
    if max_model_len > model_config.max_position_embeddings:
        model_config = dataclasses.replace(model_config, max_position_embeddings=max_model_len)
    with _default_dtype(dtype), torch.device(device):
        model = build_model(model_config)
    model.load_weights(iterate_weight_slices(model_path, device))
    return model.eval()
