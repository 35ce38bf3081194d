#!/usr/bin/env python
"""Convert at scale: time and peak memory, in memory and streaming, against the HF round trip,
the I/O lower bound and the peers; parity of the peers' results; forward time.

Checkpoints (built once into bench-out/, random weights of realistic scale):
- gpt2: GPT-2-small-sized (124M parameters, float32, tied head), pass pre-rmsnorm;
- llama: a synthetic Llama of about 3 GB in bfloat16 (d 2048, 26 layers, MLP 5632, vocab 32000,
  untied head) in 1 GB shards, pass flashnorm;
- llama-mid (1.5 GB in 300 MB shards), qwen2-0.5b (Qwen2.5-0.5B's shape: width 896, 24 layers, a
  151936-token tied vocabulary: 0.99 GB), qwen2-0.5b-untied (Qwen2.5-Coder-0.5B's: the same, head
  untied: 1.26 GB) and qwen2-vocab (the vocabulary untied at width 128: 90 MB, nearly all of it the
  two vocabulary matrices), bfloat16, flashnorm, streamed only: the checked streaming convert's
  peak (under 1 GB; above the imports, below the checkpoint's size).

Operations, each in a fresh process (time: the operation only, after the imports; peak RSS: the
process's high-water mark, imports included; dirty pages flushed (sync) before each; the best of
``--best-of`` runs on the GPT-2; on the Llama of the operations without checks, one of the rest;
the disk's and the VM's first touches of memory vary several-fold between runs), all in one run so
the ratios share a machine state:
  copy             copy every shard (read and write the bytes once): the lower bound
  roundtrip        AutoModelForCausalLM.from_pretrained (stored dtype) + save_pretrained
  mem-noverify     normsurgery convert --in-memory --no-verify
  mem              normsurgery convert --in-memory (parity check)
  stream-noverify  normsurgery convert --streaming --no-verify
  NAME@1           NAME at one thread (stream-noverify and floor: the floor is judged at one thread and at all)
  floor            the least a rewrite of the same tensors costs: the shards copied as copy does, then
                   every tensor stream-noverify changed read back, widened to float32, scaled column by
                   column (one multiply an entry, as a fold does), narrowed and written over itself; no
                   check, no config, no memory bound. How near the copy any rewrite comes on this machine
  stream           normsurgery convert --streaming (parity check, one block at a time)
  stream-verify    normsurgery verify --streaming, input against the converted output
  gguf             llama-mid only: normsurgery export --to gguf --dtype bf16 (written tensor by tensor, then
                   checked in llama.cpp, which runs in a process of its own, against transformers' streamed
                   forward); the demo Llama's tokenizer (1024 tokens; the others unused) put beside the
                   checkpoint. Peak RSS: the export's process; llama.cpp's process (which maps the file:
                   its pages count in its RSS) reported apart
  mergekit         mergekit 0.1.5 (``run_merge``) with a one-model ``passthrough`` merge: reads and writes every
                   tensor lazily with bounded memory, the peer of streaming convert (peers' venv)
  peer             gpt2: TransformerLens 4 (TransformerBridge.boot_transformers(hf_model=...) then
                   enable_compatibility_mode(), which folds the LayerNorms and centres the weights,
                   in memory, no save); llama: transformer_tricks.flashify(state_dict, config) with
                   the shards read and written by safetensors. Installed from PyPI into their own
                   venv (benchmarks/common.py), not the project's dependencies.
Then the logits of the peer's result against the original's and ours (KL and top-1; the raw
relative error and that of logits centred per position, since TransformerLens centres the
unembedding), and the forward time of the converted models against the originals.

Usage: python benchmarks/bench_convert.py [--models gpt2,llama,llama-mid,qwen2-vocab] [--json FILE] [--threads N]
       [--ops OP,...] [--best-of N] [--keep]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (current_rss_mb, folder_bytes, machine, peak_rss_mb, peers_python,  # noqa: E402
                               quiet_imports, result, spawn)

WORK = ROOT / "bench-out" / "convert"
MODELS = {
    "gpt2": {"passes": [("pre-rmsnorm", {})], "shard": "5GB", "peer": "TransformerLens 4 compatibility mode",
             "config": dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024,
                            tie_word_embeddings=True)},
    "llama": {"passes": [("flashnorm", {})], "shard": "1GB", "peer": "transformer_tricks.flashify", "half": True,
              "config": dict(hidden_size=2048, num_hidden_layers=26, num_attention_heads=16, num_key_value_heads=16,
                             intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048,
                             tie_word_embeddings=False)},
    # the checked streaming peaks of issue 35: only the streamed operations
    "llama-mid": {"passes": [("flashnorm", {})], "shard": "300MB", "half": True, "class": "Llama",
                  "ops": ("stream-noverify", "stream", "gguf"), "rss_mb": 1024,
                  "config": dict(hidden_size=2048, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16,
                                 intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048,
                                 tie_word_embeddings=False)},
    "qwen2-vocab": {"passes": [("flashnorm", {})], "shard": "5GB", "half": True, "class": "Qwen2",
                    "ops": ("stream-noverify", "stream"), "rss_mb": "checkpoint",
                    "config": dict(hidden_size=128, num_hidden_layers=24, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=512, vocab_size=151936, max_position_embeddings=2048,
                                   tie_word_embeddings=False)},
    "qwen2-0.5b": {"passes": [("flashnorm", {})], "shard": "5GB", "half": True, "class": "Qwen2",
                   "ops": ("stream-noverify", "stream"), "rss_mb": "checkpoint",
                   "config": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                  intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                                  tie_word_embeddings=True)},
    "qwen2-0.5b-untied": {"passes": [("flashnorm", {})], "shard": "5GB", "half": True, "class": "Qwen2",
                          "ops": ("stream-noverify", "stream"), "rss_mb": "checkpoint",
                          "config": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                                         max_position_embeddings=32768, tie_word_embeddings=False)},
}
OPS = ["copy", "roundtrip", "mem-noverify", "mem", "stream-noverify", "floor", "stream-noverify@1", "floor@1",
       "stream", "stream-verify", "peer", "mergekit", "gguf"]
QUICK = ("copy", "roundtrip", "mem-noverify", "stream-noverify", "floor", "stream-noverify@1", "floor@1",
         "mergekit")  # repeated on the Llama too
ONE = "@1"  # an operation run at one thread (the others: at --threads)
TARGETS = {"mem-noverify": ("roundtrip", 1.5), "mem": ("roundtrip", 3.0)}
FLOOR_TARGET = 1.1  # streamed --no-verify against the floor of the same rewrite (issue 35)
CHECKED_TARGET = 1.25  # a checked convert against the round trip plus the forwards its check needs (issue 35)
RSS_TARGET_MB = 1024  # streaming convert with its check, and streaming verify, of the 3 GB Llama


# ---------------------------------------------------------------------------------------------
# workers (fresh processes)


def op_build(args) -> dict:
    torch, T = quiet_imports()
    from normsurgery.core.synthetic import make_realistic

    spec = MODELS[args.model]
    torch.manual_seed(0)
    if args.model == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(**spec["config"]))
    else:
        torch.set_default_dtype(torch.bfloat16)
        family = spec.get("class", "Llama")
        model = getattr(T, f"{family}ForCausalLM")(getattr(T, f"{family}Config")(**spec["config"], dtype="bfloat16"))
    make_realistic(model.eval())
    model.save_pretrained(args.out, max_shard_size=spec["shard"])
    if args.model == "gpt2":  # a 1024-token BPE: its ids fit the vocabulary
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(ROOT / "normsurgery/demo/gpt2-tiny" / name, Path(args.out) / name)
    return {"params": sum(p.numel() for p in model.parameters()), "bytes": folder_bytes(args.out)}


def op_measure(args) -> dict:
    """One operation of OPS (but peer), timed after the imports."""
    torch, T = quiet_imports()
    conv = importlib.import_module("normsurgery.commands.convert")  # the module (ns.convert is the function)
    from normsurgery.core.errors import SurgeryError
    from normsurgery.commands.verify import verify

    spec, src, out = MODELS[args.model], Path(args.src), Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    config = T.AutoConfig.from_pretrained(src)  # the family's modules imported (once a process): not timed
    getattr(T, config.architectures[0])
    base = current_rss_mb()
    t = time.perf_counter()
    info = {}
    if args.op == "copy":
        out.mkdir(parents=True)
        for f in src.iterdir():
            shutil.copyfile(f, out / f.name)
    elif args.op == "roundtrip":
        T.AutoModelForCausalLM.from_pretrained(src, dtype="auto").save_pretrained(out, max_shard_size=spec["shard"])
    elif args.op == "gguf":
        from normsurgery.exporters.gguf import export as export_gguf

        for name in ("tokenizer.json", "tokenizer_config.json"):  # a GGUF holds a tokenizer
            if not (src / name).is_file():
                shutil.copy2(ROOT / "normsurgery/demo/llama-tiny" / name, src / name)
        out.mkdir(parents=True)
        r = export_gguf(src, out / "model.gguf", dtype="bf16")
        info = {"relative_error": r.parity.relative, "ok": r.parity.ok,
                "mean_kld": r.distributions["mean_kld"], "same_top_p": r.distributions["same_top_p"],
                "llama_cpp_peak_mb": r.llama_cpp["peak_rss_mb"], "gguf_bytes": r.saved["bytes"]}
    elif args.op.startswith("stream-verify"):
        r = verify(src, args.ref, streaming=True)
        info = {"relative_error": r.relative, "ok": r.ok}
    else:
        try:
            r = conv.convert(src, out, spec["passes"], verify="noverify" not in args.op,
                             streaming=args.op.startswith("stream"), max_shard_size=spec["shard"])
            info = {"relative_error": r.parity.relative if r.parity else None, "ok": r.ok,
                    "forwards": r.forwards, "seconds_check": r.seconds_check}
        except SurgeryError as e:  # parity out of tolerance: the cost was paid all the same
            info = {"refused": str(e), "ok": False}
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "peak_mb": peak_rss_mb(), "import_mb": base, **info,
            "bytes": folder_bytes(out) if out.exists() else None}


def changed_tensors(src: Path, ref: Path) -> set[str]:
    """Names of the tensors of ``src`` whose bytes differ in ``ref`` (or that ``ref`` lacks)."""
    import torch
    from safetensors import safe_open

    def tensors(folder):
        for shard in sorted(folder.glob("*.safetensors")):
            with safe_open(shard, "pt") as f:
                for k in f.keys():
                    yield k, shard

    theirs = dict(tensors(ref))
    changed = set()
    for k, shard in tensors(src):
        if k not in theirs:
            changed.add(k)
            continue
        with safe_open(shard, "pt") as a, safe_open(theirs[k], "pt") as b:
            x, y = a.get_tensor(k), b.get_tensor(k)
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x.view(-1).view(torch.uint8),
                                                                             y.view(-1).view(torch.uint8)):
                changed.add(k)
    return changed


def op_floor(args) -> dict:
    """The least this rewrite costs (see the module docstring), timed after the changed set is found:
    every shard copied as copy does, then each changed tensor's bytes read back, widened to float32,
    multiplied by one factor a column, narrowed and written over themselves."""
    torch, _ = quiet_imports()
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    src, out = Path(args.src), Path(args.out)
    changed = changed_tensors(src, Path(args.ref))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    base = current_rss_mb()
    t = time.perf_counter()
    for shard in sorted(src.iterdir()):
        shutil.copyfile(shard, out / shard.name)
        if shard.suffix != ".safetensors":
            continue
        with open(out / shard.name, "r+b") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            for k, info in header.items():
                if k not in changed:
                    continue
                lo, hi = (8 + size + o for o in info["data_offsets"])
                buf = bytearray(hi - lo)
                f.seek(lo)
                f.readinto(buf)
                x = torch.frombuffer(buf, dtype=dtypes[info["dtype"]]).view(info["shape"])
                y = x.float()
                y.mul_(torch.linspace(0.5, 1.5, x.shape[-1]))
                if y is not x:
                    x.copy_(y)
                f.seek(lo)
                f.write(buf)
    return {"seconds": time.perf_counter() - t, "peak_mb": peak_rss_mb(), "import_mb": base, "changed": len(changed),
            "bytes": folder_bytes(out)}


def op_peer(args) -> dict:
    """In the peers' venv: the peer's rewrite, timed; its logits or output kept for op_parity."""
    import torch
    import transformers as T

    T.utils.logging.set_verbosity_error()
    src, out = Path(args.src), Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    base = current_rss_mb()
    if args.model == "gpt2":
        from transformer_lens.model_bridge import TransformerBridge

        t = time.perf_counter()
        hf = T.AutoModelForCausalLM.from_pretrained(src)
        tok = T.AutoTokenizer.from_pretrained(src)
        bridge = TransformerBridge.boot_transformers(str(src), hf_model=hf, tokenizer=tok)
        bridge.enable_compatibility_mode()
        seconds, peak = time.perf_counter() - t, peak_rss_mb()
        with torch.no_grad():
            torch.save(bridge(probe(args)).float(), out / "logits.pt")
    else:
        from safetensors.torch import load_file, save_file
        from transformer_tricks import flashify

        t = time.perf_counter()
        cfg = T.AutoConfig.from_pretrained(src)
        index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
        param = {}
        for f in sorted(set(index.values())):
            param.update(load_file(src / f))
        flashify(param, cfg, False)
        for f in sorted(set(index.values())):
            save_file({k: param[k].contiguous() for k, v in index.items() if v == f}, out / f, metadata={"format": "pt"})
        seconds, peak = time.perf_counter() - t, peak_rss_mb()
        for f in src.iterdir():
            if not f.name.endswith(".safetensors"):
                shutil.copyfile(f, out / f.name)
    return {"seconds": seconds, "peak_mb": peak, "import_mb": base}


def op_mergekit(args) -> dict:
    """In the peers' venv: mergekit's passthrough of the checkpoint (every tensor read and written
    again, lazily), timed after the imports."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    src, out = Path(args.src), Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    dtype = "float32" if args.model == "gpt2" else "bfloat16"
    config = MergeConfiguration.model_validate({"models": [{"model": str(src)}], "merge_method": "passthrough",
                                                "dtype": dtype})
    base = current_rss_mb()
    t = time.perf_counter()
    run_merge(config, str(out), options=MergeOptions(copy_tokenizer=True, out_shard_size=1 << 30,
                                                     lazy_unpickle=True, quiet=True))
    return {"seconds": time.perf_counter() - t, "peak_mb": peak_rss_mb(), "import_mb": base,
            "bytes": folder_bytes(out)}


