"""Training tier: slime's real ``train_one_step`` (slime/backends/megatron_utils/model.py) drives
the plugin, with Megatron's DistributedDataParallel, Megatron's optimizer and scheduler (CPU,
gloo, one process).

What runs is slime's and Megatron's own code: train_one_step (gradient buffers zeroed, the
``--custom-megatron-before-train-step-hook-path`` hook, get_batch with the keys train_one_step
itself forwards, loss_function, Megatron's forward_backward_no_pipelining and
finalize_model_grads, optimizer.step, scheduler.step), get_megatron_optimizer and
OptimizerParamScheduler. Stand-ins, each for one piece that cannot run here:

* Megatron-LM's ``megatron.training`` package is not part of megatron-core and is not installed:
  slime's model.py imports four names from it, of which train_one_step calls only ``get_args``;
  it answers the test's args (slime_cpu.slime_model_module).
* Megatron's DDP buffers, optimizer and gradient-norm helpers create tensors on ``"cuda"``; inside
  those modules only they are created on the CPU (megatron_cpu.ddp_and_optimizer_on_cpu).
* Megatron's DistributedOptimizer refuses parameters that are not ``torch.cuda.*Tensor``: the
  optimizer is the one get_megatron_optimizer builds without ``--use-distributed-optimizer``
  (FP32Optimizer in a ChainedOptimizer). The hook only uses the optimizer's ``step`` and
  ``param_groups``, which both expose.
* The model is slime_cpu's token-wise model behind GPTModel's keyword interface.

The last tests run slime's trainer actor around it (``MegatronTrainRayActor.train_actor``: the
log-prob recompute decision, the advantages, every step of the rollout, slime's log lines).
"""

import copy
import math

import pytest
import torch

from april_slime import vcpo
from tests.support.training import megatron_cpu, reference_loss
from tests.support.training import slime_cpu as sc
from tests.support.training.opob_reference import reference_gradient

pytestmark = pytest.mark.real

HOOK = "april_slime.vcpo.before_train_step"
# copris with --use-rollout-logprobs: no log-prob recompute is needed before the step
COPRIS = dict(loss_type="custom_loss", custom_loss_function_path="april_slime.loss.policy_loss",
              april_is_mode="copris", april_is_level="token", april_is_correction="truncate", april_is_low=0.0,
              april_is_high=2.0, april_loss_level="token", use_rollout_logprobs=True)


@pytest.fixture(scope="module")
def world():
    with sc.gloo_world(), megatron_cpu.ddp_and_optimizer_on_cpu():
        yield


@pytest.fixture(autouse=True)
def fresh_vcpo_runtime():
    vcpo.reset_runtime()
    yield
    vcpo.reset_runtime()


def one_step(args, optimizer="sgd", lr=0.1, seed=0, drift=0.25):
    """A fresh model and its stale samples through slime's data path, then one train_one_step.
    Returns (samples, the model before the step, {name: parameter change}, metrics, optimizer)."""
    model = sc.GPTLikeLM(seed=seed)
    before = copy.deepcopy(model)
    samples = sc.make_stale_samples(model, seed=seed, drift=drift)
    ddp, megatron_optimizer, scheduler = sc.megatron_trainer(model, optimizer, lr)
    data = sc.rollout_to_trainer(args, samples)
    metrics, _ = sc.train_one_step(args, ddp, megatron_optimizer, scheduler, data)
    old = dict(before.named_parameters())
    delta = {n: (p.detach() - old[n].detach()).double() for n, p in model.named_parameters()}
    return samples, before, delta, metrics, megatron_optimizer


def assert_update_close(got, expected, model, name, rtol=1e-5):
    """An update read as the difference of two float32 parameters is exact up to one rounding of
    each: an absolute error of about eps * |parameter| (2 eps allowed), on top of the relative
    error of the float32 step itself."""
    atol = 2 * torch.finfo(torch.float32).eps * float(dict(model.named_parameters())[name].abs().max())
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=name)


def sequence_log_probs(model, sample):
    """sum_t m_t log pi(y_t) of the sample's response, float64, with the graph to the parameters."""
    tokens = torch.tensor(sample.tokens)
    prompt = len(sample.tokens) - sample.response_length
    lp = torch.log_softmax(model(tokens)[prompt - 1:-1], -1).gather(-1, tokens[prompt:, None])[:, 0]
    return (lp * torch.tensor(sample.loss_mask, dtype=lp.dtype)).sum()


