"""kvcli.io.tensorfile: safetensors files written from chunks or streamed pieces without joining them, read a tensor
or a range at a time."""

from __future__ import annotations

import io
import json

import pytest
import torch

from kvcli.io.tensorfile import Streamed, TensorFile, TensorFileError, file_parts, header_of


def read_tensors(raw: bytes) -> tuple[dict, dict]:
    """Every tensor of the file ``raw`` and its metadata, through :class:`TensorFile`."""
    file = TensorFile(io.BytesIO(bytes(raw)))
    return {name: file.load(name) for name in file.entries}, file.metadata


def joined(parts: list) -> bytes:
    return b"".join(piece for part in parts for piece in (part if isinstance(part, Streamed) else [part]))


def _tensors() -> dict:
    return {"keys": [torch.arange(24, dtype=torch.int8).view(2, 3, 4), torch.full((1, 3, 4), -7, dtype=torch.int8)],
            "scales": torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16), "pos": torch.arange(5, dtype=torch.int32),
            "mask": torch.tensor([True, False, True]), "step": torch.tensor(3.25, dtype=torch.float64),
            "none": torch.zeros((0, 4), dtype=torch.float16), "ids": torch.tensor([9, 8], dtype=torch.int64)}


def test_chunks_are_written_in_order_and_read_back_exactly():
    parts, digest = file_parts(_tensors(), {"note": "x"})
    raw = joined(parts)
    tensors, metadata = read_tensors(raw)
    assert metadata == {"note": "x"}
    assert torch.equal(tensors["keys"], torch.cat(_tensors()["keys"]))
    for name in ("scales", "pos", "mask", "step", "none", "ids"):
        assert tensors[name].dtype == _tensors()[name].dtype and torch.equal(tensors[name], _tensors()[name]), name
    assert len(digest) == 64


def test_the_file_is_what_safetensors_reads():
    from safetensors.torch import load

    loaded = load(joined(file_parts(_tensors())[0]))
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
    sealed = json.loads(header_of(joined(parts))["__metadata__"]["kvcli-read"])
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


def test_a_streamed_tensor_is_written_from_its_pieces_and_read_a_range_at_a_time():
    """A tensor given as pieces (a saved read's index, read from its spill) lands as if given whole; the file's
    reader takes one tensor, or a range of bytes, without the rest, and hashes the data a piece at a time."""
    import hashlib

    import kvcli.io.tensorfile as tensorfile

    whole = torch.arange(2 * 3 * 5, dtype=torch.int8).view(2, 3, 5)
    calls = []

    def pieces():
        calls.append(1)
        return (whole[i].numpy().tobytes() for i in range(2))

    parts, digest = file_parts({"keys": Streamed(torch.int8, [2, 3, 5], pieces), "ids": torch.arange(4)},
                               {"note": "x"})
    raw = joined(parts)
    assert len(calls) == 2  # once hashed, once written
    file = TensorFile(io.BytesIO(raw))
    assert torch.equal(file.load("keys"), whole) and torch.equal(file.load("ids"), torch.arange(4))
    entry = file.entries["keys"]
    assert bytes(file.read(entry.begin + 5, 5)) == whole[0, 1].numpy().tobytes()
    original, tensorfile.PIECE = tensorfile.PIECE, 7  # several pieces, the last one short
    try:
        assert file.sha256() == digest == hashlib.sha256(raw[file.data:]).hexdigest()
    finally:
        tensorfile.PIECE = original


def test_a_streamed_tensor_that_gives_other_bytes_than_its_shape_is_an_error():
    short = Streamed(torch.int8, [4], lambda: [b"\0\0\0"])
    with pytest.raises(ValueError, match="3 bytes for 4"):
        file_parts({"keys": short})


def test_a_header_longer_than_allowed_is_refused_before_it_is_read():
    raw = joined(file_parts({"a": torch.zeros(3)}, {"note": "x" * 100})[0])
    with pytest.raises(TensorFileError, match="too long"):
        TensorFile(io.BytesIO(raw), max_header=64)
