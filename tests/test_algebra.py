"""The weight algebra on single modules and tensors, without a model: each rewrite checked against
what the module computes before it, in float64."""

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from normsurgery.core import algebra
from normsurgery.core import precision

G = torch.Generator().manual_seed(0)


def linear(kind: str, n_in: int = 6, n_out: int = 5, bias: bool = True) -> nn.Module:
    mod = nn.Linear(n_in, n_out, bias=bias) if kind == "linear" else Conv1D(n_out, n_in)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=G) * 3)
    return mod.double()


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_weight_is_out_by_in_whatever_the_storage(kind):
    mod = linear(kind)
    x = torch.randn(4, 6, dtype=torch.float64, generator=G)
    assert algebra.weight(mod).shape == (5, 6) and algebra.in_width(mod) == 6 and algebra.out_width(mod) == 5
    assert torch.allclose(mod(x), x @ algebra.weight(mod).T + algebra.bias(mod), atol=1e-12)
    assert algebra.is_linear(mod) and not algebra.is_linear(nn.Embedding(3, 4))


@pytest.mark.parametrize("kind", ["linear", "conv1d", "embedding"])
def test_centred_writers_write_zero_mean_vectors_and_change_only_their_mean(kind):
    mod = nn.Embedding(7, 5).double() if kind == "embedding" else linear(kind)
    x = None if kind == "embedding" else torch.randn(3, 6, dtype=torch.float64, generator=G)
    before = mod(torch.arange(7)) if x is None else mod(x)
    algebra.centre_outputs(mod)
    after = mod(torch.arange(7)) if x is None else mod(x)
    assert after.mean(-1).abs().max() < 1e-12
    assert torch.allclose(after, before - before.mean(-1, keepdim=True), atol=1e-12)
    assert algebra.written_matrix(mod).shape[0] == 5  # one row per written entry


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("with_shift", [False, True])
def test_an_affine_map_folds_into_its_reader(kind, with_shift):
    """reader(g * n + b) == folded(n): W diag(g), c + W b."""
    mod = linear(kind)
    gain = torch.rand(6, dtype=torch.float64, generator=G) + 0.5
    shift = torch.randn(6, dtype=torch.float64, generator=G) if with_shift else None
    n = torch.randn(4, 6, dtype=torch.float64, generator=G)
    want = mod(gain * n + (shift if shift is not None else 0))
    algebra.fold_affine_into_reader(mod, gain, shift)
    assert torch.allclose(mod(n), want, atol=1e-12)


def test_a_shift_gives_a_reader_without_bias_one():
    mod = linear("linear", bias=False)
    shift = torch.randn(6, dtype=torch.float64, generator=G)
    n = torch.randn(4, 6, dtype=torch.float64, generator=G)
    want = mod(n + shift)
    algebra.fold_affine_into_reader(mod, torch.ones(6, dtype=torch.float64), shift)
    assert mod.bias is not None and torch.allclose(mod(n), want, atol=1e-12)


def test_the_mean_of_float32_is_as_accurate_as_float64_rounded():
    w = (torch.randn(256, 4096, generator=G) * 1e3 + 1e4).float()
    exact = w.double().mean(1, keepdim=True)
    assert torch.equal(algebra.mean(w, 1), exact.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_perturbing_moves_each_weight_as_rounding_into_the_storage_dtype_does(dtype):
    w = (torch.randn(10_000, generator=G) * torch.logspace(-3, 2, 10_000)).to(dtype).float()
    w[::97] = 0
    v = w.clone()
    precision.perturb(v, dtype, seed=1)
    moved = (v - w)[w != 0]
    info = torch.finfo(dtype)  # the spacing in [2^(e-1), 2^e) is eps 2^(e-1); eps tiny among subnormals
    ulp = (info.eps * 2.0 ** (torch.frexp(w[w != 0]).exponent - 1)).clamp(min=info.eps * info.tiny)
    assert bool((moved.abs() <= ulp / 2).all()) and torch.equal(v[w == 0], w[w == 0])
    # rounding's error is uniform over [-ulp/2, ulp/2]: |error| / ulp averages 1/4 (the largest, 1/2,
    # would overstate what storing costs); measured against rounding wider values into dtype
    x = torch.randn(10_000, generator=G, dtype=torch.float64) * torch.logspace(-3, 2, 10_000, dtype=torch.float64)
    rounding = ((x.to(dtype).double() - x).abs() / (info.eps * 2.0 ** (torch.frexp(x).exponent - 1))).mean()
    assert abs((moved.abs() / ulp).mean().item() - 0.25) < 0.01 and abs(rounding.item() - 0.25) < 0.01
    assert 0.45 < (moved > 0).double().mean() < 0.55  # up or down at random
    again = w.clone()
    precision.perturb(again, dtype, seed=1)
    assert torch.equal(again, v)  # seeded
    for seed in range(8):  # signs of u both ways on each entry
        odd = torch.tensor([float("inf"), -float("inf"), float("nan"), torch.finfo(dtype).max, -torch.finfo(dtype).max])
        precision.perturb(odd, dtype, seed=seed)  # a binade of inf (or NaN) is clamped: not finite stays as it is
        assert odd[:2].tolist() == [float("inf"), -float("inf")] and odd[2].isnan()
        assert odd[3:].isfinite().all()  # the largest values the storage dtype holds stay finite
