#!/usr/bin/env python
"""Convert cost, forward speed and the deferred-norm linear at GPT-2-small size (CPU).

Three parts, all in one run so the ratios share one machine state:

1. Convert cost. A GPT-2-small-sized checkpoint (n_embd 768, 12 layers, 12 heads, vocab 50257,
   n_positions 1024, tied head; random weights rescaled to realistic size, norms with non-trivial
   gains and biases; float32 safetensors) is built in a temporary folder. Each operation runs in
   a fresh subprocess: a plain ``AutoModelForCausalLM.from_pretrained`` + ``save_pretrained``
   round trip (the baseline), and ``normsurgery.convert.convert`` with pre-rmsnorm, flashnorm,
   and pre-rmsnorm without verification. Wall time counts the operation only (every worker
   imports torch, transformers and normsurgery first, so imports cancel); peak memory is the
   process's peak RSS (``ru_maxrss``), shown whole and above the post-import RSS. The convert
   runs also record time and RSS at each of convert's progress stages, to show where cost goes.
2. Forward time (no_grad, batch x seq tokens, median of interleaved runs after warm-up) of the
   original model against the pre-rmsnorm and flashnorm models (passes applied in memory with
   ``convert.apply_passes``), and the norm modules' share of it (forward hooks time them).
3. ``runtime.DeferredNormLinear`` against RMSNorm followed by nn.Linear (and LayerNorm +
   Linear for reference), eager CPU, at GPT-2-small shapes.

Usage: python benchmarks/bench_convert.py [--json FILE|-] [--repeats N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TIME_TARGET = 1.5  # convert wall time / round-trip wall time, at most
MEM_TARGET = 1.3  # convert peak RSS / round-trip peak RSS, at most
FORWARD_SLACK = 0.02  # converted forward median may exceed the original's by this much (timing noise)

GPT2_SMALL = dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024,
                  tie_word_embeddings=True)

CONVERT_OPS = {
    "convert-pre": ("convert pre-rmsnorm", [("pre-rmsnorm", {})], True),
    "convert-flash": ("convert flashnorm", [("flashnorm", {})], True),
    "convert-pre-noverify": ("convert pre-rmsnorm --no-verify", [("pre-rmsnorm", {})], False),
}


# ---------------------------------------------------------------------------------------------
# measurement helpers (worker side)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    """The process's peak RSS so far (what ``ru_maxrss`` reports; Linux gives kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Peaks:
    """Peak RSS per stage: the kernel's high-water mark (VmHWM, the figure ru_maxrss reports) is
    read and reset (``/proc/self/clear_refs``) at each mark, so each stage gets its own peak; the
    operation's peak is the largest. Where the reset is refused, stages show the peak so far."""

    def __init__(self):
        self.start = peak_mb()  # includes the imports, which happen before any reset
        self.overall = self.start
        self.resettable = self._reset()

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def mark(self) -> float:
        stage = peak_mb()
        self.overall = max(self.overall, stage)
        if self.resettable:
            self._reset()
        return stage


def _imports():
    """Everything every worker imports before its clock starts (so imports cancel)."""
    import torch
    import transformers

    import normsurgery.convert  # noqa: F401

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return torch, transformers


# ---------------------------------------------------------------------------------------------
# worker operations


