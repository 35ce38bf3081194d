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

    import normsurgery.convert  # noqa: F401
    from normsurgery.families import norm_kind

    norm_kind(torch.nn.Identity())  # imports the modeling modules of the RMSNorm families
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


def spawn(script, op: str, threads: int, python: str | None = None, **kw) -> dict:
    """Run ``script --worker op --key value ...`` in a fresh process; its last ``RESULT {json}``
    line is the result, with ``process_s`` (wall time of the whole process) added."""
    cmd = [python or sys.executable, str(script), "--worker", op, "--threads", str(threads)]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(threads), cwd=ROOT)
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
