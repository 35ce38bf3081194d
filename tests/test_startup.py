"""What a command loads that it does not need: a Llama's Layout reads its norms without importing
every other family's modeling module (the norm table grows with the modules imported)."""

import os
import subprocess
import sys
from pathlib import Path

CODE = """import sys, torch, transformers as T
from normsurgery.core.families import layout
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
            "from normsurgery.core.families import norm_kind\n"
            "import sys\n"
            "m = importlib.import_module('transformers.models.gemma.modeling_gemma')\n"
            "from normsurgery.core import families\n"
            "print('KIND', norm_kind(m.GemmaRMSNorm(8)))\n"
            "print('OTHER', norm_kind(torch.nn.Identity()))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300).stdout
    assert "KIND ('rmsnorm', 1.0)" in out and "OTHER ('other', None)" in out, out


def test_a_convert_that_reads_no_text_never_loads_the_tokenizer(tmp_path, monkeypatch):
    """The tokenizer is made when a pass first reads it (``registry.Later``): a --no-verify
    flashnorm never parses it (up to 3 s of CPU); a pass that reads text gets it."""
    import importlib

    import normsurgery as ns
    from normsurgery.io.source import Source

    convert_mod = importlib.import_module("normsurgery.commands.convert")
    demo = Path(ns.__file__).parent / "demo" / "llama-tiny"
    made = []
    real = Source.tokenizer.func

    def tokenizer(self):
        made.append(self.name)
        return real(self)

    monkeypatch.setattr(Source, "tokenizer", property(tokenizer))
    res = convert_mod.convert(demo, tmp_path / "out", [("flashnorm", {})], verify=False, streaming=True)
    assert res.saved and made == []
    text = (Path(ns.__file__).parent / "data" / "sample.txt").read_text()
    convert_mod.convert(demo, tmp_path / "masked", [("mask", {"by": "activation", "prune_units": 0.25})],
                        verify=False, text=text)
    assert made, "the pass that reads text got no tokenizer"
