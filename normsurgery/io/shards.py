"""Checkpoint tensors on disk, read and written one tensor at a time.

Reading: an :class:`Index` parses each weight file's header once (a malformed or truncated file
is refused there) and knows every tensor's file, offset, dtype and shape. A :class:`Reader`
copies one tensor at a time into a tensor it is given, with plain reads, one file open at a time
(a memory map would count every page it touched as the process's memory until closed): straight
into it when the dtypes agree, else through one small buffer, cast as it reads. Pickle weights
(``pytorch_model*.bin``, read only when allowed) are indexed through ``torch.load(mmap=True,
weights_only=True)``.

Writing: ``save_pretrained`` first gathers the whole state dict (0.46 GB GPT-2: 1.2-1.6 s
against 0.43 s for ``safetensors.save_file`` of the same tensors); a :class:`ShardWriter` writes
each tensor into the current shard as it comes (a file reserves room for its header, the header
is written into it when the shard is full, padded with spaces as the format allows), names the
shards and writes the index as transformers does: the same files, memory bounded by one tensor.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core import devices
from ..core.errors import SurgeryError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
CODES = {v: k for k, v in DTYPES.items()}
#: bits per value of every dtype the safetensors library knows (its ``Dtype::bitsize``): a file of
#: one normsurgery does not read (DTYPES) is checked as the library checks it, then refused as such
BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
        "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
        "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
#: the largest header the safetensors library reads (bytes: its ``MAX_HEADER_SIZE``)
MAX_HEADER = 100_000_000
#: bytes read at a time when a tensor is cast as it is read
STAGE = 8 << 20


def inside(path: str, scope: tuple[str, ...]) -> bool:
    """True when ``path`` is one of the module paths ``scope`` or lies under one."""
    return any(path == p or path.startswith(p + ".") for p in scope)


# ---------------------------------------------------------------------------------------------
# reading


def read_header(f: Path) -> tuple[dict, int]:
    """A safetensors file's header, refused as the safetensors library refuses it (its
    ``read_metadata`` and ``Metadata::validate``: :func:`_layout`), and then any tensor of a dtype
    normsurgery does not read.

    Returns (header without ``__metadata__``, offset of the data: where ``data_offsets`` count from)."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n > MAX_HEADER:
                raise ValueError(f"header length {n:,}: the safetensors library reads headers of at most "
                                 f"{MAX_HEADER:,} bytes")
            if size < 8 or n <= 0 or 8 + n > size:
                raise ValueError(f"header length {n} in a file of {size} bytes")
            header = json.loads(fh.read(n).decode("utf-8"), object_pairs_hook=_unique, parse_constant=_no_constant)
        _layout(header, size - 8 - n)
        for key, v in header.items():
            if v["dtype"] not in DTYPES:
                raise ValueError(f"tensor {key!r} has dtype {v['dtype']}, which normsurgery cannot read")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeError, RecursionError) as e:
        raise SurgeryError(f"{f} is not a valid safetensors file ({e})") from None
    return header, 8 + n


def _unique(pairs: list) -> dict:
    """A JSON object whose keys are unique (Python's json keeps the last of a repeated key, as the
    library's tensor map does: a name given twice is refused, whatever the library makes of it)."""
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"{k!r} is given twice")
        k.encode()  # a lone surrogate (``\\ud800``): not UTF-8, which the library's strings are
        d[k] = v
    return d


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _count(value) -> bool:
    """A JSON number the library reads as a ``usize``: an integer (not a boolean), 0 <= it < 2^64."""
    return type(value) is int and 0 <= value < 1 << 64


