"""normsurgery.commands.lens: a TransformerLens 4 model of an output, the surgery visible (no norm on an
LN-free GPT-2, folded norms on a flashnorm Llama), logits equal to the checkpoint's, hooks and
the activation cache read by name; what TransformerLens cannot express is refused."""

import pytest
import torch

import normsurgery as ns
from normsurgery.core.errors import SurgeryError
from normsurgery.core.families import layout
from normsurgery.core.parity import compare
from normsurgery.passes import remove_ln as R
from normsurgery.passes import removable_norm as RN

from models import token_ids

pytest.importorskip("transformer_lens")

GPT2 = "normsurgery/demo/gpt2-tiny"
LLAMA = "normsurgery/demo/llama-tiny"


def ln_free_gpt2(out):
    """The demo GPT-2 with every norm removed by remove-ln's fold (divisors from a batch, no
    training), saved with its tokenizer: remove-ln's default export."""
    model = ns.load(GPT2, dtype=torch.float32)
    lay = layout(model)
    norms = R.install(model, lay, True)
    R.calibrate(model, norms, token_ids(4, 32, seed=3))
    every = [(i, p) for i, rn in enumerate(norms) for p in range(len(rn.paths))]
    RN.freeze_until(norms, [(0, "all", every), (0, "position 0", [])], 0)
    RN.fold(model, lay, norms)
    ns.save(model, out, source=GPT2)
    return out


def logits_equal(bridge, folder):
    ids = token_ids(2, 12, seed=7) + 100
    with torch.no_grad():
        expected = ns.load(folder, dtype=torch.float32)(input_ids=ids).logits
        got = bridge(ids, return_type="logits")
    assert compare(expected, got).relative <= 1e-5
    return ids


def test_ln_free_gpt2_has_no_norm(tmp_path):
    folder = ln_free_gpt2(tmp_path / "noln")
    bridge = ns.lens(folder)
    assert bridge.cfg.normalization_type is None and bridge.normsurgery_parity.relative <= 1e-5
    ids = logits_equal(bridge, folder)
    assert not [h for h in bridge.hook_dict if ".ln" in h or "ln_final" in h]
    _, cache = bridge.run_with_cache(ids)
    resid = cache["blocks.1.hook_resid_pre"]
    seen = {}
    bridge.run_with_hooks(ids, fwd_hooks=[("blocks.1.hook_resid_pre", lambda t, hook: seen.setdefault("x", t))])
    assert resid.shape == (2, 12, 128) and torch.equal(seen["x"], resid)


def test_flashnorm_llama_is_folded(tmp_path):
    ns.convert(LLAMA, tmp_path / "flash", [("flashnorm", {})])
    bridge = ns.lens(tmp_path / "flash")
    assert bridge.cfg.normalization_type == "RMSPre"
    ids = logits_equal(bridge, tmp_path / "flash")
    _, cache = bridge.run_with_cache(ids)
    x = cache["blocks.0.hook_resid_pre"]
    rms = (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()  # the folded norm: x / rms(x), gain 1
    assert torch.allclose(cache["blocks.0.ln1.hook_normalized"], x / rms, rtol=1e-5, atol=1e-6)


def test_stock_gpt2_keeps_its_gains():
    assert ns.lens(GPT2).cfg.normalization_type == "LN"


def test_crmsnorm_is_refused(tmp_path):
    ns.convert(GPT2, tmp_path / "crms", [("crmsnorm", {})])
    with pytest.raises(SurgeryError, match="crmsnorm, which TransformerLens cannot express"):
        ns.lens(tmp_path / "crms")
