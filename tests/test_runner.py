"""The one runner of every command that writes (issue 49): the output claimed and checked once,
written through one stage (a folder, or a file and its card), and the caller's process left as
the command found it (TF32 flags, glibc's mmap threshold, the card's command line)."""

import importlib
import signal
import sys

import pytest
import torch
from typer.testing import CliRunner

import normsurgery as ns
from normsurgery.cli import app
from normsurgery.core import memory
from normsurgery.core.errors import SurgeryError
from normsurgery.engine import runner as job_runner, writer
from normsurgery.io import modelcard, output
from normsurgery.io.ours import GGUF

GPT2 = "normsurgery/demo/gpt2-tiny"
LLAMA = "normsurgery/demo/llama-tiny"
cli = CliRunner()


def flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.fixture
def tf32_on():
    """The caller's TF32 flags on (CPU torch has them too), and put back after the test."""
    before = flags()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


class Libc:
    """glibc's calls ``memory`` makes, recorded (glibc tells no one its mmap threshold)."""

    def __init__(self):
        self.thresholds = []

    def mallopt(self, option, value):
        assert option == memory.MMAP_THRESHOLD
        self.thresholds.append(value)

    def malloc_trim(self, pad):
        pass


def test_an_api_command_leaves_the_callers_process_as_it_found_it(tmp_path, tf32_on, monkeypatch):
    """A streamed convert and a prune computed with TF32 off (read while the written folder is
    checked) and leave the caller's flags on, as they were; glibc's mmap threshold, 1 MiB while
    a streamed plan runs, is put back to its start-up value when its job ends (the old code left
    1 MiB after any streamed plan), and left alone by a job that streams nothing; the card says
    the Python API and no command line is left set."""
    libc = Libc()
    monkeypatch.setattr(memory, "_libc", lambda: libc)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    seen = []
    checked = writer.check_written

    def spy(*args, **kwargs):
        seen.append(flags())
        return checked(*args, **kwargs)

    monkeypatch.setattr(writer, "check_written", spy)
    ns.convert(LLAMA, tmp_path / "flash", [("flashnorm", {})], streaming=True)
    assert seen == [(False, False)] and flags() == (True, True)
    assert set(libc.thresholds[:-1]) == {1 << 20} and libc.thresholds[-1] == 128 * 1024
    done = len(libc.thresholds)
    ns.prune(GPT2, tmp_path / "pruned", {"layers": 1, "method": "last"})
    assert seen[1:] == [(False, False)] and flags() == (True, True)
    assert len(libc.thresholds) == done  # in memory: the allocator left as it is
    ns.prune(GPT2, tmp_path / "streamed", {"layers": 1, "method": "last", "streaming": True})
    assert set(libc.thresholds[done:-1]) == {1 << 20} and libc.thresholds[-1] == 128 * 1024
    assert modelcard.COMMAND.get() is None
    assert "- command line: the Python API" in (tmp_path / "pruned" / "README.md").read_text()


def test_the_cli_command_line_is_the_commands_only(tmp_path, monkeypatch):
    """The entry point gives the card its command line for that command only: an API convert
    after it says the Python API (the old module global stayed set for the rest of the process)."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # main() sets them
    monkeypatch.setattr(sys, "argv", ["normsurgery", "convert", GPT2, str(tmp_path / "cli"), "--pass", "flashnorm",
                                      "--no-verify"])
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # main() sets it unless set: put back after the test
    try:
        with pytest.raises(SystemExit) as e:
            importlib.import_module("normsurgery.cli.app").main()
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert e.value.code == 0
    assert f"- command line: `normsurgery convert {GPT2} {tmp_path / 'cli'} --pass flashnorm --no-verify`" in \
        (tmp_path / "cli" / "README.md").read_text()
    assert modelcard.COMMAND.get() is None
    ns.convert(GPT2, tmp_path / "api", [("flashnorm", {})], verify=False)
    assert "- command line: the Python API" in (tmp_path / "api" / "README.md").read_text()


@pytest.mark.parametrize("how", ["cli", "api"])
def test_the_output_is_checked_once(tmp_path, monkeypatch, how):
    """One claim per command: ``check_output`` runs once, for the CLI (which locks the output
    before torch loads) as for the API (the old code checked it two or three times)."""
    calls = []
    check = output.check_output
    monkeypatch.setattr(output, "check_output", lambda *a, **k: calls.append(a) or check(*a, **k))
    out = tmp_path / "out"
    if how == "cli":
        r = cli.invoke(app, ["prune", GPT2, str(out), "--layers", "1", "--method", "last"])
        assert r.exit_code == 0, r.output
    else:
        ns.heal(GPT2, out, text="the text of the test.\n" * 200, options={"steps": 1, "seq_len": 16, "eval_samples": 1,
                                                                      "save_adapter": True})
    assert len(calls) == 1 and calls[0][0] == out


def test_a_refused_write_leaves_no_folder(tmp_path, monkeypatch):
    """A save refused after the stage was filled (here: its check) leaves neither the output nor
    the folders made for it (as a GGUF file's always did; a folder's parents stayed)."""
    def refuse(*args, **kwargs):
        raise SurgeryError("refused")

    monkeypatch.setattr(writer, "check_written", refuse)
    with pytest.raises(SurgeryError, match="refused"):
        ns.convert(GPT2, tmp_path / "new" / "deeper" / "out", [("flashnorm", {})])
    assert list(tmp_path.iterdir()) == []


CARD = "---\ntags:\n- normsurgery\n---\n# card\n"


@job_runner.job_scope
def write_file(out, *, force=False, fail=False):
    """A file output, as GGUF writes one: the file and its card (ours), through the runner's claim."""
    claim = job_runner.claim_output(out, force, None, GGUF)
    with output.staged(claim.path) as stage:
        (stage.path / out.name).write_bytes(b"GGUF weights")
        (stage.path / f"{out.name}.md").write_text(CARD)
        if fail:
            raise SurgeryError("the check failed; nothing was written")
    return stage


def test_a_file_output_is_claimed_and_moved_as_a_folder_is(tmp_path):
    """A file output: claimed with the same lock and refusals (GGUF's own words for a folder),
    staged in the same ``.OUT.tmp-PID`` folder, moved beside with its card and recorded; a
    failure leaves nothing, not even the folders made for it."""
    out = tmp_path / "sub" / "x.gguf"
    with pytest.raises(SurgeryError, match="the check failed"):
        write_file(out, fail=True)
    assert list(tmp_path.iterdir()) == []
    with output.recording() as saved:
        write_file(out)
    assert out.read_bytes() == b"GGUF weights" and (out.parent / "x.gguf.md").read_text() == CARD
    assert sorted(f.name for f in out.parent.iterdir()) == ["x.gguf", "x.gguf.md"]
    assert saved == [out]
    with pytest.raises(SurgeryError, match=r"already exists; pass --force to replace it"):
        write_file(out)
    write_file(out, force=True)
    with pytest.raises(SurgeryError, match=r"is a folder; GGUF is one file \(name it OUT.gguf\)"):
        write_file(tmp_path)
    with output.output_lock(out):  # another run holds it (the lock is this process's: re-entrant)
        write_file(out, force=True)
    with pytest.raises(SurgeryError, match="written without being claimed"):
        with output.staged(tmp_path / "y.gguf"):
            pass


def test_a_claim_needs_a_command_scope(tmp_path):
    with pytest.raises(SurgeryError, match="outside a command's job scope"):
        job_runner.Job.open(GPT2, tmp_path / "out")
