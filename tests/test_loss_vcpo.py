"""VCPO through the custom loss: whole slime training steps on a tiny model.

Each step follows slime's train_one_step: zero grads -> before-train-step hook -> per micro-batch
forward, ``policy_loss``, slime's loss scaling and Megatron's division by the micro-batch count,
backward -> Megatron's ``finalize_model_grads_func`` -> ``optimizer.step()`` -> scheduler step.
"""

import copy
import json
import math
import sys
import types
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch

from april_slime import loss as april_loss
from april_slime import vcpo
from april_slime.core.config import AprilConfigError
from tests.support.training import tokenwise
from tests.support.training.opob_reference import reference_gradient

VOCAB, D, H = 11, 6, 8
TEMPERATURE = 0.7


class TokenwiseLM(tokenwise.TokenwiseLM):
    """The position-wise model with the Megatron config slime's train() hands finalize_model_grads to."""

    def __init__(self, seed):
        super().__init__(seed, VOCAB, D, H)
        self.finalize_calls = 0
        # Megatron's TransformerConfig; slime's train() installs finalize_model_grads every rollout
        self.config = SimpleNamespace(finalize_model_grads_func=self._megatron_finalize)

    def _megatron_finalize(self, model_chunks, num_tokens=None):
        self.finalize_calls += 1


class RecordingSGD(torch.optim.SGD):
    """The optimizer as train_one_step uses it; records the lr and the gradients each step used."""

    def __init__(self, params, lr):
        super().__init__([{"params": list(params), "lr_mult": 1.0}], lr=lr)
        self.used_lr, self.used_grads = [], []

    def step(self):
        self.used_lr.append(self.param_groups[0]["lr"])
        self.used_grads.append([p.grad.clone() for p in self.param_groups[0]["params"]])
        super().step()
        return True, 0.0, 0


class Schedule:
    """Megatron's OptimizerParamScheduler: step(increment) overwrites every group's lr."""

    def __init__(self, optimizer):
        self.optimizer, self.samples = optimizer, 0
        self.step(0)

    def lr(self):
        return 0.5 / (1 + self.samples / 100)

    def step(self, increment):
        self.samples += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr() * group["lr_mult"]


@pytest.fixture
def megatron(monkeypatch):
    """The Megatron calls before_train_step makes (TP rank/size/group, the model's config)."""
    mpu = types.ModuleType("megatron.core.mpu")
    mpu.get_tensor_model_parallel_rank = lambda: 0
    mpu.get_tensor_model_parallel_world_size = lambda: 1
    mpu.get_tensor_model_parallel_group = lambda: None
    mpu.get_data_parallel_rank = lambda: 0
    mpu.get_data_parallel_world_size = lambda: 1
    mpu.get_data_parallel_group = lambda: None
    utils = types.ModuleType("megatron.core.utils")
    utils.get_model_config = lambda model: model.config
    core = types.ModuleType("megatron.core")
    core.mpu, core.utils = mpu, utils
    for name, module in (("megatron", types.ModuleType("megatron")), ("megatron.core", core),
                         ("megatron.core.mpu", mpu), ("megatron.core.utils", utils)):
        monkeypatch.setitem(sys.modules, name, module)
    vcpo.reset_runtime()
    yield
    vcpo.reset_runtime()


def make_args(**overrides):
    values = dict(
        loss_type="custom_loss", eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None,
        rollout_temperature=TEMPERATURE, entropy_coef=0.0, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1",
        use_unbiased_kl=False, advantage_estimator="grpo", use_rollout_logprobs=False, rollout_top_p=1.0,
        april_is_mode="copris", april_is_level="sequence", april_is_correction="truncate", april_is_low=0.0,
        april_is_high=1.5, april_loss_level="token",
        # the hooks a VCPO job names (april_slime.job_checks refuses VCPO without them)
        custom_megatron_before_train_step_hook_path="april_slime.vcpo.before_train_step",
        custom_advantage_function_path="april_slime.vcpo.opob_advantages",
    )
    values.update(overrides)
    return Namespace(**values)