def op_build(args) -> dict:
    """A GPT-2-small-sized float32 checkpoint with weights of realistic scale, plus a tokenizer."""
    torch, T = _imports()
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(**GPT2_SMALL)).eval()
    g = torch.Generator().manual_seed(1)
    outliers = torch.randperm(768, generator=g)[:4]
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.LayerNorm):
                # trained norms: gains spread around 1, biases of size 0.2
                mod.weight.copy_(1.0 + 0.3 * torch.randn(mod.weight.shape, generator=g))
                mod.bias.copy_(0.2 * torch.randn(mod.bias.shape, generator=g))
            elif isinstance(mod, Conv1D):  # weight [in, out]
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) / mod.weight.shape[0] ** 0.5)
                mod.bias.copy_(0.05 * torch.randn(mod.bias.shape, generator=g))
            elif isinstance(mod, torch.nn.Embedding):
                mod.weight.copy_(0.1 * torch.randn(mod.weight.shape, generator=g))
                mod.weight[:, outliers] *= 8.0  # a few large residual channels, as trained GPT-2 has
    out = Path(args.out)
    model.save_pretrained(out)
    tok = ROOT / "normsurgery" / "demo" / "gpt2-tiny"
    for name in ("tokenizer.json", "tokenizer_config.json"):  # 1024-token BPE: ids fit in 50257
        if (tok / name).is_file():
            shutil.copy2(tok / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return {"params": params, "bytes": size}


def op_baseline(args) -> dict:
    torch, T = _imports()
    base, peaks, t0 = rss_mb(), Peaks(), time.perf_counter()
    model = T.AutoModelForCausalLM.from_pretrained(args.src)
    t_load = time.perf_counter()
    stages = [{"stage": "from_pretrained", "seconds": t_load - t0, "rss_mb": rss_mb(), "peak_mb": peaks.mark()}]
    model.save_pretrained(args.out)
    t1 = time.perf_counter()
    stages.append({"stage": "save_pretrained", "seconds": t1 - t_load, "rss_mb": rss_mb(), "peak_mb": peaks.mark()})
    return {"seconds": t1 - t0, "peak_mb": peaks.overall, "import_mb": base, "stages": stages,
            "bytes": _folder_bytes(args.out)}


def op_convert(args) -> dict:
    _imports()
    conv = sys.modules["normsurgery.convert"]
    _, passes, verify = CONVERT_OPS[args.op]
    marks = []
    # count and time convert's verification calls (instrumentation only: the names convert.py
    # looks up at call time are wrapped in this process; a missing name is simply not counted)
    calls = {}
    for name in ("logits", "compare_logits"):
        f = getattr(conv, name, None)
        if callable(f):
            calls[name] = {"calls": 0, "seconds": 0.0}

            def timed(*a, _f=f, _c=calls[name], **k):
                t = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    _c["calls"] += 1
                    _c["seconds"] += time.perf_counter() - t

            setattr(conv, name, timed)

    def progress(stage, done, total):
        marks.append((f"{stage} {done}/{total}", time.perf_counter() - t0, rss_mb(), peaks.mark()))

    base, peaks, t0 = rss_mb(), Peaks(), time.perf_counter()
    result = conv.convert(args.src, args.out, passes, verify=verify, progress=progress)
    t1 = time.perf_counter()
    marks.append(("end", t1 - t0, rss_mb(), peaks.mark()))
    stages, prev = [], ("start", 0.0, base, base)
    for m in marks:  # the interval that ends at each mark, named by what ran in it
        stages.append({"stage": _interval_name(prev[0], m[0]), "seconds": m[1] - prev[1],
                       "rss_mb": m[2], "peak_mb": m[3]})
        prev = m
    return {"seconds": t1 - t0, "peak_mb": peaks.overall, "import_mb": base, "ok": result.ok,
            "relative_error": result.parity.relative if result.parity else None,
            "stages": [s for s in stages if s["seconds"] > 1e-3 or s["stage"] == "save"],
            "bytes": _folder_bytes(args.out), "per_stage_peaks": peaks.resettable, "verification": calls}


def _interval_name(a: str, b: str) -> str:
    names = {("start", "load 0/1"): "checks", ("load 0/1", "load 1/1"): "load model + tokenizer",
             ("passes 1/1", "verify 0/1"): "bookkeeping", ("verify 0/1", "verify 1/1"): "final parity logits",
             ("save 0/1", "save 1/1"): "save", ("save 1/1", "end"): "return"}
    if (a, b) in names:
        return names[(a, b)]
    if a == "load 1/1" and b.startswith("pass "):
        return "reference logits (+ cast baseline)"
    if a.startswith("pass ") and (b.startswith("pass ") or b.startswith("passes")):
        return f"{a.rsplit(' ', 1)[0]}: apply + logits before/after"
    if b == "save 0/1":
        return "cast to storage dtype (+ cast check)"
    return f"{a} -> {b}"


def _folder_bytes(path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def op_forward(args) -> dict:
    torch, T = _imports()
    import copy

    from normsurgery.convert import apply_passes
    from normsurgery.passes.norms import is_rmsnorm

    torch.set_num_threads(args.threads)
    original = T.AutoModelForCausalLM.from_pretrained(args.src).eval()
    models = {"original": original}
    for label, passes in (("pre-rmsnorm", [("pre-rmsnorm", {})]), ("flashnorm", [("flashnorm", {})])):
        m = copy.deepcopy(original)
        apply_passes(m, passes)
        models[label] = m.eval()
    ids = torch.randint(0, GPT2_SMALL["vocab_size"], (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(0))

    # forward hooks time every norm module; they cost two perf_counter calls per norm call
    # (about 50 microseconds per forward of seconds), so they stay on for the timed runs
    acc, starts, kinds = {}, {}, {}
    for k, m in models.items():
        norms = [mod for mod in m.modules() if isinstance(mod, torch.nn.LayerNorm) or is_rmsnorm(mod)]
        kinds[k] = (len(norms), sorted({type(x).__name__ for x in norms}))
        acc[k] = [0.0]
        for mod in norms:
            mod.register_forward_pre_hook(lambda mod, inp: starts.__setitem__(id(mod), time.perf_counter()))
            mod.register_forward_hook(lambda mod, inp, out, a=acc[k]: a.__setitem__(
                0, a[0] + time.perf_counter() - starts[id(mod)]))

    times = {k: [] for k in models}
    norm_s = {k: [] for k in models}
    with torch.no_grad():
        ref = original(input_ids=ids).logits
        err = {k: ((m(input_ids=ids).logits - ref).abs().max() / ref.abs().max()).item()
               for k, m in models.items()}
        for _ in range(args.warmup):
            for m in models.values():
                m(input_ids=ids)
        for _ in range(args.repeats):  # interleaved, so drift and load hit every model alike
            for k, m in models.items():
                acc[k][0] = 0.0
                t = time.perf_counter()
                m(input_ids=ids)
                times[k].append(time.perf_counter() - t)
                norm_s[k].append(acc[k][0])
    out = {}
    for k in models:
        shares = [n / t for n, t in zip(norm_s[k], times[k])]
        out[k] = {"median_s": statistics.median(times[k]), "min_s": min(times[k]), "times": times[k],
                  "relative_error": err[k], "modules": kinds[k][0], "types": kinds[k][1],
                  "norm_seconds": statistics.median(norm_s[k]), "share": statistics.median(shares)}
    return {"tokens": [args.batch, args.seq], "threads": torch.get_num_threads(), "repeats": args.repeats,
            "models": out}


def op_deferred(args) -> dict:
    torch, _ = _imports()
    import torch.nn.functional as F
    from torch import nn

    from normsurgery.runtime import DeferredNormLinear, RMSNorm

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    d, tokens = 768, (8, 512)
    x = torch.randn(*tokens, d)
    x[..., :4] *= 8.0  # outlier channels
    out = []

    def bench(fn):  # best of N: the least disturbed run (a busy machine only ever adds time)
        for _ in range(2):
            fn()
        ts = []
        for _ in range(args.micro_repeats):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return min(ts)

    with torch.no_grad():
        for width, site in ((3 * d, "ln_1 -> c_attn"), (4 * d, "ln_2 -> c_fc")):
            g = 1.0 + 0.3 * torch.randn(d)
            b = 0.2 * torch.randn(d)
            lin = nn.Linear(d, width)
            nn.init.normal_(lin.weight, std=d ** -0.5)
            rms = RMSNorm(d, eps=1e-5, bias=True)
            rms.weight.copy_(g)
            rms.bias.copy_(b)
            ln = nn.LayerNorm(d, eps=1e-5)
            ln.weight.copy_(g)
            ln.bias.copy_(b)
            deferred = DeferredNormLinear(d, width, bias=True, eps=1e-5)
            deferred.weight.copy_(lin.weight * g)  # W diag(g)
            deferred.bias.copy_(lin.bias + lin.weight @ b)  # c + W b
            w_star, c_star = deferred.weight, deferred.bias

            def inv_rms(x):
                return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

            variants = {
                "LayerNorm + Linear": lambda: lin(ln(x)),
                "runtime.RMSNorm + Linear": lambda: lin(rms(x)),
                "F.rms_norm + Linear": lambda: lin(F.rms_norm(x, (d,), rms.weight, 1e-5) + rms.bias),
                "runtime.DeferredNormLinear": lambda: deferred(x),
                "candidate: deferred, addcmul epilogue": lambda: torch.addcmul(c_star, x @ w_star.T, inv_rms(x)),
                "candidate: scale x by 1/rms, folded F.linear": lambda: F.linear(x * inv_rms(x), w_star, c_star),
                "Linear alone (no norm; floor)": lambda: lin(x),
            }
            ref = lin(rms(x))
            err = {k: (f() - ref).abs().max().item() / ref.abs().max().item()
                   for k, f in variants.items() if "runtime.Deferred" in k or "candidate" in k}
            times = {k: bench(f) for k, f in variants.items()}
            def rms_fewer_passes(x):  # one reduction pass, one product, one fused multiply-add
                n2 = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_()
                return torch.addcmul(rms.bias, x * torch.rsqrt(n2.div_(d).add_(1e-5)), rms.weight)

            norms = {"nn.LayerNorm": bench(lambda: ln(x)), "runtime.RMSNorm": bench(lambda: rms(x)),
                     "F.rms_norm (+ bias)": bench(lambda: F.rms_norm(x, (d,), rms.weight, 1e-5) + rms.bias),
                     "candidate RMSNorm: vector_norm + addcmul": bench(lambda: rms_fewer_passes(x))}
            out.append({"site": site, "in": d, "out": width, "tokens": list(tokens), "times": times,
                        "norm_alone": norms, "error_vs_rms_linear": err})
    return {"threads": torch.get_num_threads(), "repeats": args.micro_repeats, "shapes": out}


def op_runtime(args) -> dict:
    """Forward timing and the micro-benchmark share one process (one import less)."""
    return {"forward": op_forward(args), "deferred": op_deferred(args)}


WORKERS = {"build": op_build, "baseline": op_baseline, "runtime": op_runtime,
           **{k: op_convert for k in CONVERT_OPS}}


# ---------------------------------------------------------------------------------------------
# orchestration (parent side: imports no torch)


def spawn(op: str, args, **kw) -> dict:
    cmd = [sys.executable, __file__, "--worker", op, "--threads", str(args.threads),
           "--batch", str(args.batch), "--seq", str(args.seq), "--repeats", str(args.repeats),
           "--warmup", str(args.warmup), "--micro-repeats", str(args.micro_repeats)]
    for k, v in kw.items():
        cmd += [f"--{k}", str(v)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"bench_convert: worker {op!r} failed (exit {proc.returncode})")
    result = json.loads(lines[-1][len("RESULT "):])
    result["process_s"] = wall
    return result


def run_all(args, log) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="normsurgery-bench-"))
    try:
        src = tmp / "gpt2-small"
        log("building the GPT-2-small-sized checkpoint ...")
        built = spawn("build", args, out=src)
        results = {"checkpoint": {**built, "config": GPT2_SMALL, "dtype": "float32"}, "convert": {},
                   "machine": {"cpus": os.cpu_count(), "threads": args.threads,
                               "loadavg_start": os.getloadavg()[0]}}
        ops = ["baseline", *CONVERT_OPS]
        for r in range(args.convert_repeats):  # alternate the operations, fresh process each
            for op in ops:
                if CONVERT_OPS.get(op, ("", [], False))[2] and r >= args.verify_repeats:
                    continue  # the verified converts take tens of seconds: fewer repeats
                log(f"[{r + 1}/{args.convert_repeats}] {op} ...")
                out = tmp / f"out-{op}"
                shutil.rmtree(out, ignore_errors=True)
                res = spawn(op, args, src=src, out=out)
                shutil.rmtree(out, ignore_errors=True)
                results["convert"].setdefault(op, []).append(res)
        log(f"forward: {args.batch} x {args.seq} tokens, {args.repeats} runs each; "
            "then the DeferredNormLinear micro-benchmark ...")
        results.update(spawn("runtime", args, src=src))
        results["machine"]["loadavg_end"] = os.getloadavg()[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["summary"] = summarise(results)
    return results


def summarise(results) -> dict:
    def best(op):  # the fastest run; peak is nearly deterministic, take the smallest as well
        runs = results["convert"][op]
        return {"seconds": min(r["seconds"] for r in runs), "peak_mb": min(r["peak_mb"] for r in runs),
                "import_mb": min(r["import_mb"] for r in runs)}

    base = best("baseline")
    rows = {}
    for op in ["baseline", *CONVERT_OPS]:
        b = best(op)
        t, m = b["seconds"] / base["seconds"], b["peak_mb"] / base["peak_mb"]
        dm = (b["peak_mb"] - b["import_mb"]) / (base["peak_mb"] - base["import_mb"])
        rows[op] = {**b, "time_ratio": t, "mem_ratio": m, "mem_ratio_above_import": dm,
                    "time_pass": t <= TIME_TARGET, "mem_pass": m <= MEM_TARGET}
    fwd = results["forward"]["models"]
    o, omin = fwd["original"]["median_s"], fwd["original"]["min_s"]
    forward = {k: {"ratio": v["median_s"] / o, "min_ratio": v["min_s"] / omin,
                   "pass": v["median_s"] <= o * (1 + FORWARD_SLACK)} for k, v in fwd.items()}
    return {"convert": rows, "forward": forward, "targets": {"time": TIME_TARGET, "memory": MEM_TARGET,
                                                             "forward": f"not slower (median within {FORWARD_SLACK:.0%})"}}


# ---------------------------------------------------------------------------------------------
# output


def print_tables(res) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 132, highlight=False)
    ck, s, mach = res["checkpoint"], res["summary"], res["machine"]
    con.print(f"\n[bold]bench_convert[/bold]: GPT-2-small-sized checkpoint, {ck['params'] / 1e6:.1f}M parameters, "
              f"{ck['bytes'] / 2**20:.0f} MB float32 safetensors, tied head; {mach['threads']} threads on "
              f"{mach['cpus']} CPUs; load average {mach['loadavg_start']:.1f} at start, "
              f"{mach.get('loadavg_end', float('nan')):.1f} at end")
    if max(mach["loadavg_start"], mach.get("loadavg_end", 0)) > (mach["cpus"] or 1):
        con.print("[yellow]warning[/yellow]: the machine was busy with other work (load average above its "
                  "CPU count): absolute times are inflated and ratios noisier than usual")

    def flag(ok):
        return "[green]PASS[/green]" if ok else "[red]MISS[/red]"

    t = Table(title=f"Convert vs from_pretrained + save_pretrained, fresh process each, best run "
                    f"(targets: time <= {TIME_TARGET}x, peak RSS <= {MEM_TARGET}x)")
    for c in ("operation", "runs", "time s", "x time", "", "peak RSS MB", "x peak", "", "above import MB",
              "x above import", "output MB", "parity rel. err"):
        t.add_column(c, justify="left" if c == "operation" else "right")
    for op, row in s["convert"].items():
        name = "from_pretrained + save_pretrained" if op == "baseline" else CONVERT_OPS[op][0]
        runs = res["convert"][op]
        rel = runs[0].get("relative_error")
        t.add_row(name, str(len(runs)), f"{row['seconds']:.2f}", f"{row['time_ratio']:.2f}",
                  "" if op == "baseline" else flag(row["time_pass"]), f"{row['peak_mb']:.0f}",
                  f"{row['mem_ratio']:.2f}", "" if op == "baseline" else flag(row["mem_pass"]),
                  f"{row['peak_mb'] - row['import_mb']:.0f}", f"{row['mem_ratio_above_import']:.2f}",
                  f"{runs[0]['bytes'] / 2**20:.0f}", "-" if rel is None else f"{rel:.1e}")
    con.print(t)
    con.print("time: the operation only (every worker imports torch, transformers and normsurgery first); "
              "peak RSS: the process's high-water mark, imports included; above import: minus the RSS "
              "after imports.")

    per_stage = all(r.get("per_stage_peaks", True) for runs in res["convert"].values() for r in runs)
    t = Table(title="Where the time and memory go (fastest run of each operation)")
    for c in ("operation", "stage", "s", "RSS after MB", "stage peak MB" if per_stage else "peak so far MB"):
        t.add_column(c, justify="left" if c in ("operation", "stage") else "right")
    for op in res["convert"]:
        run = min(res["convert"][op], key=lambda r: r["seconds"])
        for i, st in enumerate(run["stages"]):
            t.add_row(op if i == 0 else "", st["stage"], f"{st['seconds']:.2f}", f"{st['rss_mb']:.0f}",
                      f"{st['peak_mb']:.0f}")
        t.add_section()
    con.print(t)
    for op, runs in res["convert"].items():
        run = min(runs, key=lambda r: r["seconds"])
        v = run.get("verification") or {}
        if any(c["calls"] for c in v.values()):
            lg, cmp_ = v.get("logits", {"calls": 0, "seconds": 0}), v.get("compare_logits", {"calls": 0, "seconds": 0})
            con.print(f"{op}: verification took {lg['seconds'] + cmp_['seconds']:.1f} s of {run['seconds']:.1f} s: "
                      f"{lg['calls']} logits forwards ({lg['seconds']:.1f} s), {cmp_['calls']} comparisons "
                      f"({cmp_['seconds']:.1f} s)")

    f = res["forward"]
    t = Table(title=f"Forward, no_grad, {f['tokens'][0]} x {f['tokens'][1]} tokens, median of {f['repeats']} "
                    f"interleaved runs after warm-up (target: median not slower than the original's, "
                    f"{FORWARD_SLACK:.0%} slack)")
    for c in ("model", "median s", "min s", "x original", "", "x (min)", "norm modules", "norm time",
              "norm share", "rel. logit error"):
        t.add_column(c, justify="left" if c in ("model", "norm modules") else "right")
    for k, v in f["models"].items():
        r = s["forward"][k]
        t.add_row(k, f"{v['median_s']:.3f}", f"{v['min_s']:.3f}", f"{r['ratio']:.3f}",
                  "" if k == "original" else flag(r["pass"]), f"{r['min_ratio']:.3f}",
                  f"{v['modules']} {'/'.join(v['types'])}",
                  f"{v['norm_seconds'] * 1e3:.0f} ms", f"{100 * v['share']:.1f}%", f"{v['relative_error']:.1e}")
    con.print(t)
    con.print("norm time: the norm modules' own forward calls, timed by forward hooks; the passes are "
              "applied in memory (convert.apply_passes). Saved to disk, a pre-rmsnorm GPT-2 loads with "
              "plain from_pretrained as stock LayerNorm (its RMSNorm records are native).")

    d = res["deferred"]
    t = Table(title=f"DeferredNormLinear vs norm + nn.Linear, eager CPU, {d['threads']} threads, "
                    f"best of {d['repeats']}, ms (x: vs runtime.RMSNorm + Linear)")
    t.add_column("variant")
    for sh in d["shapes"]:
        t.add_column(f"{sh['site']}: {sh['tokens'][0]}x{sh['tokens'][1]} tokens, {sh['in']} -> {sh['out']}",
                     justify="right")
    t.add_column("rel. err vs RMSNorm + Linear", justify="right")
    for v in d["shapes"][0]["times"]:
        cells = [f"{sh['times'][v] * 1e3:.1f} ({sh['times'][v] / sh['times']['runtime.RMSNorm + Linear']:.2f}x)"
                 for sh in d["shapes"]]
        errs = [sh["error_vs_rms_linear"].get(v) for sh in d["shapes"]]
        t.add_row(v, *cells, ", ".join(f"{e:.0e}" for e in errs) if errs[0] is not None else "")
    t.add_section()
    for v in d["shapes"][0]["norm_alone"]:
        t.add_row(f"{v} alone", *[f"{sh['norm_alone'][v] * 1e3:.1f}" for sh in d["shapes"]], "")
    con.print(t)
    con.print("candidates are inline expressions, not runtime modules: they show what a different "
              "DeferredNormLinear.forward would cost.")

    misses = [CONVERT_OPS[op][0] + ":" + (" time" if not r["time_pass"] else "") + (" memory" if not r["mem_pass"] else "")
              for op, r in s["convert"].items() if op != "baseline" and not (r["time_pass"] and r["mem_pass"])]
    misses += [f"forward {k}" for k, r in s["forward"].items() if not r["pass"]]
    con.print(f"[bold]targets missed[/bold]: {'; '.join(misses)}" if misses else "[bold]all targets met[/bold]")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON ('-': JSON only, to stdout)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=4, help="timed forward runs per model")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--micro-repeats", type=int, default=7)
    p.add_argument("--convert-repeats", type=int, default=2,
                   help="fresh processes for the baseline and the unverified convert (best is kept)")
    p.add_argument("--verify-repeats", type=int, default=1, help="fresh processes for each verified convert")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.op = args.worker
        result = WORKERS[args.worker](args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    quiet = args.json == "-"
    log = (lambda m: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    t = time.perf_counter()
    res = run_all(args, log)
    res["total_s"] = time.perf_counter() - t
    if quiet:
        print(json.dumps(res, indent=1))
        return 0
    print_tables(res)
    print(f"bench_convert: {res['total_s']:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
