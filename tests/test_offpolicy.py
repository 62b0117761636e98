"""Off-policy math against straightforward per-sample loop references, in float64."""

import math

import pytest
import torch

from april_slime.training import offpolicy as op
from april_slime.training.ess import effective_sample_size
from april_slime.training.staleness import expand_version_runs, staleness_stats

F64 = torch.float64


# ------------------------------------------------------------------------------ references
def ref_level_log_weight(log_ratios: list[float], mask: list[int], level: str) -> list[float]:
    """Log IS ratio of every token of ONE sample at ``level``, by plain loops."""
    kept = [x for x, m in zip(log_ratios, mask) if m]
    if level == "token":
        return [x if m else 0.0 for x, m in zip(log_ratios, mask)]
    if level == "sequence":
        total = sum(kept)
        return [total] * len(log_ratios)
    mean = sum(kept) / len(kept) if kept else 0.0
    return [mean] * len(log_ratios)


def ref_correct(w: float, correction: str, low: float, high: float) -> tuple[float, float]:
    """(weight, keep) for one weight."""
    if correction == "none":
        return w, 1.0
    if correction == "truncate":
        return min(max(w, low), high), 1.0
    return (w, 1.0) if low <= w <= high else (0.0, 0.0)


def ref_objective(lp, old, roll, adv, mask, lengths, *, mode, level, correction, low, high, eps, eps_high,
                  loss_level):
    """Per-token loss (list of 0-dim tensors, differentiable w.r.t. ``lp``), sample by sample."""
    out = []
    start = 0
    for n in lengths:
        idx = range(start, start + n)
        m = [int(mask[j]) for j in idx]
        anchor = [float(roll[j]) if mode == "copris" else float(old[j]) for j in idx]
        token_lr = [lp[j] - anchor[k] if m[k] else lp[j] * 0.0 for k, j in enumerate(idx)]
        if loss_level == "sequence":
            kept = [token_lr[k] for k in range(n) if m[k]]
            mean = sum(kept) / len(kept) if kept else lp.sum() * 0.0
            clip_lr = [mean] * n
        else:
            clip_lr = token_lr
        behav = [float(old[j]) - float(roll[j]) if m[k] else 0.0 for k, j in enumerate(idx)]
        if mode == "decoupled":
            lw = ref_level_log_weight(behav, m, level)
            factors = [ref_correct(math.exp(x), correction, low, high)[0] for x in lw]
        elif mode == "copris" and correction != "none":
            # sg(c(rho) / r): the gradient of the unclipped term is c(rho) A grad log r at every level
            cur = ref_level_log_weight([float(x.detach()) for x in token_lr], m, level)
            factors = [ref_correct(math.exp(x), correction, low, high)[0] / math.exp(float(clip_lr[k].detach()))
                       for k, x in enumerate(cur)]
        else:
            factors = [1.0] * n
        for k, j in enumerate(idx):
            r = torch.exp(clip_lr[k])
            a = float(adv[j])
            loss = torch.maximum(-r * a, -r.clamp(1 - eps, 1 + eps_high) * a)
            out.append(loss * factors[k])
        start += n
    return out


def ref_sample_mean(per_token, mask, lengths):
    total = 0.0
    start = 0
    for n in lengths:
        kept = [per_token[j] for j in range(start, start + n) if mask[j]]
        total = total + (sum(kept) / len(kept) if kept else 0.0)
        start += n
    return total / len(lengths)


def ref_token_mean(per_token, mask):
    kept = [x for x, m in zip(per_token, mask) if m]
    return sum(kept) / max(len(kept), 1)


def make_batch(lengths, seed=0, spread=0.3, drift=0.05):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    old = -torch.rand(t, generator=g, dtype=F64) * 3 - 0.05
    roll = old + spread * torch.randn(t, generator=g, dtype=F64)
    lp = (old + drift * torch.randn(t, generator=g, dtype=F64)).requires_grad_(True)
    adv = torch.randn(t, generator=g, dtype=F64)
    mask = (torch.rand(t, generator=g) > 0.2).long()
    return lp, old, roll, adv, mask


LENGTHS = [5, 1, 0, 7, 3, 4]  # includes a single-token and an empty sample


