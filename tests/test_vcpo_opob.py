"""VCPO's off-policy optimal baseline in every form it can take, against a float64 reference.

The accumulator (``training.baseline.OpobAccumulator``) forms the step's gradient micro-batch by
micro-batch: per prompt group (std-normalised or not) or over the step, with the released or the
paper's weights, with or without per-trajectory length normalisation, from packed micro-batches
(layer hooks), micro-batches of one sample (norm read off the gradient buffer) and groups that span
micro-batches. ``tests/support/training/opob_reference.py`` computes the same gradient from the
definitions, one sample's score at a time.
"""

import math

import pytest
import torch

from april_slime.training.baseline import OpobAccumulator, OpobOptions, SampleGroups, opob_policy_loss
from april_slime.training.grad_norms import PerSampleGradNorms
from april_slime.training.offpolicy import Packing
from april_slime.training.packed import response_log_probs_from_logits
from tests.support.training import tokenwise
from tests.support.training.opob_reference import reference_gradient

VOCAB, D, H = 13, 6, 9
HIGH = 1.6


def TokenwiseLM(seed=0):
    return tokenwise.TokenwiseLM(seed, VOCAB, D, H)


def make_samples(seed, group_sizes, equal_rewards_group=None):
    """Samples of prompt groups: tokens, response length, loss mask, rollout log-probs, raw reward."""
    g = torch.Generator().manual_seed(seed)
    model = TokenwiseLM(seed)
    samples = []
    for gid, size in enumerate(group_sizes):
        for _ in range(size):
            prompt, resp = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(2, 7, (1,), generator=g))
            tokens = torch.randint(VOCAB, (prompt + resp,), generator=g)
            mask = (torch.rand(resp, generator=g) > 0.25).double()
            mask[0] = 1.0
            with torch.no_grad():
                lp = response_log_probs_from_logits(model(tokens[None]), [tokens], [prompt + resp], [resp])[0][0]
            reward = 1.0 if gid == equal_rewards_group else round(float(torch.rand(1, generator=g)), 2)
            samples.append(dict(tokens=tokens, resp=resp, mask=mask, group=gid, size=size, reward=reward,
                                rollout=lp + 0.5 * torch.randn(resp, generator=g, dtype=torch.float64)))
    return model, samples


def group_std(samples):
    out = {}
    for gid in {s["group"] for s in samples}:
        r = torch.tensor([s["reward"] for s in samples if s["group"] == gid], dtype=torch.float64)
        out[gid] = float(r.std(unbiased=False))
    return out


def run_accumulator(model, samples, layout, options, stds=None):
    """One optimizer step: every micro-batch's forward, opob_policy_loss, backward; then finish."""
    params = list(model.parameters())
    norms = PerSampleGradNorms(model, weighted=True)
    acc = OpobAccumulator(norms, params, options)
    acc.begin_step()
    model.zero_grad(set_to_none=True)
    stds = group_std(samples) if stds is None else stds
    for rows in layout:
        mb = [samples[i] for i in rows]
        totals = [s["tokens"].numel() for s in mb]
        stream = torch.cat([s["tokens"] for s in mb])[None]
        lps, _ = response_log_probs_from_logits(model(stream), [s["tokens"] for s in mb], totals,
                                                [s["resp"] for s in mb])
        groups = SampleGroups([s["group"] for s in mb], [s["size"] for s in mb], [stds[s["group"]] for s in mb])
        out = opob_policy_loss(lps, [s["rollout"] for s in mb], [s["mask"] for s in mb],
                               [s["reward"] for s in mb], Packing.from_lengths(totals).packed_segment_ids(sum(totals)),
                               accumulator=acc, groups=groups, options=options)
        out.loss.backward()
    baseline = acc.finish()
    norms.remove()
    return [p.grad.clone() for p in params], acc, baseline


