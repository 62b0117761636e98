"""slime hooks, driven with micro-batches laid out the way slime's loss_function builds them."""

import math
from argparse import Namespace

import pytest
import torch

from april_slime import loss as april_loss
from april_slime.core.config import AprilConfigError
from april_slime.training import offpolicy as op
from april_slime.training.packed import response_log_probs_from_logits

VOCAB = 13


def make_args(**overrides):
    values = dict(
        eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None, rollout_temperature=0.7, entropy_coef=0.0,
        use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1", use_unbiased_kl=False, advantage_estimator="grpo",
        use_rollout_logprobs=False, use_tis=False, get_mismatch_metrics=False, rollout_top_p=1.0,
        april_is_mode="decoupled", april_is_level="token", april_is_correction="truncate", april_is_low=0.0,
        april_is_high=1.3, april_loss_level="token",
        loss_type="custom_loss", custom_loss_function_path="april_slime.loss.policy_loss",  # as a job names it
    )
    values.update(overrides)
    return Namespace(**values)


def loss_and_gradient(args, batch, logits):
    """The plugin's loss, its metrics and the gradient it puts on ``logits`` (then cleared)."""
    loss, metrics = april_loss.policy_loss(args, batch, logits, reducer_for(batch))
    loss.backward()
    grad = logits.grad.clone()
    logits.grad = None
    return loss, metrics, grad