# ---------------------------------------------------------------------------------- packing
def test_packing_split_sum_mean_max_handle_empty_samples():
    packing = op.Packing.from_lengths([2, 0, 3])
    x = torch.tensor([1.0, 2.0, 3.0, -4.0, 5.0], dtype=F64)
    mask = torch.tensor([1, 1, 0, 1, 1])
    assert [t.tolist() for t in packing.split(x)] == [[1.0, 2.0], [], [3.0, -4.0, 5.0]]
    assert packing.sum(x).tolist() == [3.0, 0.0, 4.0]
    assert packing.mean(x, mask).tolist() == [1.5, 0.0, 0.5]
    assert packing.max(x, mask).tolist() == [2.0, 0.0, 5.0]
    assert packing.expand(torch.tensor([7.0, 8.0, 9.0])).tolist() == [7.0, 7.0, 9.0, 9.0, 9.0]
    flat, p2 = op.pack([torch.ones(2), torch.ones(0), torch.ones(3)])
    assert p2.lengths.tolist() == [2, 0, 3] and flat.numel() == 5
    with pytest.raises(ValueError, match="5 tokens"):
        packing.check("x", torch.ones(4))
    with pytest.raises(ValueError, match=">= 0"):
        op.Packing.from_lengths([1, -1])


# ---------------------------------------------------------------------------------- levels
@pytest.mark.parametrize("level", op.IS_LEVELS)
def test_level_log_weights_match_loop(level):
    lp, old, roll, _, mask = make_batch(LENGTHS, seed=1)
    mask[:5] = 0  # first sample fully masked
    packing = op.Packing.from_lengths(LENGTHS)
    log_ratio = op.masked_log_ratio(old, roll, mask)
    got = op.level_log_weights(level, log_ratio, packing, mask)
    expected = []
    start = 0
    for n in LENGTHS:
        expected += ref_level_log_weight((old - roll)[start:start + n].tolist(), mask[start:start + n].tolist(), level)
        start += n
    torch.testing.assert_close(got, torch.tensor(expected, dtype=F64))
    if level != "token":
        assert got[:5].tolist() == [0.0] * 5  # all masked -> ratio 1


def test_sequence_and_geometric_weights_single_token_and_empty():
    packing = op.Packing.from_lengths([1, 0])
    lr = torch.tensor([0.7], dtype=F64)
    mask = torch.tensor([1])
    assert op.sequence_log_weights(lr, packing, mask).tolist() == [0.7, 0.0]
    assert op.geometric_log_weights(lr, packing, mask).tolist() == [0.7, 0.0]


# ------------------------------------------------------------------------------ TIS vs MIS
def test_tis_and_mis_at_and_beyond_the_bounds():
    low, high = 0.5, 2.0
    w = torch.tensor([0.25, 0.5, 1.0, 2.0, 2.0 + 1e-9, 3.0], dtype=F64)
    tis = op.correct_log_weights(w.log(), "truncate", low, high)
    mis = op.correct_log_weights(w.log(), "mask", low, high)
    torch.testing.assert_close(tis.weights, torch.tensor([0.5, 0.5, 1.0, 2.0, 2.0, 2.0], dtype=F64))
    assert tis.keep.tolist() == [1.0] * 6
    assert tis.truncated.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    # inclusive bounds: a weight exactly at a bound stays, anything beyond is dropped
    torch.testing.assert_close(mis.weights, torch.tensor([0.0, 0.5, 1.0, 2.0, 0.0, 0.0], dtype=F64))
    assert mis.keep.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    none = op.correct_log_weights(w.log(), "none", low, high)
    torch.testing.assert_close(none.weights, w)


def test_correction_with_extreme_log_ratios_stays_finite():
    lw = torch.tensor([-1e4, -50.0, 0.0, 50.0, 1e4], dtype=torch.float32)
    tis = op.correct_log_weights(lw, "truncate", 0.0, 2.0)
    mis = op.correct_log_weights(lw, "mask", 0.0, 2.0)
    assert torch.isfinite(tis.weights).all() and torch.isfinite(mis.weights).all()
    assert tis.weights[-2:].tolist() == [2.0, 2.0]
    assert mis.weights[-2:].tolist() == [0.0, 0.0]
    assert mis.keep[:3].tolist() == [1.0, 1.0, 1.0]  # low = 0 means no lower bound
    with pytest.raises(ValueError):
        op.correct_log_weights(lw, "truncate", 2.0, 1.0)
    with pytest.raises(ValueError):
        op.correct_log_weights(lw, "clip", 0.0, 2.0)


