"""What a checkpoint's config says and what a rewritten checkpoint records.

The config read (:func:`load_config`: of a family and class normsurgery handles) and written
(:func:`save_config`, :func:`write_config`, with the RoPE keys older runtimes read:
:func:`legacy_keys`). A checkpoint is resolved into a :class:`~normsurgery.io.source.Source`
(``io/source.py``) and read into a model by the :class:`~normsurgery.io.loader.Loader`
(``io/loader.py``).

A rewritten model whose modules differ from its stock architecture is saved with a list of
module records in ``config.normsurgery["modules"]``, the runtime copied beside the weights as
``modeling_normsurgery.py`` and an ``auto_map`` naming it (:func:`stamp`, :func:`finish`), so
``from_pretrained(..., trust_remote_code=True)`` rebuilds it with only transformers installed.
Records marked ``stock_equivalent`` compute the same function as the stock module on this model
(an RMSNorm on a zero-mean stream is a LayerNorm): plain ``from_pretrained`` may then load it,
which is claimed only once the written folder, loaded with the stock class, gave the same outputs.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers.initialization import no_init_weights

from ..core import runtime
from ..core.errors import SurgeryError
from ..core.families import AUTO_CLASS, class_name, head_of, stock_class_name, stock_class_of
from .output import WEIGHT_SUFFIXES, copied_folders

RUNTIME_FILE = "modeling_normsurgery.py"
NOT_COPIED = {"config.json", RUNTIME_FILE}


def load_config(path: Path, any_family: bool = False):
    """The config, of a family and class normsurgery handles (else a SurgeryError saying so;
    ``any_family``: also of a family without an adapter whose stock class ``verify`` can run,
    ``families.stock_class_name``). A checkpoint that needs the runtime names its family
    ``normsurgery_<family>`` (see :func:`save_config`): read with the stock family's config class."""
    file = path / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SurgeryError(f"cannot read {file}: {_first_line(e)}") from None
    kind = data.get("model_type") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(kind, str):
        raise SurgeryError(f"{file} is not a model config: " + ("it has no model_type" if isinstance(data, dict)
                           else f"it holds a JSON {type(data).__name__}, not an object"))
    stock = runtime.stock_model_type(kind)
    if (stock or kind) not in transformers.CONFIG_MAPPING:
        raise SurgeryError(f"{file}: model type {kind!r} is not one transformers {transformers.__version__} knows")
    try:
        if stock is None:
            cfg = transformers.AutoConfig.from_pretrained(path)
        else:
            data["model_type"] = stock
            data["auto_map"] = {k: v for k, v in data.get("auto_map", {}).items() if k != "AutoConfig"}
            cfg = transformers.CONFIG_MAPPING[stock].from_dict(data)
    except Exception as e:
        raise SurgeryError(f"cannot read {file}: {_first_line(e)}") from None
    (stock_class_name if any_family else class_name)(cfg)
    return cfg


def config_refusal(config, **changes) -> str | None:
    """Why ``config``'s class would refuse it with ``changes`` set (transformers' strict configs
    check their values, e.g. hidden_size a multiple of the head count, on saving and on loading),
    None where it accepts them or checks nothing. ``config`` itself is left as it is."""
    if getattr(config, "validate", None) is None:
        return None
    trial = copy.deepcopy(config)
    for key, value in changes.items():
        setattr(trial, key, value)
    try:
        trial.validate()
    except Exception as e:  # huggingface_hub's StrictDataclassClassValidationError, ValueError, ...
        return " ".join(str(e.__cause__ or e).split())
    return None


def save_config(config, folder: Path) -> None:
    """``config.json``. A checkpoint whose recorded modules do not all compute the stock function
    names its family ``normsurgery_<family>``, which stock transformers does not know, and maps
    ``AutoConfig`` to the runtime: a plain ``from_pretrained`` then fails loudly (asking for
    ``trust_remote_code=True``) instead of loading the stock class with weights missing or
    ignored, and ``trust_remote_code=True`` or :func:`load` load it."""
    config.save_pretrained(folder)
    file = folder / "config.json"
    data = legacy_keys(json.loads(file.read_text()))
    modules = (getattr(config, "normsurgery", None) or {}).get("modules") or []
    if not all(r.get("stock_equivalent") for r in modules):
        data["model_type"] = runtime.RUNTIME_TYPE + data["model_type"]
        data.setdefault("auto_map", {})["AutoConfig"] = f"{RUNTIME_FILE[:-3]}.NormSurgery{type(config).__name__}"
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def legacy_keys(data: dict) -> dict:
    """``data`` (a config.json) with the RoPE keys that runtimes reading the keys before
    transformers 5 look for at the top level, from transformers 5's one ``rope_parameters`` dict
    (not nested per layer type): ``rope_theta`` (MLX-LM builds RoPE with base 10000 without it),
    ``partial_rotary_factor``, and ``rope_scaling`` (a copy of ``rope_parameters``, which
    transformers reads first) where the RoPE type is not the default. Read back, transformers
    builds the same config."""
    rope = data.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        return data
    data["rope_theta"] = rope["rope_theta"]
    if "partial_rotary_factor" in rope:
        data["partial_rotary_factor"] = rope["partial_rotary_factor"]
    if rope.get("rope_type", "default") != "default":
        data["rope_scaling"] = dict(rope)
    return data


