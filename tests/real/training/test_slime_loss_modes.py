"""Training tier: every ``april_is_mode`` of the plugin's custom loss inside slime's real data path
and loss_function (CPU, gloo), on off-policy data as partial rollouts produce it.

The samples carry per-token policy versions (train_metadata) and rollout log-probs that move away
from the current policy the older the version that sampled each token; the recomputed (proximal)
log-probs sit one perturbation away from both. Each mode is compared with what slime computes:

* ``decoupled`` + truncate: slime's policy_loss with ``--use-tis`` (its vanilla TIS function),
* ``decoupled`` + mask: slime's policy_loss with its icepop TIS function,
* ``copris`` without correction: slime's policy_loss with ``--use-rollout-logprobs`` (PPO around
  the rollout log-probs),

and, where slime has no equivalent (copris with TIS/MIS, sequence and geometric levels), with the
float64 reference of docs/loss.md in tests/support/training/reference_loss.py, run through the same slime loss_function.
"""

import copy

import pytest
import torch

from tests.support.training import slime_cpu as sc

pytestmark = pytest.mark.real

PLUGIN = dict(loss_type="custom_loss", custom_loss_function_path="april_slime.loss.policy_loss",
              april_is_level="token", april_loss_level="token")
REFERENCE = dict(PLUGIN, custom_loss_function_path="tests.support.training.reference_loss.policy_loss")
SLIME_KEYS = ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl", "train_rollout_logprob_abs_diff")
BUCKETS = ("stale0", "stale1", "stale2", "stale3+")


@pytest.fixture(scope="module")
def world():
    with sc.gloo_world():
        yield


def prepared(args, recompute=True, seed=0):
    """Stale samples through slime's rollout->trainer path; with ``recompute``, the proximal
    log-probs (slime's compute_log_prob) one perturbation away from the current policy."""
    model = sc.TokenwiseLM(seed=seed)
    data = sc.rollout_to_trainer(args, sc.make_stale_samples(model, seed=seed))
    if recompute:
        sc.recompute_log_probs(args, model, data, perturb=0.2, seed=seed)
    return model, data


def run_both(reference_args, plugin_args, recompute=True):
    model, data = prepared(reference_args, recompute)
    ref = sc.train_step(reference_args, model, copy.copy(data))
    got = sc.train_step(plugin_args, model, copy.copy(data))
    return (*ref, *got)


def assert_same(ref_metrics, ref_grads, got_metrics, got_grads, keys=SLIME_KEYS):
    for key in keys:
        assert key in ref_metrics and key in got_metrics, key
        assert got_metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), key
    for name, g in ref_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def assert_weights_active(metrics):
    """The IS factors are not all 1: their mean over trained samples is not 1 (it stays near 1:
    the rollout log-probs scatter around the current policy's in both directions)."""
    assert abs(metrics["april/is_weight_mean"] / metrics["april/trained_frac"] - 1) > 1e-3


def test_data_is_off_policy_and_more_so_for_older_versions(world):
    """The premise of the comparisons below: every staleness bucket holds tokens (the plugin's
    metrics), and the older a token's version, the further pi_old is from its rollout log-prob."""
    args = sc.make_args(**PLUGIN, april_is_mode="decoupled", april_is_correction="none")
    model, data = prepared(args)
    metrics, _ = sc.train_step(args, model, copy.copy(data))
    for name in BUCKETS:
        assert metrics[f"april/{name}/tokens"] > 0, name
    # per bucket, the mean |log(pi_old / pi_rollout)| grows with staleness
    by_bucket = {name: [] for name in BUCKETS}
    for meta, old, rollout in zip(data["metadata"], data["log_probs"], data["rollout_log_probs"]):
        versions = torch.cat([torch.full((c,), v) for v, c in meta["april_token_versions_rle"]])
        for v, d in zip(versions.tolist(), (old - rollout).abs().tolist()):
            by_bucket[BUCKETS[min(meta["april_policy_version"] - v, 3)]].append(d)
    means = [sum(v) / len(v) for v in by_bucket.values()]
    # (a handful of tokens per bucket: the order is clear between far-apart buckets only)
    assert min(means[2:]) > max(means[:2]) and means[3] > 2 * means[0], means


def test_decoupled_truncate_equals_slimes_tis(world):
    base = sc.make_args(use_tis=True, tis_clip_low=0.8, tis_clip=1.3, entropy_coef=0.01)
    plugin = sc.make_args(**PLUGIN, entropy_coef=0.01, april_is_mode="decoupled", april_is_correction="truncate",
                          april_is_low=0.8, april_is_high=1.3)
    ref_m, ref_g, got_m, got_g = run_both(base, plugin)
    assert_same(ref_m, ref_g, got_m, got_g)
    assert 0 < ref_m["pg_clipfrac"] < 1 and 0 < ref_m["tis_clipfrac"] < 1
    assert got_m["april/truncated_frac"] == pytest.approx(ref_m["tis_clipfrac"], rel=1e-6)
    assert_weights_active(got_m)