# ------------------------------------------------------------------------------ objectives
CASES = [(mode, level, corr, loss_level)
         for mode in op.IS_MODES for level in op.IS_LEVELS for corr in op.IS_CORRECTIONS
         for loss_level in op.LOSS_LEVELS
         if not (mode == "on_policy" and (level != "token" or corr != "none"))]


@pytest.mark.parametrize("mode,level,correction,loss_level", CASES)
def test_policy_objective_matches_loop_reference_values_and_gradients(mode, level, correction, loss_level):
    lp, old, roll, adv, mask = make_batch(LENGTHS, seed=3, spread=0.25, drift=0.15)
    kwargs = dict(mode=mode, level=level, correction=correction, low=0.8, high=1.25, eps=0.2, eps_high=0.28,
                  loss_level=loss_level)
    packing = op.Packing.from_lengths(LENGTHS)
    keep = mask.bool()
    for how in ("sample_mean", "token_mean"):
        lp.grad = None
        lp_ref = lp.detach().clone().requires_grad_(True)
        ref = ref_objective(lp_ref, old, roll, adv, mask, LENGTHS, **kwargs)
        obj = op.policy_objective(lp, old, roll, adv, mask, packing, mode=mode, is_level=level,
                                  correction=correction, is_low=0.8, is_high=1.25, eps_clip=0.2,
                                  eps_clip_high=0.28, loss_level=loss_level)
        torch.testing.assert_close(obj.loss.detach()[keep], torch.stack(ref).detach()[keep])
        got = op.reduce_loss(obj.loss, mask, packing, how)
        expected = ref_sample_mean(ref, mask, LENGTHS) if how == "sample_mean" else ref_token_mean(ref, mask)
        torch.testing.assert_close(got.detach(), expected.detach())
        got.backward()
        expected.backward()
        torch.testing.assert_close(lp.grad, lp_ref.grad)


def test_objective_exercises_clipping_truncation_and_masking():
    lp, old, roll, adv, mask = make_batch(LENGTHS, seed=3, spread=0.25, drift=0.15)
    packing = op.Packing.from_lengths(LENGTHS)
    tis = op.policy_objective(lp, old, roll, adv, mask, packing, mode="decoupled", correction="truncate",
                              is_low=0.8, is_high=1.25)
    mis = op.policy_objective(lp, old, roll, adv, mask, packing, mode="decoupled", correction="mask",
                              is_low=0.8, is_high=1.25)
    keep = mask.bool()
    assert 0 < tis.truncated[keep].mean() < 1
    assert 0 < (1 - mis.keep[keep]).mean() < 1
    assert 0 < tis.clipped[keep].mean() < 1
    # masked tokens contribute nothing, kept ones carry the raw weight
    assert (mis.loss[mis.keep == 0] == 0).all()
    kept = (mis.keep == 1) & keep
    torch.testing.assert_close(mis.is_weight[kept], torch.exp(old - roll)[kept])


