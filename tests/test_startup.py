"""What a command loads that it does not need: a Llama's Layout reads its norms without importing
every other family's modeling module (the norm table grows with the modules imported)."""

import os
import subprocess
import sys
from pathlib import Path

CODE = """import sys, torch, transformers as T
from normsurgery.families import layout
cfg = T.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=64, vocab_size=96)
lay = layout(T.LlamaForCausalLM(cfg))
print("KINDS", sorted(lay.norm_kinds), [s.offset for s in lay.norms][:1])
print("OTHERS", sorted(m for m in sys.modules if m.startswith("transformers.models.") and m.count(".") == 3
                       and m.rsplit(".", 1)[1].startswith("modeling_") and "llama" not in m))
"""


def test_a_layout_imports_no_other_familys_modules():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=300).stdout
    assert "KINDS ['rmsnorm'] [0.0]" in out, out
    others = out.split("OTHERS", 1)[1].strip()
    assert "gemma" not in others and "qwen" not in others and "olmo" not in others, others


def test_an_unknown_norm_class_is_looked_up_among_every_family():
    """A norm class whose module is not imported by the model's own (a Gemma RMSNorm inside a
    Llama, say) is still known: the families' modules are imported when a lookup misses."""
    code = ("import torch, transformers as T, importlib\n"
            "from normsurgery.families import norm_kind\n"
            "import sys\n"
            "m = importlib.import_module('transformers.models.gemma.modeling_gemma')\n"
            "from normsurgery import families\n"
            "print('KIND', norm_kind(m.GemmaRMSNorm(8)))\n"
            "print('OTHER', norm_kind(torch.nn.Identity()))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300).stdout
    assert "KIND ('rmsnorm', 1.0)" in out and "OTHER ('other', None)" in out, out