def write_config(model, folder: Path, dtype: torch.dtype) -> None:
    """config.json (stating ``dtype``, what the weights load as; :func:`save_config`) and, for a
    model that generates, generation_config.json."""
    model.config.dtype = dtype
    save_config(model.config, folder)
    if model.can_generate():
        model.generation_config.save_pretrained(folder)


def widest(dtypes) -> torch.dtype:
    """The floating dtype that holds every value of ``dtypes`` (float32 for float16 with bfloat16)."""
    dtypes = set(dtypes)
    best = max(dtypes, key=lambda d: torch.finfo(d).bits)
    return best if len(dtypes) == 1 or torch.finfo(best).bits > 16 else torch.float32


def load_dtype(model) -> torch.dtype:
    """The dtype ``model`` loads back in: its parameters' (the widest when mixed)."""
    return widest({p.dtype for p in model.parameters() if p.is_floating_point()})

# ---------------------------------------------------------------------------------------------
# what a rewritten checkpoint records


def structure_records(model) -> list[dict]:
    """What differs from the stock architecture built from the same config.

    Runtime modules are recorded by class and constructor kwargs; stock modules with other
    parameter shapes by their new shapes; a module list shorter than the stock one (per-head
    modules of fewer heads) by its length; any module's ``_normsurgery_attrs`` as attributes.
    """
    cfg = copy.deepcopy(model.config)
    cfg.normsurgery = None
    with torch.device("meta"), no_init_weights():
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
            if isinstance(mod, nn.ModuleList) and ref is not None and len(ref) > len(mod):
                rec["length"] = len(mod)
                rec["stock_equivalent"] = False
            if own != theirs:
                rec["params"] = {k: list(own[k]) if k in own else None for k in {*own, *theirs}}
                rec["stock_equivalent"] = False
        if getattr(mod, "_normsurgery_attrs", None):
            rec["attrs"] = dict(mod._normsurgery_attrs)
            rec["stock_equivalent"] = False
        if len(rec) > 1:
            records.append(rec)
    return records


def stamp(model, record: dict | None) -> list[dict]:
    """Write into ``model.config`` what a rewritten checkpoint needs: the module records, the
    ``auto_map`` naming the runtime when there are any, ``record`` and the stock architecture.
    Reads only classes and shapes (a model on the meta device will do). Returns the records."""
    records = structure_records(model)
    cfg = model.config
    base = stock_class_of(model)
    auto_map = dict(getattr(cfg, "auto_map", None) or {})
    for name in (*AUTO_CLASS.values(), "AutoConfig"):
        auto_map.pop(name, None)
    if records:
        auto_map[AUTO_CLASS[head_of(model).objective]] = f"{RUNTIME_FILE[:-3]}.NormSurgery{base.__name__}"
    _set_or_drop(cfg, "auto_map", auto_map)
    _set_or_drop(cfg, "normsurgery", {**(record or {}), "modules": records} if (record or records) else None)
    cfg.architectures = [base.__name__]
    return records


def finish(folder: Path, records: list[dict], source=None) -> None:
    """The runtime beside the weights when modules were rebuilt; the ``source``'s (a ``Source``) side files
    (tokenizer, generation config, ...: every file but the config, the weights and ours) and the
    subfolders ``output.copied_folders`` names (sentence-transformers modules), as they are."""
    if records:
        shutil.copyfile(runtime.__file__, folder / RUNTIME_FILE)
    if source is not None:
        for f in source.path.iterdir():
            if f.is_file() and f.name not in NOT_COPIED and not f.name.startswith(".") \
                    and not f.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(f, folder / f.name)
        for f in copied_folders(source.path):
            shutil.copytree(f, folder / f.name)


def mark_not_stock(model, records: list[dict], folder: Path) -> None:
    """The plain-class claim was false: say so in the folder's config and on the modules."""
    for r in records:
        r["stock_equivalent"] = False
        model.get_submodule(r["path"]).stock_equivalent = False
    save_config(model.config, folder)


def claims(records: list[dict], reload: dict | None = None) -> dict:
    """What a save says about loading: without a ``reload`` check nothing is claimed."""
    return {"custom_modules": len(records),
            "plain_transformers": None if reload is None else reload["loader"] == "plain transformers",
            "reload": reload}


def _set_or_drop(cfg, name, value) -> None:
    if value:
        setattr(cfg, name, value)
    elif hasattr(cfg, name):
        delattr(cfg, name)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