@pytest.mark.parametrize("mode,level,correction,loss_level", [
    ("on_policy", "token", "none", "token"),
    ("decoupled", "token", "truncate", "token"),
    ("decoupled", "geometric", "mask", "sequence"),
    ("copris", "token", "none", "sequence"),
])
def test_gradcheck(mode, level, correction, loss_level):
    # copris with TIS/MIS multiplies by a stop-gradient factor c(rho) / q that depends on pi_theta,
    # which finite differences cannot respect; its gradient is checked against the loop reference.
    lengths = [3, 1, 4]
    lp, old, roll, adv, mask = make_batch(lengths, seed=5, spread=0.2, drift=0.1)
    packing = op.Packing.from_lengths(lengths)

    def f(x):
        obj = op.policy_objective(x, old, roll, adv, mask, packing, mode=mode, is_level=level, correction=correction,
                                  is_low=0.7, is_high=1.4, eps_clip=0.2, eps_clip_high=0.28, loss_level=loss_level)
        return op.reduce_loss(obj.loss, mask, packing, "token_mean")

    assert torch.autograd.gradcheck(f, (lp.detach().clone().requires_grad_(True),), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("level", op.IS_LEVELS)
@pytest.mark.parametrize("correction", op.IS_CORRECTIONS)
@pytest.mark.parametrize("loss_level", op.LOSS_LEVELS)
def test_decoupled_reduces_to_ppo_when_proximal_equals_behaviour(level, correction, loss_level):
    lp, old, _, adv, mask = make_batch(LENGTHS, seed=7, drift=0.2)
    packing = op.Packing.from_lengths(LENGTHS)
    common = dict(is_level=level, correction=correction, is_low=0.5, is_high=2.0, loss_level=loss_level)
    decoupled = op.policy_objective(lp, old, old.clone(), adv, mask, packing, mode="decoupled", **common)
    ppo = op.policy_objective(lp, old, None, adv, mask, packing, mode="on_policy", loss_level=loss_level)
    torch.testing.assert_close(decoupled.loss, ppo.loss)
    assert decoupled.is_weight.eq(1).all()


@pytest.mark.parametrize("level", op.IS_LEVELS)
@pytest.mark.parametrize("loss_level", op.LOSS_LEVELS)
def test_copris_reduces_to_on_policy_ppo_when_rollout_equals_old(level, loss_level):
    lp, old, _, adv, mask = make_batch(LENGTHS, seed=8, drift=0.05)
    packing = op.Packing.from_lengths(LENGTHS)
    ppo = op.policy_objective(lp, old, None, adv, mask, packing, mode="on_policy", loss_level=loss_level)
    copris = op.policy_objective(lp, old, old.clone(), adv, mask, packing, mode="copris", is_level=level,
                                 loss_level=loss_level)
    torch.testing.assert_close(copris.loss, ppo.loss)
    # truncation with bounds wider than every ratio is a no-op too, at the level of the clipped ratio
    matched = "token" if loss_level == "token" else "geometric"
    wide = op.policy_objective(lp, old, old.clone(), adv, mask, packing, mode="copris", is_level=matched,
                               correction="truncate", is_low=0.01, is_high=100.0, loss_level=loss_level)
    torch.testing.assert_close(wide.loss, ppo.loss)


def test_copris_truncation_caps_the_gradient_weight_of_a_large_ratio():
    # one token, ratio pi_theta/pi_rollout = e, negative advantage: TIS at 2 makes the gradient 2 * A
    packing = op.Packing.from_lengths([1])
    lp = torch.tensor([0.0], dtype=F64, requires_grad=True)
    roll = torch.tensor([-1.0], dtype=F64)
    adv = torch.tensor([-1.0], dtype=F64)
    obj = op.policy_objective(lp, lp.detach(), roll, adv, torch.tensor([1]), packing, mode="copris",
                              correction="truncate", is_low=0.0, is_high=2.0)
    obj.loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([2.0], dtype=F64))  # d/dlp of -(2/e) * e^lp * A


def test_gspo_ratio_is_the_geometric_mean_shared_by_the_sample():
    lp, old, roll, adv, mask = make_batch([4, 3], seed=9, drift=0.1)
    packing = op.Packing.from_lengths([4, 3])
    obj = op.policy_objective(lp, old, roll, adv, mask, packing, mode="on_policy", loss_level="sequence")
    for start, n in ((0, 4), (4, 3)):
        m = mask[start:start + n].bool()
        expected = torch.exp((lp.detach() - old)[start:start + n][m].mean())
        torch.testing.assert_close(obj.ratio[start:start + n], expected.expand(n))


def test_dual_clip_bounds_negative_advantage_loss():
    loss, _ = op.ppo_clip_loss(torch.tensor([math.log(10.0)], dtype=F64), torch.tensor([-1.0], dtype=F64),
                               0.2, 0.2, eps_clip_c=3.0)
    assert loss.item() == pytest.approx(3.0)
    with pytest.raises(ValueError):
        op.ppo_clip_loss(torch.zeros(1), torch.ones(1), 0.2, 0.2, eps_clip_c=0.5)


def test_extreme_log_ratios_give_finite_loss_and_gradient():
    packing = op.Packing.from_lengths([3])
    lp = torch.tensor([0.0, -0.1, -0.2], dtype=torch.float32, requires_grad=True)
    roll = torch.tensor([-500.0, -0.1, 400.0])
    adv = torch.tensor([-1.0, 1.0, 1.0])
    for mode in ("copris", "decoupled"):
        for level in op.IS_LEVELS:
            for correction in op.IS_CORRECTIONS:
                obj = op.policy_objective(lp, lp.detach(), roll, adv, torch.ones(3), packing, mode=mode,
                                          is_level=level, correction=correction)
                loss = op.reduce_loss(obj.loss, torch.ones(3), packing)
                lp.grad = None
                loss.backward()
                assert torch.isfinite(loss) and torch.isfinite(lp.grad).all(), (mode, level, correction)


