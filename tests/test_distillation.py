"""The distillation losses (core/distillation.py) against sums written out in float64 here."""

import math

import torch

from normsurgery.core import distillation as d


def _logits(*shape, scale=4.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _kl_by_hand(s, t, temperature):
    """T^2 sum_v p(v) (log p(v) - log q(v)) per position, p and q written out from exp and sums."""
    ps = torch.exp(t / temperature)
    p = ps / ps.sum(-1, keepdim=True)
    qs = torch.exp(s / temperature)
    q = qs / qs.sum(-1, keepdim=True)
    return temperature ** 2 * (p * (p.log() - q.log())).sum(-1)


def test_kd_loss_is_the_temperature_scaled_forward_kl():
    s, t = _logits(2, 5, 11, seed=1), _logits(2, 5, 11, seed=2)
    for temperature in (1.0, 2.0, 0.5):
        total, n = d.kd_loss_sum(s, t, temperature)
        assert n.item() == 10
        assert math.isclose(total.item(), _kl_by_hand(s, t, temperature).sum().item(), rel_tol=1e-5)


def test_kd_loss_is_forward_not_reverse():
    s, t = _logits(3, 7, seed=3), _logits(3, 7, seed=4)
    forward = d.kd_loss_sum(s, t)[0].item()
    assert math.isclose(forward, _kl_by_hand(s, t, 1.0).sum().item(), rel_tol=1e-5)
    assert not math.isclose(forward, _kl_by_hand(t, s, 1.0).sum().item(), rel_tol=1e-2)


def test_kd_loss_counts_only_the_masked_positions():
    s, t = _logits(2, 6, 9, seed=5), _logits(2, 6, 9, seed=6)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 1] = mask[1, 4] = True
    total, n = d.kd_loss_sum(s, t, 1.0, mask)
    by_hand = _kl_by_hand(s, t, 1.0)
    assert n.item() == 2
    assert math.isclose(total.item(), (by_hand[0, 1] + by_hand[1, 4]).item(), rel_tol=1e-5)


def test_kd_loss_is_zero_for_the_teacher_itself():
    t = _logits(4, 13, seed=7)
    assert abs(d.kd_loss_sum(t, t.clone(), 2.0)[0].item()) < 1e-5


def test_top_k_at_the_vocabulary_is_the_full_kl():
    s, t = _logits(3, 5, 17, seed=8), _logits(3, 5, 17, seed=9)
    for temperature in (1.0, 2.0):
        cache = d.top_k(t, 17, temperature)
        assert torch.isinf(cache.tail).all()
        full = d.kd_loss_sum(s, t, temperature)[0].item()
        folded = d.kd_top_k_loss_sum(s, cache)[0].item()
        assert math.isclose(folded, full, rel_tol=1e-5)


def test_top_k_folds_to_k_plus_one_outcomes():
    """Below the vocabulary, the loss is the KL of the (k tokens, the rest) distributions, written out."""
    s, t = _logits(4, 50, seed=10), _logits(4, 50, seed=11)
    k = 5
    cache = d.top_k(t, k)
    p, q = torch.softmax(t, -1), torch.softmax(s, -1)
    ids = p.topk(k, -1).indices
    pk, qk = p.gather(-1, ids), q.gather(-1, ids)
    pr, qr = 1 - pk.sum(-1), 1 - qk.sum(-1)
    by_hand = ((pk * (pk.log() - qk.log())).sum(-1) + pr * (pr.log() - qr.log())).sum().item()
    got = d.kd_top_k_loss_sum(s, cache)[0].item()
    assert math.isclose(got, by_hand, rel_tol=1e-4)
    assert got < d.kd_loss_sum(s, t)[0].item()  # folding outcomes never adds divergence


def test_top_k_gradients_are_finite_at_the_vocabulary():
    s = _logits(2, 9, seed=12).float().requires_grad_()
    loss = d.kd_top_k_loss_sum(s, d.top_k(_logits(2, 9, seed=13), 9))[0]
    loss.backward()
    assert torch.isfinite(s.grad).all()


def test_block_nmse():
    h = _logits(2, 3, 8, seed=14)
    out = h + _logits(2, 3, 8, seed=15)
    assert d.block_nmse(out, out, h).item() == 0
    assert math.isclose(d.block_nmse(h, out, h).item(), 1.0, rel_tol=1e-6)  # the identity misses all the update
    half = h + 0.5 * (out - h)
    assert math.isclose(d.block_nmse(half, out, h).item(), 0.25, rel_tol=1e-5)
