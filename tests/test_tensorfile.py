"""kvcli.io.tensorfile: safetensors files written from chunks without joining them, read as views of one buffer."""

from __future__ import annotations

import json

import pytest
import torch

from kvcli.io.tensorfile import TensorFileError, file_parts, header_of, read_tensors


def _tensors() -> dict:
    return {"keys": [torch.arange(24, dtype=torch.int8).view(2, 3, 4), torch.full((1, 3, 4), -7, dtype=torch.int8)],
            "scales": torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16), "pos": torch.arange(5, dtype=torch.int32),
            "mask": torch.tensor([True, False, True]), "step": torch.tensor(3.25, dtype=torch.float64),
            "none": torch.zeros((0, 4), dtype=torch.float16), "ids": torch.tensor([9, 8], dtype=torch.int64)}


def test_chunks_are_written_in_order_and_read_back_exactly():
    parts, digest = file_parts(_tensors(), {"note": "x"})
    raw = bytearray(b"".join(parts))
    tensors, metadata = read_tensors(raw)
    assert metadata == {"note": "x"}
    assert torch.equal(tensors["keys"], torch.cat(_tensors()["keys"]))
    for name in ("scales", "pos", "mask", "step", "none", "ids"):
        assert tensors[name].dtype == _tensors()[name].dtype and torch.equal(tensors[name], _tensors()[name]), name
    assert len(digest) == 64


def test_the_file_is_what_safetensors_reads():
    from safetensors.torch import load

    loaded = load(b"".join(file_parts(_tensors())[0]))
    assert torch.equal(loaded["keys"], torch.cat(_tensors()["keys"]))
    assert torch.equal(loaded["scales"], _tensors()["scales"]) and torch.equal(loaded["mask"], _tensors()["mask"])


def test_parts_are_views_of_the_tensors_not_copies():
    chunk = torch.zeros(4, dtype=torch.int32)
    parts, _ = file_parts({"a": [chunk, torch.ones(2, dtype=torch.int32)]})
    assert len(parts) == 3  # the header, then one view per chunk
    chunk[0] = 5
    assert bytes(parts[1])[:4] == (5).to_bytes(4, "little")


def test_the_seal_is_the_datas_sha256_in_the_metadata():
    import hashlib

    parts, digest = file_parts({"a": torch.ones(3)}, {"kvcli-read": json.dumps({"format": "f"})}, sealed="kvcli-read")
    sealed = json.loads(header_of(b"".join(parts))["__metadata__"]["kvcli-read"])
    assert sealed == {"format": "f", "data_sha256": digest} and digest == hashlib.sha256(parts[1]).hexdigest()


def _crafted(entries: dict, data: bytes) -> bytearray:
    text = json.dumps(entries).encode()
    return bytearray(len(text).to_bytes(8, "little") + text + data)


@pytest.mark.parametrize("entries, data", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),  # size of another shape
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8),  # data left over
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),  # a gap before it
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),  # past the end
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),  # overlapping
    ({"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\0"),  # no such dtype
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b""),  # negative size
    ({"a": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}, b"\0" * 4),  # a shape that is no list
    ({"a": {"dtype": "F32"}}, b""),  # fields missing
])
def test_a_header_that_does_not_describe_its_data_exactly_is_refused(entries, data):
    with pytest.raises(TensorFileError):
        read_tensors(_crafted(entries, data))


@pytest.mark.parametrize("raw", [b"", b"\x05\0\0\0\0\0\0\0{}", b"\x02\0\0\0\0\0\0\0[]", b"\x03\0\0\0\0\0\0\0{x}"])
def test_what_is_no_safetensors_file_is_refused(raw):
    with pytest.raises(TensorFileError):
        read_tensors(bytearray(raw))
