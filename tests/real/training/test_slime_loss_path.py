"""Training tier: the plugin's loss hooks inside slime's real data path and loss_function (CPU, gloo).

slime's built-in loss is the reference: with the settings that make the two objectives the same,
the plugin must give slime's loss, metrics and gradients. See slime_cpu.py for what runs and the
test-only adaptations.
"""

import copy

import pytest
import torch

from tests.support.training import slime_cpu as sc

pytestmark = pytest.mark.real

PLUGIN = dict(loss_type="custom_loss", custom_loss_function_path="april_slime.loss.policy_loss",
              april_is_mode="on_policy", april_is_level="token", april_is_correction="none", april_is_low=0.0,
              april_is_high=2.0, april_loss_level="token")
SLIME_KEYS = ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "train_rollout_logprob_abs_diff")


@pytest.fixture(scope="module")
def world():
    with sc.gloo_world():
        yield


def prepared(args, seed=0, perturb=0.5, with_ref=False):
    """Samples through slime's rollout->trainer path, with the recomputed (proximal) log-probs one
    perturbation away from the current policy so that the PPO clip is active."""
    model = sc.TokenwiseLM(seed=seed)
    samples = sc.make_samples(seed=seed, model=model, temperature=args.rollout_temperature)
    data = sc.rollout_to_trainer(args, samples)
    sc.recompute_log_probs(args, model, data, perturb=perturb, seed=seed)
    if with_ref:
        sc.recompute_log_probs(args, model, data, store_prefix="ref_", perturb=0.3, seed=seed + 1)
    return model, data


def run_both(reference_args, plugin_args, **kw):
    model, data = prepared(reference_args, **kw)
    ref_metrics, ref_grads = sc.train_step(reference_args, model, copy.copy(data))
    got_metrics, got_grads = sc.train_step(plugin_args, model, copy.copy(data))
    return ref_metrics, ref_grads, got_metrics, got_grads


def assert_same(ref_metrics, ref_grads, got_metrics, got_grads, keys=SLIME_KEYS):
    for key in keys:
        if key in ref_metrics:
            assert got_metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), key
    for name, g in ref_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


SETTINGS = {
    "grpo": {},
    "clip_higher": dict(eps_clip_high=0.28),
    "dual_clip": dict(eps_clip_c=1.5),
    "entropy": dict(entropy_coef=0.01),
    "kl": dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl"),
    "per_token_loss": dict(calculate_per_token_loss=True),
    "temperature": dict(rollout_temperature=0.7),
    "chunked_log_probs": dict(log_probs_chunk_size=3),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_on_policy_custom_loss_equals_slimes_policy_loss(world, name):
    base = sc.make_args(**SETTINGS[name])
    plugin = sc.make_args(**SETTINGS[name], **PLUGIN)
    ref_m, ref_g, got_m, got_g = run_both(base, plugin, with_ref=name == "kl")
    assert_same(ref_m, ref_g, got_m, got_g)
    if name == "grpo":
        assert 0 < ref_m["pg_clipfrac"] < 1  # the clip is exercised
        # per-token versions crossed slime's data path into the loss (train_metadata patch)
        assert got_m["april/stale1/tokens"] > 0 and got_m["april/trained_frac"] == pytest.approx(1.0)


def test_sequence_level_equals_slimes_gspo(world):
    base = sc.make_args(advantage_estimator="gspo")
    plugin = sc.make_args(advantage_estimator="gspo", **PLUGIN)
    assert_same(*run_both(base, plugin), keys=("loss", "pg_loss", "entropy_loss", "pg_clipfrac"))
    # april_loss_level: sequence is the same objective under GRPO advantages
    base = sc.make_args(advantage_estimator="gspo")
    plugin = sc.make_args(advantage_estimator="grpo", **dict(PLUGIN, april_loss_level="sequence"))
    model, data = prepared(base)
    ref_m, ref_g = sc.train_step(base, model, copy.copy(data))
    got_m, got_g = sc.train_step(plugin, model, copy.copy(data))
    assert_same(ref_m, ref_g, got_m, got_g, keys=("loss", "pg_loss"))


TIS = dict(use_tis=True, custom_tis_function_path="april_slime.loss.tis", april_is_mode="decoupled",
           april_is_level="token", april_is_low=0.8, april_is_high=1.3, april_loss_level="token")


def test_tis_hook_equals_slimes_tis(world):
    base = sc.make_args(use_tis=True, tis_clip_low=0.8, tis_clip=1.3)
    plugin = sc.make_args(**TIS, april_is_correction="truncate")
    ref_m, ref_g, got_m, got_g = run_both(base, plugin, perturb=0.2)
    assert_same(ref_m, ref_g, got_m, got_g)
    assert 0 < ref_m["tis_clipfrac"] < 1 and got_m["april/truncated_frac"] == pytest.approx(ref_m["tis_clipfrac"])
    # staleness from the train_metadata slime passes to the hook (patch)
    assert got_m["april/stale1/tokens"] > 0


def test_tis_hook_mask_mode_equals_slimes_icepop(world):
    base = sc.make_args(use_tis=True, tis_clip_low=0.8, tis_clip=1.3,
                        custom_tis_function_path="slime.backends.megatron_utils.loss.icepop_function")
    plugin = sc.make_args(**TIS, april_is_correction="mask")
    ref_m, ref_g, got_m, got_g = run_both(base, plugin, perturb=0.2)
    # icepop zeroes the rejected tokens' loss and keeps the masks; MIS also removes them from the
    # masks, so slime's reducer leaves them out of the entropy and KL metrics too: loss and
    # gradient are the same, those metrics differ by design
    assert_same(ref_m, ref_g, got_m, got_g, keys=("loss", "pg_loss"))
    assert got_m["april/masked_frac"] == pytest.approx(ref_m["tis_clipfrac"])