# ---------------------------------------------------------------------------------- NaN policy
def test_nan_at_kept_token_raises_and_nan_at_masked_token_is_ignored():
    lp, old, roll, adv, mask = make_batch([2, 3], seed=11)
    mask = torch.tensor([1, 1, 1, 0, 1])
    packing = op.Packing.from_lengths([2, 3])
    bad = roll.clone()
    bad[4] = float("nan")
    with pytest.raises(op.NonFiniteLogProbError, match=r"rollout_log_probs: .* sample 1, token 2"):
        op.policy_objective(lp, old, bad, adv, mask, packing, mode="copris")
    ignored = roll.clone()
    ignored[3] = float("nan")
    obj = op.policy_objective(lp, old, ignored, adv, mask, packing, mode="decoupled", is_level="sequence")
    assert torch.isfinite(obj.loss).all()
    ref = op.policy_objective(lp, old, roll, adv, mask, packing, mode="decoupled", is_level="sequence")
    torch.testing.assert_close(obj.loss[mask.bool()], ref.loss[mask.bool()])
    inf_lp = lp.detach().clone()
    inf_lp[0] = -float("inf")
    with pytest.raises(op.NonFiniteLogProbError, match="log_probs"):
        op.policy_objective(inf_lp, old, roll, adv, mask, packing, mode="on_policy")


def test_missing_rollout_log_probs_is_an_error_outside_on_policy():
    lp, old, _, adv, mask = make_batch([2], seed=12)
    with pytest.raises(ValueError, match="rollout log-probs"):
        op.policy_objective(lp, old, None, adv, mask, op.Packing.from_lengths([2]), mode="copris")


# ----------------------------------------------------------------------------------------- ESS
def ref_ess(weights):
    return sum(weights) ** 2 / sum(w * w for w in weights)


def test_ess_matches_formula_and_limits():
    lw = torch.tensor([0.1, -0.4, 0.9, 0.0, -1.2], dtype=F64)
    got = effective_sample_size(lw)
    expected = ref_ess([math.exp(x) for x in lw.tolist()])
    assert got.ess == pytest.approx(expected, rel=1e-12)
    assert got.ess_ratio == pytest.approx(expected / 5, rel=1e-12)
    assert got.num_samples == 5
    assert effective_sample_size(torch.full((7,), 3.3)).ess_ratio == pytest.approx(1.0)
    dominated = effective_sample_size(torch.tensor([1000.0, -1000.0, -1000.0, 0.0]))
    assert dominated.ess == pytest.approx(1.0) and dominated.ess_ratio == pytest.approx(0.25)
    valid = torch.tensor([True, False, True, True, False])
    masked = effective_sample_size(lw, valid=valid)
    assert masked.ess == pytest.approx(ref_ess([math.exp(lw[i].item()) for i in (0, 2, 3)]))
    empty = effective_sample_size(torch.zeros(0))
    assert (empty.ess, empty.ess_ratio, empty.num_samples) == (0.0, 1.0, 0)
    with pytest.raises(op.NonFiniteLogProbError):
        effective_sample_size(torch.tensor([0.0, float("nan")]))


def test_objective_sequence_log_weights_are_unclipped_behaviour_log_ratios():
    lp, old, roll, adv, mask = make_batch(LENGTHS, seed=13, spread=2.0)
    packing = op.Packing.from_lengths(LENGTHS)
    obj = op.policy_objective(lp, old, roll, adv, mask, packing, mode="decoupled", is_level="sequence",
                              correction="truncate", is_high=1.1)
    start = 0
    for i, n in enumerate(LENGTHS):
        m = mask[start:start + n].bool()
        assert obj.sequence_log_weights[i].item() == pytest.approx((old - roll)[start:start + n][m].sum().item())
        start += n


# ------------------------------------------------------------------------------------ staleness
def test_expand_version_runs_and_staleness_stats():
    assert expand_version_runs([[3, 2], [5, 1]], 3).tolist() == [3, 3, 5]
    assert expand_version_runs([], 0).tolist() == []
    with pytest.raises(ValueError, match="cover 3 tokens but the response has 4"):
        expand_version_runs([[3, 2], [5, 1]], 4)
    staleness = torch.tensor([0, 0, 1, 2, 5, 9])
    ratio = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    mask = torch.tensor([1, 1, 1, 1, 1, 0])
    counts, sums = staleness_stats(ratio, staleness, mask, 4)
    assert counts.tolist() == [2.0, 1.0, 1.0, 1.0]
    assert sums.tolist() == [3.0, 3.0, 4.0, 5.0]