def probe(args):
    import torch

    return torch.randint(0, MODELS[args.model]["config"]["vocab_size"], (2, 32),
                         generator=torch.Generator().manual_seed(0))


def op_parity(args) -> dict:
    """Logits (float32) of the original, ours and the peer's, one model in memory at a time."""
    torch, T = quiet_imports()
    from normsurgery.io.loader import load
    from normsurgery.core.parity import compare

    ids = probe(args)

    def outputs(path):
        model = load(path, torch.float32)
        with torch.no_grad():
            out = model(input_ids=ids).logits
        del model
        return out

    orig, ours = outputs(args.src), outputs(args.ref)
    peer = torch.load(Path(args.out) / "logits.pt") if args.model == "gpt2" else outputs(args.out)

    def cmp(a, b):
        c = compare(a, b)
        cen = compare(a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True))
        return {"relative": c.relative, "centred_relative": cen.relative, "kl": c.kl, "top1": c.top1}

    return {"peer_vs_original": cmp(orig, peer), "peer_vs_ours": cmp(ours, peer), "ours_vs_original": cmp(orig, ours)}


def op_forward(args) -> dict:
    """Forward time (no_grad, float32) of the original and the converted model, one loaded at a
    time: warm-up, then the median of a few runs."""
    torch, T = quiet_imports()
    from normsurgery.io.loader import load

    torch.set_num_threads(args.threads)
    batch, seq = (4, 256) if args.model == "gpt2" else (1, 128)
    ids = torch.randint(0, MODELS[args.model]["config"]["vocab_size"], (batch, seq),
                        generator=torch.Generator().manual_seed(0))
    out = {"tokens": [batch, seq]}
    for label, path in (("original", args.src), ("converted", args.ref)):
        model = load(path, torch.float32)
        times = []
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
            for _ in range(args.repeats):
                t = time.perf_counter()
                model(input_ids=ids, use_cache=False)
                times.append(time.perf_counter() - t)
        out[label] = {"median_s": statistics.median(times), "min_s": min(times), "class": type(model).__name__}
        del model
    return out


