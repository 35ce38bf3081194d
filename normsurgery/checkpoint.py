"""Reading and writing checkpoints: local folders or cached hub ids in, atomic safetensors out.

A rewritten model whose modules differ from its stock architecture is saved with a list of
module records in ``config.normsurgery["modules"]``, the runtime copied beside the weights as
``modeling_normsurgery.py`` and an ``auto_map`` naming it, so ``from_pretrained(...,
trust_remote_code=True)`` rebuilds it with only transformers installed. Records marked
``stock_equivalent`` compute the same function as the stock module on this model (an RMSNorm
on a zero-mean stream is a LayerNorm): when all are, plain ``from_pretrained`` may load it, and
that is claimed only once the written folder, loaded with the stock class, gave the same outputs.

Checkpoints load with the class their ``architectures`` names (causal or masked LM, base model,
sequence or token classifier: ``families.FAMILIES``) and save with the same class.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import transformers

from . import runtime, shards
from .families import AUTO_CLASS, check_supported, class_name, head_of, stock_class_of
from .errors import SurgeryError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
RUNTIME_FILE = "modeling_normsurgery.py"
NOT_COPIED = {"config.json", RUNTIME_FILE}
#: buffers old checkpoints store that no current class reads (GPT-2's attention constant)
STALE_BUFFERS = (".masked_bias",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")
#: folders a checkpoint may hold that ``--force`` may replace with it (ours: an unmerged adapter)
CHECKPOINT_FOLDERS = {"adapter", ".cache"}
#: pickle checkpoints (.bin) can run code when loaded: refused unless allowed (the CLI's
#: --allow-pickle); even then transformers reads them with torch.load(weights_only=True)
ALLOW_PICKLE = os.environ.get("NORMSURGERY_ALLOW_PICKLE") == "1"


def resolve(src: str | os.PathLike) -> Path:
    """A checkpoint folder: ``src`` itself, or the snapshot of a hub id in the local cache."""
    path = Path(src).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SurgeryError(f"{src} is not a checkpoint folder: it has no config.json")
        return path
    if path.exists():
        raise SurgeryError(f"{src} is a file; give the checkpoint's folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(src), local_files_only=True))
    except Exception:
        raise SurgeryError(f"no checkpoint at {src!r}: not a folder, and not a hub id in the local Hugging Face "
                           "cache (normsurgery reads local files only and never downloads, as if offline): "
                           f"download it first, e.g. `hf download {src} --local-dir DIR`, and pass DIR") from None


def weight_files(path: Path) -> list[Path]:
    """The weight files, checked: an index's shards must exist; safetensors headers must parse."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise SurgeryError(f"{index} is not a valid safetensors index ({e})") from None
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SurgeryError(f"{path}: the index names missing shards: {', '.join(missing)}")
    else:
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise SurgeryError(f"{path} holds no weights (no *.safetensors or pytorch_model*.bin)")
    if files[0].suffix == ".bin" and not ALLOW_PICKLE:
        raise SurgeryError(f"{path} stores its weights as pickle ({files[0].name}), which can run code when "
                           "loaded: convert it to safetensors, or pass --allow-pickle to load it with "
                           "torch.load(weights_only=True)")
    for f in files:
        if f.suffix == ".safetensors":
            safetensors_header(f)
    return files


def safetensors_header(f: Path) -> tuple[dict, int]:
    """Parse the header and check the data it describes is all there (a truncated file fails).

    Returns (header, offset of the data: where ``data_offsets`` count from)."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError("bad header length")
            header = json.loads(fh.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"truncated: {size} bytes, header describes {8 + n + end}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise SurgeryError(f"{f} is not a valid safetensors file ({e})") from None
    return header, 8 + n


def storage_dtype(path: Path) -> torch.dtype:
    """The floating dtype the checkpoint stores its weights in. Mixed dtypes (tensors kept in
    float32 beside float16 ones, ``precision``): the config's dtype when it is one of them, as
    ``from_pretrained`` would load it, else the widest, which holds every tensor exactly."""
    stored = set()
    for f in weight_files(path):
        if f.suffix != ".safetensors":
            break
        header, _ = safetensors_header(f)
        stored |= {dt for k, v in header.items() if k != "__metadata__"
                   and (dt := shards.DTYPES.get(v["dtype"])) is not None and dt.is_floating_point}
    cfg = transformers.AutoConfig.from_pretrained(path)
    dt = getattr(cfg, "dtype", None) or torch.float32
    dt = getattr(torch, dt) if isinstance(dt, str) else dt
    if len(stored) == 1 or (stored and dt not in stored):
        return widest(stored)
    return dt


def widest(dtypes) -> torch.dtype:
    """The floating dtype that holds every value of ``dtypes`` (float32 for float16 with bfloat16)."""
    dtypes = set(dtypes)
    best = max(dtypes, key=lambda d: torch.finfo(d).bits)
    return best if len(dtypes) == 1 or torch.finfo(best).bits > 16 else torch.float32


def load_dtype(model) -> torch.dtype:
    """The dtype ``model`` loads back in: its parameters' (the widest when mixed)."""
    return widest({p.dtype for p in model.parameters() if p.is_floating_point()})