def rollout_sum(sample):
    """sum_t m_t log mu(y_t), with the rollout log-probs rounded to float32 as slime's trainer holds them."""
    rollout = torch.tensor(sample.rollout_log_probs, dtype=torch.float32).double()
    return (rollout * torch.tensor(sample.loss_mask, dtype=torch.float64)).sum()


def test_train_one_step_hands_each_samples_metadata_to_the_loss(world):
    """Per-sample train_metadata reaches the custom loss through train_one_step's own batch keys
    (the train_one_step hunk of patches/slime-forward-train-metadata.patch), with its sample."""
    reference_loss.RECORDED.clear()
    recording = "tests.support.training.reference_loss.recording_policy_loss"
    args = sc.make_args(**dict(COPRIS, custom_loss_function_path=recording))
    samples, *_, metrics, _ = one_step(args)
    seen = []
    for microbatch in reference_loss.RECORDED:
        assert microbatch["metadata"] is not None, "train_one_step did not forward the metadata"
        for meta, tokens in zip(microbatch["metadata"], microbatch["tokens"], strict=True):
            assert tokens == samples[meta["sample"]].tokens
            assert meta == samples[meta["sample"]].train_metadata
            seen.append(meta["sample"])
    assert sorted(seen) == list(range(len(samples)))
    # and the plugin's staleness metrics came out of slime's metric reduction
    for bucket in ("stale0", "stale1", "stale2", "stale3+"):
        assert metrics[f"april/{bucket}/tokens"] > 0, bucket


def test_slimes_rollout_logging_skips_the_metadata(world):
    """slime's trainer logs every rollout field before training (log_rollout_data); the
    per-sample metadata dicts must be left out of its sums, not break them (train_metric_utils hunk)."""
    from slime.observability import train_metric_utils

    args = sc.make_args(**COPRIS)
    data = sc.rollout_to_trainer(args, sc.make_stale_samples(sc.TokenwiseLM(seed=0)))
    assert all(m["sample"] == int(i) for m, i in zip(data["metadata"], data["sample_indices"]))
    train_metric_utils.log_rollout_data(0, args, data)


def test_ess_lr_scale_reaches_megatrons_parameter_update(world):
    """The same step with and without VCPO's ESS learning-rate scaling. With Adam's first step the
    update is -lr * g / (|g| + eps) elementwise: it scales with the lr and not with the gradient,
    so only a scaled lr (not a scaled loss) moves the parameters by the factor."""
    plain = sc.make_args(**COPRIS)
    scaled = sc.make_args(**COPRIS, custom_megatron_before_train_step_hook_path=HOOK, april_vcpo_lr_scaling=True,
                          april_vcpo_rho_on=1.0)
    # rollout log-probs far enough from the current policy for an ESS well below 1
    samples, before, delta_plain, _, _ = one_step(plain, optimizer="adam", lr=1e-2, drift=0.8)
    _, _, delta_scaled, _, optimizer = one_step(scaled, optimizer="adam", lr=1e-2, drift=0.8)
    rt = vcpo.runtime()
    assert rt is not None and optimizer.step._vcpo_runtime is rt  # the hook wrapped Megatron's optimizer

    # the ESS of the step's unclipped sequence weights pi_theta / pi_rollout, float64, from the samples
    model = before.double()
    with torch.no_grad():
        w = torch.stack([(sequence_log_probs(model, s) - rollout_sum(s)).exp() for s in samples])
    ess_ratio = float(w.sum() ** 2 / (len(w) * w.square().sum()))
    factor = math.sqrt(ess_ratio / 1.0)  # rho_on = 1, inside [scale_min, scale_max] = [0, 1]
    assert factor < 0.95
    assert rt.lr_scaler.last_ess_ratio == pytest.approx(ess_ratio, rel=1e-5)
    assert rt.lr_scaler.last_scale == pytest.approx(factor, rel=1e-5)
    for name, d in delta_plain.items():
        assert d.abs().max() > 1e-3, name
        assert_update_close(delta_scaled[name], factor * d, before, name)
    # the scaled lr is put back: the schedule's value is what the next step starts from
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-2] * len(optimizer.param_groups))