WORKERS = {"build": op_build, "peer": op_peer, "mergekit": op_mergekit, "parity": op_parity, "forward": op_forward,
           **{op: op_floor if op.startswith("floor") else op_measure for op in OPS if op not in ("peer", "mergekit")}}


# ---------------------------------------------------------------------------------------------
# orchestration (parent side)


def run_model(name: str, args, log, peers) -> dict:
    spec = MODELS[name]
    src, conv = WORK / f"{name}-in", WORK / f"{name}-converted"
    if not (src / "config.json").is_file():
        log(f"{name}: building the checkpoint ...")
        shutil.rmtree(src, ignore_errors=True)
        spawn(__file__, "build", args.threads, model=name, out=src)
    res = {"params": None, "bytes": folder_bytes(src), "shards": len(list(src.glob("*.safetensors"))),
           "passes": [p for p, _ in spec["passes"]], "ops": {}}
    for r in range(args.best_of):  # the operations alternate, so load from other work hits each alike
        # on the Llama the operations with checks take minutes: run once
        for op in [o for o in OPS if o in args.ops.split(",") and (name == "gpt2" or r == 0 or o in QUICK)
                   and not (o.endswith(ONE) and args.threads == 1) and o in spec.get("ops", OPS)]:
            log(f"{name}: [{r + 1}/{args.best_of}] {op} ...")
            out = conv if op == "stream-noverify" else WORK / f"{name}-{op}"
            threads = 1 if op.endswith(ONE) else args.threads
            os.sync()
            try:
                if op in ("peer", "mergekit"):
                    if peers[0] is None:
                        res["ops"][op] = {"error": f"peers not installed: {peers[1]}"}
                        continue
                    got = spawn(__file__, op, args.threads, python=peers[0], model=name, src=src, out=out)
                    if op == "peer" and "parity" not in res:
                        res["parity"] = spawn(__file__, "parity", args.threads, model=name, src=src, ref=conv, out=out)
                else:
                    got = spawn(__file__, op, threads, model=name, src=src, out=out, ref=conv)
                best = res["ops"].get(op)
                if best is None or "seconds" not in best or got["seconds"] < best["seconds"]:
                    best = res["ops"][op] = got  # the fastest run, with its own peak
                best["runs"] = r + 1
            except RuntimeError as e:
                res["ops"][op] = {"error": str(e)}
            if out != conv and not args.keep:
                shutil.rmtree(out, ignore_errors=True)
    if "forward" in args.ops.split(",") and "forward" in spec.get("ops", ("forward",)):
        log(f"{name}: forward ...")
        res["forward"] = spawn(__file__, "forward", args.threads, model=name, src=src, ref=conv, repeats=args.repeats)
    return res


