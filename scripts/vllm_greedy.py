"""Greedy tokens of a checkpoint folder in vLLM (its CPU build), for ``make test-serve``
(tests/test_serve.py): run by the serving venv's python (.venv-serve), which has vLLM and not
normsurgery.

Usage: python scripts/vllm_greedy.py FOLDER PROMPTS_JSON NEW_TOKENS OUT
PROMPTS_JSON: a JSON list of token id lists. Writes to the file OUT the JSON list of each
prompt's NEW_TOKENS greedy tokens (temperature 0, end-of-sequence ignored), computed in float32
(a file: vLLM's processes log to standard output too, also while shutting down).
The folder is loaded with ``trust_remote_code`` (a nemotron-nas folder's config class comes from
the folder). vLLM's engine is a spawned process: the ``__main__`` guard is needed.
"""

import json
import os
import sys


def main() -> None:
    folder, prompts, new_tokens, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of key/value cache (the default asks for 4)
    from vllm import LLM, SamplingParams

    llm = LLM(folder, trust_remote_code=True, dtype="float32", max_model_len=128, enforce_eager=True, seed=0)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    with open(out, "w") as f:
        json.dump([list(o.outputs[0].token_ids) for o in outs], f)


if __name__ == "__main__":
    main()
