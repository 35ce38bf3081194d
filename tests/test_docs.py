"""The documentation's generated pages are what the code gives now, every page is in the site's
navigation, and no page cites the project's internal issue numbers. (README's and the pages'
commands and example outputs: tests/test_cli.py.)"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_is_what_the_cli_and_the_registry_say():
    """docs/reference/ is scripts/cli_reference.py's output now: a changed command, option, default
    or help text fails here until `python scripts/cli_reference.py --write` regenerates it."""
    for name, text in script("cli_reference").pages().items():
        assert (ROOT / "docs" / "reference" / name).read_text() == text, name


def test_the_family_matrix_is_what_the_passes_do():
    """docs/families.md's matrix is scripts/family_matrix.py's, each cell's verdict and every
    refusal's reason as running the passes gives them now (the digits of a float64 error follow the
    machine's rounding)."""
    matrix = script("family_matrix")
    page = (ROOT / "docs" / "families.md").read_text()
    shown = page.split(matrix.START)[1].split(matrix.END)[0]

    def same(text):
        return re.sub(r"\d+", "#", text).split()

    assert same(shown) == same(matrix.matrix())


def test_every_page_is_in_the_site_and_every_page_named_exists():
    def pages(nav):
        for entry in nav:
            for value in entry.values():
                yield from pages(value) if isinstance(value, list) else [value]

    named = list(pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]))
    assert sorted(named) == sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))


def test_no_page_cites_an_internal_issue_number():
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    cited = [(p.name, m) for p in pages for m in re.findall(r"(?i)\bissues? \d[\d.]*", p.read_text())]
    assert not cited, cited


def test_the_add_a_pass_example_runs_as_printed(tmp_path):
    """The contributing guide's own pass, run as printed (from a folder where the demo's paths resolve):
    it registers, converts the demo Llama and leaves a checkpoint whose final norm gain is halved."""
    import torch
    from safetensors.torch import load_file

    page = (ROOT / "docs" / "contributing" / "add-a-pass.md").read_text()
    block = re.search(r"## A pass of your own.*?```python\n(.*?)```", page, re.S).group(1)
    (tmp_path / "normsurgery").symlink_to(ROOT / "normsurgery")
    r = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    before = load_file(ROOT / "normsurgery/demo/llama-tiny/model.safetensors")
    after = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(after["model.norm.weight"], before["model.norm.weight"] * 0.5)
