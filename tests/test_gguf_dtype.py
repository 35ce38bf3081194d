"""export --to gguf keeps the checkpoint's precision by default (issue 54, item 7): --dtype auto
writes a bf16 checkpoint's matrices as BF16, f16 as F16, f32 as F32 (a bf16 Qwen2.5-0.5B of 1.26 GB
was written as 2.53 GB of F32), as llama.cpp's converter keeps the input's precision; the summary
line says the type. Read back from the written file with the gguf package."""

import shutil
from pathlib import Path

import pytest
import torch
import transformers as T
from typer.testing import CliRunner

import normsurgery as ns
from normsurgery.cli import app

LLAMA = Path("normsurgery/demo/llama-tiny")


def stored_in(tmp_path: Path, dtype: torch.dtype) -> Path:
    """llama-tiny saved in ``dtype`` (its tokenizer beside it)."""
    folder = tmp_path / f"llama-{str(dtype).split('.')[-1]}"
    T.AutoModelForCausalLM.from_pretrained(LLAMA, dtype=dtype).save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(LLAMA / f, folder / f)
    return folder


def types(path: Path) -> dict[str, set[str]]:
    """The GGML types of the file's matrices and of its 1-D tensors."""
    import gguf

    reader = gguf.GGUFReader(path)
    found = {"matrices": set(), "vectors": set()}
    for t in reader.tensors:
        found["matrices" if len([d for d in t.shape if d > 1]) > 1 else "vectors"].add(t.tensor_type.name)
    return found


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "BF16"), (torch.float16, "F16"), (torch.float32, "F32")])
def test_the_default_type_is_the_checkpoints(tmp_path, dtype, name):
    src, out = stored_in(tmp_path, dtype), tmp_path / "out.gguf"
    r = ns.export(src, out, to="gguf")
    assert r.dtype == name.lower() and r.parity.ok
    assert types(out) == {"matrices": {name}, "vectors": {"F32"}}


def test_the_summary_line_says_the_type(tmp_path):
    out = tmp_path / "out.gguf"
    r = CliRunner().invoke(app, ["export", str(stored_in(tmp_path, torch.bfloat16)), str(out), "--to", "gguf"])
    assert r.exit_code == 0, r.output
    said = " ".join(r.stdout.split())  # the console wraps lines at its width
    assert "llama.cpp architecture llama, matrices in BF16 (--dtype auto: the checkpoint's type)" in said, said
    assert types(out)["matrices"] == {"BF16"}
    r = CliRunner().invoke(app, ["export", str(LLAMA), str(out), "--to", "gguf", "--dtype", "f16", "--force"])
    assert r.exit_code == 0 and "matrices in F16;" in " ".join(r.stdout.split()), r.output
    assert types(out)["matrices"] == {"F16"}