def test_approx_kl_estimators():
    lp = torch.tensor([-1.0, -2.0])
    base = torch.tensor([-1.5, -1.0])
    lr = lp - base
    torch.testing.assert_close(op.approx_kl(lp, base, "k1"), lr)
    torch.testing.assert_close(op.approx_kl(lp, base, "k2"), lr ** 2 / 2)
    torch.testing.assert_close(op.approx_kl(lp, base, "k3"), torch.exp(-lr) - 1 + lr)
    with pytest.raises(ValueError):
        op.approx_kl(lp, base, "k9")


# ------------------------------------------------------------------------ defects of issue 8
def test_mis_removed_tokens_are_not_counted_as_clipped():
    lp, old, roll, adv, mask = make_batch(LENGTHS, seed=31, spread=0.6)
    packing = op.Packing.from_lengths(LENGTHS)
    obj = op.policy_objective(lp, old, roll, adv, mask, packing, mode="copris", correction="mask",
                              is_low=0.8, is_high=1.25, eps_clip=0.2, eps_clip_high=0.28)
    assert (obj.keep == 0).any()
    assert (obj.clipped[obj.keep == 0] == 0).all()
    assert obj.clipped.sum() == 0  # kept ratios lie in [0.8, 1.25], inside the clip range


def test_truncated_weight_keeps_its_gradient_beyond_the_log_ratio_bound():
    # copris + TIS at 2: a token 25 nats above its rollout log-prob, negative advantage. The
    # gradient is the truncated weight times the advantage (d/dlp of -c A log pi = -2 * -1 = 2),
    # not the zero a hard clamp at 20 nats would give.
    packing = op.Packing.from_lengths([1])
    lp = torch.tensor([0.0], dtype=F64, requires_grad=True)
    roll = torch.tensor([-25.0], dtype=F64)
    adv = torch.tensor([-1.0], dtype=F64)
    obj = op.policy_objective(lp, lp.detach(), roll, adv, torch.tensor([1]), packing, mode="copris",
                              correction="truncate", is_low=0.0, is_high=2.0)
    obj.loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([2.0], dtype=F64))
    torch.testing.assert_close(obj.loss.detach(), torch.tensor([2.0], dtype=F64))


def test_sequence_level_truncation_gradient_is_the_truncated_weight_times_the_score():
    # copris, sequence-level TIS with a lower bound: the gradient of each kept, unclipped token is
    # c(rho) * A * grad log pi (docs/loss.md). Dividing by rho instead of the token ratio gave
    # low / rho times the token ratio: thousands of times the uncorrected gradient.
    lengths = [6, 9, 4, 7]
    lp, old, roll, adv, mask = make_batch(lengths, seed=32, spread=0.9, drift=0.0)
    mask = torch.ones_like(mask)
    packing = op.Packing.from_lengths(lengths)
    kw = dict(eps_clip=0.2, eps_clip_high=0.28)
    obj = op.policy_objective(lp, old, roll, adv, mask, packing, mode="copris", is_level="sequence",
                              correction="truncate", is_low=0.5, is_high=2.0, **kw)
    op.reduce_loss(obj.loss, mask, packing).backward()
    got = lp.grad.clone()

    # reference: sum over samples of mean_t of -c(rho_i) A_t log pi_t on tokens PPO does not clip
    lr = (lp.detach() - roll)
    rho = packing.sum(lr).exp()
    assert (rho < 0.5).any()  # the lower bound is active
    c = rho.clamp(0.5, 2.0)
    r = lr.exp()
    active = ~(((adv > 0) & (r > 1.28)) | ((adv < 0) & (r < 0.8)))
    x = lp.detach().clone().requires_grad_(True)
    ref = -(packing.expand(c) * adv * x * active)
    op.reduce_loss(ref, mask, packing).backward()
    torch.testing.assert_close(got, x.grad)
    # each token's gradient is at most the upper bound times |A| / n_i
    assert (got.abs() <= 2.0 * adv.abs() / packing.expand(packing.lengths.to(F64)) + 1e-12).all()
