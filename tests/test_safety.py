"""Nothing lost, ever: outputs that would destroy data are refused, interrupted and concurrent runs
leave the previous output or none, bad values are refused before any work, bad checkpoints are
one line each. Subprocess tests run the real entry point with ``save_pretrained`` made to wait,
so a signal lands while the output is being written."""

import copy
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import normsurgery as ns
from normsurgery.io import output
from normsurgery.io.ours import png_marked
from normsurgery.cli import app

from conftest import assert_refused
from models import tiny_model

GPT2 = "normsurgery/demo/gpt2-tiny"
LLAMA = "normsurgery/demo/llama-tiny"
ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def run(*args, **kw):
    return runner.invoke(app, [str(a) for a in args], **kw)


def digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def leftovers(out):
    return [p.name for p in Path(out).parent.iterdir() if p.name.startswith(f".{Path(out).name}.")]


# ---- data safety 1-2: --force and outputs around the input ----

def test_force_never_replaces_the_folder_holding_the_input(tmp_path):
    parent = tmp_path / "work"
    shutil.copytree(GPT2, parent / "in")
    (parent / "notes.txt").write_text("mine")
    before = digest(parent)
    assert_refused(run("convert", parent / "in", parent, "--pass", "flashnorm", "--force"), match="holds the input")
    assert digest(parent) == before


def test_force_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"")
    (out / "sub" / "data.csv").write_text("1,2")
    before = digest(out)
    assert_refused(run("convert", GPT2, out, "--pass", "flashnorm", "--force"), match="holds folders")
    assert digest(out) == before


def test_force_refuses_a_checkpoint_holding_files_it_did_not_write(tmp_path):
    """Newcomer finding 3: a user's my_eval_results.txt inside a checkpoint OUT was deleted by
    --force without a word (folders were protected, files were not)."""
    src, out = tmp_path / "in", tmp_path / "out"
    shutil.copytree(GPT2, src)
    (src / "special_tokens_map.json").write_text("{}")  # a side file of the input: copied, so ours
    r = run("convert", src, out, "--pass", "flashnorm", "--no-verify")
    assert r.exit_code == 0, r.output
    (out / "my_eval_results.txt").write_text("mine")
    before = digest(out)
    assert_refused(run("convert", src, out, "--pass", "flashnorm", "--no-verify", "--force"),
                   match="did not write, which it would delete (my_eval_results.txt)")
    assert digest(out) == before
    (out / "my_eval_results.txt").unlink()  # what a run writes (card, tokenizer, the input's files) is replaced
    r = run("convert", src, out, "--pass", "flashnorm", "--no-verify", "--force")
    assert r.exit_code == 0, r.output


def test_force_keeps_a_readme_normsurgery_did_not_write(tmp_path):
    """Issue 34, finding 4: --force replaced a hand-written README.md inside an existing output
    without a word. Refused, naming it; the card a run wrote (tagged normsurgery) is replaced."""
    out = tmp_path / "out"
    assert run("convert", GPT2, out, "--pass", "flashnorm", "--no-verify").exit_code == 0
    ours = (out / "README.md").read_text()
    (out / "README.md").write_text("# My notes on this model\n\nEvaluated on our data: see below.\n")
    before = digest(out)
    assert_refused(run("convert", GPT2, out, "--pass", "flashnorm", "--no-verify", "--force"),
                   match="holds a README.md normsurgery did not write, which it would delete")
    assert digest(out) == before
    (out / "README.md").write_text(ours)
    assert run("convert", GPT2, out, "--pass", "flashnorm", "--no-verify", "--force").exit_code == 0

def test_output_inside_the_input_is_refused(tmp_path):
    src = tmp_path / "in"
    shutil.copytree(GPT2, src)
    before = digest(src)
    assert_refused(run("convert", src, src / "out", "--pass", "flashnorm"), match="inside the input")
    assert_refused(run("prune", src, src / "out", "--layers", "1"), match="inside the input")
    assert digest(src) == before


