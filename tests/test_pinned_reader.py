"""The checkpoint reader that stages bytes through (pinned) buffers: header parsing, row
ranges split over buffers and threads, and WeightSlice's use of it."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from worker_proc.loader import _pinned_slice
from worker_proc.pinned_reader import PinnedReader, SafetensorsFile


@pytest.fixture()
def checkpoint(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "b.weight": torch.randn(37, 53, generator=gen).to(torch.bfloat16),
        "a.bias": torch.randn(53, generator=gen),
        "c.ids": torch.randint(0, 1000, (5, 3, 7), generator=gen),
        "d.scale": torch.tensor(3.5),
        "e.half": torch.randn(11, 4, generator=gen).to(torch.float16),
    }
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    return path, tensors


def _rows(reader: PinnedReader, table: SafetensorsFile, name: str, start: int, length: int):
    entry = table.entries[name]
    return reader.read(table.fd, entry.begin + start * entry.row_bytes, length * entry.row_bytes)


def test_header_matches_safetensors(checkpoint):
    path, tensors = checkpoint
    table = SafetensorsFile(path)
    try:
        assert set(table.entries) == set(tensors)
        for name, tensor in tensors.items():
            entry = table.entries[name]
            assert entry.shape == tuple(tensor.shape)
            assert entry.end - entry.begin == tensor.numel() * tensor.element_size()
        begins = [table.entries[n].begin for n in table.names_in_file_order()]
        assert begins == sorted(begins)
    finally:
        table.close()


@pytest.mark.parametrize(
    "buffer_bytes,threads,piece", [(64, 1, 16), (100, 3, 8), (1 << 20, 4, 1 << 20), (7, 2, 1)]
)
def test_row_ranges_round_trip(checkpoint, buffer_bytes, threads, piece):
    """Ranges larger than a buffer, ranges split over threads, and odd sizes all come back
    byte for byte."""
    path, tensors = checkpoint
    table = SafetensorsFile(path)
    cpu = torch.device("cpu")
    try:
        with PinnedReader(
            cpu,
            buffer_bytes=buffer_bytes,
            num_buffers=2,
            num_threads=threads,
            min_piece_bytes=piece,
        ) as reader:
            weight = tensors["b.weight"]
            for start, length in [(0, 37), (5, 9), (36, 1), (10, 0)]:
                data = _rows(reader, table, "b.weight", start, length)
                got = data.view(torch.bfloat16).view(length, 53)
                assert torch.equal(got, weight[start : start + length])
            ids = _rows(reader, table, "c.ids", 1, 3).view(torch.int64).view(3, 3, 7)
            assert torch.equal(ids, tensors["c.ids"][1:4])
    finally:
        table.close()


def test_weight_slice_reads_through_the_reader(checkpoint):
    """Whole tensors and first-dimension ranges take the reader's path; other indexing
    goes through safetensors; both give the file's values."""
    path, tensors = checkpoint
    table = SafetensorsFile(path)
    cpu = torch.device("cpu")
    try:
        with (
            PinnedReader(cpu, buffer_bytes=96, num_threads=2, min_piece_bytes=16) as reader,
            safe_open(path, framework="pt", device="cpu") as f,
        ):
            calls = []
            read = reader.read
            reader.read = lambda *args: calls.append(args) or read(*args)
            for name, tensor in tensors.items():
                weight = _pinned_slice(f, table, name, reader)
                assert weight.shape == tensor.shape and weight.dtype == tensor.dtype
                before = len(calls)
                assert torch.equal(weight.materialize(), tensor)
                assert len(calls) == before + (1 if tensor.ndim else 0)
                if tensor.ndim:
                    assert torch.equal(weight.narrow(0, 1, 2), tensor[1:3])
                    assert len(calls) == before + 2
                if tensor.ndim == 2:
                    assert torch.equal(weight.narrow(1, 2, 2), tensor[:, 2:4])
                    assert len(calls) == before + 2  # part of a later dim: safetensors
                    assert torch.equal(weight.narrow(1, 0, tensor.shape[1]), tensor)
                    assert torch.equal(weight[1:3], tensor[1:3])
                    assert torch.equal(weight[2:, :], tensor[2:])
                    assert len(calls) == before + 5
                    assert torch.equal(weight[1:5:2], tensor[1:5:2])
                    assert torch.equal(weight[:, 1:3], tensor[:, 1:3])
                    assert len(calls) == before + 5
    finally:
        table.close()


def test_short_file_is_an_error(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        with PinnedReader(torch.device("cpu"), buffer_bytes=8) as reader:
            with pytest.raises(OSError, match="end of file"):
                reader.read(fd, 4, 20)
    finally:
        os.close(fd)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_cuda_reads_match_safetensors(checkpoint):
    path, tensors = checkpoint
    table = SafetensorsFile(path)
    device = torch.device("cuda")
    try:
        with (
            PinnedReader(device, buffer_bytes=128, num_buffers=2) as reader,
            safe_open(path, framework="pt", device="cpu") as f,
        ):
            assert all(buffer._registered for buffer in reader._buffers)  # page-locked
            for name, tensor in tensors.items():
                got = _pinned_slice(f, table, name, reader).materialize()
                assert got.device.type == "cuda"
                assert torch.equal(got.cpu(), tensor)
    finally:
        table.close()
