"""A library call leaves its caller's process as it found it (issue 54, item 3): each entry point
of the Python API is run on a tiny model, and torch's global generator, its float32 arithmetic
settings (TF32, the matmul precision: older and newer API), the current CUDA device where torch
sees one, and the module globals of normsurgery's modules are compared before and after.

The caller's settings are not torch's defaults here: the matmul precision "medium" (the CPU's
oneDNN in bf16) and cuDNN's TF32 on, so that a job putting back only the ``allow_tf32`` flags is
caught (the old ``exact_arithmetic`` left the precision unreadable after "medium")."""

import copy
import sys
from collections import deque
from contextvars import ContextVar
from pathlib import Path

import pytest
import torch

import normsurgery as ns
from normsurgery.core import devices
from normsurgery.engine import runner as job_runner, writer

GPT2 = "normsurgery/demo/gpt2-tiny"
LLAMA = "normsurgery/demo/llama-tiny"
SAMPLE = "normsurgery/data/sample.txt"
SMALL = {"batch_size": 2, "seq_len": 16, "eval_samples": 2}
TRAINING = {"steps": 2, **SMALL}

#: torch's float32 settings as a caller reads them: the older API and each (backend, op) of the newer
GETTERS = {
    "matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
    "cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
    "float32_matmul_precision": torch.get_float32_matmul_precision,
    **{f"{name}.fp32_precision": (lambda b=b: b.fp32_precision) for name, b in {
        "backends": torch.backends, "cuda.matmul": torch.backends.cuda.matmul, "cudnn": torch.backends.cudnn,
        "cudnn.conv": torch.backends.cudnn.conv, "cudnn.rnn": torch.backends.cudnn.rnn,
        "mkldnn": torch.backends.mkldnn, "mkldnn.matmul": torch.backends.mkldnn.matmul}.items()},
}


def read(get):
    try:
        return get()
    except RuntimeError:  # torch >= 2.9 refuses to read an older setting the newer ones contradict
        return "unreadable"


def arithmetic() -> dict:
    return {name: read(get) for name, get in GETTERS.items()}


def module_globals() -> dict[str, str]:
    """What each loaded normsurgery module holds at module level that a call could change in place
    or rebind: containers, plain values and context variables, by repr."""
    plain = (int, float, str, bytes, bool, type(None), tuple, frozenset, Path)
    held = {}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != "normsurgery" or module is None:
            continue
        for key, value in vars(module).items():
            if isinstance(value, ContextVar):
                held[f"{name}.{key}"] = repr(value.get("<unset>"))
            elif f"{name}.{key}" in CACHES:
                continue
            elif isinstance(value, (dict, list, set, bytearray, deque, *plain)) and not key.startswith("__"):
                held[f"{name}.{key}"] = repr(value)
    return held


#: module globals that may grow in a call, by what first importing a module adds, and why; what they
#: held before must still be there, unchanged
CACHES = {
    "normsurgery.core.registry.PASSES": "the built-in passes register as normsurgery.passes is first imported",
    "normsurgery.core.families._NORMS": "a family's norm classes, added as its transformers modeling module "
                                        "is first imported (core.families._norm_table)",
    "normsurgery.core.families._ADDED": "the modeling modules whose norm classes _NORMS holds",
}


def caches() -> dict:
    return {name: copy.copy(getattr(sys.modules[name.rpartition(".")[0]], name.rpartition(".")[2]))
            for name in CACHES if name.rpartition(".")[0] in sys.modules}


def process() -> dict:
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {"rng": torch.random.get_rng_state(), "arithmetic": arithmetic(),
            "cuda device": torch.cuda.current_device() if cuda else None, "globals": module_globals(),
            "caches": caches()}


@pytest.fixture
def caller():
    """The caller's process: settings of its own, a generator drawn from; torch's put back after."""
    before = arithmetic()
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(1234)
    torch.rand(3)
    yield
    torch.set_float32_matmul_precision(before["float32_matmul_precision"])
    torch.backends.cudnn.allow_tf32 = before["cudnn.allow_tf32"]