def test_output_holding_the_current_folder_is_refused(tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(GPT2, out)  # a checkpoint, so --force alone would allow it
    monkeypatch.chdir(out)
    assert_refused(run("convert", ROOT / GPT2, ".", "--pass", "flashnorm", "--force"), match="current folder")
    assert (out / "model.safetensors").is_file()


# ---- issue 54: a file is replaced only when normsurgery wrote it (GGUF, its card, a plot) ----

def test_force_never_replaces_a_file_that_is_not_a_gguf_file(tmp_path):
    """Issue 54, item 1: ``export ... notes.txt --to gguf --force`` exited 0, "saved notes.txt": the
    notes were gone (a text file named x.gguf too). Refused in one line, exit 1, untouched."""
    for name in ("notes.txt", "x.gguf"):
        out = tmp_path / name
        out.write_text("my notes\n")
        assert_refused(run("export", LLAMA, out, "--to", "gguf", "--force"), out, kept=True,
                       match=f"{out} exists and is not a GGUF file; normsurgery replaces only what it wrote")
        assert out.read_text() == "my notes\n" and not Path(f"{out}.md").exists()


def test_force_replaces_a_gguf_file_and_card_only_when_ours(tmp_path):
    """Issue 54, item 1: the card beside a GGUF file (``x.gguf.md``) was written with no check of its
    own, and any GGUF file was replaced. A card not ours is refused, with or without --force; a GGUF
    file is ours only with our card beside it; the file and card a run wrote are replaced."""
    out, card = tmp_path / "x.gguf", tmp_path / "x.gguf.md"
    card.write_text("# my notes on x\n")
    for force in ((), ("--force",)):
        assert_refused(run("export", LLAMA, out, "--to", "gguf", *force), out,
                       match=f"{card} exists and is not a card normsurgery wrote")
        assert card.read_text() == "# my notes on x\n"
    card.unlink()
    assert run("export", LLAMA, out, "--to", "gguf").exit_code == 0
    ours, first = card.read_text(), out.stat().st_ino
    for mine in ("# my notes on x\n", None):  # our GGUF file, its card replaced by the user's, or gone
        card.unlink()
        if mine:
            card.write_text(mine)
        before = digest(tmp_path)
        assert_refused(run("export", LLAMA, out, "--to", "gguf", "--force"), out, kept=True,
                       match=f"{out} exists and is a GGUF file normsurgery did not write (no card of normsurgery's")
        assert digest(tmp_path) == before
    card.write_text(ours)
    kept = card.stat().st_ino
    assert run("export", LLAMA, out, "--to", "gguf", "--force").exit_code == 0
    assert out.stat().st_ino != first and card.stat().st_ino != kept and card.read_text() == ours  # replaced, each
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf", "x.gguf.md"]


PRUNE = ("--layers", 1, "--samples", 2, "--seq-len", 32, "--eval-samples", 1)


def prune_plot(tmp_path, png, *flags):
    return run("prune", LLAMA, tmp_path / "pruned", *PRUNE, "--plot", png, *flags)


def test_a_plot_is_claimed_and_replaced_as_any_output(tmp_path):
    """Issue 54, item 4: ``prune --plot FILE`` saved the PNG after the checkpoint, unlocked, over any
    existing file without --force. The plot is claimed before any work: an existing file refused
    without --force (nothing computed or written), a file not ours (not a PNG, or a PNG without our
    Software text) even with --force; our earlier plot replaced with --force, in one rename."""
    png, pruned = tmp_path / "scores.png", tmp_path / "pruned"
    png.write_bytes(b"my picture")
    for force in ((), ("--force",)):
        assert_refused(prune_plot(tmp_path, png, *force), pruned, match=f"{png} exists and is not a PNG plot")
        assert png.read_bytes() == b"my picture"
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    fig = pyplot.figure()
    fig.savefig(png, format="png")  # a PNG drawn elsewhere: matplotlib's own Software text
    pyplot.close(fig)
    before = png.read_bytes()
    assert_refused(prune_plot(tmp_path, png, "--force"), pruned, match="is a PNG plot normsurgery did not write")
    assert png.read_bytes() == before
    png.unlink()
    r = prune_plot(tmp_path, png)
    assert r.exit_code == 0 and f"plot: {png}" in r.output and png_marked(png), r.output
    first = png.stat().st_ino
    shutil.rmtree(pruned)  # the output is checked first (its refusal would come before the plot's)
    assert_refused(prune_plot(tmp_path, png), match=f"output {png} already exists; pass --force to replace it")
    assert png.stat().st_ino == first
    assert prune_plot(tmp_path, png, "--force").exit_code == 0
    assert png.stat().st_ino != first and png_marked(png) and not leftovers(png)


def test_a_plot_that_fails_leaves_no_file(tmp_path, monkeypatch):
    """Issue 54, item 4: savefig wrote straight to FILE, so a failure left part of a PNG there. The
    plot is drawn into the claim's stage: a failure leaves nothing, and says so in one line."""
    from matplotlib.figure import Figure

    def broken(self, fname, **kwargs):
        Path(fname).write_bytes(b"\x89PNG\r\n\x1a\npart")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", broken)
    png = tmp_path / "scores.png"
    assert_refused(prune_plot(tmp_path, png), png, match="No space left on device")


def module_state(module) -> dict:
    """The module's own lists, dicts and sets (its state), copied."""
    return {k: copy.deepcopy(v) for k, v in vars(module).items()
            if not k.startswith("__") and isinstance(v, (list, dict, set))}


def test_an_api_call_leaves_the_output_module_as_it_found_it(tmp_path):
    """Issue 54, item 3: ``output.REPLACED`` grew by every output an API call moved into place, in its
    caller's process. A call (here a convert with force over an existing output) leaves the module's
    lists, dicts and sets as they were."""
    out = tmp_path / "out"
    ns.convert(GPT2, out, [("flashnorm", {})], verify=False)
    before = module_state(output)
    ns.convert(GPT2, out, [("flashnorm", {})], verify=False, force=True)
    assert module_state(output) == before


# ---- data safety 3 and hardening: signals, SIGKILL, stale folders, concurrent writers ----

SLOW_SAVE = """import importlib, os, sys, time
from normsurgery.cli import main
module, name = os.environ["NS_WAIT_AFTER"].split(":")
owner, _, name = name.rpartition(".")
owner = getattr(importlib.import_module(module), owner) if owner else importlib.import_module(module)
done = getattr(owner, name)
def slow(*args):
    value = done(*args)
    open(os.environ["NS_READY"], "w").close()
    for _ in range(600):
        if os.path.exists(os.environ["NS_GO"]):
            break
        time.sleep(0.1)
    return value
setattr(owner, name, slow)
sys.argv = ["normsurgery", *sys.argv[1:]]
main()
"""


def slow_convert(tmp_path, out, *extra, wait_after="normsurgery.io.shards:ShardWriter.close"):
    """A convert whose save waits after ``wait_after`` (module:function; default: once the weights
    are written) until ``tmp_path/go`` exists. Ctrl-C acts as from a terminal (see
    :func:`test_ctrl_c_during_start_up_is_one_line`)."""
    env = {**os.environ, "NS_READY": str(tmp_path / "ready"), "NS_GO": str(tmp_path / "go"),
           "NS_WAIT_AFTER": wait_after, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, "convert", GPT2, str(out), "--pass", "flashnorm",
                             "--no-verify", *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 180
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.1)
    return proc


def test_sigterm_while_saving_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    proc = slow_convert(tmp_path, out)
    assert leftovers(out)  # the temporary folder exists while saving
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.strip() == "error: terminated: nothing was written"
    assert not out.exists() and not leftovers(out)


def test_ctrl_c_once_the_output_is_in_place_says_it_was_written(tmp_path):
    """Issue 34, finding 2: Ctrl-C just after the new output replaced the previous one said
    "nothing was written". It names the output written instead (exit 130: the run was cut short)."""
    out = tmp_path / "out"
    shutil.copytree(GPT2, out)  # the previous output
    before = digest(out)
    proc = slow_convert(tmp_path, out, "--force", wait_after="normsurgery.io.output:_replace")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip() == f"error: interrupted after {out} was written in full (only the report was cut short)"
    assert digest(out) != before and (out / "README.md").is_file() and not leftovers(out)


def test_ctrl_c_during_the_swap_waits_for_the_whole_swap(tmp_path, monkeypatch):
    """Issue 34, finding 2: a signal held during the two renames was raised before the previous
    output was removed, leaving it beside the new one as .out.old-PID; and with another thread
    running (torch's), which takes a signal the main thread blocks, it was raised inside the swap.
    The swap ends first."""
    out, tmp = tmp_path / "out", tmp_path / ".out.tmp-1"
    for folder, name in ((out, "previous"), (tmp, "new")):
        folder.mkdir()
        (folder / name).write_text(name)
    rename = Path.rename

    def interrupted(self, target):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during the swap
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", interrupted)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    idle = threading.Event()
    other = threading.Thread(target=idle.wait)  # a thread that does not block the signal
    other.start()
    try:
        with pytest.raises(KeyboardInterrupt), output.recording() as saved:
            output._replace(tmp, out)
    finally:
        idle.set()
        other.join()
        signal.signal(signal.SIGINT, handler)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in out.iterdir()] == ["new"]
    assert saved == [out]