def direct_objective(batch, logits, **options):
    """The training wing's objective over log-probs taken straight from the definition (slime's
    default clip bounds and temperature, as ``make_args`` sets them)."""
    lp = direct_log_probs(logits, batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"], 0.7)
    flat_lp, packing = op.pack(lp)
    return op.policy_objective(
        flat_lp, torch.cat(batch["log_probs"]), torch.cat(batch["rollout_log_probs"]), torch.cat(batch["advantages"]),
        torch.cat(batch["loss_masks"]), packing, is_high=1.3, eps_clip=0.2, eps_clip_high=0.28, **options)


def direct_log_probs(logits, tokens, total_lengths, response_lengths, temperature):
    """log p(token) one position at a time, straight from the definition."""
    out = []
    offset = 0
    for toks, total, resp in zip(tokens, total_lengths, response_lengths):
        prompt = total - resp
        values = []
        for j in range(resp):
            position = offset + prompt + j - 1  # the logits that predict token prompt + j
            row = logits[0, position] / temperature
            values.append(row[toks[prompt + j]] - torch.logsumexp(row, dim=0))
        out.append(torch.stack(values) if values else logits.new_zeros(0))
        offset += total
    return out


def slime_reducer(response_lengths, loss_masks, denominators):
    """slime's sum_of_sample_mean without context parallelism."""
    def reduce(x):
        return sum((xi * mi).sum() / torch.clamp_min(d, 1)
                   for xi, mi, d in zip(x.split(response_lengths), loss_masks, denominators))
    return reduce


def make_batch(seed=0, prompt_lengths=(3, 2, 4, 1), response_lengths=(5, 1, 6, 4), dtype=torch.float64,
               spread=0.2, drift=0.0):
    g = torch.Generator().manual_seed(seed)
    total_lengths = [p + r for p, r in zip(prompt_lengths, response_lengths)]
    tokens = [torch.randint(VOCAB, (n,), generator=g) for n in total_lengths]
    padded = -(-sum(total_lengths) // 8) * 8  # slime pads the packed stream
    logits = torch.randn(1, padded, VOCAB, generator=g, dtype=dtype).requires_grad_(True)
    current = [lp.detach() for lp in direct_log_probs(logits, tokens, total_lengths, response_lengths, 0.7)]
    old = [c + drift * torch.randn(c.shape, generator=g, dtype=dtype) for c in current]
    rollout = [o + spread * torch.randn(o.shape, generator=g, dtype=dtype) for o in old]
    masks = [(torch.rand(r, generator=g) > 0.2).int() for r in response_lengths]
    masks[1] = torch.ones(response_lengths[1], dtype=torch.int)  # one sample fully kept
    advantages = [torch.full((r,), float(torch.randn(1, generator=g)), dtype=dtype) for r in response_lengths]
    batch = {
        "unconcat_tokens": tokens, "total_lengths": total_lengths, "response_lengths": list(response_lengths),
        "loss_masks": masks, "log_probs": old, "rollout_log_probs": rollout, "advantages": advantages,
        "rollout_mask_sums": [m.sum().to(dtype) for m in masks], "ref_log_probs": None,
    }
    return batch, logits


def reducer_for(batch):
    return slime_reducer(batch["response_lengths"], batch["loss_masks"], batch["rollout_mask_sums"])


# --------------------------------------------------------------------------------- log-probs
def test_logits_path_matches_direct_softmax_with_temperature_and_padding():
    batch, logits = make_batch(seed=1)
    lps, ents = response_log_probs_from_logits(
        logits, batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"], temperature=0.7,
        with_entropy=True)
    expected = direct_log_probs(logits, batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"],
                                0.7)
    for got, exp in zip(lps, expected):
        torch.testing.assert_close(got, exp)
    row = logits[0, batch["total_lengths"][0] - 1 - 1] / 0.7  # last response token of sample 0
    p = torch.softmax(row, 0)
    torch.testing.assert_close(ents[0][-1], -(p * p.log()).sum())
    with pytest.raises(ValueError, match="positions"):
        response_log_probs_from_logits(logits[:, :5], batch["unconcat_tokens"], batch["total_lengths"],
                                                  batch["response_lengths"])


# -------------------------------------------------------------------------------- custom loss
@pytest.mark.parametrize("mode,level,correction,estimator", [
    ("on_policy", "token", "none", "grpo"),
    ("decoupled", "token", "truncate", "grpo"),
    ("decoupled", "sequence", "mask", "grpo"),
    ("decoupled", "geometric", "truncate", "gspo"),
    ("copris", "token", "none", "grpo"),
    ("copris", "geometric", "mask", "grpo"),
    ("copris", "token", "truncate", "gspo"),
])
def test_policy_loss_equals_direct_objective_and_gradient(mode, level, correction, estimator):
    batch, logits = make_batch(seed=2, drift=0.05)
    args = make_args(april_is_mode=mode, april_is_level=level, april_is_correction=correction,
                     advantage_estimator=estimator, april_is_low=0.8)
    loss, metrics, grad = loss_and_gradient(args, batch, logits)
    obj = direct_objective(batch, logits, mode=mode, is_level=level, correction=correction, is_low=0.8,
                           loss_level="sequence" if estimator == "gspo" else "token")
    expected = reducer_for(batch)(obj.loss)
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach())
    torch.testing.assert_close(grad, logits.grad)
    assert metrics["pg_loss"].item() == pytest.approx(expected.item())


def test_metrics_follow_slimes_contract_and_keys_are_stable():
    args = make_args(april_is_mode="copris", april_is_correction="mask")
    keys = None
    for seed in (3, 4):
        batch, logits = make_batch(seed=seed, prompt_lengths=(2, 5), response_lengths=(3 + seed, 2))
        _, metrics = april_loss.policy_loss(args, batch, logits, reducer_for(batch))
        for key, value in metrics.items():
            assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad, key
            assert value.dtype == torch.float32 and math.isfinite(value.item()), key
        keys = keys or list(metrics)
        assert list(metrics) == keys  # slime sums the value vectors of every micro-batch position-wise
    # slime packs them exactly like this
    torch.tensor([0] + list(metrics.values()))
    for key in ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl", "train_rollout_logprob_abs_diff",
                "april/ratio_mean", "april/ratio_max", "april/is_weight_mean", "april/truncated_frac",
                "april/masked_frac", "april/behaviour_ratio_mean", "april/seq_weight", "april/seq_weight_sq",
                "april/ess_ratio_microbatch"):
        assert key in metrics
    assert not any(k.startswith("april/stale") for k in metrics)  # no versions in the batch


