"""Pass options from one source: each pass's options are an options dataclass of ``option()`` fields in
the torch-free pass table (``normsurgery/passes/__init__.py``), checked by the same function as the
commands' (``Limit.refusal``), from the command line (``--pass name:key=value``), a recipe and the API;
"not given" is None; the held-out share has the commands' name."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from normsurgery.cli import app
from normsurgery.core import options, registry
from normsurgery.core.errors import UsageError
from normsurgery.core.limits import Limit

builtin = importlib.import_module("normsurgery.passes")  # the pass table (``normsurgery.passes`` is also a function)
GPT2 = "normsurgery/demo/gpt2-tiny"
MARK = "refused by Limit.refusal:"


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def models() -> dict[str, type]:
    return {p.name: p.model for p in registry.all_passes() if p.model is not None}


def test_each_pass_option_is_an_option_field_of_its_passs_options_dataclass():
    """Every built-in pass's options are its options dataclass's ``option()`` fields: the registry's
    defaults and limits are that dataclass's, declared nowhere else (no dict of defaults, no table of limits)."""
    for p in registry.all_passes():
        flagged = options.flagged(p.model)
        assert [f.name for f in flagged] == list(p.options), p.name
        for f in flagged:
            assert p.options[f.name] == options.default_of(f), (p.name, f.name)
            assert p.limits.get(f.name) is f.metadata["flag"].limit, (p.name, f.name)
    assert not hasattr(builtin, "LIMITS") and not hasattr(builtin, "MASK_OPTIONS")
    assert builtin.MaskOptions.__dataclass_fields__["by"].metadata["flag"].choices is options.CRITERIA


@pytest.mark.parametrize("name, key, typed, message", [
    ("minimize", "sparsity", "2", "must be in [0, 1), got 2.0"),
    ("mask", "by", "random", "'random': choose one of magnitude, activation"),
    ("remove-ln", "steps", "0", "must be a whole number >= 1, got 0"),
    ("prepbn", "momentum", "0", "must be in (0, 1], got 0.0"),
    ("remove-ln", "keep", "block", "'block': choose one of none, final"),
])
def test_a_pass_option_out_of_range_is_refused_by_the_one_check_everywhere(tmp_path, monkeypatch, name, key, typed,
                                                                         message):
    """``--pass name:key=value``, a recipe's table and the API (``apply_passes``' ``check_options``) refuse
    the value in the same words, by the function that refuses the commands' options: a usage error
    (exit 2) before anything is loaded."""
    real = Limit.refusal
    monkeypatch.setattr(Limit, "refusal", lambda self, v: None if real(self, v) is None else f"{MARK} {real(self, v)}")
    said = f"pass {name!r}: option {key} {MARK} {message}"
    with pytest.raises(UsageError) as e:
        registry.check_options(registry.get(name), {key: typed})
    assert str(e.value) == said
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[[pass]]\nname = "{name}"\n{key} = {typed if typed[0].isdigit() else f"{typed!r}"}\n')
    for how in (["--pass", f"{name}:{key}={typed}"], ["--recipe", recipe]):
        r = run("convert", GPT2, tmp_path / "out", *how, "--text", "normsurgery/data/sample.txt")
        assert r.exit_code == 2 and r.output.strip() == f"error: {said}", (how, r.output)
    assert not (tmp_path / "out").exists()


def test_not_given_is_none_and_an_old_sentinel_is_refused():
    """An option chosen from the model or the other options when not given defaults to None (no -1, no 0
    standing for "auto"); the old sentinels are refused, not read as "auto"."""
    rl, pb = registry.get("remove-ln"), registry.get("prepbn")
    for p, names in ((rl, ("seq_len", "warmup", "min_lr", "start", "gap", "final_gap", "block_aux")),
                     (pb, ("seq_len", "warmup", "decay"))):
        for k in names:
            assert p.options[k] is None, (p.name, k)
            with pytest.raises(UsageError, match=f"option {k} must be"):
                registry.check_options(p, {k: -1 if k not in ("seq_len", "gap", "final_gap") else 0})
    assert registry.check_options(rl, {"warmup": 5})["warmup"] == 5
    assert not hasattr(registry, "AUTO")


def test_the_held_out_share_has_the_commands_name_and_the_old_one_is_refused_with_it():
    """One name for the held-out share: heal's, squeeze's and the trained passes' ``eval_fraction``;
    remove-ln's old ``heldout`` is refused, naming the new one (not read, not silently dropped)."""
    for cls in (options.HealOptions, options.SqueezeOptions, builtin.PrepbnOptions, builtin.RemoveLnOptions):
        names = {f.name for f in dataclasses.fields(cls)}
        assert "eval_fraction" in names and "heldout" not in names, cls
    with pytest.raises(UsageError, match=r"pass 'remove-ln' has no option heldout \(renamed 'eval_fraction'"):
        registry.check_options(registry.get("remove-ln"), {"heldout": 0.2})


def test_an_option_a_pass_shares_with_a_command_has_one_limit():
    """An option of the same name in a command's and a pass's options (steps, seq_len, lr, precision,
    eval_fraction, ...; convert's --steps and the like given to every trained pass) takes the same values."""
    commands = [*options.COMMANDS.values(), options.PassFlags]
    limit = {}
    for cls in [*commands, *models().values()]:
        for f in options.flagged(cls):
            got = f.metadata["flag"].limit
            if got is not None and f.name not in ("dtype", "fold"):  # verify's compute dtype, export's GGUF type
                limit.setdefault(f.name, got.text)
                assert limit[f.name] == got.text, (cls.__name__, f.name, got.text, limit[f.name])
    assert {"steps", "seq_len", "lr", "precision", "eval_fraction", "batch_size"} <= set(limit)


def test_the_pass_table_and_its_usage_errors_load_no_torch(tmp_path):
    code = ("import sys\nimport normsurgery.passes\nfrom normsurgery.core import registry\n"
            "try:\n    registry.check_options(registry.get('mask'), {'sparsity': '2'})\nexcept Exception as e:\n"
            "    print(type(e).__name__)\nprint(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert r.returncode == 0 and r.stdout.split() == ["UsageError", "[]"], r.stdout + r.stderr