LATE_SIGNAL = """import os, signal, sys
from normsurgery.cli import main
class Late:  # dropped as Python clears __main__, after it has put back the default signal handlers
    def __del__(self, kill=os.kill, pid=os.getpid(), sig=signal.SIGINT):
        kill(pid, sig)
late = Late()
sys.argv = ["normsurgery", *sys.argv[1:]]
main()
"""


def test_ctrl_c_while_python_shuts_down_after_a_save_changes_nothing(tmp_path):
    """Issue 34, finding 2: Ctrl-C after "saved OUT" was printed, while Python shut down, killed the
    process: exit 130 and no line, which says nothing was written. The command's own exit stands."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", LATE_SIGNAL, "convert", GPT2, str(out), "--pass", "flashnorm",
                           "--no-verify"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode == 0 and not proc.stderr, (proc.returncode, proc.stderr)
    assert f"saved {out}" in proc.stdout and (out / "model.safetensors").is_file()


def test_a_second_writer_fails_clearly_sigkill_keeps_the_previous_output_the_next_run_cleans_up(tmp_path):
    out = tmp_path / "out"
    shutil.copytree(GPT2, out)  # the previous output
    before = digest(out)
    proc = slow_convert(tmp_path, out, "--force")
    r = run("convert", GPT2, out, "--pass", "flashnorm", "--force")  # while the first one saves
    assert_refused(r, match=f"another normsurgery run (PID {proc.pid}) is writing")
    proc.kill()
    proc.wait(timeout=60)
    assert digest(out) == before  # the previous one, whole
    stale = leftovers(out)
    assert stale == [f".out.tmp-{proc.pid}"]
    r = run("convert", GPT2, out, "--pass", "flashnorm", "--force", "--no-verify")
    assert r.exit_code == 0, r.output
    assert f"removed .out.tmp-{proc.pid}" in r.output
    assert not leftovers(out) and digest(out) != before
    lock = Path(tempfile.gettempdir(), "normsurgery-locks",
                hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:24] + ".lock")
    assert not lock.exists()  # a finished run removes its lock file (the killed one's stays, unlocked)


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_killed_between_the_renames_the_previous_output_is_put_back(tmp_path):
    out = tmp_path / "out"
    old = tmp_path / f".out.old-{dead_pid()}"
    shutil.copytree(GPT2, old)
    before = digest(old)
    done = output.check_output(out, force=True)
    assert done == [f"restored {out} from {old.name}"]
    assert digest(out) == before and not leftovers(out)


def test_ctrl_c_during_start_up_is_one_line(tmp_path):
    # as from a terminal: a harness that runs the suite in the background ignores SIGINT, and a
    # child inherits that (Python then installs no handler: Ctrl-C would be ignored, rightly)
    proc = subprocess.Popen([sys.executable, "-m", "normsurgery", "convert", GPT2, str(tmp_path / "out"), "--pass",
                             "flashnorm"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120  # until the command is importing torch (its libraries mapped)
    while "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.01)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip() == "error: interrupted: nothing was written"


# ---- data safety 4: bad values refused before any work ----

@pytest.mark.parametrize("args, match", [
    (("verify", GPT2, GPT2, "--samples", "0"), "--samples"),
    (("verify", GPT2, GPT2, "--generate", "-1"), "--generate"),
    (("verify", GPT2, GPT2, "--tol", "-1"), "--tol"),
    (("verify", GPT2, GPT2, "--dtype", "float33"), "float32"),
    (("convert", GPT2, "OUT", "--pass", "flashnorm", "--max-shard-size", "lots"), "not a size"),
    (("prune", GPT2, "OUT", "--fraction", "1.5"), "--fraction"),
    (("prune", GPT2, "OUT", "--layers", "0"), "--layers"),
    (("heal", GPT2, "OUT", "--text", "x.txt", "--eval-fraction", "0"), "--eval-fraction"),
])
def test_bad_values_are_usage_errors_before_any_work(tmp_path, args, match, monkeypatch):
    from normsurgery.io.source import Source

    def never(*a, **k):
        raise AssertionError("a checkpoint was read before the usage error")

    monkeypatch.setattr(Source, "open", never)
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert "Invalid value" in r.output and match in r.output and "internal error" not in r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content, match", [(b"", "empty"), (b"\x00\x01\x02binary\xff\xfe" * 50, "not a text file")])
def test_binary_or_empty_text_is_refused(tmp_path, content, match):
    f = tmp_path / "text.txt"
    f.write_bytes(content)
    assert_refused(run("verify", GPT2, GPT2, "--text", f), match=match)
    assert_refused(run("convert", GPT2, tmp_path / "out", "--pass", "flashnorm", "--text", f), match=match)


# ---- data safety 5: defaults fit the model ----

def test_default_window_fits_a_model_with_few_positions(tmp_path):
    src = tmp_path / "short"
    torch.manual_seed(0)
    T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=1024, n_positions=64)).save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(GPT2) / f, src)
    r = run("prune", src, tmp_path / "out", "--layers", "1", "--json")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert_refused(run("prune", src, tmp_path / "out2", "--layers", "1", "--seq-len", "128"),
                   match="--seq-len 128 is longer than the model's 64 positions")
    # every default adapts the same way: remove-ln's and prepbn's windows too
    text = str(ROOT / "normsurgery/data/sample.txt")
    r = run("convert", src, tmp_path / "out3", "--pass", "remove-ln:steps=12,batch_size=2,eval_samples=2",
            "--text", text, "--json")
    assert r.exit_code == 0, r.output
    for name in ("remove-ln", "prepbn"):
        assert_refused(run("convert", src, tmp_path / "out4", "--pass", f"{name}:steps=12,seq_len=128", "--text", text),
                       match=f"{name}: seq_len 128 is longer than the model's 64 positions")


# ---- hardening: bad checkpoints, one line each, input untouched, nothing written ----

def broken(tmp_path, how):
    src = tmp_path / "src"
    shutil.copytree(GPT2, src)
    if how == "missing shard":
        (src / "model.safetensors.index.json").write_text(
            '{"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}')
    elif how in ("nan", "inf"):
        w = load_file(src / "model.safetensors")
        w["transformer.h.0.mlp.c_fc.weight"][0, 0] = float(how)
        save_file(w, src / "model.safetensors", metadata={"format": "pt"})
    elif how == "pickle":
        torch.save(load_file(src / "model.safetensors"), src / "pytorch_model.bin")
        (src / "model.safetensors").unlink()
    return src


@pytest.mark.parametrize("how, match", [("missing shard", "missing shards"), ("nan", "NaN or Inf"),
                                        ("inf", "NaN or Inf"), ("pickle", "--allow-pickle")])
def test_bad_checkpoints_are_one_line(tmp_path, how, match):
    src = broken(tmp_path, how)
    before = digest(src)
    out = tmp_path / "out"
    assert_refused(run("convert", src, out, "--pass", "flashnorm"), match=match)
    assert digest(src) == before and not out.exists() and not leftovers(out)


def test_pickle_loads_when_allowed(tmp_path):
    src = broken(tmp_path, "pickle")
    r = run("convert", src, tmp_path / "out", "--pass", "flashnorm", "--allow-pickle", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["parity"]["ok"] and (tmp_path / "out" / "model.safetensors").is_file()
    ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    original = T.AutoModelForCausalLM.from_pretrained(GPT2)  # the weights the pickle holds
    ours = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    a, b = original(input_ids=ids).logits, ours(input_ids=ids).logits
    assert ((a - b).abs().max() / a.abs().max()).item() <= 1e-5
    assert_refused(run("inspect", src), match="--allow-pickle")  # for that command only


def test_verify_refuses_models_that_cannot_be_compared(tmp_path):
    small = tmp_path / "small"
    tiny_model("gpt2").float().save_pretrained(small)
    assert_refused(run("verify", GPT2, small), match="vocabulary of 1024 tokens")
    assert_refused(run("verify", GPT2, LLAMA), match="a gpt2 model and")


def test_unwritable_output_location(tmp_path):
    """Issue 47.11: /proc/x said "No such file or directory" (mkdir's answer there), not that the
    output cannot be created."""
    out = Path("/sys/normsurgery-test/out")  # refused even to root
    assert_refused(run("convert", GPT2, out, "--pass", "flashnorm"),
                   match="cannot create /sys/normsurgery-test/out: /sys does not take new folders")
    assert_refused(run("convert", GPT2, "/proc/x", "--pass", "flashnorm"),
                   match="cannot create /proc/x: /proc does not take new folders (No such file or directory); "
                         "choose an output elsewhere")


def test_hub_id_not_in_the_cache_says_how_to_pass_a_path(tmp_path):
    assert_refused(run("convert", "no-such-org/no-such-model", tmp_path / "out", "--pass", "flashnorm"),
                   match="never downloads")
