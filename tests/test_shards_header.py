"""Safetensors headers are refused as the safetensors library refuses them (issue 54, item 2): each
file here is built by hand (8-byte little-endian header length, the JSON header, the data), and
``io.shards.read_header`` must refuse it in one line naming the file and the tensor wherever
``safetensors.safe_open`` refuses the same bytes; a good file is read alike by both. One refusal
is ours alone: a name given twice (the library keeps the last)."""

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from normsurgery.core.errors import SurgeryError
from normsurgery.io.shards import MAX_HEADER, Index, Reader, read_header


def tensor(dtype: str, shape, offsets) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def write(path, header, data: bytes):
    """``header`` (a dict, or the JSON text itself: repeated keys) and ``data`` as a safetensors file."""
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def library_refuses(path) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            list(f.keys())
    except Exception:
        return True
    return False


def refused(path, *names: str) -> str:
    """Our refusal of ``path``: one line naming the file and each of ``names``; the library refuses it too."""
    with pytest.raises(SurgeryError) as e:
        read_header(path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message, message
    for name in names:
        assert repr(name) in message, message
    assert library_refuses(path), f"the safetensors library reads {path.name}"
    return message


A, B = tensor("F32", [2], [0, 8]), tensor("F16", [2], [8, 12])

# each: (header, data, the tensor our message names, a word of the reason)
BAD = {
    "overlapping": ({"a": A, "b": tensor("F16", [2], [6, 10])}, bytes(10), "b", "overlap"),
    "a gap": ({"a": A, "b": tensor("F16", [2], [12, 16])}, bytes(16), "b", "gap"),
    "not from 0": ({"a": tensor("F32", [2], [4, 12])}, bytes(12), "a", "(0)"),
    "more bytes than shape x dtype": ({"a": tensor("F32", [1], [0, 8])}, bytes(8), "a", "4 bytes"),
    "fewer bytes than shape x dtype": ({"a": A, "b": tensor("F16", [4], [8, 12])}, bytes(12), "b", "8 bytes"),
    "an end before its start": ({"a": tensor("F32", [0], [4, 0])}, bytes(4), "a", "span -4"),
    "a negative dimension": ({"a": tensor("U8", [-2, -4], [0, 8])}, bytes(8), "a", "counts"),
    "a dimension of 2.0": ({"a": tensor("F32", [2.0], [0, 8])}, bytes(8), "a", "counts"),
    "a dimension true": ('{"a": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}', bytes(4), "a", "counts"),
    "three offsets": ({"a": tensor("F32", [2], [0, 8, 8])}, bytes(8), "a", "two"),
    "a shape over 2^64 values": ({"a": tensor("F32", [1 << 40, 1 << 40, 0], [0, 0])}, b"", "a", "overflows"),
    "an unknown dtype": ({"a": tensor("Q4", [2], [0, 1])}, bytes(1), "a", "does not know"),
    "an F8 tensor of the wrong size": ({"a": tensor("F8_E4M3", [4], [0, 2])}, bytes(2), "a", "span 2"),
    "a name given twice": ('{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                           '"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}', bytes(16), "a", "twice"),
    "not an object": ({"a": [0, 8]}, bytes(8), "a", "not an object"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_header_the_library_refuses_is_refused_naming_the_tensor(tmp_path, case):
    header, data, name, why = BAD[case]
    message = refused(write(tmp_path / "model.safetensors", header, data), name)
    assert why in message, message


# each: (header, data, a word of the reason): nothing to name but the file
BAD_FILE = {
    "data beyond the tensors": ({"a": A}, bytes(9), "holds 9"),
    "data short of the tensors": ({"a": A, "b": B}, bytes(11), "holds 11"),
    "a field given twice": ('{"a": {"dtype": "F32", "dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', bytes(8),
                            "'dtype' is given twice"),
    "metadata not strings": ({"__metadata__": {"format": 1}, "a": A}, bytes(8), "__metadata__"),
    "NaN": ('{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]}}', bytes(8), "NaN"),
    "a UTF-8 byte-order mark": ("\ufeff" + json.dumps({"a": A}), bytes(8), "BOM"),
    "a list": ("[]", b"", "not a JSON object"),
    "nested too deep": ('{"__metadata__": ' + "[" * 5000 + "]" * 5000 + "}", b"", "recursion"),
}


@pytest.mark.parametrize("case", BAD_FILE)
def test_a_file_the_library_refuses_is_refused(tmp_path, case):
    header, data, why = BAD_FILE[case]
    assert why in refused(write(tmp_path / "model.safetensors", header, data))


def test_a_name_given_twice_is_refused_where_the_library_keeps_the_last(tmp_path):
    """Two entries of one name: the library reads the last (and would refuse this one had the
    ranges differed); we refuse it, as the ambiguity it is."""
    path = write(tmp_path / "model.safetensors", '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                 '"a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}}', bytes(8))
    assert not library_refuses(path)
    with pytest.raises(SurgeryError, match=r"model.safetensors is not a valid safetensors file \('a' is given twice\)"):
        read_header(path)


def test_a_header_over_the_librarys_limit_is_refused(tmp_path):
    """A valid header padded with spaces (as the format allows) to one byte over the library's
    100 MB limit: the library refuses it before reading it, and so do we."""
    text = json.dumps({"a": A}).encode()
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER + 1) + text)
        f.write(b" " * (MAX_HEADER + 1 - len(text)))
        f.write(bytes(8))
    assert "at most 100,000,000 bytes" in refused(path)


def test_a_good_file_is_read_as_the_library_reads_it(tmp_path):
    """Tensors stored out of name order, a zero-size one, a scalar, metadata, the header padded
    with spaces: both read it, to the same values."""
    values = {"b": torch.arange(6, dtype=torch.float16).reshape(2, 3), "a": torch.tensor([1.5, -2.0]),
              "empty": torch.zeros(0, 3), "s": torch.tensor(7, dtype=torch.int64)}
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, t in values.items():
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = tensor({torch.float16: "F16", torch.float32: "F32", torch.int64: "I64"}[t.dtype],
                              list(t.shape), [len(data), len(data) + len(raw)])
        data += raw
    path = write(tmp_path / "model.safetensors", json.dumps(header) + "    ", data)
    assert not library_refuses(path)
    got, start = read_header(path)
    assert sorted(got) == sorted(values) and start == path.stat().st_size - len(data)
    reader = Reader(Index([path]))
    with safe_open(str(path), "pt") as f:
        for name in values:
            assert torch.equal(reader.read(name), f.get_tensor(name)) and torch.equal(reader.read(name), values[name])
    reader.close()


def test_a_dtype_the_library_knows_and_we_do_not_read_is_refused_as_such(tmp_path):
    """An F8 tensor of the right size is a valid file (the library reads it) that normsurgery does
    not read: said so, naming the tensor, not called invalid layout."""
    path = write(tmp_path / "model.safetensors", {"w": tensor("F8_E4M3", [2, 2], [0, 4])}, bytes(4))
    assert not library_refuses(path)
    with pytest.raises(SurgeryError, match=r"tensor 'w' has dtype F8_E4M3, which normsurgery cannot read"):
        read_header(path)


def test_a_checkpoint_with_a_damaged_file_is_refused_by_the_cli(tmp_path):
    """End to end: a checkpoint whose tensors overlap is one line and exit 1, not wrong weights."""
    from typer.testing import CliRunner

    from normsurgery.cli import app

    demo = tmp_path / "ckpt"
    demo.mkdir()
    (demo / "config.json").write_text(Path("normsurgery/demo/llama-tiny/config.json").read_text())
    write(demo / "model.safetensors", {"a": A, "b": tensor("F16", [2], [6, 10])}, bytes(10))
    r = CliRunner().invoke(app, ["verify", str(demo), str(demo)])
    assert r.exit_code == 1, r.output
    line = r.output.strip().splitlines()[-1]
    assert "model.safetensors is not a valid safetensors file (tensor 'b'" in line and "overlap" in line, r.output