def reference(model, samples, options):
    params = list(model.parameters())
    scores, log_w, tokens = [], [], []
    for s in samples:
        lp = response_log_probs_from_logits(model(s["tokens"][None]), [s["tokens"]], [s["tokens"].numel()],
                                            [s["resp"]])[0][0]
        scores.append(torch.autograd.grad(-(lp * s["mask"]).sum(), params))
        log_w.append(float(((lp.detach() - s["rollout"]) * s["mask"]).sum()))
        tokens.append(int(s["mask"].sum()))
    return reference_gradient(scores, log_w, tokens, [s["reward"] for s in samples], [s["group"] for s in samples],
                              scope=options.scope, norm_by_std=options.norm_by_std, length_norm=options.length_norm,
                              weights=options.weights, high=options.high), log_w


GROUPS = [3, 3, 2]
LAYOUTS = {  # micro-batches as lists of sample indices (groups: 0-2, 3-5, 6-7)
    "one_group_per_microbatch": [[0, 1, 2], [3, 4, 5], [6, 7]],
    "one_sample_per_microbatch": [[i] for i in range(8)],
    "groups_across_microbatches": [[0, 1], [2], [3], [4, 5], [6, 7]],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("length_norm", [True, False])
@pytest.mark.parametrize("weights", ["released", "paper"])
def test_group_baseline_matches_the_float64_reference(layout, norm_by_std, length_norm, weights):
    model, samples = make_samples(1, GROUPS)
    options = OpobOptions(scope="group", norm_by_std=norm_by_std, length_norm=length_norm, weights=weights, high=HIGH)
    (expected, baselines), log_w = reference(model, samples, options)
    assert any(math.exp(x) > HIGH for x in log_w) and any(math.exp(x) < HIGH for x in log_w)  # TIS exercised
    got, acc, baseline = run_accumulator(model, samples, LAYOUTS[layout], options)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)
    assert [b for b, _ in acc.last_group_baselines] == pytest.approx([baselines[g] for g in range(3)], rel=1e-10)
    assert baseline == pytest.approx(sum(baselines.values()) / 3, rel=1e-10)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("weights", ["released", "paper"])
def test_a_masked_member_is_left_out_of_its_groups_baseline(layout, weights):
    """A member masked out of its group (april_mask_failed_samples: loss mask 0, a placeholder
    reward, its group's std taken without it as vcpo.opob_advantages does): the step's gradient and
    each group's baseline are those of the remaining members only."""
    model, samples = make_samples(2, GROUPS)
    masked = 1  # of group 0
    samples[masked]["mask"] = torch.zeros_like(samples[masked]["mask"])
    samples[masked]["reward"] = 5.0  # far from the others: it would move the baseline and the std
    remaining = [s for i, s in enumerate(samples) if i != masked]
    options = OpobOptions(scope="group", norm_by_std=True, length_norm=True, weights=weights, high=HIGH)
    (expected, baselines), _ = reference(model, remaining, options)
    got, acc, _ = run_accumulator(model, samples, LAYOUTS[layout], options, stds=group_std(remaining))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)
    assert [b for b, _ in acc.last_group_baselines] == pytest.approx([baselines[g] for g in range(3)], rel=1e-10)


@pytest.mark.parametrize("layout", ["packed", "single", "mixed"])
@pytest.mark.parametrize("weights", ["released", "paper"])
@pytest.mark.parametrize("length_norm", [True, False])
def test_global_baseline_matches_the_float64_reference(layout, weights, length_norm):
    model, samples = make_samples(2, GROUPS)
    options = OpobOptions(scope="global", length_norm=length_norm, weights=weights, high=HIGH)
    (expected, baselines), _ = reference(model, samples, options)
    rows = {"packed": [[0, 1, 2, 3], [4, 5, 6, 7]], "single": [[i] for i in range(8)],
            "mixed": [[0], [1, 2, 3], [4], [5], [6, 7]]}[layout]
    got, _, baseline = run_accumulator(model, samples, rows, options)
    assert baseline == pytest.approx(baselines["global"], rel=1e-10)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)


