"""Where work runs (``devices``), checked where no GPU is: the choice, its refusals, where it is
recorded, and the contracts the GPU path rests on (tests/test_gpu.py runs them on a GPU)."""

import contextlib
import json

import pytest
import torch

import normsurgery as ns
from typer.testing import CliRunner

from normsurgery.core import devices
from normsurgery.cli import app
from normsurgery.core.errors import SurgeryError, UsageError
from normsurgery.engine.training import TrainConfig, mixed_precision, train

from models import tiny_model, token_ids

LLAMA = "normsurgery/demo/llama-tiny"
SAMPLE = "normsurgery/data/sample.txt"
runner = CliRunner()


@pytest.fixture
def no_gpu(monkeypatch):
    """A machine where torch sees no GPU (whatever this one has)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_the_spellings_and_the_choice(no_gpu):
    for spec in ("auto", "cpu", "cuda", "cuda:0", "cuda:3"):
        assert devices.check(spec) == spec
    for spec in ("gpu", "cuda0", "cuda:", "CPU", "meta", ""):
        with pytest.raises(UsageError, match="choose auto, cpu, cuda or cuda:N"):
            devices.check(spec)
    assert devices.choose("auto") == torch.device("cpu") == devices.choose("cpu")
    assert devices.describe(devices.choose("auto")) == {"device": "cpu", "name": "CPU"}


@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_a_gpu_asked_for_where_there_is_none_is_refused(no_gpu, spec):
    with pytest.raises(SurgeryError, match=f"--device {spec}: torch sees no GPU here .*use --device cpu or auto"):
        devices.choose(spec)


def test_precision_auto_is_fp32_on_the_cpu():
    cpu = torch.device("cpu")
    assert mixed_precision("auto", cpu) == "no" and mixed_precision("fp32", cpu) == "no"
    assert mixed_precision("bf16", cpu) == "bf16"
    with pytest.raises(SurgeryError, match="choose auto, fp32, bf16, fp16"):
        mixed_precision("fp8", cpu)


def test_cli_refuses_a_bad_device_or_precision_before_loading(tmp_path):
    r = runner.invoke(app, ["convert", LLAMA, str(tmp_path / "o"), "--pass", "flashnorm", "--device", "gpu"])
    assert r.exit_code == 2 and "choose auto, cpu, cuda or cuda:N" in r.output
    r = runner.invoke(app, ["heal", LLAMA, str(tmp_path / "o"), "--text", SAMPLE, "--precision", "bf32"])
    assert r.exit_code == 2 and "choose one of auto, fp32, bf16, fp16" in r.output
    assert not (tmp_path / "o").exists()


def test_cli_without_a_gpu_says_so_in_one_line(tmp_path, no_gpu):
    out = tmp_path / "o"
    r = runner.invoke(app, ["verify", LLAMA, LLAMA, "--device", "cuda"])
    assert r.exit_code == 1, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda: torch sees no GPU"), r.output
    r = runner.invoke(app, ["convert", LLAMA, str(out), "--pass", "flashnorm", "--device", "cuda:0"])
    assert r.exit_code == 1 and "torch sees no GPU" in r.output and not out.exists()


def test_the_choice_is_printed_and_recorded(tmp_path, no_gpu):
    out = tmp_path / "o"
    r = runner.invoke(app, ["convert", LLAMA, str(out), "--pass", "flashnorm", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["device"] == {"device": "cpu", "name": "CPU"}
    assert json.loads((out / "config.json").read_text())["normsurgery"]["device"] == {"device": "cpu", "name": "CPU"}
    assert "- computed on: cpu\n" in (out / "README.md").read_text()
    r = runner.invoke(app, ["verify", LLAMA, str(out), "--device", "cpu"])
    assert r.exit_code == 0 and "computed on cpu" in r.output
    r = runner.invoke(app, ["verify", LLAMA, str(out), "--json", "--samples", "1", "--generate", "0"])
    assert json.loads(r.stdout)["device"] == {"device": "cpu", "name": "CPU"}


def test_train_gives_the_model_back_where_it_found_it(monkeypatch):
    """Every move of the model is recorded: the last one, after the last step, is back to where it
    was. Home and the accelerator's device must differ for that to show (moving back to the
    accelerator's device instead would pass otherwise): where no GPU is, the model is taken to be at
    home on the meta device (a stand-in) and trains on the CPU (with the move-back removed, the last
    event is a step; with the model moved to the accelerator's device instead, the last move is to
    the CPU: both fail)."""
    model = tiny_model("llama", torch.float32)
    meta, cpu = torch.device("meta"), torch.device("cpu")
    where = devices.of
    monkeypatch.setattr(devices, "of", lambda m: meta if m is model else where(m))
    events = []
    real = type(model).to

    def to(self, *args, **kwargs):
        events.append(("to", torch.device(args[0]) if args and isinstance(args[0], (str, torch.device)) else None))
        return real(self, *args, **kwargs)

    type(model).to = to
    try:
        train(model, token_ids(1, 600, seed=1)[0], token_ids(2, 16, seed=2),
              TrainConfig(steps=2, batch_size=2, seq_len=16, lr=1e-3),
              on_step=lambda step, m: events.append(("step", step)))
    finally:
        type(model).to = real
    steps = [i for i, e in enumerate(events) if e[0] == "step"]
    moves = [i for i, e in enumerate(events) if e[0] == "to"]
    assert steps and moves and moves[0] < steps[0] and moves[-1] > steps[-1]
    assert {events[i] for i in moves if i < steps[0]} == {("to", cpu)}  # trained on the accelerator's device
    assert events[moves[-1]] == ("to", meta)  # given back home
    assert all(p.device == meta for p in model.parameters())


def test_training_that_cannot_fit_the_gpu_is_refused_before_anything_moves(monkeypatch):
    from normsurgery.engine.training import check_fits, training_bytes

    model = tiny_model("llama", torch.float32)
    params = list(model.parameters())
    gpu = torch.device("cuda")
    weights = sum(p.numel() * 4 for p in params)
    assert training_bytes(model, params, gpu) == 4 * weights  # weights, gradients, two AdamW moments
    assert training_bytes(model, params[:1], gpu) == weights + 3 * params[0].numel() * 4
    monkeypatch.setattr(devices, "free_bytes",
                        lambda device: 2 * weights if torch.device(device).type == "cuda" else None)
    with pytest.raises(SurgeryError, match=r"training needs at least .* GiB on cuda .*heal --train lora or norms"):
        check_fits(model, params, gpu)
    check_fits(model, params[:1], gpu)  # one matrix trains: it fits
    check_fits(model, params, torch.device("cpu"))  # host memory is not measured here


class TwoGpus:
    """Torch told it sees two GPUs (there are none): the current device kept here, set by
    ``torch.cuda.set_device`` and by a ``torch.cuda.device`` block as torch's own is; the caller's
    is the second."""

    def __init__(self, monkeypatch):
        self.current = 1
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "set_device", self.set)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "device", self.block)
        monkeypatch.setattr(devices, "rng_kept", lambda device: contextlib.nullcontext())  # no generator to fork

    def set(self, device) -> None:
        self.current = device if isinstance(device, int) else torch.device(device).index

    @contextlib.contextmanager
    def block(self, device):
        before = self.current
        self.set(device)
        try:
            yield
        finally:
            self.current = before


def test_a_job_makes_its_gpu_current_and_turns_tf32_off_for_itself_alone(monkeypatch, tmp_path):
    """TF32 (10 mantissa bits) would round a float32 check far past its 1e-5: a job on a GPU
    (``runner.Job``) computes with it off, its GPU the current CUDA device, and puts the caller's
    flags and current device back when it ends (issues 49 and 54: the library leaves its caller's
    process as it found it; ``choose`` sets nothing). Torch is told there are two GPUs: with
    ``exact_arithmetic()`` left out of the job's scope the flags stay on inside it, with them not
    put back they stay off after it, and with ``choose`` setting the device (the old code) the
    caller's current device is left at the job's; each way this fails."""
    from normsurgery.engine import runner as job_runner

    cuda_matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before = cuda_matmul.allow_tf32, cudnn.allow_tf32
    gpus = TwoGpus(monkeypatch)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    inside = []

    @job_runner.job_scope
    def job():
        inside.append((job_runner.Job.open(LLAMA, tmp_path / "o", device="cuda").device, gpus.current,
                       cuda_matmul.allow_tf32, cudnn.allow_tf32))

    try:
        cuda_matmul.allow_tf32 = cudnn.allow_tf32 = True
        job()
        assert inside == [(torch.device("cuda", 0), 0, False, False)]
        assert cuda_matmul.allow_tf32 is True and cudnn.allow_tf32 is True  # the caller's, put back
        assert gpus.current == 1
        assert devices.choose("cuda:0") == torch.device("cuda", 0) and gpus.current == 1  # choosing sets nothing
        assert cuda_matmul.allow_tf32 is True and cudnn.allow_tf32 is True
    finally:
        cuda_matmul.allow_tf32, cudnn.allow_tf32 = before


def test_verify_compares_with_tf32_off_and_puts_the_flags_back(monkeypatch):
    """verify (a command that writes nothing) holds the job's process settings too: TF32 off while
    it compares, the caller's flags back after (without its scope it compared with TF32 on)."""
    from normsurgery.commands import verify as verify_mod

    cuda_matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before, seen = (cuda_matmul.allow_tf32, cudnn.allow_tf32), []
    compare = verify_mod.compare
    monkeypatch.setattr(verify_mod, "compare", lambda *a, **k: seen.append(
        (cuda_matmul.allow_tf32, cudnn.allow_tf32)) or compare(*a, **k))
    try:
        cuda_matmul.allow_tf32 = cudnn.allow_tf32 = True
        assert ns.verify(LLAMA, LLAMA, streaming=True).ok
        assert seen and set(seen) == {(False, False)}
        assert (cuda_matmul.allow_tf32, cudnn.allow_tf32) == (True, True)
    finally:
        cuda_matmul.allow_tf32, cudnn.allow_tf32 = before