def load_config(path: Path):
    try:
        cfg = transformers.AutoConfig.from_pretrained(path)
    except Exception as e:
        raise SurgeryError(f"cannot read {path / 'config.json'}: {_first_line(e)}") from None
    check_supported(cfg.model_type)
    return cfg


def stock_class(config):
    """The stock transformers class the config's ``architectures`` names (see ``families.class_name``)."""
    return getattr(transformers, class_name(config))


def model_class(config):
    """The stock class, or its normsurgery subclass when the config records rebuilt modules."""
    base = stock_class(config)
    if _records(config):
        return getattr(runtime, "NormSurgery" + base.__name__)
    return base


def load(src, dtype: torch.dtype | None = None, *, stock: bool = False):
    """Load a checkpoint (rewritten or stock) with the class its ``architectures`` names, in
    ``dtype`` (default: its storage dtype), eval mode. ``stock``: with the plain stock class, as
    ``from_pretrained`` without normsurgery would. A missing, unexpected or mis-shaped weight is
    an error naming it (transformers would initialise it at random and only log it)."""
    path = resolve(src)
    cfg = load_config(path)
    weight_files(path)
    dtype = dtype or storage_dtype(path)
    cls = stock_class(cfg) if stock else model_class(cfg)
    try:
        model, info = cls.from_pretrained(path, config=cfg, dtype=dtype, output_loading_info=True,
                                          ignore_mismatched_sizes=True)
    except Exception as e:
        raise SurgeryError(f"cannot load {src}: {_first_line(e)}") from None
    check_loading(src, cls.__name__, info)
    check_finite(model, src)
    return model.eval()


def check_loading(src, cls: str, info: dict) -> None:
    """Refuse a load that left weights missing, unexpected or mis-shaped (``output_loading_info``)."""
    problems = []
    for key, what in (("missing_keys", "missing"), ("unexpected_keys", "unexpected"),
                      ("mismatched_keys", "mis-shaped")):
        keys = sorted(k[0] if isinstance(k, tuple) else k for k in info.get(key) or ()
                      if not (key == "unexpected_keys" and str(k).endswith(STALE_BUFFERS)))
        if keys:
            more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
            problems.append(f"{what} {', '.join(keys[:5])}{more}")
    if problems:
        raise SurgeryError(f"cannot load {src} as {cls}: weights {'; '.join(problems)} "
                           "(transformers would fill them at random)")


def check_finite(model, src) -> None:
    """Refuse weights holding NaN or Inf: every check downstream would compare NaN with NaN.
    A sum is NaN or infinite when an entry is (or when it overflows: then each entry is tested)."""
    bad = [n for n, p in model.named_parameters() if p.is_floating_point()
           and not bool(torch.isfinite(p.detach().sum())) and not bool(torch.isfinite(p).all())]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        kept = (getattr(model.config, "normsurgery", None) or {}).get("kept_float32") or ()
        if bad[0] in kept:  # loaded in a narrower dtype than the one it was saved to be loaded in
            raise SurgeryError(f"{src}: {bad[0]}{more} overflow {next(model.parameters()).dtype}: convert kept "
                               "them in float32 (--on-overflow keep-float32); load the checkpoint in float32")
        raise SurgeryError(f"{src} holds NaN or Inf weights: {bad[0]}{more}")


def load_tokenizer(src):
    """The checkpoint's tokenizer, or None when it has none."""
    path = resolve(src)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        return transformers.AutoTokenizer.from_pretrained(path)
    except Exception:
        return None


