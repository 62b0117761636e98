"""Training tier: slime's own trainer actor (``MegatronTrainRayActor.train_actor``) with the custom
loss and the proximal log-probs it needs (decoupled PPO).

With one optimizer step per rollout the proximal policy is the policy being trained:
``patches/slime-skip-proximal-recompute.patch`` lets slime ask the custom loss
(``policy_loss.reuses_train_log_probs``) and skip its separate log-prob forward, and the loss takes
the training forward's own log-probs. Loss, metrics and the parameter update must be those of the
run with slime's recompute. With several steps per rollout slime still recomputes them, unless
``april_prox_log_probs: loglinear`` interpolates them by token version (exact on the first step).

What stands in for what cannot run here is listed in tests/support/training/slime_cpu.py
(``train_actor``) and in test_slime_train_step.py's docstring.
"""

import copy

import pytest
import torch

from april_slime import vcpo
from tests.support.training import megatron_cpu
from tests.support.training import slime_cpu as sc

pytestmark = pytest.mark.real

DECOUPLED = dict(loss_type="custom_loss", custom_loss_function_path="april_slime.loss.policy_loss",
                 april_is_mode="decoupled", april_is_level="token", april_is_correction="truncate", april_is_low=0.0,
                 april_is_high=2.0, april_loss_level="token", eps_clip=0.1, eps_clip_high=0.1)
HOOK = "april_slime.vcpo.before_train_step"


@pytest.fixture(scope="module")
def world():
    with sc.gloo_world(), megatron_cpu.ddp_and_optimizer_on_cpu():
        yield


@pytest.fixture(autouse=True)
def fresh_vcpo_runtime():
    vcpo.reset_runtime()
    yield
    vcpo.reset_runtime()


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