def _layout(header: dict, data: int) -> None:
    """What the library checks of a parsed header (``header``, ``__metadata__`` removed here) against
    ``data`` bytes of tensors: ``__metadata__`` null or strings by name; each tensor a dtype it knows
    (:data:`BITS`), a shape of counts and two offsets; in offset order, each starting where the one
    before ended (the first at 0), of exactly prod(shape) x bits / 8 bytes (no product over 2^64),
    the last ending where the file does."""
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ValueError("__metadata__ is not a map of strings")
    spans = []
    for key, v in header.items():
        if not isinstance(v, dict):
            raise ValueError(f"tensor {key!r} is {v!r}, not an object")
        if v.get("dtype") not in BITS:
            raise ValueError(f"tensor {key!r} has dtype {v.get('dtype')!r}, which safetensors does not know")
        shape, offsets = v.get("shape"), v.get("data_offsets")
        if not (isinstance(shape, list) and all(map(_count, shape)) and isinstance(offsets, list)
                and len(offsets) == 2 and all(map(_count, offsets))):
            raise ValueError(f"tensor {key!r}: shape {shape!r} and data_offsets {offsets!r} are not counts "
                             "(a list of them; two)")
        count = 1
        for d in shape:
            count *= d
            if count >> 64:
                raise ValueError(f"tensor {key!r}: shape {shape} overflows 64 bits")
        bits = count * BITS[v["dtype"]]
        if bits >> 64 or bits % 8 or offsets[1] - offsets[0] != bits // 8:
            raise ValueError(f"tensor {key!r}: shape {shape} of {v['dtype']} is {bits / 8:g} bytes, its data_offsets "
                             f"{offsets} span {offsets[1] - offsets[0]}")
        spans.append((tuple(offsets), key))
    end = 0
    for (start, stop), key in sorted(spans):
        if start != end:
            raise ValueError(f"tensor {key!r}: data_offsets [{start}, {stop}] do not start where the tensors "
                             f"before it end ({end}): tensors overlap or leave a gap")
        end = stop
    if end != data:
        raise ValueError(f"the tensors end at byte {end} of the data, which holds {data} bytes")


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies: its file and bytes (safetensors), or the tensor itself (pickle)."""

    file: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    tensor: torch.Tensor | None = None  # pickle weights: the memory-mapped tensor

    @property
    def numel(self) -> int:
        return torch.Size(self.shape).numel()


class Index:
    """Every tensor of a checkpoint's weight files, by key."""

    def __init__(self, files: list[Path]):
        self.files = list(files)
        self.entries: dict[str, Entry] = {}
        for f in self.files:
            if f.suffix == ".safetensors":
                header, start = read_header(f)
                for key, v in header.items():
                    self.entries[key] = Entry(f, start + v["data_offsets"][0], DTYPES[v["dtype"]], tuple(v["shape"]))
            else:
                for key, t in _pickled(f).items():
                    self.entries[key] = Entry(f, 0, t.dtype, tuple(t.shape), t)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __getitem__(self, key: str) -> Entry:
        return self.entries[key]

    def keys(self):
        return self.entries.keys()

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries.values())

    def floating_dtypes(self) -> set[torch.dtype]:
        return {e.dtype for e in self.entries.values() if e.dtype.is_floating_point}