def _records(config) -> list[dict]:
    return list((getattr(config, "normsurgery", None) or {}).get("modules", []))


def structure_records(model) -> list[dict]:
    """What differs from the stock architecture built from the same config.

    Runtime modules are recorded by class and constructor kwargs; stock modules with other
    parameter shapes by their new shapes; any module's ``_normsurgery_attrs`` as attributes.
    """
    cfg = copy.deepcopy(model.config)
    cfg.normsurgery = None
    with torch.device("meta"):
        stock = stock_class_of(model)(cfg)
    stock_modules = dict(stock.named_modules())
    records = []
    for name, mod in model.named_modules():
        rec = {"path": name}
        if type(mod).__name__ in runtime.MODULES and isinstance(mod, runtime.MODULES[type(mod).__name__]):
            rec.update({"class": type(mod).__name__, "kwargs": mod.spec(),
                        "stock_equivalent": bool(getattr(mod, "stock_equivalent", False))})
        else:
            ref = stock_modules.get(name)
            own = {k: tuple(p.shape) for k, p in mod.named_parameters(recurse=False)}
            theirs = {} if ref is None else {k: tuple(p.shape) for k, p in ref.named_parameters(recurse=False)}
            if ref is None and own:
                raise SurgeryError(f"cannot record {name}: the stock architecture has no such module")
            if own != theirs:
                rec["params"] = {k: list(own[k]) if k in own else None for k in {*own, *theirs}}
                rec["stock_equivalent"] = False
        if getattr(mod, "_normsurgery_attrs", None):
            rec["attrs"] = dict(mod._normsurgery_attrs)
            rec["stock_equivalent"] = False
        if len(rec) > 1:
            records.append(rec)
    return records


def save(model, out, *, source=None, force: bool = False, record: dict | None = None,
         max_shard_size: str | int = "5GB", check: Callable[[torch.nn.Module], Any] | None = None,
         release: bool = False) -> dict:
    """Write ``model`` to ``out`` atomically (a temporary sibling folder, then one rename), with the
    same class (and head) it has.

    Copies tokenizer, generation config and other non-weight files from ``source``; stores
    ``record`` (what was done) under ``config.normsurgery``. Returns what was written.

    ``check(reloaded)`` compares a model loaded back from the written folder with ``model`` and
    returns a verify.Comparison. The folder is loaded with the plain stock class first: only if
    that passes is ``plain_transformers`` claimed; if not, the module records are marked not
    stock-equivalent and the folder must pass loaded with the runtime (``normsurgery.load``), or
    nothing is saved. Without ``check`` nothing is claimed (``plain_transformers`` is None).

    ``release``: ``model``'s weights are freed once written (it is spent; ``check`` compares with
    outputs computed before), so the model loaded back does not stack on them in memory.
    """
    with writing(out, force=force, source=source) as stage:
        info = save_into(model, stage.path, source=source, record=record, max_shard_size=max_shard_size,
                         check=check, release=release)
    return written(out, stage, info)


def save_into(model, folder: Path, *, source=None, record: dict | None = None, max_shard_size: str | int = "5GB",
              check: Callable[[torch.nn.Module], Any] | None = None, release: bool = False) -> dict:
    """Write ``model`` (weights, config with its record, runtime file, the source's side files)
    into ``folder``, normally a :func:`writing` stage, and check it loads back (see :func:`save`)."""
    records = stamp(model, record)
    shards.write_weights(model, folder, max_shard_size)
    shards.write_config(model, folder, load_dtype(model))  # mixed (tensors kept in float32): float32
    if release:
        model.to("meta")
    finish(folder, records, source)
    return claims(records, None if check is None else _check_reload(model, folder, records, check))


def stamp(model, record: dict | None) -> list[dict]:
    """Write into ``model.config`` what a rewritten checkpoint needs: the module records, the
    ``auto_map`` naming the runtime when there are any, ``record`` and the stock architecture.
    Reads only classes and shapes (a model on the meta device will do). Returns the records."""
    records = structure_records(model)
    cfg = model.config
    base = stock_class_of(model)
    auto_map = dict(getattr(cfg, "auto_map", None) or {})
    auto = AUTO_CLASS[head_of(model).objective]
    for name in AUTO_CLASS.values():
        auto_map.pop(name, None)
    if records:
        auto_map[auto] = f"{RUNTIME_FILE[:-3]}.NormSurgery{base.__name__}"
    _set_or_drop(cfg, "auto_map", auto_map)
    _set_or_drop(cfg, "normsurgery", {**(record or {}), "modules": records} if (record or records) else None)
    cfg.architectures = [base.__name__]
    return records


