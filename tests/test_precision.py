"""Casting rewritten weights back to float16 / bfloat16: tensors that overflow or lose their small
values are found (``precision``), then refused or kept in float32 (``convert --on-overflow``),
and a checkpoint with tensors kept in float32 loads back with plain transformers and verifies."""

import json

import pytest
import torch
import transformers as T
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from normsurgery.core import precision
from normsurgery.cli import app
from normsurgery.core.options import ON_OVERFLOW

from models import tiny_model, token_ids

runner = CliRunner()
Q = "model.layers.0.self_attn.q_proj.weight"


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def realistic_weights(n=256 * 256, scale=0.02):
    return torch.randn(n, generator=torch.Generator().manual_seed(0)) * scale


def test_a_cast_within_range_loses_nothing():
    w = realistic_weights()  # float32, about 0.2% of the entries below float16's smallest normal
    assert precision.cast_loss("w", w, torch.float16) is None
    assert precision.cast_loss("w", w, torch.bfloat16) is None
    assert precision.cast_loss("w", w.half().float(), torch.float16) is None  # read from float16: exact


def test_overflow_is_counted():
    w = realistic_weights()
    w[:3] = torch.tensor([7e4, -1e5, 65504.0])  # 65504 is float16's largest finite value: it fits
    loss = precision.cast_loss("w", w, torch.float16)
    assert loss is not None and loss.overflow == 2 and "2 values overflow" in str(loss)
    assert precision.cast_loss("w", w, torch.bfloat16) is None  # bfloat16 has float32's range
    w[3:5] = torch.tensor([3.397e38, -3.39e38])  # the first rounds to inf in bfloat16 (its largest: 3.3895e38)
    loss = precision.cast_loss("w", w, torch.bfloat16)
    assert loss is not None and loss.overflow == 1 and "1 value overflows" in str(loss)


def test_underflow_is_found_by_the_cast_error_exceeding_the_rounding_bound():
    w = realistic_weights() * 1e-3  # typical entry 2e-5: float16 subnormals, a few significant bits
    loss = precision.cast_loss("w", w, torch.float16)
    assert loss is not None and loss.overflow == 0 and loss.relative > loss.bound == 2 ** -11
    assert "underflow" in str(loss)
    assert precision.cast_loss("w", w, torch.bfloat16) is None
    assert precision.cast_loss("w", w * 1e-36, torch.bfloat16) is not None


def test_the_float32_sums_agree_with_the_float64_check():
    """The one-pass check (float32 sums) decides as the float64 one and reports its error."""
    for scale in (0.02, 2e-5, 3e-6, 1e-39):  # within range; some float16 subnormals; mostly subnormals; float32's
        for src in (torch.float32, torch.float64):
            w = realistic_weights(scale=scale).to(src)
            for dtype in (torch.float16, torch.bfloat16):
                fast = precision.cast_loss("w", w, dtype)
                exact = precision._exact_loss("w", w.reshape(-1), w.to(dtype).reshape(-1), dtype)
                assert (fast is None) == (exact is None), (scale, src, dtype)
                if fast is not None:
                    assert fast.relative == pytest.approx(exact.relative, rel=1e-4)


def test_the_cli_offers_the_policies_precision_has():
    assert ON_OVERFLOW == precision.POLICIES


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    """A float16 Llama whose first norm has an outlier gain 6e4 on channel 0 (an input channel
    the embedding writes small values to), read by weights up to 2: folding it gives 1.2e5, more
    than float16 holds, while the float16 model itself computes finite outputs."""
    model = tiny_model("llama", torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] *= 1e-3
        model.model.layers[0].input_layernorm.weight[0] = 6e4
        for name in ("q_proj", "k_proj", "v_proj"):
            col = getattr(model.model.layers[0].self_attn, name).weight[:, 0]
            col *= 2 / col.abs().max()
    model = model.half()
    assert torch.isfinite(model(input_ids=token_ids()).logits).all()
    folder = tmp_path_factory.mktemp("fp16") / "in"
    model.save_pretrained(folder)
    return folder


def test_refused_by_default_nothing_written(overflowing, tmp_path):
    for extra in ([], ["--no-verify"], ["--streaming"]):
        r = run("convert", overflowing, tmp_path / "out", "--pass", "flashnorm", *extra)
        assert r.exit_code == 1, r.output
        assert f"do not fit float16: {Q} (" in r.output and "values overflow" in r.output, r.output
        assert "--on-overflow keep-float32" in r.output and "Traceback" not in r.output
        assert not (tmp_path / "out").exists()
        assert not [p for p in tmp_path.iterdir()]