def summarise(res: dict) -> list[str]:
    """The targets, met or missed, as lines."""
    lines = []
    for name, r in res["models"].items():
        ops = r["ops"]
        for op, (base, target) in TARGETS.items():
            if "seconds" in ops.get(op, {}) and "seconds" in ops.get(base, {}):
                x = ops[op]["seconds"] / ops[base]["seconds"]
                lines.append(f"{name}: {op} time {x:.2f}x {base} (target <= {target}x): {'met' if x <= target else 'MISSED'}")
        for at, threads in (("", res["machine"]["threads"]), (ONE, 1)):  # the floor at all threads and at one
            fl, sn = ops.get("floor" + at, {}), ops.get("stream-noverify" + at, {})
            if "seconds" in fl and "seconds" in sn:
                x = sn["seconds"] / fl["seconds"]
                copy = ops.get("copy", {}).get("seconds")
                lines.append(f"{name}, {threads} thread(s): stream-noverify {sn['seconds']:.2f} s = {x:.2f}x the floor "
                             f"{fl['seconds']:.2f} s (the {fl['changed']} changed tensors rewritten by hand"
                             + (f", {fl['seconds'] / copy:.2f}x the copy" if copy else "")
                             + f") (target <= {FLOOR_TARGET}x): {'met' if x <= FLOOR_TARGET else 'MISSED'}")
        for op in ("stream", "mem"):  # the check's floor: the round trip plus the forwards the check needs
            o, rt = ops.get(op, {}), ops.get("roundtrip", {}).get("seconds")
            if o.get("forwards") and rt:
                need = 3 if MODELS[name].get("half") else 2  # a half-precision output: its rounding measured too
                floor = rt + need * o["seconds_check"] / o["forwards"]
                x = o["seconds"] / floor
                ran = rt + o["seconds_check"]  # the round trip plus every forward the check ran
                lines.append(f"{name}: {op} time {o['seconds']:.1f} s = {x:.2f}x (round trip + the {need} forwards the "
                             f"check needs: {floor:.1f} s; it ran {o['forwards']} forwards, {o['seconds_check']:.1f} s: "
                             f"{o['seconds'] / ran:.2f}x the round trip + those) (target <= {CHECKED_TARGET}x): "
                             f"{'met' if x <= CHECKED_TARGET else 'MISSED'}")
        mk, sn = ops.get("mergekit", {}), ops.get("stream-noverify", {})
        if "peak_mb" in mk and "peak_mb" in sn:
            lines.append(f"{name}: stream-noverify {sn['seconds']:.2f} s, peak RSS {sn['peak_mb']:.0f} MB; mergekit's "
                         f"passthrough {mk['seconds']:.2f} s, {mk['peak_mb']:.0f} MB (peak target: lower): "
                         f"{'met' if sn['peak_mb'] < mk['peak_mb'] else 'MISSED'}")
        if name == "llama":
            for op in ("stream-noverify", "stream", "stream-verify"):
                if "peak_mb" in ops.get(op, {}):
                    p = ops[op]["peak_mb"]
                    lines.append(f"{name}: {op} peak RSS {p:.0f} MB (target < {RSS_TARGET_MB} MB): "
                                 f"{'met' if p < RSS_TARGET_MB else 'MISSED'}")
        bound = MODELS[name].get("rss_mb")
        for op in ("stream-noverify", "stream", "gguf") if bound else ():
            o = ops.get(op, {})
            if "peak_mb" in o and bound == "checkpoint":  # above the imports, against the file's bytes
                p, size = o["peak_mb"] - o["import_mb"], r["bytes"] / 1e6
                lines.append(f"{name}: {op} peak RSS {p:.0f} MB above the imports (target: below the checkpoint's "
                             f"{size:.0f} MB): {'met' if p < size else 'MISSED'}")
            elif "peak_mb" in o:
                lines.append(f"{name}: {op} peak RSS {o['peak_mb']:.0f} MB (target < {bound} MB): "
                             f"{'met' if o['peak_mb'] < bound else 'MISSED'}"
                             + (f"; llama.cpp's own process {o['llama_cpp_peak_mb']:.0f} MB (the "
                                f"{o['gguf_bytes'] / 1e6:.0f} MB file mapped)" if "llama_cpp_peak_mb" in o else ""))
        peer = ops.get("peer", {})
        if "seconds" in peer and "seconds" in ops.get("mem-noverify", {}):
            x = ops["mem-noverify"]["seconds"] / peer["seconds"]
            lines.append(f"{name}: mem-noverify {x:.2f}x the peer's time (target: ahead, < 1): "
                         f"{'met' if x < 1 else 'MISSED'}")
    return lines