def sample_log_probs(model, tokens, response_length):
    """log pi(response token | prefix) of one sample, from the definition."""
    prompt = tokens.numel() - response_length
    logp = (model(tokens[None])[0] / TEMPERATURE).log_softmax(-1)
    return logp[prompt - 1:-1].gather(-1, tokens[prompt:, None]).squeeze(-1)


def make_microbatch(model, g, response_lengths, spread, empty_sample=None):
    """A micro-batch as slime's get_batch hands it to the loss; ``log_probs`` are recomputed with
    the current model (slime does that once per rollout, before its first step)."""
    prompt_lengths = [int(torch.randint(1, 4, (1,), generator=g)) for _ in response_lengths]
    total_lengths = [p + r for p, r in zip(prompt_lengths, response_lengths)]
    tokens = [torch.randint(1, VOCAB, (n,), generator=g) for n in total_lengths]
    stream = torch.zeros(1, -(-sum(total_lengths) // 8) * 8, dtype=torch.long)  # slime pads the stream
    stream[0, :sum(total_lengths)] = torch.cat(tokens)
    with torch.no_grad():
        old = [sample_log_probs(model, t, r) for t, r in zip(tokens, response_lengths)]
    rollout = [o + spread * torch.randn(o.shape, generator=g, dtype=o.dtype) for o in old]
    masks = [(torch.rand(r, generator=g) > 0.25).int() for r in response_lengths]
    for m in masks:
        m[0] = 1
    if empty_sample is not None:
        masks[empty_sample] = torch.zeros_like(masks[empty_sample])
    rewards = torch.rand(len(response_lengths), generator=g, dtype=torch.float64).round()
    rewards[0] = 0.5
    return {
        "tokens": stream, "unconcat_tokens": tokens, "total_lengths": total_lengths,
        "response_lengths": list(response_lengths), "loss_masks": masks, "log_probs": old,
        "rollout_log_probs": rollout,
        "advantages": [torch.full((r,), float(R), dtype=torch.float64) for r, R in zip(response_lengths, rewards)],
        "rollout_mask_sums": [m.sum().double() for m in masks], "ref_log_probs": None, "rewards": rewards,
    }


def sum_of_sample_mean(batch):
    """slime's reducer without context parallelism."""
    def reduce(x):
        return sum((xi * mi).sum() / torch.clamp_min(d, 1) for xi, mi, d in
                   zip(x.split(batch["response_lengths"]), batch["loss_masks"], batch["rollout_mask_sums"]))
    return reduce


def slime_train_one_step(args, model, optimizer, scheduler, microbatches, step_id):
    model.zero_grad(set_to_none=True)
    vcpo.before_train_step(args, 0, step_id, [model], optimizer, scheduler)
    num_microbatches = len(microbatches)
    step_global_batch_size = sum(len(mb["total_lengths"]) for mb in microbatches)
    for mb in microbatches:
        logits = model(mb["tokens"])
        loss, _ = april_loss.policy_loss(args, mb, logits, sum_of_sample_mean(mb))
        loss = loss * num_microbatches / step_global_batch_size  # slime's loss_function, one DP rank
        (loss / num_microbatches).backward()  # Megatron's forward_step divides by the micro-batch count
    model.config.finalize_model_grads_func([model])
    scheduled_lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    assert optimizer.param_groups[0]["lr"] == scheduled_lr  # restored right after the step
    scheduler.step(step_global_batch_size)


def sequence_log_weights(model, microbatches, against="current"):
    """[(log-weight, R)] of every sample with a loss-masked token, float64, from the definition."""
    out = []
    with torch.no_grad():
        for mb in microbatches:
            for i, (tok, r) in enumerate(zip(mb["unconcat_tokens"], mb["response_lengths"])):
                m = mb["loss_masks"][i]
                if not m.any():
                    continue
                lp = sample_log_probs(model, tok, r) if against == "current" else mb["log_probs"][i]
                out.append((float(((lp - mb["rollout_log_probs"][i]) * m).sum()), float(mb["rewards"][i])))
    return out


def ess_ratio(log_weights):
    w = [math.exp(x) for x in log_weights]
    return sum(w) ** 2 / sum(x * x for x in w) / len(w)


def test_lr_of_each_step_is_scaled_by_the_ess_of_that_steps_batch_and_restored(megatron):
    """Two optimizer steps of one rollout (log-probs recomputed once, before the first): the ESS of
    step 2 is over the policy of step 2, not the recomputed one."""
    args = make_args(april_is_mode="decoupled", april_is_level="token", april_vcpo_lr_scaling=True,
                     april_vcpo_rho_on_estimate=True, april_is_high=1.2)
    model = TokenwiseLM(seed=0)
    optimizer = RecordingSGD(model.parameters(), lr=0.0)
    scheduler = Schedule(optimizer)
    g = torch.Generator().manual_seed(1)
    step1 = [make_microbatch(model, g, [5, 3, 6], spread=0.1), make_microbatch(model, g, [4, 2], spread=0.1)]
    step2 = [make_microbatch(model, g, [6, 4, 5], spread=0.6, empty_sample=1),
             make_microbatch(model, g, [3, 7], spread=0.6)]

    ratio1 = ess_ratio([lw for lw, _ in sequence_log_weights(model, step1)])
    lr1 = scheduler.lr()
    slime_train_one_step(args, model, optimizer, scheduler, step1, step_id=0)
    scaler = vcpo.runtime().lr_scaler
    assert scaler.rho_on == pytest.approx(ratio1, rel=1e-12)  # the first step defines rho_on: factor 1
    assert optimizer.used_lr[-1] == pytest.approx(lr1, rel=1e-12)

    ratio2 = ess_ratio([lw for lw, _ in sequence_log_weights(model, step2)])
    clipped2 = ess_ratio([min(lw, math.log(1.2)) for lw, _ in sequence_log_weights(model, step2)])
    stale_ratio2 = ess_ratio([lw for lw, _ in sequence_log_weights(model, step2, against="recomputed")])
    assert abs(ratio2 - stale_ratio2) > 1e-4  # the two definitions are told apart by this test
    factor = math.sqrt(ratio2 / ratio1)
    assert 0.0 < factor < 0.9
    lr2 = scheduler.lr()
    slime_train_one_step(args, model, optimizer, scheduler, step2, step_id=1)
    assert optimizer.used_lr[-1] == pytest.approx(lr2 * factor, rel=1e-9)
    assert scaler.last_ess_ratio == pytest.approx(ratio2, rel=1e-9)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(scheduler.lr())  # the schedule's, unscaled
    assert vcpo.runtime().metrics()["vcpo/lr_scale"] == pytest.approx(factor, rel=1e-9)
    # logged beside it, not used by the rule: the ESS of the same samples' weights truncated at is_high
    assert abs(clipped2 - ratio2) > 1e-3  # some weights are past the truncation
    assert scaler.last_ess_ratio_clipped == pytest.approx(clipped2, rel=1e-9)
    assert vcpo.runtime().metrics()["vcpo/ess_ratio_clipped"] == pytest.approx(clipped2, rel=1e-9)


def test_rho_on_is_fixed_by_default_and_an_estimate_survives_a_restart(megatron, tmp_path):
    """The released runs fix rho_on (1.0 here: the first step is scaled by sqrt(ESS_ratio)); the
    estimate, when asked for, is written to --save after its step and read from --load by a
    restarted job, whose first step is then scaled against it instead of defining a new one."""
    model = TokenwiseLM(seed=0)
    g = torch.Generator().manual_seed(1)
    first = [make_microbatch(model, g, [5, 3, 6], spread=0.3)]
    later = [make_microbatch(model, g, [6, 4, 5], spread=0.9)]
    ratio_first = ess_ratio([lw for lw, _ in sequence_log_weights(model, first)])
    ratio_later = ess_ratio([lw for lw, _ in sequence_log_weights(model, later)])
    if ratio_later > ratio_first:  # the restarted step must see the lower ESS (a factor below the cap of 1)
        first, later, ratio_first, ratio_later = later, first, ratio_later, ratio_first
    assert ratio_later < ratio_first - 0.01 and ratio_first < 0.999

    def run(args, microbatches):
        fresh = copy.deepcopy(model)
        optimizer = RecordingSGD(fresh.parameters(), lr=0.0)
        scheduler = Schedule(optimizer)
        lr = scheduler.lr()
        slime_train_one_step(args, fresh, optimizer, scheduler, microbatches, step_id=0)
        return optimizer.used_lr[-1] / lr

    assert run(make_args(april_vcpo_lr_scaling=True), first) == pytest.approx(math.sqrt(ratio_first), rel=1e-9)
    vcpo.reset_runtime()
    estimate = dict(april_vcpo_lr_scaling=True, april_vcpo_rho_on_estimate=True, save=str(tmp_path),
                    load=str(tmp_path))
    assert run(make_args(**estimate), first) == pytest.approx(1.0, rel=1e-12)  # the estimate's own step
    saved = json.loads((tmp_path / vcpo.STATE_FILE).read_text())
    assert saved == {"rho_on": pytest.approx(ratio_first, rel=1e-12)}
    vcpo.reset_runtime()  # a restarted job
    assert run(make_args(**estimate), later) == pytest.approx(math.sqrt(ratio_later / ratio_first), rel=1e-9)
    assert vcpo.runtime().lr_scaler.rho_on == pytest.approx(ratio_first, rel=1e-12)
    (tmp_path / vcpo.STATE_FILE).write_text(json.dumps({"rho_on": 3.0}))
    vcpo.reset_runtime()
    with pytest.raises(AprilConfigError, match="no valid rho_on"):
        run(make_args(**estimate), later)
    with pytest.raises(AprilConfigError, match="april_vcpo_rho_on: set either"):
        april_loss.config_for(make_args(april_vcpo_rho_on=0.55, april_vcpo_rho_on_estimate=True))


def with_groups(microbatches, group_of_microbatch):
    """Each micro-batch one prompt group, as vcpo.opob_advantages writes it into the metadata."""
    for mb, gid in zip(microbatches, group_of_microbatch):
        r = mb["rewards"]
        std = float(r.std(unbiased=False))
        mb["metadata"] = [{"april_opob_group": {"group": gid, "size": len(r), "reward_std": std}} for _ in r]
    return microbatches


@pytest.mark.parametrize("scope, length_norm, weights", [("group", True, "released"), ("global", False, "paper"),
                                                         ("group", False, "paper"), ("global", True, "released")])
def test_baseline_gradient_equals_the_directly_baselined_loss(megatron, scope, length_norm, weights):
    """grad at optimizer.step == (1/N) sum_i a_i wbar_i lambda_i grad(-log pi(y_i|x_i)), the float64
    reference of tests/support/training/opob_reference.py from per-sample gradients taken one by one."""
    args = make_args(april_vcpo_baseline=True, april_vcpo_lr_scaling=True, april_vcpo_rho_on=1.0,
                     april_vcpo_baseline_scope=scope, april_vcpo_length_norm=length_norm,
                     april_vcpo_baseline_weights=weights)
    model = TokenwiseLM(seed=3)
    optimizer = RecordingSGD(model.parameters(), lr=0.0)
    scheduler = Schedule(optimizer)
    g = torch.Generator().manual_seed(9)
    step = with_groups([make_microbatch(model, g, [5, 3, 6], spread=0.5),
                        make_microbatch(model, g, [4, 6], spread=0.5)], [0, 1])

    params = list(model.parameters())
    log_w, rewards, scores, tokens, groups = [], [], [], [], []
    for gid, mb in enumerate(step):
        for i, (tok, r) in enumerate(zip(mb["unconcat_tokens"], mb["response_lengths"])):
            lp = sample_log_probs(model, tok, r)
            m = mb["loss_masks"][i].double()
            log_w.append(float(((lp.detach() - mb["rollout_log_probs"][i]) * m).sum()))
            rewards.append(float(mb["rewards"][i]))
            scores.append(torch.autograd.grad(-(lp * m).sum(), params))
            tokens.append(int(m.sum()))
            groups.append(gid)
    assert any(math.exp(x) > 1.5 for x in log_w) and any(math.exp(x) < 1.5 for x in log_w)  # TIS exercised
    expected, baselines = reference_gradient(scores, log_w, tokens, rewards, groups, scope=scope, norm_by_std=True,
                                             length_norm=length_norm, weights=weights, high=1.5,
                                             scale=1.0 / len(rewards))
    ratio = ess_ratio(log_w)
    lr = scheduler.lr()

    slime_train_one_step(args, model, optimizer, scheduler, step, step_id=0)
    rt = vcpo.runtime()
    mean_b = sum(baselines.values()) / len(baselines)
    assert rt.last_baseline == pytest.approx(mean_b, rel=1e-10)
    assert model.finalize_calls == 1
    for got, want in zip(optimizer.used_grads[-1], expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert optimizer.used_lr[-1] == pytest.approx(lr * math.sqrt(ratio / 1.0), rel=1e-9)
    assert rt.opob.microbatches == 0  # the next step starts clean
    assert rt.last_log["vcpo/baseline"] == pytest.approx(mean_b, rel=1e-10)
    assert 0.0 < rt.last_log["vcpo/opob_time_frac"] < 1.0


def test_vcpo_settings_the_loss_cannot_serve_are_refused(megatron):
    model = TokenwiseLM(seed=5)
    optimizer = RecordingSGD(model.parameters(), lr=0.0)
    for overrides, message in [
        (dict(april_is_mode="decoupled"), "april_is_mode=decoupled"),
        (dict(april_is_mode="on_policy"), "april_is_mode=on_policy"),
        (dict(april_is_level="token"), "april_is_level=token"),
        (dict(advantage_estimator="gspo"), "gspo"),
        (dict(entropy_coef=0.01), "entropy-coef"),
    ]:
        with pytest.raises(AprilConfigError, match=message):
            vcpo.before_train_step(make_args(april_vcpo_baseline=True, **overrides), 0, 0, [model], optimizer, None)
        assert vcpo.runtime() is None
    with pytest.raises(AprilConfigError, match="--loss-type custom_loss"):
        vcpo.before_train_step(make_args(april_vcpo_lr_scaling=True, loss_type="policy_loss"), 0, 0, [model],
                               optimizer, None)

    g = torch.Generator().manual_seed(6)
    mb = make_microbatch(model, g, [3, 4], spread=0.2)
    with pytest.raises(AprilConfigError, match="before-train-step hook"):  # the hook was not installed
        april_loss.policy_loss(make_args(april_vcpo_lr_scaling=True), mb, model(mb["tokens"]), sum_of_sample_mean(mb))
    with pytest.raises(AprilConfigError, match="TIS hook"):
        april_loss.tis(make_args(april_is_mode="decoupled", april_vcpo_lr_scaling=True, use_tis=True),
                       pg_loss=torch.zeros(7, dtype=torch.float64), train_log_probs=mb["log_probs"],
                       rollout_log_probs=mb["rollout_log_probs"], loss_masks=mb["loss_masks"])

    args = make_args(april_vcpo_baseline=True, april_vcpo_baseline_scope="global")
    vcpo.before_train_step(args, 0, 0, [model], optimizer, None)
    mb["advantages"][1] = torch.linspace(0.0, 1.0, 4, dtype=torch.float64)  # per-token advantages
    with pytest.raises(ValueError, match="sample 1: april_vcpo_baseline needs one reward per sample"):
        april_loss.policy_loss(args, mb, model(mb["tokens"]), sum_of_sample_mean(mb))