def test_metric_values_against_hand_computation():
    batch, logits = make_batch(seed=5, spread=0.5)
    reduce = reducer_for(batch)
    args = make_args(april_is_mode="decoupled", april_is_level="sequence", april_is_correction="mask",
                     april_is_low=0.5, april_is_high=1.5)
    _, metrics = april_loss.policy_loss(args, batch, logits, reduce)
    n = len(batch["response_lengths"])
    seq_lw = [((o - r) * m).sum() for o, r, m in zip(batch["log_probs"], batch["rollout_log_probs"],
                                                      batch["loss_masks"])]
    seq_w = [math.exp(x) for x in seq_lw]
    assert metrics["april/seq_weight"].item() == pytest.approx(sum(seq_w), rel=1e-5)
    assert metrics["april/seq_weight_sq"].item() == pytest.approx(sum(w * w for w in seq_w), rel=1e-5)
    ess_ratio = sum(seq_w) ** 2 / sum(w * w for w in seq_w) / n
    assert metrics["april/ess_ratio_microbatch"].item() == pytest.approx(ess_ratio * n, rel=1e-5)
    masked = sum(1.0 for w in seq_w if not 0.5 <= w <= 1.5)
    assert metrics["april/masked_frac"].item() == pytest.approx(masked, rel=1e-6)
    # the current policy equals the recomputed one here, so the clip ratio is exactly 1
    assert metrics["april/ratio_mean"].item() == pytest.approx(n)


def test_staleness_metrics_from_train_metadata():
    batch, logits = make_batch(seed=6, prompt_lengths=(2, 2), response_lengths=(4, 3))
    batch["loss_masks"] = [torch.ones(4, dtype=torch.int), torch.ones(3, dtype=torch.int)]
    batch["rollout_mask_sums"] = [torch.tensor(4.0, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64)]
    batch["metadata"] = [
        {"april_token_versions_rle": [[5, 1], [6, 2], [7, 1]], "april_policy_version": 7},
        {"april_token_versions_rle": [[3, 3]], "april_policy_version": 7},
    ]
    _, metrics = april_loss.policy_loss(make_args(), batch, logits, reducer_for(batch))
    # sample means: sample 0 staleness [2, 1, 1, 0], sample 1 staleness [4, 4, 4]
    assert metrics["april/offpolicy_token_frac"].item() == pytest.approx(3 / 4 + 1)
    assert metrics["april/staleness_mean"].item() == pytest.approx(1.0 + 4.0)
    assert metrics["april/stale0/tokens"].item() == pytest.approx(1 / 4)
    assert metrics["april/stale1/tokens"].item() == pytest.approx(2 / 4)
    assert metrics["april/stale2/tokens"].item() == pytest.approx(1 / 4)
    assert metrics["april/stale3+/tokens"].item() == pytest.approx(1.0)
    ratio0 = torch.exp(batch["log_probs"][0] - batch["rollout_log_probs"][0])
    assert metrics["april/stale1/ratio_mass"].item() == pytest.approx(float(ratio0[1:3].sum() / 4), rel=1e-5)

    # reference version missing: the newest version in the micro-batch (7) is used instead
    for m in batch["metadata"]:
        del m["april_policy_version"]
    _, metrics2 = april_loss.policy_loss(make_args(), batch, logits, reducer_for(batch))
    assert metrics2["april/staleness_mean"].item() == pytest.approx(metrics["april/staleness_mean"].item())

    # the direct key wins and a sample without versions is simply not counted
    batch["april_token_versions_rle"] = [[[7, 4]], None]
    _, metrics3 = april_loss.policy_loss(make_args(), batch, logits, reducer_for(batch))
    assert metrics3["april/offpolicy_token_frac"].item() == 0.0
    assert metrics3["april/stale0/tokens"].item() == pytest.approx(1.0)

    batch["april_token_versions_rle"] = [[[7, 3]], None]
    with pytest.raises(ValueError, match="sample 0: april_token_versions_rle"):
        april_loss.policy_loss(make_args(), batch, logits, reducer_for(batch))