def test_decoupled_mask_equals_slimes_icepop(world):
    base = sc.make_args(use_tis=True, tis_clip_low=0.8, tis_clip=1.3,
                        custom_tis_function_path="slime.backends.megatron_utils.loss.icepop_function")
    plugin = sc.make_args(**PLUGIN, april_is_mode="decoupled", april_is_correction="mask", april_is_low=0.8,
                          april_is_high=1.3)
    ref_m, ref_g, got_m, got_g = run_both(base, plugin)
    # icepop zeroes the rejected tokens' loss but keeps them in its masks; MIS also takes them out
    # of pg_clipfrac and the entropy (docs/loss.md): loss and gradient are the same objective
    assert_same(ref_m, ref_g, got_m, got_g, keys=("loss", "pg_loss"))
    assert 0 < ref_m["tis_clipfrac"] < 1
    assert got_m["april/masked_frac"] == pytest.approx(ref_m["tis_clipfrac"], rel=1e-6)
    assert_weights_active(got_m)


@pytest.mark.parametrize("recompute", [False, True], ids=["rollout_logprobs_only", "with_recompute"])
def test_copris_equals_slimes_ppo_around_rollout_log_probs(world, recompute):
    """slime with --use-rollout-logprobs clips around the rollout log-probs: copris without a
    correction. Without the recompute (how a copris job runs) and with it (the proximal
    log-probs in the batch must not become the anchor)."""
    base = sc.make_args(use_rollout_logprobs=True, entropy_coef=0.01)
    plugin = sc.make_args(**PLUGIN, entropy_coef=0.01, april_is_mode="copris", april_is_correction="none",
                          use_rollout_logprobs=not recompute)
    ref_m, ref_g, got_m, got_g = run_both(base, plugin, recompute=recompute)
    # every metric too: ppo_kl from the anchor, and the rollout gap against the current policy
    assert_same(ref_m, ref_g, got_m, got_g, keys=SLIME_KEYS)
    assert ref_m["ppo_kl"] != 0
    assert 0 < ref_m["pg_clipfrac"] < 1


CORRECTED = {
    "copris_token_truncate": dict(april_is_mode="copris", april_is_level="token", april_is_correction="truncate",
                                  april_is_low=0.9, april_is_high=1.1),
    "copris_sequence_truncate": dict(april_is_mode="copris", april_is_level="sequence",
                                     april_is_correction="truncate", april_is_low=0.8, april_is_high=1.15),
    # wider than the PPO clip [0.8, 1.2], so that kept tokens are clipped too
    "copris_token_mask": dict(april_is_mode="copris", april_is_level="token", april_is_correction="mask",
                              april_is_low=0.5, april_is_high=2.0),
    "copris_geometric_mask": dict(april_is_mode="copris", april_is_level="geometric", april_is_correction="mask",
                                  april_is_low=0.95, april_is_high=1.05),
    "decoupled_geometric_truncate": dict(april_is_mode="decoupled", april_is_level="geometric",
                                         april_is_correction="truncate", april_is_low=0.9, april_is_high=1.1),
}


@pytest.mark.parametrize("name", list(CORRECTED))
def test_corrected_modes_equal_the_float64_reference(world, name):
    """The plugin's objective against docs/loss.md's, in float64 (reference_loss.py), both as
    slime's custom loss on the same micro-batches. The data has pi_old != pi_rollout, so a copris
    ratio anchored on the recomputed log-probs instead of the rollout ones fails here."""
    settings = CORRECTED[name]
    ref_m, ref_g, got_m, got_g = run_both(sc.make_args(**{**REFERENCE, **settings}),
                                              sc.make_args(**{**PLUGIN, **settings}))
    assert_same(ref_m, ref_g, got_m, got_g, keys=("loss", "pg_loss", "pg_clipfrac"))
    assert got_m["april/is_weight_mean"] == pytest.approx(ref_m["ref/weight"], rel=1e-5)
    assert got_m["april/truncated_frac"] == pytest.approx(ref_m["ref/truncated"], abs=1e-7)
    assert got_m["april/masked_frac"] == pytest.approx(ref_m["ref/masked"], abs=1e-7)
    changed = ref_m["ref/truncated"] if settings["april_is_correction"] == "truncate" else ref_m["ref/masked"]
    assert 0 < changed < 1 and 0 < ref_m["pg_clipfrac"] < 1
    assert_weights_active(got_m)
    # the per-token versions in train_metadata, bucketed independently of the plugin
    for bucket in BUCKETS:
        for q in ("tokens", "ratio_mass"):
            assert got_m[f"april/{bucket}/{q}"] == pytest.approx(ref_m[f"ref/{bucket}/{q}"], rel=1e-5), (bucket, q)


def test_decoupled_truncate_equals_the_float64_reference(world):
    """The same objective as test_decoupled_truncate_equals_slimes_tis, against the reference,
    so that the reference is itself checked against slime."""
    settings = dict(april_is_mode="decoupled", april_is_correction="truncate", april_is_low=0.8, april_is_high=1.3)
    slime_args = sc.make_args(use_tis=True, tis_clip_low=0.8, tis_clip=1.3)
    ref_m, ref_g, slime_m, slime_g = run_both(sc.make_args(**{**REFERENCE, **settings}), slime_args)
    assert_same(ref_m, ref_g, slime_m, slime_g, keys=("loss", "pg_loss", "pg_clipfrac"))
    assert ref_m["ref/truncated"] == pytest.approx(slime_m["tis_clipfrac"], rel=1e-6)