@pytest.mark.parametrize("micro_batch_size", [3, 1])
def test_optimal_baseline_runs_in_slimes_train_step(world, micro_batch_size):
    """VCPO's off-policy optimal baseline through slime, as the released runs use it (one baseline per
    prompt group, std-normalised, per-trajectory length normalisation, the released weights): the raw
    rewards from vcpo.opob_advantages (slime's custom advantage slot) although slime group-normalises
    its own, the loss's opob term inside loss_function, the baseline folded micro-batch by micro-batch
    (a whole group per micro-batch through the layer hooks; one sample per micro-batch through the
    gradient buffer) and applied in Megatron's finalize_model_grads, then Megatron's SGD step. The
    update must be -lr times the float64 reference of tests/support/training/opob_reference.py,
    computed here from per-sample backward passes."""
    low, high, lr = 0.0, 1.15, 0.1
    args = sc.make_args(**dict(COPRIS, april_is_level="sequence", april_is_low=low, april_is_high=high),
                        custom_megatron_before_train_step_hook_path=HOOK, april_vcpo_baseline=True,
                        custom_advantage_function_path="april_slime.vcpo.opob_advantages",
                        rewards_normalization=True, micro_batch_size=micro_batch_size)
    samples, before, delta, metrics, _ = one_step(args, optimizer="sgd", lr=lr)

    model = before.double()
    params = dict(model.named_parameters())
    scores, log_w, tokens = [], [], []
    for s in samples:
        seq = sequence_log_probs(model, s)
        scores.append(torch.autograd.grad(-seq, list(params.values())))
        log_w.append(float(seq.detach() - rollout_sum(s)))
        tokens.append(sum(s.loss_mask))
    rewards = [float(s.reward) for s in samples]
    groups = [s.group_index for s in samples]
    grad, baselines = reference_gradient(scores, log_w, tokens, rewards, groups, scope="group", norm_by_std=True,
                                         length_norm=True, weights="released", high=high,
                                         scale=1.0 / args.global_batch_size)
    expected = {name: -lr * g for name, g in zip(params, grad)}
    assert any(math.exp(x) > high for x in log_w) and len(set(rewards)) > 1  # truncation active, mixed rewards
    rt = vcpo.runtime()
    assert rt.last_baseline == pytest.approx(sum(baselines.values()) / len(baselines), rel=1e-4)
    for name, d in delta.items():
        assert_update_close(d, expected[name], model, name)
    assert metrics["pg_clipfrac"] == 0  # the opob term clips nothing (docs/loss.md)


def test_vcpo_values_reach_slimes_logger_every_step(world):
    """slime's own trainer actor (train_actor -> train -> train_one_step) with VCPO on, two optimizer
    steps per rollout: after every step the learning-rate factor, the ESS ratio, rho_on, the baseline
    and the baseline's share of the step time reach slime's logger at slime's train/step."""
    args = sc.make_args(**dict(COPRIS, april_is_level="sequence", april_is_high=8.0), **sc.ACTOR_ARGS,
                        custom_megatron_before_train_step_hook_path=HOOK, april_vcpo_baseline=True,
                        april_vcpo_lr_scaling=True, custom_advantage_function_path="april_slime.vcpo.opob_advantages",
                        micro_batch_size=3, global_batch_size=3)
    model = sc.GPTLikeLM(seed=0)
    ddp, optimizer, scheduler = sc.megatron_trainer(model, "adam", 1e-2)
    data = sc.rollout_to_trainer(args, sc.make_stale_samples(model, drift=0.8))
    logged = sc.train_actor(args, ddp, optimizer, scheduler, data, rollout_id=3)
    vcpo_lines = [line for line in logged if "train/vcpo/lr_scale" in line]
    assert [line["train/step"] for line in vcpo_lines] == [6, 7]  # rollout 3 of 2 steps each
    slime_steps = [line["train/step"] for line in logged if "train/loss" in line]
    assert slime_steps == [6, 7]
    for line in vcpo_lines:
        assert 0 < line["train/vcpo/ess_ratio"] < 1 and line["train/vcpo/rho_on"] == 1.0
        assert line["train/vcpo/lr_scale"] == pytest.approx(math.sqrt(line["train/vcpo/ess_ratio"]), rel=1e-9)
        assert math.isfinite(line["train/vcpo/baseline"]) and math.isfinite(line["train/vcpo/baseline_shift"])
        assert 0 < line["train/vcpo/opob_time_frac"] < 1