def differing(a: Index, b: Index, rows: int = 1 << 22) -> frozenset[str]:
    """The keys of ``a`` whose tensors ``b`` does not hold as they are: absent from ``b``, of another
    shape, or of other values (of different dtypes: compared in float64). Read ``rows`` entries at
    a time (a slab of rows)."""
    ra, rb, out = Reader(a), Reader(b), set()
    try:
        for k in a.keys():
            ea = a[k]
            eb = b[k] if k in b else None
            if eb is None or eb.shape != ea.shape:
                out.add(k)
                continue
            dtype = None if ea.dtype == eb.dtype else torch.float64
            n = ea.shape[0] if ea.shape else 1
            step = max(1, rows // max(1, ea.numel // max(n, 1)))
            for i in range(0, n, step):
                j = min(n, i + step)
                x = ra.read_rows(k, i, j, dtype) if ea.shape else ra.read(k, dtype)
                y = rb.read_rows(k, i, j, dtype) if eb.shape else rb.read(k, dtype)
                if not torch.equal(x, y):
                    out.add(k)
                    break
    finally:
        ra.close()
        rb.close()
    return frozenset(out)


def _pickled(f: Path) -> dict[str, torch.Tensor]:
    try:
        sd = torch.load(f, map_location=devices.HOST, mmap=True, weights_only=True)
    except Exception as e:
        raise SurgeryError(f"{f} is not a readable PyTorch weights file ({type(e).__name__})") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise SurgeryError(f"{f} does not hold a state dict of tensors")
    return sd


class Reader:
    """Reads tensors of an :class:`Index` into given tensors (see the module docstring)."""

    def __init__(self, index: Index):
        self.index = index
        self._file, self._fh = None, None
        self._stage: torch.Tensor | None = None

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """``key``'s values into ``out`` (contiguous, its shape, in host memory: the file's bytes land
        in it directly; ``loader.Loader`` moves what it read to the device), cast to ``out``'s dtype."""
        e = self.index[key]
        if e.tensor is not None:
            return out.copy_(e.tensor)
        return self._read_entry(e, key, out)

    def _read_entry(self, e: Entry, key: str, out: torch.Tensor) -> torch.Tensor:
        self._seek(e, 0)
        if e.dtype == out.dtype:
            self._read(memoryview(out.view(-1).view(torch.uint8).numpy()), key)  # host
            return out
        flat, step = out.view(-1), STAGE // e.dtype.itemsize
        if self._stage is None:  # one buffer for every cast (fresh pages cost more than the cast)
            self._stage = torch.empty(STAGE, dtype=torch.uint8)
        for i in range(0, flat.numel(), step):
            n = min(step, flat.numel() - i)
            self._read(memoryview(self._stage.numpy())[:n * e.dtype.itemsize], key)  # host
            flat[i:i + n].copy_(self._stage[:n * e.dtype.itemsize].view(e.dtype))
        return out

    def read_rows(self, key: str, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows start..stop of ``key`` (along its first axis: contiguous bytes), in ``dtype``."""
        e = self.index[key]
        out = torch.empty((stop - start, *e.shape[1:]), dtype=dtype or e.dtype)
        if e.tensor is not None:
            return out.copy_(e.tensor[start:stop])
        row = torch.Size(e.shape[1:]).numel() * e.dtype.itemsize
        return self._read_entry(Entry(e.file, e.offset + start * row, e.dtype, tuple(out.shape)), key, out)

    def read(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``key`` as a new tensor (in ``dtype``, default as stored)."""
        e = self.index[key]
        return self.read_into(key, torch.empty(e.shape, dtype=dtype or e.dtype))

    def _seek(self, e: Entry, at: int) -> None:
        if self._file != e.file:
            self.close()
            self._file, self._fh = e.file, open(e.file, "rb", buffering=0)
        self._fh.seek(e.offset + at)

    def _read(self, view: memoryview, key: str) -> None:
        done = 0
        while done < len(view):
            n = self._fh.readinto(view[done:])
            if not n:
                raise SurgeryError(f"{self._file.name} ended inside tensor {key}")
            done += n

    def copy_to(self, key: str, out, check=None) -> None:
        """Append ``key``'s stored bytes to the open binary file ``out`` at its position, unchanged
        (dtype and bytes as stored; a safetensors entry only). ``check(tensor)``: called on each
        chunk, viewed in the stored dtype, before it is written (e.g. refuse NaN): the bytes then
        go through one buffer; without it the kernel copies them file to file."""
        e = self.index[key]
        if e.tensor is not None:
            raise SurgeryError(f"internal: {key} is not stored as safetensors bytes")
        size, done = e.numel * e.dtype.itemsize, 0
        if check is None and hasattr(os, "copy_file_range"):
            self._seek(e, 0)
            out.flush()
            src, dst = self._fh.fileno(), out.fileno()
            at = out.tell()
            try:
                while done < size:
                    n = os.copy_file_range(src, dst, size - done, e.offset + done, at + done)
                    if not n:
                        raise SurgeryError(f"{self._file.name} ended inside tensor {key}")
                    done += n
            except OSError:  # a file system without it: through the buffer below
                pass
            out.seek(at + done)
        if done == size:
            return
        self._seek(e, done)
        if self._stage is None:
            self._stage = torch.empty(STAGE, dtype=torch.uint8)
        step = STAGE - STAGE % e.dtype.itemsize
        while done < size:
            n = min(step, size - done)
            view = memoryview(self._stage.numpy())[:n]  # host
            self._read(view, key)
            if check is not None:
                check(self._stage[:n].view(e.dtype))
            out.write(view)
            done += n

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
        self._file, self._fh = None, None


# ---------------------------------------------------------------------------------------------
# writing


class ShardWriter:
    """Safetensors shards of at most ``max_bytes`` (a larger tensor gets one of its own), written
    as the tensors come; ``close`` names them as transformers does and writes the index."""

    def __init__(self, folder: Path, max_bytes: int, header_room: int):
        self.folder, self.max, self.room = Path(folder), max_bytes, -(-header_room // 8) * 8
        self.done: list[tuple[Path, list[str]]] = []
        self.fh, self.header, self.used = None, {}, 0
        self.total, self.params = 0, 0
        self.copied = 0  # bytes copied as stored (:meth:`copy`)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (from any device: written from a host copy)."""
        t = tensor.detach().to(devices.HOST).contiguous().reshape(-1)
        size = t.numel() * t.element_size()
        self._open(size)
        self.fh.write(memoryview(t.view(torch.uint8).numpy()))  # host
        self._entry(name, t.dtype, tuple(tensor.shape), size)

    def copy(self, name: str, reader: Reader, key: str, check=None) -> None:
        """Append the tensor stored as ``key`` (``reader``'s index) under ``name``, its bytes copied
        as stored (:meth:`Reader.copy_to`; ``check`` on each chunk): nothing decoded or cast."""
        e = reader.index[key]
        size = e.numel * e.dtype.itemsize
        self._open(size)
        reader.copy_to(key, self.fh, check)
        self._entry(name, e.dtype, e.shape, size)
        self.copied += size

    def _open(self, size: int) -> None:
        """The shard the next ``size`` bytes go to (a new one when they would overflow this one)."""
        if self.fh is not None and self.used and self.used + size > self.max:
            self._finish_shard()
        if self.fh is None:
            path = self.folder / f".shard-{len(self.done)}"
            self.fh, self.header, self.used = open(path, "wb"), {}, 0
            self.fh.seek(8 + self.room)

    def _entry(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], size: int) -> None:
        self.header[name] = {"dtype": CODES[dtype], "shape": list(shape),
                             "data_offsets": [self.used, self.used + size]}
        self.used += size
        self.total += size
        self.params += torch.Size(shape).numel()

    def _finish_shard(self) -> None:
        head = json.dumps({"__metadata__": {"format": "pt"}, **self.header}, separators=(",", ":")).encode()
        if len(head) > self.room:
            raise RuntimeError(f"shard header of {len(head)} bytes overflows the {self.room} reserved")
        self.fh.seek(0)
        self.fh.write(struct.pack("<Q", self.room) + head + b" " * (self.room - len(head)))
        self.fh.close()
        self.done.append((Path(self.fh.name), list(self.header)))
        self.fh = None

    def close(self) -> list[str]:
        """Finish the last shard, name the shards, write the index; returns the file names."""
        if self.fh is not None:
            self._finish_shard()
        n = len(self.done)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for (path, _), name in zip(self.done, names):
            path.rename(self.folder / name)
        if n > 1:
            weight_map = {k: name for (_, keys), name in zip(self.done, names) for k in keys}
            index = {"metadata": {"total_parameters": self.params, "total_size": self.total},
                     "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names


def header_room(names) -> int:
    """Bytes reserved for a shard's header holding ``names`` (dtype, shape, offsets each)."""
    return sum(2 * (len(n) + 160) for n in names) + 256


def saved_tensors(model, scope: tuple[str, ...] | None = None, meta: bool = False) -> dict[str, torch.Tensor]:
    """The state dict (``scope``: only entries under those module paths) under the names
    ``save_pretrained`` writes: tied copies and ignored keys dropped, weight conversions reverted
    (a mixture's stacked experts split into one tensor per expert, as its checkpoints store
    them). ``meta``: names and shapes only, on meta stand-ins (nothing copied)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    sd = {k: v.to("meta") if meta else v for k, v in model.state_dict().items() if scope is None or inside(k, scope)}
    for k in getattr(model, "_keys_to_ignore_on_save", None) or ():
        sd.pop(k, None)
    return revert_weight_conversion(model, remove_tied_weights_from_state_dict(sd, model))