def finish(folder: Path, records: list[dict], source=None) -> None:
    """The runtime beside the weights when modules were rebuilt; the source's side files."""
    if records:
        shutil.copyfile(runtime.__file__, folder / RUNTIME_FILE)
    if source is not None:
        _copy_side_files(resolve(source), folder)


def claims(records: list[dict], reload: dict | None = None) -> dict:
    """What a save says about loading: without a ``reload`` check nothing is claimed."""
    return {"custom_modules": len(records),
            "plain_transformers": None if reload is None else reload["loader"] == "plain transformers",
            "reload": reload}


@dataclass
class Stage:
    path: Path  # the temporary folder to fill
    stale: list[str] = field(default_factory=list)  # leftovers of killed runs, removed


@contextmanager
def writing(out, *, force: bool = False, source=None):
    """Yields a :class:`Stage`: a temporary sibling folder ``.OUT.tmp-PID`` to fill. When the
    block ends without an exception the folder replaces ``out`` (see :func:`_replace`); on any
    exception, Ctrl-C or SIGTERM (the CLI turns it into an exception) it is removed, and ``out``
    is as it was. Holds :func:`output_lock` throughout; first removes what killed runs left."""
    out = Path(out).expanduser()
    with output_lock(out):
        stale = check_output(out, force, source)
        try:
            stage = Stage(out.parent / f".{out.name}.tmp-{os.getpid()}", stale)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(stage.path, ignore_errors=True)
            stage.path.mkdir()
            try:
                yield stage
                _replace(stage.path, out)
            finally:
                shutil.rmtree(stage.path, ignore_errors=True)
        except OSError as e:
            raise SurgeryError(f"cannot write {out}: {e.strerror or e}"
                               + (f" ({e.filename})" if e.filename else "")) from None


def written(out, stage: Stage, info: dict) -> dict:
    """What a save returns once ``stage`` replaced ``out``: the folder, its files, ``info`` (see
    :func:`claims`) and the leftovers of killed runs that were removed."""
    out = Path(out).expanduser()
    return {"path": str(out), "files": sorted(p.name for p in out.iterdir()), **info,
            **({"stale_removed": stage.stale} if stage.stale else {})}


def _check_reload(model, folder: Path, records: list[dict], check) -> dict:
    """Load ``folder`` back (plain stock class first, where the records say it computes the same
    function) and compare it with ``model``; see :func:`save`. Returns what was checked."""
    plain = None
    if all(r.get("stock_equivalent") for r in records):
        plain = check(load(folder, load_dtype(model), stock=True))
        if plain.ok:
            return {"loader": "plain transformers", "comparison": plain.as_dict()}
        for r in records:  # the claim was false: say so in the folder and on the modules
            r["stock_equivalent"] = False
            model.get_submodule(r["path"]).stock_equivalent = False
        model.config.save_pretrained(folder)
    if not records:
        raise SurgeryError(f"the saved checkpoint does not reload to the same function (relative error "
                           f"{_beyond(plain)}); nothing was saved")
    ours = check(load(folder, load_dtype(model)))
    if not ours.ok:
        raise SurgeryError(f"the saved checkpoint, loaded back with normsurgery's runtime, differs (relative error "
                           f"{_beyond(ours)}); nothing was saved")
    return {"loader": "trust_remote_code=True or normsurgery.load", "comparison": ours.as_dict(),
            "plain_transformers": None if plain is None else plain.as_dict()}


def _beyond(c) -> str:
    return f"{c.relative:.2e} > {c.tolerance:.1e}" + (f": {c.reason}" if c.reason else "")


def _set_or_drop(cfg, name, value) -> None:
    if value:
        setattr(cfg, name, value)
    elif hasattr(cfg, name):
        delattr(cfg, name)