def print_tables(res: dict) -> None:
    m = res["machine"]
    print(f"\nbench_convert: {m['cpu']}, {m['threads']} threads of {m['cpus']} CPUs, {m['ram_mb'] / 1024:.0f} GiB RAM; "
          f"load average {m['loadavg_start']:.1f} at start, {m.get('loadavg_end', float('nan')):.1f} at end")
    for name, r in res["models"].items():
        spec = MODELS[name]
        ops = r["ops"]
        print(f"\n{name}: {r['bytes'] / 2**30:.2f} GiB in {r['shards']} shard(s), passes {', '.join(r['passes'])}"
              + (f"; peer: {spec['peer']}" if "peer" in spec else ""))
        print(f"{'operation':<17}{'time s':>9}{'x copy':>8}{'x roundtrip':>12}{'peak RSS MB':>13}{'above import':>14}"
              f"{'rel. error':>12}")
        for op in OPS:
            o = ops.get(op)
            if not o:
                continue
            if "error" in o:
                print(f"{op:<17}  {o['error']}")
                continue
            c, rt = ops.get("copy", {}).get("seconds"), ops.get("roundtrip", {}).get("seconds")
            rel = o.get("relative_error")
            if o.get("refused"):
                print(f"{op:<17}  refused after {o['seconds']:.1f} s, peak RSS {o['peak_mb']:.0f} MB: {o['refused']}")
                continue
            print(f"{op:<17}{o['seconds']:>9.2f}{o['seconds'] / c if c else float('nan'):>8.2f}"
                  f"{o['seconds'] / rt if rt else float('nan'):>12.2f}{o['peak_mb']:>13.0f}"
                  f"{o['peak_mb'] - o['import_mb']:>14.0f}{'' if rel is None else f'{rel:.1e}':>12}")
        if "parity" in r:
            print("parity (2 x 32 random tokens, float32): relative | centred relative | KL | top-1")
            for k, v in r["parity"].items():
                if not isinstance(v, dict):
                    continue
                print(f"  {k:<18}{v['relative']:>10.1e}{v['centred_relative']:>10.1e}{v['kl']:>10.1e}{v['top1']:>8.3f}")
        f = r.get("forward")
        if f is None:
            continue
        o, c = f["original"], f["converted"]
        print(f"forward {f['tokens'][0]} x {f['tokens'][1]} tokens, float32, median of {res['repeats']}: original "
              f"{o['median_s']:.3f} s ({o['class']}), converted {c['median_s']:.3f} s ({c['class']}): "
              f"{c['median_s'] / o['median_s']:.3f}x")
    print("\ntargets:")
    for line in res["summary"]:
        print("  " + line)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of every operation (default: all "
                   "cores); the NAME@1 operations run at one")
    p.add_argument("--repeats", type=int, default=3, help="timed forward runs per model")
    p.add_argument("--ops", default=",".join(OPS + ["forward"]), help="operations to run (default: all)")
    p.add_argument("--best-of", type=int, default=3, help="runs of each operation (best kept; on the Llama only those without checks)")
    p.add_argument("--keep", action="store_true", help="keep bench-out/convert (checkpoints of several GB)")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    for k in ("model", "src", "out", "ref"):
        p.add_argument(f"--{k}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.op = args.worker
        result(WORKERS[args.worker](args))
        return 0
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    t = time.perf_counter()
    WORK.mkdir(parents=True, exist_ok=True)
    res = {"machine": machine(args.threads), "repeats": args.repeats, "models": {},
           "command": "python benchmarks/bench_convert.py " + " ".join(argv or sys.argv[1:])}
    peers = peers_python(log)
    try:
        for name in args.models.split(","):
            res["models"][name] = run_model(name, args, log, peers)
    finally:
        if not args.keep:
            shutil.rmtree(WORK, ignore_errors=True)
    res["machine"]["loadavg_end"] = os.getloadavg()[0]
    res["summary"] = summarise(res)
    res["total_s"] = time.perf_counter() - t
    print_tables(res)
    print(f"bench_convert: {res['total_s']:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
