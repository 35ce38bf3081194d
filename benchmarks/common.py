"""What the benchmarks share: memory figures, fresh worker processes, the peers' own venv.

Memory: ``current_rss_mb`` is the resident set now (``/proc/self/statm``); ``peak_rss_mb`` the
process's high-water mark so far (``ru_maxrss``, imports included). Every measurement that
reports a peak runs in a fresh process (``spawn``), so the peak is its own.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ["transformer-lens>=4", "transformer-tricks", "mergekit==0.1.5"]


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """The process's peak RSS so far (Linux reports ``ru_maxrss`` in kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def quiet_imports():
    """torch, transformers, accelerate, normsurgery and the model classes of the benchmarked
    families, imported before a worker's clock starts (so every operation's time is its own)."""
    import accelerate  # noqa: F401
    import torch
    import transformers

    import normsurgery.commands.convert  # noqa: F401
    from normsurgery.core.families import norm_kind

    norm_kind(torch.nn.Identity())  # imports the modeling modules of the RMSNorm families (an unknown class: all)
    transformers.GPT2LMHeadModel, transformers.LlamaForCausalLM  # noqa: B018

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return torch, transformers


def folder_bytes(path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def env(threads: int) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def spawn(script, op: str, threads: int, python: str | None = None, environ: dict | None = None, **kw) -> dict:
    """Run ``script --worker op --key value ...`` in a fresh process (``environ``: variables set
    beside :func:`env`'s, or removed where None); its last ``RESULT {json}`` line is the result,
    with ``process_s`` (wall time of the whole process) added."""
    cmd = [python or sys.executable, str(script), "--worker", op, "--threads", str(threads)]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    variables = env(threads)
    for k, v in (environ or {}).items():
        if v is None:
            variables.pop(k, None)
        else:
            variables[k] = v
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=variables, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise RuntimeError(f"{Path(script).name}: worker {op!r} failed (exit {proc.returncode})")
    result = json.loads(lines[-1][len("RESULT "):])
    result["process_s"] = time.perf_counter() - t
    return result


def result(data: dict) -> None:
    print("RESULT " + json.dumps(data), flush=True)


def peers_python(log) -> tuple[str | None, str | None]:
    """A Python with the peers installed from PyPI into their own venv (``bench-out/peers-venv``;
    ``NORMSURGERY_PEERS_PYTHON`` names another), seeing this environment's torch and
    transformers through a .pth file so pip adds only what the peers need. (python, None), or
    (None, pip's error)."""
    given = os.environ.get("NORMSURGERY_PEERS_PYTHON")
    if given:
        return given, None
    venv = ROOT / "bench-out" / "peers-venv"
    py = venv / "bin" / "python"
    if not (venv / ".installed").is_file():
        log(f"installing the peers into {venv} (pip: {', '.join(PEERS)}) ...")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        ours = [p for p in sys.path if p.endswith("site-packages")]
        Path(site, "normsurgery-bench.pth").write_text("\n".join(ours) + "\n")
        pip = subprocess.run([str(py), "-m", "pip", "install", "-q", *PEERS], capture_output=True, text=True)
        if pip.returncode:
            return None, (pip.stderr.strip().splitlines() or ["pip failed"])[-1]
        (venv / ".installed").write_text("\n".join(PEERS) + "\n")
    return str(py), None


def machine(threads: int) -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = next((int(ln.split()[1]) // 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")), 0)
    return {"cpu": cpu, "cpus": os.cpu_count(), "threads": threads, "ram_mb": mem,
            "loadavg_start": os.getloadavg()[0]}


def write_json(dest: str, data) -> None:
    """A benchmark's ``--json DEST``: ``data`` as JSON into the file DEST, or on stdout for "-"."""
    text = json.dumps(data, indent=1)
    print(text) if dest == "-" else Path(dest).write_text(text)


#: the demo models the trained passes were developed on
DEMOS = {"gpt2-tiny": ROOT / "normsurgery/demo/gpt2-tiny", "llama-tiny": ROOT / "normsurgery/demo/llama-tiny"}


def quality_models(names: str, held: str | None = None) -> list[tuple[str, str, Path]]:
    """(label, family, folder) of each model a quality benchmark runs on: the demo models named in
    ``names`` (comma-separated; a folder is taken as given, labelled by its last two parts, its
    family its folder's name), then
    with ``held`` every held-back model of those families under it (``scripts/make_demo.py
    --held-back HELD`` writes HELD/seedN/gpt2-tiny and HELD/seedN/llama-tiny)."""
    models = [(name if name in DEMOS else "/".join(Path(name).parts[-2:]), Path(DEMOS.get(name, name)).name,
               Path(DEMOS.get(name, name))) for name in names.split(",")]
    if held:
        families = sorted({family for _, family, _ in models})
        models += [(f"{d.name}/{family}", family, d / family) for d in sorted(Path(held).iterdir())
                   for family in families if (d / family / "config.json").is_file()]
    return models


def spread(rows: list[dict], value: str, bound: float) -> list[dict]:
    """Per family (each row's ``family``): how many models, the mean and the worst (largest) of
    their ``value`` (a loss gap: larger is worse), and the models over ``bound``."""
    out = []
    for family in dict.fromkeys(r["family"] for r in rows):
        got = [(r[value], r["model"]) for r in rows if r["family"] == family]
        out.append({"family": family, "models": len(got), "mean": sum(v for v, _ in got) / len(got),
                    "worst": max(got)[0], "worst_model": max(got)[1], "bound": bound,
                    "over": [m for v, m in got if v > bound]})
    return out


def print_spread(title: str, rows: list[dict], value: str, bound: float) -> list[dict]:
    """Print every row's ``value`` and each family's mean and worst against ``bound`` (see
    :func:`spread`), with the load average; returns the spread."""
    print(f"\n{title} (bound {bound:+.3f}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    for r in rows:
        print(f"  {r['model']:<22}{r[value]:>+9.4f}  {'met' if r[value] <= bound else 'MISSED'}")
    summary = spread(rows, value, bound)
    for s in summary:
        over = ", ".join(s["over"]) or "none"
        print(f"  {s['family']:<11} {s['models']} models: mean {s['mean']:+.4f}, worst {s['worst']:+.4f} "
              f"({s['worst_model']}); over the bound: {over}")
    return summary


def saved_rows(files: list[str]) -> list[dict]:
    """The rows of earlier ``--json`` files of a benchmark (a list, or a dict holding ``rows``):
    long quality runs are split over processes and summarized together."""
    rows = []
    for f in files:
        data = json.loads(Path(f).read_text())
        rows += data["rows"] if isinstance(data, dict) else data
    return rows


def trained_pass(path: Path, name: str, text: str, options: dict):
    """The trained pass ``name`` with ``options`` on the model at ``path`` (in memory; TEXT its
    training text, the pass holding out its last 10%): (model, the pass's metrics, wall seconds)."""
    from normsurgery.io.loader import load
    from normsurgery.io.source import Source
    from normsurgery.commands.convert import apply_passes
    from normsurgery.core.registry import PassContext

    model = load(path)
    ctx = PassContext(tokenizer=Source.open(path).tokenizer, text=text)
    t = time.perf_counter()
    [step] = apply_passes(model, [(name, options)], context=ctx)
    return model, step.metrics, time.perf_counter() - t
