"""Every command on a GPU gives the verdicts it gives on the CPU (``make test-gpu``; skipped, with
the reason, where torch sees no GPU: CI never has one).

Each command runs as a user runs it (the CLI, ``--device cuda``) on the demo checkpoints; the
exact passes are judged on both devices with the same rules, and their relative errors must be of
the same order (float32: within 10x of each other, both within tolerance; float64: both within
1e-10)."""

import json
from contextlib import contextmanager

import pytest
import torch
from typer.testing import CliRunner

from normsurgery.io.source import Source
from normsurgery.cli import app
from normsurgery.engine.sweep import CheckpointWork
from normsurgery.io.shards import ShardWriter
from normsurgery.engine.training import TrainConfig, train

from models import tiny_model, token_ids

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no GPU here (make test-gpu on a "
                                 "machine with one)")]

GPT2 = "normsurgery/demo/gpt2-tiny"
LLAMA = "normsurgery/demo/llama-tiny"
SAMPLE = "normsurgery/data/sample.txt"
runner = CliRunner()


def cli(*args) -> dict:
    r = runner.invoke(app, [str(a) for a in args] + ["--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def largest_tensor_bytes(src) -> int:
    """The largest tensor of checkpoint ``src`` in bfloat16 (2 bytes an entry): what any computation
    on the whole model holds at least, in the narrowest dtype a command computes in."""
    return 2 * max(e.numel for e in Source.open(src).index.entries.values())


@contextmanager
def on_the_gpu(at_least: int):
    """The block's work ran on the GPU: CUDA memory allocated in it peaked ``at_least`` bytes above
    what was allocated before (the commands run in this process: CliRunner). Not the device a
    command reports, which is the one it was asked for."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated(0)
    torch.cuda.reset_peak_memory_stats(0)
    yield
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated(0) - start
    assert used >= at_least, f"{used} bytes of CUDA memory used, expected at least {at_least}"


def tf32_is_off() -> bool:
    """torch's own flags, read here (not through ``devices``, part of what is tested)."""
    return not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


@pytest.mark.parametrize("src,passes", [(LLAMA, ["flashnorm"]), (GPT2, ["pre-rmsnorm:fold=true", "rotate"])])
@pytest.mark.parametrize("plan", ["--streaming", "--in-memory"])
def test_convert_on_cuda_gives_the_cpu_verdict(tmp_path, src, passes, plan, monkeypatch):
    """convert on the GPU gives the CPU's verdict, with TF32 off while the written folder is
    checked, and the caller's TF32 flags as they were once the command ends (issue 49: the job
    puts them back)."""
    from normsurgery.engine import writer

    flags = [a for p in passes for a in ("--pass", p)]
    cpu = cli("convert", src, tmp_path / "cpu", *flags, plan, "--device", "cpu")
    checked, off = writer.check_written, []
    monkeypatch.setattr(writer, "check_written", lambda *a, **k: off.append(tf32_is_off()) or checked(*a, **k))
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with on_the_gpu(largest_tensor_bytes(src)):
        gpu = cli("convert", src, tmp_path / "gpu", *flags, plan, "--device", "cuda")
    assert gpu["device"]["device"] == "cuda:0" and gpu["device"]["name"] == torch.cuda.get_device_name(0)
    assert cpu["ok"] and gpu["ok"]
    a, b = cpu["parity"]["relative"], gpu["parity"]["relative"]
    assert b <= gpu["parity"]["tolerance"] and max(a, b) <= 10 * max(min(a, b), 1e-7), (a, b)
    assert off == [True] and (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def test_float64_algebra_on_cuda(tmp_path):
    with on_the_gpu(2 * largest_tensor_bytes(LLAMA) * 2):  # float64: 4 times bfloat16's bytes
        r = cli("convert", LLAMA, tmp_path / "o", "--pass", "flashnorm", "--work-dtype", "float64", "--device", "cuda")
    assert r["ok"] and r["parity"]["relative"] <= 1e-10


def test_verify_on_cuda(tmp_path):
    cli("convert", LLAMA, tmp_path / "o", "--pass", "flashnorm", "--device", "cpu")
    for dtype in ("float32", "float64", "bfloat16"):
        cpu = cli("verify", LLAMA, tmp_path / "o", "--dtype", dtype, "--device", "cpu")
        with on_the_gpu(largest_tensor_bytes(LLAMA)):
            gpu = cli("verify", LLAMA, tmp_path / "o", "--dtype", dtype, "--device", "cuda")
        assert cpu["ok"] == gpu["ok"] is True, (dtype, cpu, gpu)
        assert gpu["device"]["device"] == "cuda:0"
    with on_the_gpu(largest_tensor_bytes(LLAMA)):
        gpu = cli("verify", LLAMA, tmp_path / "o", "--streaming", "--device", "cuda")
    assert gpu["ok"] and gpu["streaming"]


def test_trained_commands_on_cuda(tmp_path):
    """heal, prune --heal, squeeze and both trained passes run on the GPU, write one checked
    output, and record where they ran."""
    short = ["--text", SAMPLE, "--device", "cuda"]
    with on_the_gpu(largest_tensor_bytes(LLAMA)):
        h = cli("heal", LLAMA, tmp_path / "heal", "--steps", "3", "--seq-len", "32", *short)
    auto = "bf16" if torch.cuda.is_bf16_supported() else "no"  # --precision auto on a GPU, as documented
    assert h["device"]["device"] == "cuda:0" and h["heal"]["mixed_precision"] == auto
    cli("prune", LLAMA, tmp_path / "prune", "--layers", "1", "--heal", "--steps", "2", "--seq-len", "32", *short)
    cli("squeeze", LLAMA, tmp_path / "sq", "--target", "0.7", "--cycles", "2", "--steps-per-cycle", "2",
        "--seq-len", "32", *short)
    for p in ("remove-ln", "prepbn"):
        r = cli("convert", GPT2, tmp_path / p, "--pass", p, "--steps", "30", "--seq-len", "32", *short)
        assert r["steps"][0]["metrics"]["steps"] == 30
    cli("verify", tmp_path / "heal", tmp_path / "heal", "--device", "cuda")


def test_export_and_outliers_on_cuda(tmp_path):
    r = cli("export", LLAMA, tmp_path / "onnx", "--to", "onnx", "--with-past", "--device", "cuda")
    assert r["ok"] and r["parity"]["generation"] == 1.0
    with on_the_gpu(largest_tensor_bytes(LLAMA)):
        r = cli("inspect", LLAMA, "--outliers", "--samples", "2", "--device", "cuda")
    assert r["device"]["device"] == "cuda:0"


def test_parts_are_read_onto_the_device_and_written_from_the_host(tmp_path):
    source = Source.open(LLAMA)
    work = CheckpointWork(source, torch.float32, streamed=True, device="cuda")
    part = work.parts[1]
    work.enter(part)
    inside = [p for n, p in work.model.named_parameters() if n.startswith(part.scope[0] + ".")]
    assert inside and all(p.device.type == "cuda" for p in inside)
    assert all(b.device.type == "cuda" for b in work.model.buffers())
    work.close()
    writer = ShardWriter(tmp_path, 1 << 30, 1 << 12)
    t = torch.randn(3, 4, device="cuda")
    writer.add("t", t)
    writer.close()
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(next(tmp_path.glob("*.safetensors"))))["t"], t.cpu())


def test_train_on_cuda_gives_a_cpu_model_back_on_the_cpu():
    model = tiny_model("llama", torch.float32)
    from normsurgery.engine.training import make_accelerator

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with on_the_gpu(weights):  # the model went there to train
        r = train(model, token_ids(1, 600, seed=1)[0], token_ids(2, 16, seed=2),
                  TrainConfig(steps=2, batch_size=2, seq_len=16, lr=1e-3),
                  accelerator=make_accelerator("fp32", "cuda"))
    assert r.steps == 2 and all(p.device.type == "cpu" for p in model.parameters())
