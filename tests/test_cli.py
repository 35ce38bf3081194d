"""The CLI: results, and refusals that give one line, a non-zero exit and leave nothing behind."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers as T
from typer.testing import CliRunner

from normsurgery.cli import app
from normsurgery.cli.report import fmt

from conftest import apart_runner, assert_refused
from models import tiny_model

GPT2 = "normsurgery/demo/gpt2-tiny"
LLAMA = "normsurgery/demo/llama-tiny"
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in Path(folder).iterdir()}


def test_convert_and_verify(tmp_path):
    out = tmp_path / "rms"
    r = run("convert", GPT2, out, "--recipe", "recipes/gpt2-rmsnorm.toml", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["ok"] and data["steps"][0]["name"] == "pre-rmsnorm"
    assert data["steps"][0]["options"] == {"fold": True}
    r = run("verify", GPT2, out, "--json")
    assert r.exit_code == 0, r.output
    v = json.loads(r.stdout)
    assert v["ok"] and v["relative"] <= 1e-5 and v["top1"] == 1.0 and v["generation"] == 1.0


def test_verify_fails_on_a_different_model(tmp_path):
    other = tmp_path / "other"
    m = T.AutoModelForCausalLM.from_pretrained(GPT2)
    m.transformer.h[0].mlp.c_fc.weight.data.mul_(1.5)
    m.save_pretrained(other)
    shutil.copy(Path(GPT2) / "tokenizer.json", other)
    r = run("verify", GPT2, other)
    assert r.exit_code == 1
    assert "DIFFERENT" in r.output


def test_passes_and_inspect():
    r = run("passes", "--json")
    names = {p["name"] for p in json.loads(r.stdout)}
    assert {"pre-rmsnorm", "flashnorm"} <= names
    r = run("inspect", LLAMA, "--json")
    info = json.loads(r.stdout)
    assert info["family"] == "llama" and info["norm"] == "rmsnorm" and info["blocks"] == 8
    assert info["passes"]["pre-rmsnorm"] == "the norms are already RMSNorm"
    assert info["passes"]["flashnorm"] == "applies"


def test_refuses_post_ln_bert(tmp_path):
    src = tmp_path / "bert"
    tiny_model("bert").float().save_pretrained(src)
    before = digest(src)
    out = tmp_path / "out"
    assert_refused(run("convert", src, out, "--pass", "pre-rmsnorm"), out, "Post-LN")
    assert digest(src) == before


def test_refuses_unknown_architecture(tmp_path):
    src = tmp_path / "t5"
    T.T5ForConditionalGeneration(T.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8,
                                            vocab_size=50)).save_pretrained(src)
    out = tmp_path / "out"
    assert_refused(run("convert", src, out, "--pass", "flashnorm"), out, "no adapter for 't5'; supported:")


@pytest.mark.parametrize("config,match", [('{"foo": 1}', "it has no model_type"),
                                          ("[1, 2]", "it holds a JSON list"),
                                          ('{"model_type": "nonesuch"}', "model type 'nonesuch' is not one"),
                                          ("{not json", "cannot read")])
@pytest.mark.parametrize("command", ["convert", "verify", "inspect", "prune"])
def test_refuses_a_config_that_is_not_one(tmp_path, config, match, command):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(config)
    shutil.copy(Path(LLAMA) / "model.safetensors", src)
    out = tmp_path / "out"
    args = {"convert": [src, out, "--pass", "flashnorm"], "verify": [LLAMA, src], "inspect": [src],
            "prune": [src, out]}[command]
    assert_refused(run(command, *args), out if command in ("convert", "prune") else None, match)


def test_refuses_pass_that_does_not_apply(tmp_path):
    out = tmp_path / "out"
    assert_refused(run("convert", LLAMA, out, "--pass", "pre-rmsnorm"), out, "already RMSNorm")


def test_refuses_missing_input(tmp_path):
    out = tmp_path / "out"
    assert_refused(run("convert", tmp_path / "nope", out, "--pass", "flashnorm"), out, "no checkpoint at")


def test_refuses_existing_output(tmp_path):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_refused(run("convert", GPT2, out, "--pass", "flashnorm"), out, "--force", kept=True)
    assert (out / "keep.txt").read_text() == "mine"
    # --force replaces only a checkpoint: a folder of the user's files is refused, kept whole
    assert_refused(run("convert", GPT2, out, "--pass", "flashnorm", "--force"), out, "not a checkpoint", kept=True)
    assert (out / "keep.txt").read_text() == "mine"
    previous = tmp_path / "previous"
    assert run("convert", GPT2, previous, "--pass", "flashnorm").exit_code == 0
    (previous / "notes.md").write_text("a file of the user's in the checkpoint: refused, kept (it was deleted)")
    assert_refused(run("convert", GPT2, previous, "--pass", "flashnorm", "--force"), None, "notes.md")
    assert (previous / "notes.md").is_file()
    (previous / "notes.md").unlink()
    r = run("convert", GPT2, previous, "--pass", "flashnorm", "--force")
    assert r.exit_code == 0 and (previous / "model.safetensors").is_file()


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_refuses_corrupt_safetensors(tmp_path, damage):
    src = tmp_path / "src"
    shutil.copytree(GPT2, src)
    f = src / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x10\x00\x00\x00\x00\x00\x00\x00not json" + data[16:])
    before = digest(src)
    out = tmp_path / "out"
    assert_refused(run("convert", src, out, "--pass", "flashnorm"), out, "not a valid safetensors file")
    assert digest(src) == before


@pytest.mark.parametrize("args,match", [
    (["--pass", "nonsense"], "unknown pass 'nonsense'"),
    (["--pass", "pre-rmsnorm:fold=maybe"], "option fold='maybe' is not a bool"),
    (["--pass", "minimize:sparsity=2"], "option sparsity must be in [0, 1), got 2.0"),
    (["--pass", "minimize:by=random"], "option by 'random': choose one of magnitude, activation"),
    (["--pass", "remove-ln:steps=0"], "option steps must be a whole number >= 1, got 0"),
    ([], "no passes given"),
])
def test_usage_errors_exit_2_before_loading(tmp_path, args, match):
    out = tmp_path / "out"
    assert_refused(run("convert", GPT2, out, *args), out, match, code=2)


def test_real_process_prints_one_line(tmp_path):
    """The installed entry point, as a user runs it: one line on stderr, exit 1."""
    r = subprocess.run([sys.executable, "-m", "normsurgery", "convert", str(tmp_path / "nope"),
                        str(tmp_path / "out"), "--pass", "flashnorm"], capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error: no checkpoint")


def test_convert_refuses_to_save_when_parity_breaks(tmp_path):
    out = tmp_path / "out"
    r = run("convert", GPT2, out, "--pass", "flashnorm", "--tol", "1e-30")
    assert_refused(r, out, "broke parity")
    r = run("convert", GPT2, out, "--pass", "flashnorm", "--tol", "1e-30", "--force")
    assert r.exit_code == 0 and (out / "config.json").is_file()


def test_inspect_shows_dead_units_of_a_masked_model(tmp_path):
    out = tmp_path / "masked"
    assert run("convert", GPT2, out, "--pass", "mask:prune_channels=16").exit_code == 0
    dead = json.loads(run("inspect", out, "--json").stdout)["dead"]
    assert dead["width"] == 128 and len(dead["dead_channels"]) == 16
    assert all(len(d["unwritten_channels"]) >= 16 for d in dead["layers"])
    assert json.loads(run("inspect", GPT2, "--json").stdout)["dead"]["dead_channels"] == []


# ---- behaving like the tools users know ----

def test_help_version_passes_and_usage_errors_load_neither_torch_nor_transformers():
    """The registry knows every pass's name, kind and options without importing its module."""
    code = ("import sys\nfrom normsurgery.cli import app\nfrom typer.testing import CliRunner\n"
            "for args in (['--help'], ['-h'], ['--version'], ['convert', '-h'], ['verify', 'a', 'b', '--samples', '0'],\n"
            "             ['passes'], ['passes', '--json'], ['convert', 'a', 'b', '--pass', 'FlashNorm'],\n"
            "             ['convert', 'a', 'b', '--pass', 'minimize:sparsity=x'],\n"
            "             ['convert', 'a', 'b', '--pass', 'minimize:sparsity=2'],\n"
            "             ['squeeze', 'a', 'b', '--text', 'x', '--structure', 'layers']):\n"
            "    r = CliRunner().invoke(app, args)\n"
            "    usage = 'verify' in args or 'convert' in args and '-h' not in args or 'squeeze' in args\n"
            "    assert r.exit_code == (2 if usage else 0), (args, r.output)\n"
            "from normsurgery.cli.app import read_text\n"
            "assert read_text('normsurgery/data/sample.txt')  # --text is read before the lock and torch\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_version_short_help_and_help_as_users_read_it():
    from normsurgery import __version__

    assert run("--version").stdout.strip() == f"normsurgery {__version__}"
    r = run("convert", "-h")
    assert r.exit_code == 0
    assert "[[pass]]" in r.stdout and "<bool>" not in r.stdout and "--json" in r.stdout
    assert "--recipe FILE" in r.stdout and "--max-shard-size SIZE" in r.stdout
    for command in ("verify", "passes", "inspect", "prune", "heal"):
        assert "print the result as JSON" in run(command, "--help").stdout


@pytest.mark.parametrize("args, match", [
    (["convert", GPT2, "OUT", "--pass", "FlashNorm"], "did you mean 'flashnorm'"),
    (["convert", GPT2, "OUT", "--pass", "pre_rmsnorm"], "did you mean 'pre-rmsnorm'"),
    (["convert", GPT2, "OUT", "--pass", "pre-rmsnorm:flod=true"], "did you mean 'fold'"),
    (["convert", GPT2, "OUT", "--pass", "flashnorm", "--flod"], "--fold"),
    (["covert", GPT2, "OUT"], "Did you mean 'convert'"),
])
def test_did_you_mean(tmp_path, args, match):
    r = run(*[str(tmp_path / "out") if a == "OUT" else a for a in args])
    assert r.exit_code in (1, 2) and match in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_a_bug_of_ours_has_its_own_exit_code_and_says_where_to_report_it(monkeypatch):
    from normsurgery import passes  # noqa: F401  (the built-in passes)
    from normsurgery.core import registry

    def broken():
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(registry, "all_passes", broken)
    r = run("passes")
    assert r.exit_code == 3, r.output
    assert "internal error, ZeroDivisionError" in r.output and "please report it" in r.output
    assert "Traceback" not in r.output


def test_tables_fit_80_columns_and_minimize_prints_its_sizes(tmp_path):
    r = runner.invoke(app, ["passes"], env={"COLUMNS": "80"})
    assert r.exit_code == 0 and max(map(len, r.stdout.splitlines())) <= 80
    assert "prune_channels" in r.stdout  # option names whole, never cut
    out = tmp_path / "small"
    r = apart_runner().invoke(app, ["convert", GPT2, str(out), "--pass", "minimize:prune_channels=16"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert max(map(len, r.stdout.splitlines())) <= 80
    assert "minimize: sizes per layer" in r.stdout and "total" in r.stdout and "bytes" in r.stdout


def test_a_table_never_cuts_a_number(tmp_path):
    """A long row label ("compensated-ln (reference)") used to push the columns so that 80
    columns printed KL 3.45e-1 for 3.45e-13, "rel. erro" and "ye": labels wrap, numbers never."""
    args = ["convert", GPT2, str(tmp_path / "out"), "--pass", "compensated-ln:prune_channels=8"]
    apart = apart_runner()  # the table and the JSON on stdout; a warning on stderr
    r = apart.invoke(app, args, env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    j = apart.invoke(app, args + ["--force", "--json"], env={"COLUMNS": "80"})
    lines = r.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    header = next(line for line in lines if "pass" in line and "kind" in line)
    assert header.split() == ["pass", "kind", "rel.", "error", "max", "|Δ|", "KL", "top-1", "ok"]
    rows = [line.split() for line in lines if line.split()[:1] == ["compensated-ln"]][:2]
    for step, row in zip(json.loads(j.stdout)["steps"], rows):
        p = step["parity"]
        assert [fmt(p["relative"]), fmt(p["max_abs"]), fmt(p["kl"])] == row[2:5]
        assert row[-1] in ("-", "yes")


ROOT = Path(__file__).resolve().parent.parent


def doc_pages() -> list[Path]:
    """README and every page of the documentation (docs/), README first."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_readme_matches_the_cli():
    """What README and the docs promise exists: the bug-report section errors.REPORT_BUGS points at,
    the flag spellings the CLI takes; their examples need nothing beside the clone (no ../shared)."""
    from normsurgery.commands.heal import PRECISIONS
    from normsurgery.core.errors import REPORT_BUGS

    docs = "\n".join(p.read_text() for p in doc_pages())
    assert "docs/errors.md: Reporting bugs" in REPORT_BUGS
    assert "\n## Reporting bugs\n" in (ROOT / "docs/errors.md").read_text()
    shown = docs.split("[--precision ")[1].split("]")[0].split("|")
    assert set(shown) <= set(PRECISIONS) and "fp32" in shown
    assert "--on-overflow refuse|keep-float32" in docs
    for f in [*doc_pages(), ROOT / "normsurgery/demo/README.md",
              *(p for p in [*ROOT.glob("recipes/*"), *ROOT.glob("scripts/*")] if p.is_file())]:
        assert "../shared" not in f.read_text(), f
    assert "/demo-out/" in (ROOT / ".gitignore").read_text().split()


#: flags README and the docs quote alone that belong to a script, not to normsurgery: the script taking each
SCRIPT_FLAGS = {"--models": "scripts/make_demo.py", "--summarize": "benchmarks/bench_squeeze.py",
                "--real": "benchmarks/bench_rotate.py", "--only": "benchmarks/bench_remove_ln_objective.py",
                "--worker": "benchmarks/bench_heal_objective.py", "--cut": "benchmarks/bench_heal_objective.py"}


def readme_commands(readme: str):
    """(command or None, text) for every command line a page shows: a `normsurgery CMD ...` line of
    a code block with its continuation lines, a quoted `CMD ...` or `... normsurgery CMD ...`, and
    (None) a quoted `--flag ...`."""
    import itertools
    import re

    commands = "convert|verify|passes|inspect|heal|prune|squeeze|export"
    parts = readme.split("```")
    for block in parts[1::2]:
        lines = block.splitlines()
        for i, line in enumerate(lines):
            m = re.search(rf"normsurgery (?:--threads \S+ )?({commands})\b(.*)", line)
            if m:
                more = list(itertools.takewhile(lambda x: x.strip().startswith(("[", "--")), lines[i + 1:]))
                yield m[1], " ".join([m[2], *more])
    for prose in parts[0::2]:
        for span in re.findall(r"`([^`]+)`", prose):
            m = re.match(rf"(?:.* )?(?:normsurgery )({commands})\b(.*)", span, re.S) or \
                re.match(rf"({commands}) (.*)", span, re.S)
            if m:
                yield m[1], m[2]
            elif span.startswith("--"):
                yield None, span


def test_readme_names_only_options_that_exist():
    """Issue 34.9: every option README and the docs show is one the command takes (a few scripts'
    flags excepted, each checked against its script)."""
    import re

    import typer

    root = Path(__file__).resolve().parent.parent
    group = typer.main.get_command(app)

    def flags(params):
        return {o for p in params for o in (*p.opts, *getattr(p, "secondary_opts", ())) if o.startswith("--")}

    common = flags(group.params) | {"--help"}
    per = {name: common | flags(c.params) for name, c in group.commands.items()}
    for flag, script in SCRIPT_FLAGS.items():
        assert f'"{flag}"' in (root / script).read_text(), (flag, script)
    every = set().union(*per.values()) | set(SCRIPT_FLAGS)
    shown = [(c, text) for page in doc_pages() for c, text in readme_commands(page.read_text())]
    assert {c for c, _ in shown} >= {"convert", "verify", "prune", "heal", "squeeze", "export", None}
    assert {c for c, _ in readme_commands((root / "README.md").read_text())} >= {
        "convert", "verify", "prune", "heal", "squeeze", "export"}
    wrong = [(c, f) for c, text in shown for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)
             if f not in (per[c] if c else every)]
    assert not wrong, wrong


def shown_examples(text: str):
    """(command line, output shown) for every code block of a page that starts with `$ normsurgery`."""
    for block in text.split("```")[1::2]:
        lines = block.split("\n")
        if len(lines) > 1 and lines[1].startswith("$ normsurgery "):
            yield lines[1][2:], "\n".join(lines[2:])


def test_readme_example_output_is_what_the_command_prints(tmp_path, monkeypatch):
    """Issue 34.9: every example output README and the docs show (a code block starting with
    `$ normsurgery ...`) is the command's, run where README runs it (80 columns, on the CPU; the
    commands in the order shown, README's first, each run once); numbers aside: they follow the
    machine's rounding and speed. A line `...` stands for lines left out."""
    import re

    shown = [(page, command, out) for page in doc_pages() for command, out in shown_examples(page.read_text())]
    assert {command.split()[1] for page, command, _ in shown if page.name == "README.md"} >= {
        "convert", "verify", "prune", "heal", "squeeze", "export"}
    (tmp_path / "normsurgery").mkdir()
    for name in ("demo", "data"):
        (tmp_path / "normsurgery" / name).symlink_to(ROOT / "normsurgery" / name)
    monkeypatch.chdir(tmp_path)

    def same(text):
        return re.sub(r"\d+", "#", " ".join(text.split()))

    printed = {}
    for page, command, out in shown:
        if command not in printed:
            r = runner.invoke(app, command.split()[1:] + ["--device", "cpu"], env={"COLUMNS": "80"})
            assert r.exit_code == 0, (page, command, r.output)
            printed[command] = same(r.output)
        parts = [same(part) for part in re.split(r"^\.\.\.$", out, flags=re.M)]
        assert re.fullmatch(".*".join(map(re.escape, parts)), printed[command], re.S), (page, command, printed[command])


def test_keep_tied_on_an_untied_head_says_it_changed_nothing(tmp_path):
    """Issue 34.9: flashnorm:keep_tied=true on an untied checkpoint (the demo Llama) is noted, not silent."""
    assert not json.loads((Path(LLAMA) / "config.json").read_text())["tie_word_embeddings"]
    r = run("convert", LLAMA, tmp_path / "out", "--pass", "flashnorm:keep_tied=true", "--json")
    assert r.exit_code == 0, r.output
    notes = json.loads(r.stdout)["steps"][0]["notes"]
    assert any(n.startswith("keep_tied=true changed nothing: lm_head is not tied") for n in notes), notes


def test_an_interrupt_names_the_training_state_it_keeps(tmp_path, monkeypatch):
    """Ctrl-C during a trained pass: no output, and the resumable state beside it is named."""
    import importlib

    conv = importlib.import_module("normsurgery.commands.convert")
    from normsurgery.engine.train_state import STATE_FILE, state_dir

    out = tmp_path / "out"

    def interrupted(src, out, *args, **kwargs):
        state_dir(out).mkdir()
        (state_dir(out) / STATE_FILE).write_bytes(b"state")
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "convert", interrupted)
    r = run("convert", GPT2, out, "--pass", "remove-ln", "--text", "normsurgery/data/sample.txt")
    assert r.exit_code == 130
    assert f"nothing was written; the training state is kept in {tmp_path / '.out.train-state'}" in r.output
    assert "--resume continues from it" in r.output and not out.exists()


def test_readme_pass_table_and_streaming_help_say_what_the_code_does():
    """Issue 28: README's pass kinds are the registry's; --streaming's help states convert's rule
    (streams whenever every pass is blockwise), and README says the plans write the same tensors."""
    import re

    from normsurgery import passes  # noqa: F401  (the built-in passes)
    from normsurgery.core import registry

    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z-]+)` \| (exact|reference|trained) \|", readme, re.M))
    assert rows == {p.name: p.kind for p in registry.all_passes()}
    table = (ROOT / "docs/passes/index.md").read_text()
    assert dict(re.findall(r"^\| `([a-z-]+)` \| (exact|reference|trained) \|", table, re.M)) == rows
    assert not [p for p in doc_pages() if "bit-identical to the in-memory" in p.read_text()]
    help_text = " ".join(run("convert", "--help").output.split())
    assert "convert streams when every pass is blockwise" in help_text.replace("│ ", "").replace(" │", "")


@pytest.mark.parametrize("command", ["export", "squeeze", "convert"])
def test_force_help_names_no_other_command(command):
    """Issue 28: --force's help, shared by every writing command, names none of them."""
    text = " ".join(run(command, "--help").output.replace("│", " ").split())
    assert "--force" in text and "convert, prune, heal" not in text
    if command == "export":  # its own (issue 47.11): what it replaces is a file or an export's folder, and an
        # export that fails its check is never kept
        assert "a GGUF file" in text and "kept even if its reload check fails" not in text
    else:
        assert "kept even if its reload check fails" in text


def test_dead_units_table_fits_80_columns():
    """Issue 28: at 80 columns the last header was cut to "channel"."""
    from rich.console import Console

    from normsurgery.cli.report import dead_table

    layer = {"layer": 0, "dead_units": [], "mlp_units": 384, "dead_heads": [], "heads": 4, "removable_heads": [],
             "removable_kv_heads": [], "kv_heads": 2, "unwritten_channels": []}
    console = Console(width=80, record=True, file=open("/dev/null", "w"))
    console.print(dead_table({"width": 128, "dead_channels": [], "removable_channels": [], "layers": [layer] * 2}))
    text = console.export_text()
    header = " ".join(line for line in text.split("─")[0].splitlines() if "dead units" not in line).split()
    assert "channels" in header and "unwritten" in header and "removable" in header, text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_a_failure_with_json_prints_an_error_object(tmp_path, monkeypatch):
    """Issue 34, finding 11: with --json a failed command printed nothing on stdout. Scripts get
    {"ok": false, "error": ..., "exit_code": N} there, the exit code and the stderr line as before."""
    from normsurgery import passes  # noqa: F401  (the built-in passes)
    from normsurgery.core import registry

    apart = apart_runner()

    def failure(*args) -> int:
        r = apart.invoke(app, [str(a) for a in (*args, "--json")])
        assert json.loads(r.stdout) == {"ok": False, "error": r.stderr.strip().removeprefix("error: "),
                                        "exit_code": r.exit_code}, r.output
        assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
        return r.exit_code

    assert failure("convert", tmp_path / "nope", tmp_path / "out", "--pass", "flashnorm") == 1
    assert failure("verify", GPT2, tmp_path / "nope") == 1
    assert failure("convert", GPT2, tmp_path / "out", "--pass", "nonsense") == 2
    monkeypatch.setattr(registry, "all_passes", lambda: 1 / 0)
    assert failure("passes") == 3


def test_python_run_beside_a_clone_named_normsurgery_says_so(tmp_path):
    """Issue 34, finding 11: from the folder holding a clone named normsurgery, Python imported the
    clone's folder (an empty namespace package, found before an editable install's package), and
    `normsurgery.verify` was an AttributeError. The import fails at once, saying what happened."""
    root = Path(__file__).resolve().parent.parent
    (tmp_path / "normsurgery").symlink_to(root, target_is_directory=True)
    r = subprocess.run([sys.executable, "-c", "import normsurgery; normsurgery.verify"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 1 and "no attribute" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"ImportError: Python imported the normsurgery repository ({tmp_path / 'normsurgery'}) instead of the "
        "package inside it, because it runs from the folder holding the clone: run it from any other folder")


def test_verify_different_says_so_in_one_error_line_on_stderr(tmp_path):
    """Issue 47.9: README promises one `error:` line on stderr for exit code 1; verify's DIFFERENT
    verdict went to stdout only. Now the table (or JSON) on stdout, and one error line on stderr."""
    other = tmp_path / "other"
    m = T.AutoModelForCausalLM.from_pretrained(GPT2)
    m.transformer.h[0].mlp.c_fc.weight.data.mul_(1.5)
    m.save_pretrained(other)
    try:  # click < 8.2 mixes stderr into stdout unless told not to
        apart = CliRunner(mix_stderr=False)
    except TypeError:
        apart = CliRunner()
    for extra in ((), ("--json",)):
        r = apart.invoke(app, ["verify", GPT2, str(other), "--generate", "0", *extra])
        lines = r.stderr.splitlines()
        assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        assert f"{other} does not compute the same function as {GPT2}: relative error" in lines[0]
        assert ("DIFFERENT: relative error" in r.stdout) if not extra else json.loads(r.stdout)["ok"] is False
    r = apart.invoke(app, ["verify", GPT2, GPT2, "--generate", "0"])
    assert r.exit_code == 0 and not r.stderr and "same function" in r.stdout


def test_a_heal_report_says_how_it_was_trained():
    """Issue 47.9: an FSDP2 run was reported as "2 process(es)", like a data-parallel one. The table
    says what the report says (issue 54.10: the JSON carries the same ``sharded``), not what the
    environment of the printing process asks."""
    from types import SimpleNamespace

    from normsurgery.cli.report import heal_line

    report = SimpleNamespace(steps=4, tokens=512, seconds=2.0, tokens_per_second=256.0, processes=2,
                             mixed_precision="no", train="lora", rank=8, target_modules=7, trainable_parameters=99,
                             sharded=False)
    assert "(256 tokens/s, data-parallel over 2 processes, precision fp32)" in heal_line(report)
    report.sharded = True
    assert "(256 tokens/s, sharded (FSDP2) over 2 processes, precision fp32)" in heal_line(report)
    report.processes = 1
    assert "(256 tokens/s, 1 process, precision fp32)" in heal_line(report)


def test_help_and_legends_say_what_they_do():
    """Issue 47.11: verify's --streaming help spoke of a rewrite, export's --force of checkpoints
    only, squeeze's legend of "(/ of the KV-head groups, where other)"; a size under 0.1 GiB was
    "about 0.00 GiB"."""
    from types import SimpleNamespace

    from normsurgery.cli.report import squeeze_table
    from normsurgery.commands.convert import _size

    def helped(command, option):
        text = " ".join(run(command, "--help").output.split())
        return text[text.index(option):][:240]

    assert "rewrite" not in helped("verify", "--streaming") and "comparing only their outputs" in \
        helped("verify", "--streaming")
    assert "a GGUF file" in helped("export", "--force")
    cycle = SimpleNamespace(cycle=1, fraction=0.25, heads_fraction=0.5, params=10, bytes=40, minimize_relative=1e-7,
                            released=3, ce_masked=4.0, ce_after=3.5)
    result = SimpleNamespace(original={"params": 20, "bytes": 80, "ce": 3.4}, cycles=[cycle], control=None)
    legend = str(squeeze_table(result).caption)
    assert "(/ of" not in legend and "a/b: a of the MLP units and channels, b of the KV-head groups" in legend
    assert [_size(2.2e6), _size(0.1 * 2**30), _size(3 * 2**30)] == ["2.2 MB", "0.10 GiB", "3.00 GiB"]