def calls(tmp: Path) -> dict:
    """Each entry point, on a tiny model, as cheaply as it runs."""
    text = Path(SAMPLE).read_text()[:20000]
    return {
        "convert": lambda: ns.convert(LLAMA, tmp / "convert", [("flashnorm", {})]),
        "verify": lambda: ns.verify(LLAMA, LLAMA, streaming=True),
        "outliers": lambda: ns.outliers(GPT2, samples=2),
        "prune": lambda: ns.prune(GPT2, tmp / "prune", {"layers": 1, "method": "last"}),
        "heal": lambda: ns.heal(LLAMA, tmp / "heal", text=text, options=TRAINING),
        "squeeze": lambda: ns.squeeze(LLAMA, tmp / "squeeze", text=text, options={"target": 0.7, "steps_per_cycle": 2,
                                                                            **SMALL}),
        "export onnx": lambda: ns.export(GPT2, tmp / "onnx"),
        "export gguf": lambda: ns.export(GPT2, tmp / "model.gguf", to="gguf"),
        "lens": lambda: ns.lens(GPT2),
        "load": lambda: ns.load(LLAMA),
        "save": lambda model=ns.load(LLAMA): ns.save(model, tmp / "save"),
        "apply_passes": lambda model=ns.load(LLAMA): ns.apply_passes(model, [("flashnorm", {})]),
    }


ENTRY_POINTS = ["convert", "verify", "outliers", "prune", "heal", "squeeze", "export onnx", "export gguf", "lens",
                "load", "save", "apply_passes"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_an_entry_point_leaves_the_callers_process_as_it_found_it(entry, tmp_path, caller):
    call = calls(tmp_path)[entry]
    before = process()
    call()
    after = process()
    assert torch.equal(after["rng"], before["rng"]), "torch's global generator moved"
    assert after["arithmetic"] == before["arithmetic"]
    assert after["cuda device"] == before["cuda device"]
    changed = {k: (v, after["globals"].get(k, "<gone>")) for k, v in before["globals"].items()
               if after["globals"].get(k, "<gone>") != v}
    assert not changed, sorted(changed)
    for name, held in before["caches"].items():
        grown = after["caches"][name]
        kept = held <= grown if isinstance(held, set) else all(k in grown and grown[k] is v for k, v in held.items())
        assert kept, f"{name} changed what it held: {CACHES[name]}, never more"


def test_training_leaves_tf32_off_for_the_checks_after_it(tmp_path, caller, monkeypatch):
    """make_accelerator keeps the job's settings (TF32 off) for the work after it: the written
    model is checked with TF32 off, though accelerate turned it on (the old code called the
    context manager ``exact_arithmetic()`` bare, which does nothing); the caller's settings are
    back when heal returns. Read directly after make_accelerator too, inside a job."""
    import accelerate

    real = accelerate.Accelerator

    def eager(*args, **kwargs):
        acc = real(*args, **kwargs)
        torch.backends.cuda.matmul.allow_tf32 = True
        return acc

    monkeypatch.setattr(accelerate, "Accelerator", eager)
    seen, checked = [], writer.check_written
    monkeypatch.setattr(writer, "check_written", lambda *a, **k: seen.append(arithmetic()) or checked(*a, **k))
    off = {"matmul.allow_tf32": False, "cudnn.allow_tf32": False, "float32_matmul_precision": "highest",
           "cuda.matmul.fp32_precision": "ieee", "cudnn.conv.fp32_precision": "ieee",
           "cudnn.rnn.fp32_precision": "ieee", "mkldnn.matmul.fp32_precision": "ieee"}

    @job_runner.job_scope
    def job():
        devices.make_accelerator("fp32", "cpu")
        return arithmetic()

    before = arithmetic()
    inside = job()
    assert inside["matmul.allow_tf32"] is False, "accelerate's TF32 left on"
    assert inside.items() >= off.items()
    assert arithmetic() == before
    ns.heal(LLAMA, tmp_path / "heal", text=Path(SAMPLE).read_text()[:20000], options=TRAINING)
    assert len(seen) == 1 and seen[0]["matmul.allow_tf32"] is False and seen[0].items() >= off.items()
    assert arithmetic() == before