def test_kept_in_float32_loads_back_and_verifies(overflowing, tmp_path):
    out = tmp_path / "out"
    r = run("convert", overflowing, out, "--pass", "flashnorm", "--on-overflow", "keep-float32", "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["ok"] and Q in result["kept_float32"]
    assert result["warnings"] and Q in result["warnings"][0]
    with safe_open(out / "model.safetensors", "pt") as st:
        dtypes = {k: st.get_slice(k).get_dtype() for k in st.keys()}
    assert dtypes[Q] == "F32" and dtypes["model.embed_tokens.weight"] == "F16"
    assert {k for k, d in dtypes.items() if d == "F32"} == set(result["kept_float32"])
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["normsurgery"]["kept_float32"] == result["kept_float32"]

    # plain transformers, default dtype: everything in float32, the kept tensor exact
    plain = T.AutoModelForCausalLM.from_pretrained(out)
    q = plain.get_parameter(Q)
    assert q.dtype == torch.float32 and q.abs().max() > 65504 and torch.isfinite(q).all()
    source = T.AutoModelForCausalLM.from_pretrained(overflowing, dtype=torch.float32)
    ids = token_ids()
    a, b = source(input_ids=ids).logits.double(), plain(input_ids=ids).logits.double()
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-3  # float16 rounding of the folded weights

    r = run("verify", overflowing, out)
    assert r.exit_code == 0, r.output
    r = run("verify", overflowing, out, "--dtype", "float16")  # cast back on loading: says why
    assert r.exit_code == 1 and f"{Q} (and 2 more) overflow torch.float16" in r.output, r.output

    # one block at a time: the same tensors, bit for bit, the same config
    r = run("convert", overflowing, tmp_path / "streamed", "--pass", "flashnorm", "--on-overflow", "keep-float32",
            "--streaming", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["kept_float32"] == result["kept_float32"]
    streamed = load_file(tmp_path / "streamed" / "model.safetensors")
    assert all(torch.equal(t, streamed[k]) and t.dtype == streamed[k].dtype
               for k, t in load_file(out / "model.safetensors").items())
    assert json.loads((tmp_path / "streamed" / "config.json").read_text())["dtype"] == "float32"

    # the one-line warning on stderr without --json
    r = run("convert", overflowing, tmp_path / "again", "--pass", "flashnorm", "--on-overflow", "keep-float32")
    assert r.exit_code == 0, r.output
    warning = [line for line in r.output.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and Q in warning[0] and "in float32" in warning[0]
    assert "stored in float16, 3 tensors kept in float32" in " ".join(r.output.split())  # the table's title


def test_on_overflow_is_checked_before_any_work(tmp_path):
    r = run("convert", "normsurgery/demo/llama-tiny", tmp_path / "out", "--pass", "flashnorm",
            "--on-overflow", "keep-fp32")
    assert r.exit_code == 2 and "keep-float32" in r.output and not (tmp_path / "out").exists()


@pytest.mark.parametrize("src", [torch.float32, torch.float64])
def test_narrowing_in_place_equals_a_cast_and_takes_no_new_memory(src):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        if dtype == src:
            continue
        for n in (5, precision.CHUNK, 3 * precision.CHUNK + 7):  # within the first chunk; across several
            w = realistic_weights(n).to(src).reshape(-1, 1)
            expected, where = w.to(dtype), w.data_ptr()
            out = precision.narrow_in_place(w, dtype)
            assert out.dtype == dtype and out.shape == (n, 1) and torch.equal(out, expected)
            assert out.data_ptr() == where
    view = realistic_weights(64).to(src)[8:]  # not its storage's own: cast to new memory
    assert torch.equal(precision.narrow_in_place(view, torch.float16), view.to(torch.float16))


def test_a_tensor_not_spent_keeps_its_values():
    w = realistic_weights(3 * precision.CHUNK)
    kept = w.clone()
    out = precision.for_storage("w", w, torch.bfloat16, [], spend=False)
    assert torch.equal(w, kept) and torch.equal(out, kept.to(torch.bfloat16))
    precision.for_storage("w", w, torch.bfloat16, [])  # spent: cast in its own memory
    assert not torch.equal(w, kept)