def test_entropy_and_kl_terms():
    batch, logits = make_batch(seed=7)
    batch["ref_log_probs"] = [lp - 0.1 for lp in batch["log_probs"]]
    args = make_args(april_is_mode="on_policy", april_is_correction="none", entropy_coef=0.01, use_kl_loss=True,
                     kl_loss_coef=0.5, kl_loss_type="k3")
    reduce = reducer_for(batch)
    loss, metrics = april_loss.policy_loss(args, batch, logits, reduce)
    lps, ents = response_log_probs_from_logits(
        logits, batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"], 0.7, with_entropy=True)
    flat = torch.cat(lps)
    kl = op.approx_kl(flat, torch.cat(batch["ref_log_probs"]), "k3")
    expected = metrics["pg_loss"] - 0.01 * reduce(torch.cat(ents)) + 0.5 * reduce(kl)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["kl_loss"].item() == pytest.approx(reduce(kl).item(), rel=1e-5)


def test_copris_without_recomputed_log_probs_uses_the_current_policy():
    batch, logits = make_batch(seed=8)
    batch["log_probs"] = None  # --use-rollout-logprobs: slime skips the recompute
    args = make_args(april_is_mode="copris", april_is_correction="none", use_rollout_logprobs=True)
    loss, metrics = april_loss.policy_loss(args, batch, logits, reducer_for(batch))
    assert torch.isfinite(loss)
    # as slime reports it with --use-rollout-logprobs: from the anchor, the rollout log-probs
    current = direct_log_probs(logits, batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"],
                               args.rollout_temperature)
    reduce = reducer_for(batch)
    rollout = torch.cat(batch["rollout_log_probs"])
    expected_kl = reduce(rollout - torch.cat(current))
    assert metrics["ppo_kl"].item() == pytest.approx(expected_kl.item(), rel=1e-5) and expected_kl.item() != 0.0
    expected_gap = reduce((torch.cat(current) - rollout).abs())
    assert metrics["train_rollout_logprob_abs_diff"].item() == pytest.approx(expected_gap.item(), rel=1e-5)


def test_configuration_errors_are_clear():
    batch, logits = make_batch(seed=9)
    no_old = dict(batch, log_probs=None)
    with pytest.raises(AprilConfigError, match="decoupled with april_prox_log_probs: recompute needs"):
        april_loss.policy_loss(make_args(april_prox_log_probs="recompute"), no_old, logits, reducer_for(batch))
    two_steps = dict(rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=4)
    with pytest.raises(AprilConfigError, match="2 optimizer steps per rollout needs the proximal.*loglinear"):
        april_loss.policy_loss(make_args(**two_steps), no_old, logits, reducer_for(batch))
    no_rollout = dict(batch, rollout_log_probs=None)
    with pytest.raises(AprilConfigError, match="copris needs rollout log-probs"):
        april_loss.policy_loss(make_args(april_is_mode="copris"), no_rollout, logits, reducer_for(batch))
    with pytest.raises(AprilConfigError, match="CISPO"):
        april_loss.policy_loss(make_args(advantage_estimator="cispo"), batch, logits, reducer_for(batch))
    with pytest.raises(AprilConfigError, match="april_is_correction"):
        april_loss.config_for(make_args(april_is_correction="clip"))
    bad = dict(batch, rollout_log_probs=[r.clone() for r in batch["rollout_log_probs"]])
    bad["rollout_log_probs"][2][0] = float("nan")
    bad["loss_masks"] = [m.clone() for m in batch["loss_masks"]]
    bad["loss_masks"][2][0] = 1
    with pytest.raises(op.NonFiniteLogProbError, match="sample 2, token 0"):
        april_loss.policy_loss(make_args(), bad, logits, reducer_for(bad))


def test_config_is_built_once_per_args_object():
    args = make_args()
    assert april_loss.config_for(args) is april_loss.config_for(args)
    assert april_loss.config_for(make_args()) is not april_loss.config_for(args)


# ------------------------------------------------------------------------------------ TIS hook
def tis_inputs(seed=10):
    batch, _ = make_batch(seed=seed, spread=0.4)
    pg_loss = torch.randn(sum(batch["response_lengths"]), dtype=torch.float64)
    return batch, pg_loss


def call_tis(args, batch, pg_loss):
    return april_loss.tis(args, pg_loss=pg_loss, train_log_probs=batch["log_probs"],
                          rollout_log_probs=batch["rollout_log_probs"], loss_masks=batch["loss_masks"],
                          total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"])


def test_tis_hook_truncates_decoupled_weights_per_token():
    batch, pg_loss = tis_inputs()
    args = make_args(use_tis=True, april_is_low=0.9, april_is_high=1.2)
    new_loss, masks, metrics = call_tis(args, batch, pg_loss)
    mask = torch.cat(batch["loss_masks"]).bool()
    w = torch.exp(torch.cat(batch["log_probs"]) - torch.cat(batch["rollout_log_probs"])).clamp(0.9, 1.2)
    torch.testing.assert_close(new_loss[mask], (pg_loss * w)[mask])
    assert masks is batch["loss_masks"]
    for key, value in metrics.items():
        assert value.shape == pg_loss.shape and not value.requires_grad, key
    assert metrics["april/truncated_frac"][mask].sum() > 0


def test_tis_hook_masking_at_sequence_level_drops_whole_samples():
    batch, pg_loss = tis_inputs(seed=10)  # sequence weights 3.14, 1.1, 0.35, 1.14
    args = make_args(use_tis=True, april_is_level="sequence", april_is_correction="mask", april_is_low=0.5,
                     april_is_high=1.5)
    new_loss, masks, _ = call_tis(args, batch, pg_loss)
    for i, (o, r, m, new_m) in enumerate(zip(batch["log_probs"], batch["rollout_log_probs"], batch["loss_masks"],
                                             masks)):
        w = math.exp(float(((o - r) * m).sum()))
        inside = 0.5 <= w <= 1.5
        assert torch.equal(new_m, m if inside else torch.zeros_like(m)), i
        assert new_m.dtype == m.dtype
    assert [bool(m.any()) for m in masks] == [False, True, False, True]
    mask = torch.cat(masks).bool()
    w = torch.cat([torch.exp(((o - r) * m).sum()).expand(len(m)) for o, r, m in
                   zip(batch["log_probs"], batch["rollout_log_probs"], batch["loss_masks"])])
    torch.testing.assert_close(new_loss[mask], (pg_loss * w)[mask])


def test_tis_hook_without_use_tis_only_reports_metrics():
    batch, pg_loss = tis_inputs(seed=12)
    args = make_args(april_is_mode="copris", get_mismatch_metrics=True, use_rollout_logprobs=True)
    new_loss, masks, metrics = call_tis(args, batch, pg_loss)
    assert new_loss is pg_loss and masks is batch["loss_masks"]
    assert "april/ess_ratio_microbatch" in metrics


@pytest.mark.parametrize("mode", ["copris", "on_policy"])
def test_tis_hook_refuses_modes_it_cannot_express(mode):
    batch, pg_loss = tis_inputs(seed=13)
    with pytest.raises(AprilConfigError, match="TIS hook implements decoupled"):
        call_tis(make_args(use_tis=True, april_is_mode=mode), batch, pg_loss)


# ------------------------------------------------------------------------ defects of issue 8
def test_clip_fraction_counts_only_tokens_the_mask_keeps():
    # copris + MIS at [0.8, 1.25]: every kept token has its ratio inside the PPO clip range
    # [0.8, 1.28], so nothing that enters the loss is clipped; removed tokens must not count
    batch, logits = make_batch(seed=21, spread=0.6)
    args = make_args(april_is_mode="copris", april_is_correction="mask", april_is_low=0.8, april_is_high=1.25)
    _, metrics = april_loss.policy_loss(args, batch, logits, reducer_for(batch))
    assert metrics["april/masked_frac"].item() > 0.5  # the mask did remove tokens
    assert metrics["pg_clipfrac"].item() == 0.0


@pytest.mark.parametrize("key", ["rollout_log_probs", "log_probs", "advantages", "loss_masks"])
def test_per_sample_lengths_are_checked_and_the_sample_named(key):
    batch, logits = make_batch(seed=22)
    # sample 0 one token short, sample 2 one token long: the total still matches
    shifted = list(batch[key])
    shifted[0], shifted[2] = shifted[0][:-1], torch.cat([shifted[2], shifted[2][-1:]])
    bad = dict(batch, **{key: shifted})
    with pytest.raises(ValueError, match=f"sample 0: {key} has shape"):
        april_loss.policy_loss(make_args(april_is_mode="copris"), bad, logits, reducer_for(batch))


@pytest.mark.parametrize("key", ["rollout_log_probs", "log_probs", "loss_masks"])
def test_tis_hook_checks_per_sample_lengths(key):
    batch, pg_loss = tis_inputs(seed=23)
    shifted = list(batch[key])
    shifted[1], shifted[3] = torch.cat([shifted[1], shifted[1]]), shifted[3][:-1]
    bad = dict(batch, **{key: shifted})
    name = "train_log_probs" if key == "log_probs" else key
    with pytest.raises(ValueError, match=f"sample 1: {name} has shape"):
        call_tis(make_args(use_tis=True), bad, pg_loss)


def test_metrics_are_exact_under_slimes_per_sample_count_reduction():
    # 8 samples, one removed (all-zero loss mask, as slime writes for remove_sample); slime sums
    # every metric over the step and divides by the sample count 8
    batch, logits = make_batch(seed=24, prompt_lengths=(2,) * 8, response_lengths=(3, 5, 2, 4, 6, 3, 4, 5),
                               spread=0.5)
    batch["loss_masks"][5] = torch.zeros_like(batch["loss_masks"][5])
    batch["rollout_mask_sums"] = [m.sum().to(torch.float64) for m in batch["loss_masks"]]
    n = 8

    _, metrics = april_loss.policy_loss(make_args(april_is_mode="on_policy", april_is_correction="none"), batch,
                                        logits, reducer_for(batch))
    logged = {k: v.item() / n for k, v in metrics.items()}
    assert logged["april/trained_frac"] == pytest.approx(7 / 8)
    assert logged["april/is_weight_mean"] / logged["april/trained_frac"] == pytest.approx(1.0)

    seq_w = torch.tensor([math.exp(float(((o - r) * m).sum())) for o, r, m in
                          zip(batch["log_probs"], batch["rollout_log_probs"], batch["loss_masks"]) if m.any()],
                         dtype=torch.float64)
    true_ess_ratio = float(seq_w.sum() ** 2 / seq_w.square().sum() / seq_w.numel())
    from_metrics = logged["april/seq_weight"] ** 2 / (logged["april/trained_frac"] * logged["april/seq_weight_sq"])
    assert from_metrics == pytest.approx(true_ess_ratio, rel=1e-6)


def test_metrics_are_exact_under_slimes_per_token_count_reduction():
    """--calculate-per-token-loss: slime sums the metrics as plain token sums and divides by its token
    count, in which a sample without a trained token counts as one token. The per-sample metrics sit
    on one token per sample, so trained_frac and the ESS formula still read the step's samples; the
    new metrics are the k3 KL(rollout || train) and the token-weight quantiles."""
    batch, logits = make_batch(seed=24, prompt_lengths=(2,) * 8, response_lengths=(3, 5, 2, 4, 6, 3, 4, 5),
                               spread=0.9)
    batch["loss_masks"][5] = torch.zeros_like(batch["loss_masks"][5])
    masks = batch["loss_masks"]
    tokens = sum(max(int(m.sum()), 1) for m in masks)  # slime's loss_function count

    def token_sum(x):
        return sum((xi * mi).sum() for xi, mi in zip(x.split(batch["response_lengths"]), masks))

    args = make_args(april_is_mode="on_policy", april_is_correction="none", calculate_per_token_loss=True)
    _, metrics = april_loss.policy_loss(args, batch, logits, token_sum)
    logged = {k: v.item() / tokens for k, v in metrics.items()}
    assert logged["april/trained_frac"] == pytest.approx(7 / tokens)
    seq_w = torch.tensor([math.exp(float(((o - r) * m).sum())) for o, r, m in
                          zip(batch["log_probs"], batch["rollout_log_probs"], masks) if m.any()], dtype=torch.float64)
    true_ess_ratio = float(seq_w.sum() ** 2 / seq_w.square().sum() / seq_w.numel())
    from_metrics = logged["april/seq_weight"] ** 2 / (logged["april/trained_frac"] * logged["april/seq_weight_sq"])
    assert from_metrics == pytest.approx(true_ess_ratio, rel=1e-6) and true_ess_ratio < 0.9
    # the token-weighted reading of the same sums (each sample weighted by its tokens) is told apart
    lengths = torch.tensor([float(m.sum()) for m in masks if m.any()], dtype=torch.float64)
    token_weighted = float((lengths * seq_w).sum() ** 2 / (lengths.sum() * (lengths * seq_w.square()).sum()))
    assert abs(token_weighted - true_ess_ratio) > 1e-3

    current = direct_log_probs(logits, batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"],
                               0.7)
    r = [(c.detach() - rl).exp() for c, rl in zip(current, batch["rollout_log_probs"])]
    k3 = sum(float(((ri - 1 - ri.log()) * m).sum()) for ri, m in zip(r, masks)) / tokens
    assert logged["april/kl_rollout_train_k3"] == pytest.approx(k3, rel=1e-6) and k3 > 0
    trained = torch.cat([(o - rl)[m.bool()] for o, rl, m in zip(batch["log_probs"], batch["rollout_log_probs"], masks)])
    trained_tokens = sum(int(m.sum()) for m in masks)
    for q in (0.05, 0.5, 0.95, 0.99):
        expected = math.exp(float(torch.quantile(trained, q))) * trained_tokens / tokens
        assert logged[f"april/is_weight_q{round(q * 100):02d}"] == pytest.approx(expected, rel=1e-6)


def test_tis_hook_reports_staleness_from_the_train_metadata_slime_passes():
    batch, pg_loss = tis_inputs(seed=25)
    metadata = [{"april_token_versions_rle": [[4, n - 1], [5, 1]], "april_policy_version": 5}
                for n in batch["response_lengths"]]
    _, _, metrics = april_loss.tis(
        make_args(use_tis=True), pg_loss=pg_loss, train_log_probs=batch["log_probs"],
        rollout_log_probs=batch["rollout_log_probs"], loss_masks=batch["loss_masks"],
        total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"], train_metadata=metadata)
    reduce = reducer_for(batch)
    kept_stale = [float((m[:-1]).sum() / max(int(m.sum()), 1)) for m in batch["loss_masks"]]
    assert reduce(metrics["april/offpolicy_token_frac"]).item() == pytest.approx(sum(kept_stale))
    assert reduce(metrics["april/stale1/tokens"]).item() == pytest.approx(sum(kept_stale))
    assert "april/stale0/ratio_mass" in metrics


@pytest.mark.parametrize("weight", [0.0, 0.25])
def test_stale_tokens_are_masked_or_down_weighted_exactly(weight):
    """april_stale_token_lag 1: tokens more than one version behind their sample's policy version
    get ``weight`` in the policy loss (after the IS correction); loss, gradient and the
    stale_token_frac metric equal a float64 reference built token by token."""
    batch, logits = make_batch(seed=7, prompt_lengths=(2, 3, 1), response_lengths=(4, 3, 5), drift=0.05)
    versions = [[[5, 1], [6, 2], [7, 1]], [[3, 3]], [[7, 5]]]
    batch["metadata"] = [{"april_token_versions_rle": v, "april_policy_version": 7} for v in versions]
    args = make_args(april_stale_token_lag=1, april_stale_token_weight=weight)
    loss, metrics, grad = loss_and_gradient(args, batch, logits)
    obj = direct_objective(batch, logits, mode="decoupled", is_level="token", correction="truncate", is_low=0.0)
    lags = [7 - v for runs in versions for v, n in runs for _ in range(n)]
    w = torch.tensor([weight if lag > 1 else 1.0 for lag in lags], dtype=torch.float64)
    expected = reducer_for(batch)(obj.loss * w)
    expected.backward()
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, logits.grad, rtol=0, atol=1e-12)
    stale = torch.tensor([float(lag > 1) for lag in lags], dtype=torch.float64)
    assert metrics["april/stale_token_frac"].item() == pytest.approx(reducer_for(batch)(stale).item())
    assert reducer_for(batch)(stale).item() > 0
    # off by default: the same batch without the setting trains the old tokens at full weight
    off, off_metrics = april_loss.policy_loss(make_args(), batch, logits, reducer_for(batch))
    torch.testing.assert_close(off.detach(), reducer_for(batch)(obj.loss).detach(), rtol=0, atol=1e-12)
    assert "april/stale_token_frac" not in off_metrics


def test_stale_token_lag_without_versions_is_a_clear_error():
    batch, logits = make_batch(seed=8)
    with pytest.raises(ValueError, match="april_stale_token_lag needs the per-token versions"):
        april_loss.policy_loss(make_args(april_stale_token_lag=2), batch, logits, reducer_for(batch))
    with pytest.raises(AprilConfigError, match="april_stale_token_weight: must be in"):
        april_loss.policy_loss(make_args(april_stale_token_lag=2, april_stale_token_weight=1.5), batch, logits,
                               reducer_for(batch))


# ----------------------------------------------------------------------- masked tokens' values
def _with_masked_values(batch, value):
    """The batch with ``value`` in the rollout and proximal log-probs of every loss-masked token."""
    out = dict(batch)
    for key in ("rollout_log_probs", "log_probs"):
        out[key] = [torch.where(m.bool(), x, torch.full_like(x, value))
                    for x, m in zip(batch[key], batch["loss_masks"])]
    return out


@pytest.mark.parametrize("mode", ["copris", "decoupled"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_metrics_ignore_the_values_of_loss_masked_tokens(mode, value):
    """A NaN or inf log-prob at a token the loss mask drops (an engine's placeholder at a tool
    token, say) changes neither the loss nor any logged metric: slime's reduction multiplies by the
    mask, and NaN times 0 is NaN, so masked values must be left out, not multiplied away."""
    batch, logits = make_batch(seed=12, spread=0.4)
    assert any(not bool(m.all()) for m in batch["loss_masks"])  # some tokens are masked
    args = make_args(april_is_mode=mode)
    finite = _with_masked_values(batch, -3.0)
    loss, metrics = april_loss.policy_loss(args, finite, logits, reducer_for(batch))
    loss_bad, metrics_bad = april_loss.policy_loss(args, _with_masked_values(batch, value), logits,
                                                   reducer_for(batch))
    assert torch.isfinite(loss_bad) and loss_bad.item() == pytest.approx(loss.item(), rel=1e-12)
    assert metrics_bad.keys() == metrics.keys()
    for key, got in metrics_bad.items():
        assert math.isfinite(got.item()), key
        assert got.item() == pytest.approx(metrics[key].item(), rel=1e-6, abs=1e-9), key


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_tis_hook_metrics_ignore_the_values_of_loss_masked_tokens(value):
    batch, pg_loss = tis_inputs(seed=13)
    args = make_args(use_tis=True)
    reduce = reducer_for(batch)
    _, _, metrics = call_tis(args, _with_masked_values(batch, -3.0), pg_loss)
    _, _, metrics_bad = call_tis(args, _with_masked_values(batch, value), pg_loss)
    for key, got in metrics_bad.items():
        got, want = reduce(got).item(), reduce(metrics[key]).item()
        assert math.isfinite(got), key
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9), key
