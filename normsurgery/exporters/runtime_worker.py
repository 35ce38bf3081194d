"""The runtime a written folder is checked in, MLX-LM or vLLM, run for ``runtime_check`` in a
process of its own: ``python -I runtime_worker.py`` reads a request (JSON) on stdin and writes what
the runtime computed to the file it names (numpy ``.npz``).

It imports numpy and the runtime, nothing of normsurgery or torch: vLLM's python may be another
environment's (``NORMSURGERY_SERVE_PYTHON``). The request: ``runtime`` (``mlx`` or ``vllm``),
``folder``, ``ids`` (the probe windows: lists of token ids), ``prompt`` (tokens of each window a
greedy continuation starts from), ``new_tokens`` (0: none), ``vocab``, ``out``, ``dtype``
(``float32``, or ``float64``: MLX-LM only, on its CPU, the runtime's own exact reference of the
folder). Written: ``logits`` [windows, tokens, vocab] in ``dtype``, the runtime's logits on each
window, and ``tokens`` [windows, new_tokens], its greedy continuation (argmax, end-of-text
ignored) of each window's first ``prompt`` tokens through its key/value cache.

- MLX-LM: ``mlx_lm.load`` (the tokenizer with ``trust_remote_code``: config.json has an
  ``auto_map``; a folder without one: ``load_model``), parameters cast to float32; the logits of
  one forward, the tokens of ``generate_step``.
- vLLM: ``LLM(folder, trust_remote_code=True, dtype="float32")``; the logits are its raw logits
  (``logprobs_mode="raw_logits"``): at each window's positions but the last, its prompt logits
  (``prompt_logprobs``: the whole vocabulary), at the last, those of its first generated token.

Why a process: MLX computes a forward in one C++ call, and Python acts on Ctrl-C only when it
returns (tens of seconds for a 135M model on a busy CPU); vLLM starts an engine process and
threads. The caller kills this process on an interrupt and nothing is left. Exit status 3: the
runtime refused the folder (why: the last line on stderr).
"""

import json
import os
import sys
from pathlib import Path

import numpy as np


def mlx_load(folder: str, dtype: str = "float32"):
    """``folder`` in MLX-LM, its parameters cast to ``dtype`` (float64: on the CPU, MLX has no
    float64 on a GPU)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.utils import load_model

    if dtype == "float64":
        mx.set_default_device(mx.cpu)
    tokenizer = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
    if any(os.path.isfile(os.path.join(folder, f)) for f in tokenizer):
        model, _ = load(folder, tokenizer_config={"trust_remote_code": True})
    else:
        model, _ = load_model(Path(folder))
    model.set_dtype(getattr(mx, dtype))
    return model


def mlx_logits(model, ids: np.ndarray) -> np.ndarray:
    """MLX-LM's logits of ``ids`` [windows, tokens] (no cache), in the model's dtype (float32 or float64)."""
    import mlx.core as mx

    return np.array(model(mx.array(ids)))


def mlx_greedy(model, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
    """``new_tokens`` greedy tokens after each row of ``prompts`` (``generate_step``: argmax, the cache)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return np.array([[int(t) for t, _ in generate_step(mx.array(row), model, max_tokens=new_tokens)]
                     for row in prompts])


def mlx_run(req: dict, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    try:
        model = mlx_load(req["folder"], req.get("dtype", "float32"))
    except Exception as e:  # MLX-LM's own refusals (a model type or key it does not know, a missing weight)
        refuse(e)
    prompts = ids[:, :req["prompt"]]
    tokens = mlx_greedy(model, prompts, req["new_tokens"]) if req["new_tokens"] else prompts[:, :0]
    return mlx_logits(model, ids), tokens


def vllm_run(req: dict, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of key/value cache (the default asks for 4)
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(req["folder"], trust_remote_code=True, dtype="float32", enforce_eager=True, seed=0,
                  max_model_len=ids.shape[1] + req["new_tokens"] + 8, max_logprobs=-1, logprobs_mode="raw_logits")
    except Exception as e:
        refuse(e)
    vocab = req["vocab"]

    def row(entries) -> np.ndarray:
        out = np.full(vocab, np.nan, np.float32)
        for token, entry in entries.items():
            out[token] = entry.logprob
        return out

    probe = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=-1, logprobs=-1)
    logits = [np.stack([row(p) for p in o.prompt_logprobs[1:]] + [row(o.outputs[0].logprobs[0])])
              for o in llm.generate([{"prompt_token_ids": w.tolist()} for w in ids], probe, use_tqdm=False)]
    greedy = SamplingParams(temperature=0, max_tokens=req["new_tokens"], ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": w[:req["prompt"]].tolist()} for w in ids], greedy, use_tqdm=False)
    return np.stack(logits), np.array([list(o.outputs[0].token_ids) for o in outs])


def refuse(e: Exception):
    print(" ".join(str(e).split())[:300], file=sys.stderr, flush=True)
    os._exit(3)


def main() -> None:
    req = json.loads(sys.stdin.read())
    ids = np.array(req["ids"], dtype=np.int64)
    logits, tokens = (mlx_run if req["runtime"] == "mlx" else vllm_run)(req, ids)
    np.savez(req["out"], logits=logits.astype(req.get("dtype", "float32")), tokens=tokens.astype(np.int64))
    sys.stdout.flush()
    os._exit(0)  # vLLM's engine and its threads end with the process


if __name__ == "__main__":  # vLLM's engine is a spawned process: the guard is needed
    main()
