"""llama.cpp, run for ``gguf.run_llama`` in a process of its own: ``python -I llamacpp_worker.py``
reads a request (JSON) on stdin and writes what llama.cpp computed to the file it names.

It imports xllamacpp (llama.cpp's server as a Python module) and nothing of normsurgery or torch.
The request: ``model`` (the GGUF file), ``n_ctx``, ``threads``, ``prompts`` (lists of token
ids), ``new_tokens``, ``vocab`` (the checkpoint's vocabulary size), ``text``, ``out``. For each
prompt, ``new_tokens`` greedy tokens (temperature 0, end-of-text ignored) and, at each of
their positions, the log-probability of every token of the vocabulary (``n_probs`` = the
vocabulary, from the logits before sampling), streamed a token at a time so that one position's
JSON is held at once; then the text tokenized by the server's ``/tokenize`` on its loopback port
(as transformers tokenizes: special tokens added, none parsed). Written to ``out`` (numpy
``.npz``): ``tokens`` [prompts, new_tokens], ``logprobs`` [prompts, new_tokens, vocab] float32,
``text_tokens``; and ``out.json``: the server's address, threads, llama.cpp's system info, this
process's peak RSS.

Why a process: llama.cpp's server installs SIGINT/SIGTERM handlers, starts threads (HTTP pool,
task loop, a log thread that lives as long as the process) and a listening socket, maps the file
(its pages count in the process's RSS), and may abort on a malformed file. Its process ends when
the check has its answer (``os._exit``, which also avoids xllamacpp's destructor: it joins the
task loop, and a server destroyed before that loop started waits forever), so nothing is left.
Exit status 3: llama.cpp did not load the file (its log, errors only, on stderr says why; no
server was made, so the process exits normally and its log thread prints what it holds).
"""

import json
import os
import resource
import sys
import urllib.request

import numpy as np


def main() -> int:
    req = json.loads(sys.stdin.read())
    import xllamacpp as x

    p = x.CommonParams()
    p.model.path = req["model"]
    p.n_ctx = p.n_batch = p.n_ubatch = int(req["n_ctx"])
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = int(req["threads"])
    p.n_parallel = 1
    p.warmup = False
    p.port = 0  # a free loopback port
    p.verbosity = 1  # errors only (0: none)
    p.cache_type_k = p.cache_type_v = x.ggml_type.GGML_TYPE_F32  # only the weights' storage type differs from torch
    p.flash_attn_type = x.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
    try:
        server = x.Server(p)
    except RuntimeError:
        return 3
    vocab, n = int(req["vocab"]), int(req["new_tokens"])
    tokens = np.zeros((len(req["prompts"]), n), np.int64)
    logprobs = np.full((len(req["prompts"]), n, vocab), np.nan, np.float32)
    for i, prompt in enumerate(req["prompts"]):
        seen, problems = [], []

        def chunk(data: dict) -> bool:
            if "error" in data:
                problems.append(str(data["error"].get("message", data["error"])))
                return True
            for c in ((data.get("choices") or [{}])[0].get("logprobs") or {}).get("content") or []:
                top = c["top_logprobs"]
                ids = np.fromiter((e["id"] for e in top), np.int64, len(top))
                if len(top) != vocab or ids.min() < 0 or ids.max() >= vocab:
                    problems.append(f"llama.cpp gave {len(top)} log-probabilities with ids up to {ids.max()} for a "
                                    f"vocabulary of {vocab}")
                    return True
                row = len(seen)
                if row < n:
                    logprobs[i, row, ids] = np.fromiter((e["logprob"] for e in top), np.float64, len(top))
                seen.append(int(c["id"]))
            return False

        server.handle_completions({"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
                                   "repeat_penalty": 1.0, "ignore_eos": True, "n_probs": vocab,
                                   "post_sampling_probs": False, "cache_prompt": False, "stream": True}, chunk)
        if problems or len(seen) != n:
            print(f"error: {problems[0] if problems else f'llama.cpp generated {len(seen)} of {n} tokens'}",
                  file=sys.stderr)
            return 4
        tokens[i] = seen
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    body = json.dumps({"content": req["text"], "add_special": True, "parse_special": False}).encode()
    with opener.open(urllib.request.Request(f"{server.listening_address}/tokenize", body,
                                            {"Content-Type": "application/json"}), timeout=60) as r:
        text_tokens = json.loads(r.read())["tokens"]
    np.savez(req["out"], tokens=tokens, logprobs=logprobs, text_tokens=np.asarray(text_tokens, np.int64))
    with open(req["out"] + ".json", "w") as f:
        json.dump({"address": server.listening_address, "threads": int(req["threads"]),
                   "system": x.get_system_info().strip(), "xllamacpp": getattr(x, "__version__", None),
                   "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, f)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except BaseException as e:  # said on stderr in one line; never the interpreter's exit (module docstring)
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        code = 5
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 3:  # no server: a normal exit, which lets llama.cpp's log thread print why it did not load
        sys.exit(code)
    os._exit(code)