def check_output(out: Path, force: bool, source=None) -> list[str]:
    """Refuse, before any work, an output that would lose data or cannot be written: the input
    itself, a folder inside it or holding it, the current folder (or one holding it), an existing
    folder without ``force``, and with ``force`` anything but a checkpoint (config.json and
    weights; no folders of the user's); an unwritable location. First clears what killed runs
    left beside ``out`` (:func:`remove_stale`) and returns what that did."""
    out = Path(out).expanduser()
    target = out.resolve()
    stale = remove_stale(out)
    if source is not None:
        src = resolve(source).resolve()
        if target == src:
            raise SurgeryError(f"output {out} is the input checkpoint; choose another folder")
        if src in target.parents:
            raise SurgeryError(f"output {out} is inside the input checkpoint {source}; choose a folder outside it")
        if target in src.parents:
            raise SurgeryError(f"output {out} holds the input checkpoint {source}: replacing it would delete "
                               "the input; choose another folder")
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise SurgeryError(f"output {out} is the current folder or holds it; run from elsewhere or name "
                           "another folder")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise SurgeryError(f"output {out} exists and is not a folder")
        if not force:
            raise SurgeryError(f"output {out} already exists; pass --force to replace it")
        why = _not_a_checkpoint(out)
        if why:
            raise SurgeryError(f"--force replaces only a checkpoint folder, and {out} {why}; move what you "
                               "keep there or choose another output")
    _check_writable(target.parent)
    return stale


def _not_a_checkpoint(folder: Path) -> str | None:
    """Why ``--force`` may not replace ``folder`` (None: an empty folder, or a checkpoint)."""
    entries = list(folder.iterdir())
    if not entries:
        return None
    if not (folder / "config.json").is_file():
        return "has no config.json (it is not a checkpoint)"
    if not any(f.is_file() and f.name.endswith(WEIGHT_SUFFIXES) for f in entries):
        return "holds no weights (it is not a checkpoint)"
    other = sorted(f.name for f in entries if f.is_dir() and f.name not in CHECKPOINT_FOLDERS)
    if other:
        return f"holds folders a checkpoint does not have ({', '.join(other[:3])})"
    return None


def _check_writable(folder: Path) -> None:
    """The nearest existing ancestor of ``folder`` must take a new folder: probed, then removed."""
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise SurgeryError(f"cannot write there: {folder} is a file")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".normsurgery-probe-", dir=folder))
    except OSError as e:
        raise SurgeryError(f"cannot write to {folder}: {e.strerror or e}") from None


STALE = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)")


def remove_stale(out: Path) -> list[str]:
    """Remove the ``.OUT.tmp-PID`` / ``.OUT.old-PID`` folders of killed runs (PID no longer
    alive); an ``.old`` one with no ``out`` beside it (killed between the two renames of
    :func:`_replace`) is the previous output: it is put back. Returns what was done."""
    done = []
    if not out.parent.is_dir():
        return done
    for f in out.parent.iterdir():
        m = STALE.fullmatch(f.name)
        if not m or m["name"] != out.name or not f.is_dir() or _alive(int(m["pid"])):
            continue
        if m["kind"] == "old" and not out.exists():
            f.rename(out)
            done.append(f"restored {out} from {f.name}")
        else:
            shutil.rmtree(f, ignore_errors=True)
            done.append(f"removed {f.name}")
    return done


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_HELD: dict[str, int] = {}


@contextmanager
def output_lock(out):
    """An exclusive lock on the output path for this process (re-entrant), so two runs writing
    the same output at once cannot mix: the second fails at once, naming the first's PID.
    The lock file lives in the temporary directory, never beside the output."""
    key = str(Path(out).expanduser().resolve())
    if os.environ.get("RANK", "0") != "0":  # a secondary process of a distributed run: rank 0 writes
        yield
        return
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    folder = Path(tempfile.gettempdir()) / "normsurgery-locks"
    folder.mkdir(exist_ok=True)
    fd = os.open(folder / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise SurgeryError(f"another normsurgery run (PID {owner}) is writing {out}; wait for it to finish "
                           "or choose another output") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _HELD[key] = 1
    try:
        yield
    finally:
        del _HELD[key]
        os.close(fd)


def _copy_side_files(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.is_file() and f.name not in NOT_COPIED and not f.name.startswith(".") \
                and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(f, dst / f.name)


def _replace(tmp: Path, out: Path) -> None:
    """Move ``tmp`` to ``out``; an old ``out`` is only removed once the new one is in place.
    Ctrl-C and SIGTERM wait for the two renames; a SIGKILL between them leaves the previous
    output as ``.OUT.old-PID``, which the next run puts back (:func:`remove_stale`)."""
    old = None
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        if out.exists() or out.is_symlink():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
        tmp.rename(out)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__