# ---------------------------------------------------------------- the proximal log-probs
# With one optimizer step per rollout the proximal policy is the policy being trained:
# patches/slime-skip-proximal-recompute.patch lets slime ask the custom loss
# (policy_loss.reuses_train_log_probs) and skip its separate log-prob forward, and the loss takes the
# training forward's own log-probs; loss, metrics and the update must be those of the run with
# slime's recompute. With several steps slime still recomputes them, unless
# april_prox_log_probs: loglinear interpolates them (exact on the first step). slime's own trainer
# actor runs (train_actor; stand-ins in tests/support/training/slime_cpu.py).
DECOUPLED = dict(loss_type="custom_loss", custom_loss_function_path="april_slime.loss.policy_loss",
                 april_is_mode="decoupled", april_is_level="token", april_is_correction="truncate", april_is_low=0.0,
                 april_is_high=2.0, april_loss_level="token", eps_clip=0.1, eps_clip_high=0.1)
def rollout(args, seed=0):
    """One rollout through slime's trainer actor: (did slime recompute the log-probs, slime's
    logged train lines, {parameter: update})."""
    model = sc.GPTLikeLM(seed=seed)
    before = copy.deepcopy(model)
    ddp, optimizer, scheduler = sc.megatron_trainer(model, "sgd", 0.5)
    data = sc.rollout_to_trainer(args, sc.make_stale_samples(model, seed=seed, drift=0.5))
    logged = sc.train_actor(args, ddp, optimizer, scheduler, data)
    old = dict(before.named_parameters())
    delta = {n: (p.detach() - old[n].detach()) for n, p in model.named_parameters()}
    return "log_probs" in data, [line for line in logged if "train/loss" in line], delta


def test_one_step_per_rollout_skips_the_recompute_and_trains_the_same(world):
    recomputed, lines_r, delta_r = rollout(sc.make_args(**DECOUPLED, **sc.ACTOR_ARGS, april_prox_log_probs="recompute"))
    skipped, lines_s, delta_s = rollout(sc.make_args(**DECOUPLED, **sc.ACTOR_ARGS))  # april_prox_log_probs: auto
    assert recomputed and not skipped  # slime ran its log-prob forward in the first run only
    assert len(lines_r) == len(lines_s) == 1
    for key, value in lines_r[0].items():
        assert lines_s[0][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert lines_r[0]["train/april/is_weight_mean"] != pytest.approx(lines_r[0]["train/april/trained_frac"])
    for name, d in delta_r.items():
        assert d.abs().max() > 1e-4, name
        torch.testing.assert_close(delta_s[name], d, rtol=1e-6, atol=1e-8, msg=name)


def test_several_steps_per_rollout_keep_the_recompute(world):
    """Two optimizer steps: the proximal policy of the second is not its trained one; slime recomputes."""
    recomputed, lines, _ = rollout(sc.make_args(**DECOUPLED, **sc.ACTOR_ARGS, global_batch_size=3, micro_batch_size=3))
    assert recomputed and len(lines) == 2


def test_loglinear_skips_the_recompute_and_is_exact_on_the_first_step(world):
    """loglinear with two steps per rollout: no recompute; the first step's proximal log-probs are
    the trained policy's own (alpha = 1), so its loss and metrics are those of the recompute run; the
    second step differs (an interpolation, not slime's recomputed proximal policy)."""
    two_steps = dict(global_batch_size=3, micro_batch_size=3, custom_megatron_before_train_step_hook_path=HOOK)
    recomputed, lines_r, _ = rollout(sc.make_args(**DECOUPLED, **sc.ACTOR_ARGS, **two_steps,
                                                  april_prox_log_probs="recompute"))
    vcpo.reset_runtime()
    skipped, lines_l, _ = rollout(sc.make_args(**DECOUPLED, **sc.ACTOR_ARGS, **two_steps,
                                               april_prox_log_probs="loglinear"))
    assert recomputed and not skipped
    for key, value in lines_r[0].items():
        assert lines_l[0][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert lines_l[1]["train/ppo_kl"] != pytest.approx(lines_r[1]["train/ppo_kl"], rel=1e-3)