def test_the_options_change_the_gradient():
    """Each option moves the gradient by far more than the tolerance (none is a no-op here)."""
    model, samples = make_samples(3, GROUPS)
    base = OpobOptions(high=HIGH)
    grads = {}
    for name, options in {"released": base, "paper": OpobOptions(weights="paper", high=HIGH),
                          "no_std": OpobOptions(norm_by_std=False, high=HIGH),
                          "summed": OpobOptions(length_norm=False, high=HIGH),
                          "global": OpobOptions(scope="global", high=HIGH)}.items():
        (expected, _), _ = reference(model, samples, options)
        grads[name] = torch.cat([e.reshape(-1) for e in expected])
    for name, g in grads.items():
        if name != "released":
            assert (g - grads["released"]).norm() > 1e-3 * grads["released"].norm(), name


def test_a_group_with_equal_rewards_contributes_nothing():
    """All rewards equal: b_g is that reward, every a_i is 0 (the std is 0: no division)."""
    model, samples = make_samples(4, [3, 3], equal_rewards_group=1)
    options = OpobOptions(high=HIGH)
    only_group_1 = [s for s in samples if s["group"] == 1]
    got, acc, _ = run_accumulator(model, only_group_1, [[0, 1, 2]], options)
    assert acc.last_group_baselines[0][0] == pytest.approx(1.0, rel=1e-12)
    assert max(float(g.abs().max()) for g in got) < 1e-12


def test_released_weights_stay_finite_far_off_policy():
    """Sequence log-weights of hundreds of nats: the released W_i = ||wbar g||^2 w^2 is formed in log
    space, so the baseline is the reward of the most off-policy sample instead of inf/nan."""
    model, samples = make_samples(5, [3])
    samples[1]["rollout"] = samples[1]["rollout"] - 150.0  # w = e^(150 * tokens): far beyond float64
    samples[1]["reward"], samples[0]["reward"], samples[2]["reward"] = 1.0, 0.0, 0.0
    got, acc, _ = run_accumulator(model, samples, [[0, 1, 2]], OpobOptions(high=HIGH))
    assert acc.last_group_baselines[0][0] == pytest.approx(1.0, rel=1e-12)
    assert all(torch.isfinite(g).all() for g in got)


@pytest.mark.parametrize("rows, message", [
    ([[0, 1, 2, 3], [4, 5], [6, 7]], "holds samples of prompt groups \\[0, 1\\]"),
    ([[0, 1], [3], [2], [4, 5], [6, 7]], "prompt group 0 is interrupted after 2 of its 3 samples by group 1"),
])
def test_group_scope_refuses_layouts_it_cannot_fold(rows, message):
    model, samples = make_samples(6, GROUPS)
    with pytest.raises(RuntimeError, match=message):
        run_accumulator(model, samples, rows, OpobOptions(high=HIGH))


def test_a_group_missing_samples_on_this_rank_is_refused_at_the_step_end():
    model, samples = make_samples(7, GROUPS)
    with pytest.raises(RuntimeError, match="prompt group 2 has 1 of its 2 samples .* whole groups on one rank"):
        run_accumulator(model, samples[:7], [[0, 1, 2], [3, 4, 5], [6]], OpobOptions(high=HIGH))


def test_the_timed_variants_compute_the_same_gradients():
    """What scripts/vcpo_overhead.py and scripts/gpu_vcpo_bench.py time: VCPO's two micro-batchings
    give one gradient, and so do the plain loss's (the ratios compare equal work)."""
    from april_workbench.vcpo_timing import CONFIGS, VARIANTS, build

    runner = build(CONFIGS["tiny"], dtype=torch.float64)
    grads = {}
    for variant in VARIANTS:
        runner.prepare(variant)
        runner.step(variant)
        grads[variant] = torch.cat([p.grad.reshape(-1).clone() for p in runner.model.parameters()])
    runner.close()
    torch.testing.assert_close(grads["opob_single"], grads["opob_packed"], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grads["plain_single"], grads["plain"], rtol=1e-9, atol=1e-12)
    assert (grads["opob_packed"] - grads["plain"]).norm() > 1e-3 * grads["plain"].norm()
