"""VCPO: exact per-sample gradient norms, the off-policy optimal baseline by linearity, ESS lr scaling."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from april_slime import vcpo
from april_slime.core.config import AprilConfigError
from april_slime.job_checks import check_vcpo, groups_across_ranks
from april_slime.training.baseline import OpobAccumulator, OpobOptions, opob_policy_loss
from april_slime.training.ess import EssLrScaler, EssStats
from april_slime.training.grad_norms import PerSampleGradNorms
from april_slime.training.offpolicy import Packing
from april_slime.vcpo import opob_advantages

VOCAB, D, HEADS, FF = 23, 12, 2, 20


class Block(nn.Module):
    def __init__(self, norm_cls):
        super().__init__()
        self.norm1, self.norm2 = norm_cls(D), norm_cls(D)
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D, bias=False), nn.Linear(D, D)
        self.o = nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, FF), nn.Linear(FF, D, bias=False)

    def forward(self, x, mask):  # x [B, T, D]; mask [B, T, T] True = may attend
        h = self.norm1(x)
        b, t, _ = h.shape
        q, k, v = (m(h).view(b, t, HEADS, D // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(D // HEADS)
        att = att.masked_fill(~mask[:, None], -1e9).softmax(-1)
        x = x + self.o((att @ v).transpose(1, 2).reshape(b, t, D))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(nn.RMSNorm), Block(nn.LayerNorm)])
        self.final_norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens, segments):  # tokens, segments [B, T]; segment -1 = padding
        t = tokens.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] >= 0)
        mask = causal[None] & same
        mask = mask | torch.eye(t, dtype=torch.bool)[None]  # padding rows attend to themselves
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(self.final_norm(x))


def token_logprobs(logits, tokens):
    """log p(tokens[t+1] | ..t), aligned to position t+1 (position 0 gets 0)."""
    lp = logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


def make_model(seed=0):
    torch.manual_seed(seed)
    model = TinyLM().double()
    with torch.no_grad():  # non-trivial affine norm parameters
        for m in model.modules():
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                m.weight.add_(0.3 * torch.randn_like(m.weight))
                if getattr(m, "bias", None) is not None:
                    m.bias.add_(0.1 * torch.randn_like(m.bias))
    return model


def per_sample_nll(model, tokens, segments, resp_masks):
    """-sum_t mask log p per sample; padded layout [B, T]."""
    lp = token_logprobs(model(tokens, segments), tokens)
    return -(lp * resp_masks).sum(-1)


def reference_sq_norms_padded(model, tokens, segments, resp_masks):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, tok, seg, m):
        return per_sample_nll_functional(model, p, tok[None], seg[None], m[None])[0]

    grads = vmap(grad(loss_one), in_dims=(None, 0, 0, 0))(params, tokens, segments, resp_masks)
    return sum(g.pow(2).flatten(1).sum(1) for g in grads.values()), grads


def per_sample_nll_functional(model, params, tokens, segments, masks):
    logits = functional_call(model, params, (tokens, segments))
    return -(token_logprobs(logits, tokens) * masks).sum(-1)


def padded_batch(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    tokens = torch.randint(0, VOCAB, (len(lengths), t), generator=g)
    segments = Packing.from_lengths(lengths).padded_segment_ids(t)
    resp = torch.zeros(len(lengths), t, dtype=torch.float64)
    for i, n in enumerate(lengths):
        resp[i, max(1, n // 3):n] = 1.0  # "prompt" = first third, response = the rest
    return tokens, segments, resp


@pytest.mark.parametrize("weighted", [False, True])
def test_per_sample_norms_match_vmap_grad_padded(weighted):
    model = make_model()
    lengths = [9, 4, 7, 2]
    tokens, segments, resp = padded_batch(lengths)
    ref, _ = reference_sq_norms_padded(model, tokens, segments, resp)
    tracker = PerSampleGradNorms(model, weighted=weighted, gram_tile=3)
    nll = per_sample_nll(model, tokens, segments, resp)
    coeffs = torch.arange(1.0, 5.0, dtype=torch.float64)
    tracker.set_microbatch(segments, len(lengths), coeffs if weighted else None)
    nll.sum().backward()
    torch.testing.assert_close(tracker.last_sq_norms, ref, rtol=1e-9, atol=0)
    tracker.remove()


def test_gram_and_direct_paths_both_exercised_and_agree():
    # d_in=d_out=12 -> Gram wins for T*(24) < 144, i.e. T <= 5; long samples take the direct path.
    model = make_model(3)
    tokens, segments, resp = padded_batch([3, 11], seed=5)
    ref, _ = reference_sq_norms_padded(model, tokens, segments, resp)
    for tile in (1, 2, 64):
        model.zero_grad()
        tracker = PerSampleGradNorms(model, gram_tile=tile)
        tracker.set_microbatch(segments, 2)
        per_sample_nll(model, tokens, segments, resp).sum().backward()
        torch.testing.assert_close(tracker.last_sq_norms, ref, rtol=1e-9, atol=0)
        tracker.remove()


def test_per_sample_norms_packed_varlen_match_per_sample_grad():
    """Packed (thd-like) layout: one row, samples back to back, a padding tail."""
    model = make_model(7)
    lengths = [5, 8, 3]
    cu = [0, 5, 13, 16, 18]  # last segment = padding, as slime appends it
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (1, 18), generator=g)
    seg = Packing.from_cu_seqlens(cu[:-1]).packed_segment_ids(18)  # the trailing padding segment is not a sample
    assert seg.tolist()[-2:] == [-1, -1]
    resp = torch.zeros(1, 18, dtype=torch.float64)
    for s, e in [(2, 5), (7, 13), (14, 16)]:
        resp[0, s:e] = 1
    tracker = PerSampleGradNorms(model)
    tracker.set_microbatch(seg, 3)
    logits = model(tokens, seg[None])
    lp = token_logprobs(logits, tokens)
    # a token's log-prob is predicted from the previous position: never across a sample boundary
    resp_pos = resp * (seg[None] >= 0)
    lp.mul(resp_pos).sum().backward()
    tracker.remove()
    params = {k: v.detach() for k, v in model.named_parameters()}
    for i, (s, e) in enumerate(zip(cu[:-2], cu[1:-1])):
        def loss_i(p, s=s, e=e):
            tok = tokens[:, s:e]
            sub_seg = torch.zeros(1, e - s, dtype=torch.long)
            return (token_logprobs(functional_call(model, p, (tok, sub_seg)), tok) * resp[:, s:e]).sum()
        gi = grad(loss_i)(params)
        ref = sum(v.pow(2).sum() for v in gi.values())
        torch.testing.assert_close(tracker.last_sq_norms[i], ref, rtol=1e-9, atol=0)
    assert len(lengths) == 3


def test_baseline_and_linearity_match_direct_baselined_loss():
    """grad after the accumulator's finish == grad of sum_i w_i (R_i - b)(-log pi_i) with b from
    reference (vmap) per-sample gradients, b = sum w^2 R |g|^2 / sum w^2 |g|^2 (global scope, the
    paper's weights, summed trajectory loss), on a transformer with attention."""
    model = make_model(2)
    lengths = [8, 5, 9, 3, 6]
    tokens, segments, resp = padded_batch(lengths, seed=4)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5], dtype=torch.float64)
    with torch.no_grad():
        true_lp = token_logprobs(model(tokens, segments), tokens)
    g = torch.Generator().manual_seed(3)
    rollout_lp = true_lp + 0.3 * torch.randn(true_lp.shape, generator=g, dtype=torch.float64)

    ref_sq, _ = reference_sq_norms_padded(model, tokens, segments, resp)
    log_ratio = ((true_lp - rollout_lp) * resp).sum(-1)
    w = torch.exp(log_ratio).clamp(max=2.0)
    b_ref = float((w ** 2 * rewards * ref_sq).sum() / (w ** 2 * ref_sq).sum())

    model.zero_grad()
    direct = (w * (rewards - b_ref) * per_sample_nll(model, tokens, segments, resp)).sum()
    direct.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    tracker = PerSampleGradNorms(model, weighted=True)
    options = OpobOptions(scope="global", weights="paper", length_norm=False, high=2.0)
    acc = OpobAccumulator(tracker, list(model.parameters()), options)
    acc.begin_step()
    # two micro-batches, as slime's gradient accumulation runs them, and one sample alone
    for rows in ([0, 1], [2], [3, 4]):
        tok, m = tokens[rows], resp[rows]
        seg = Packing.from_lengths([lengths[r] for r in rows]).padded_segment_ids(tokens.shape[1])
        lp = token_logprobs(model(tok, seg), tok)
        out = opob_policy_loss(list(lp), list(rollout_lp[rows]), list(m), rewards[rows], seg,
                               accumulator=acc, options=options)
        torch.testing.assert_close(out.is_weights, w[rows])
        out.loss.backward()
    b = acc.finish()
    assert b == pytest.approx(b_ref, rel=1e-10)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-9, atol=1e-12, msg=n)
    assert acc.microbatches == 0 and tracker.weighted_grads == {}


def test_finish_uses_megatron_main_grad_when_present():
    lin = nn.Linear(3, 2, bias=False).double()
    x = torch.randn(1, 4, 3, dtype=torch.float64)
    seg = torch.tensor([0, 0, 1, 1])
    g0_grad = torch.autograd.grad(lin(x[:, :2]).sum(), lin.weight)[0]
    g1_grad = torch.autograd.grad(lin(x[:, 2:]).sum(), lin.weight)[0]
    tracker = PerSampleGradNorms(lin, weighted=True)
    acc = OpobAccumulator(tracker, [lin.weight], OpobOptions(scope="global", weights="paper", length_norm=False))
    acc.begin_step()
    lin.weight.main_grad = torch.zeros_like(lin.weight)  # Megatron accumulates here
    acc.add_microbatch(seg, torch.tensor([2.0, -1.0], dtype=torch.float64), torch.zeros(2, dtype=torch.float64),
                       torch.ones(2, dtype=torch.float64), None)
    lin(x).sum().backward()
    lin.weight.main_grad += lin.weight.grad
    p_grad = lin.weight.grad.clone()
    b = acc.finish()
    n0, n1 = g0_grad.pow(2).sum(), g1_grad.pow(2).sum()
    assert b == pytest.approx(float((2 * n0 - n1) / (n0 + n1)))
    torch.testing.assert_close(lin.weight.main_grad, 2 * g0_grad - g1_grad - b * p_grad)
    torch.testing.assert_close(lin.weight.grad, p_grad)  # untouched: main_grad is the one Megatron uses


def test_uncovered_tied_and_reused_modules_are_rejected():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.scale = nn.Parameter(torch.ones(2))

    with pytest.raises(ValueError, match="scale"):
        PerSampleGradNorms(Odd())
    emb, head = nn.Embedding(5, 4), nn.Linear(4, 5, bias=False)
    head.weight = emb.weight
    with pytest.raises(ValueError, match="tied"):
        PerSampleGradNorms(nn.ModuleList([emb, head]))
    lin = nn.Linear(2, 2)
    tracker = PerSampleGradNorms(lin)
    with pytest.raises(RuntimeError, match="twice"):
        lin(lin(torch.randn(3, 2)))
    tracker.remove()
    lin2 = nn.Linear(2, 2)
    tracker = PerSampleGradNorms(lin2)
    with pytest.raises(RuntimeError, match="set_microbatch"):
        lin2(torch.randn(3, 2)).sum().backward()
    with torch.no_grad():  # log-prob recomputation passes are ignored
        lin2(torch.randn(3, 2))
    tracker.reset()


def test_opob_loss_rejects_bad_input():
    lp = [torch.tensor([-1.0, float("nan")])]
    with pytest.raises(ValueError, match="non-finite"):
        opob_policy_loss(lp, [torch.zeros(2)], [torch.ones(2)], torch.tensor([1.0]), torch.zeros(2))
    with pytest.raises(ValueError, match="differ in length"):
        opob_policy_loss([torch.zeros(2)], [torch.zeros(3)], [torch.ones(2)], torch.tensor([1.0]),
                         torch.zeros(2))
    with pytest.raises(ValueError, match="rewards"):
        opob_policy_loss([torch.zeros(2)], [torch.zeros(2)], [torch.ones(2)], torch.tensor([1.0, 2.0]),
                         torch.zeros(2))


def test_segment_helpers():
    assert Packing.from_lengths([2, 0, 3]).padded_segment_ids(3).tolist() == [[0, 0, -1], [-1, -1, -1], [2, 2, 2]]
    assert Packing.from_cu_seqlens([0, 2, 2, 5]).packed_segment_ids(6).tolist() == [0, 0, 2, 2, 2, -1]
    with pytest.raises(ValueError):
        Packing.from_cu_seqlens([0, 3, 2]).packed_segment_ids(4)
    with pytest.raises(ValueError):
        Packing.from_lengths([4]).padded_segment_ids(3)


# ------------------------------------------------------------------------------ ESS and lr
def test_ess_stats_are_shift_stable_and_mergeable():
    log_w = torch.tensor([800.0, 799.0, 790.0, 801.5], dtype=torch.float64)
    w = torch.exp(log_w - 800)
    expected = float(w.sum() ** 2 / (w ** 2).sum())
    s = EssStats()
    s.add(log_w[:2])
    s.add(log_w[2:])
    assert s.ess == pytest.approx(expected, rel=1e-12)
    assert s.ess_ratio == pytest.approx(expected / 4, rel=1e-12)
    equal = EssStats()
    equal.add(torch.zeros(5))
    assert equal.ess_ratio == pytest.approx(1.0)
    with pytest.raises(ValueError, match="non-finite"):
        s.add(torch.tensor([float("nan")]))


class FakeMegatronOptimizer:
    """param_groups with 'lr' (two groups, like Megatron's decay / no-decay split); step() records
    the lr it applied."""

    def __init__(self):
        self.param_groups = [{"lr": 0.0, "lr_mult": 1.0}, {"lr": 0.0, "lr_mult": 0.5}]
        self.used = []
        self.fail_next = False

    def step(self):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("inf in grads")
        self.used.append([g["lr"] for g in self.param_groups])
        return True, 1.0, 0


class FakeScheduler:
    """Megatron's OptimizerParamScheduler: step(increment) overwrites every group's lr from the
    schedule (and __init__ runs step(0))."""

    def __init__(self, optimizer):
        self.optimizer, self.num_steps = optimizer, 0
        self.step(0)

    def lr_at(self, n):
        return 1e-3 * (1 + n)

    def step(self, increment):
        self.num_steps += increment
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr_at(self.num_steps) * g["lr_mult"]


def slime_train_one_step(hook, optimizer, scheduler, log_ratios_per_microbatch, rt_getter, valid=True):
    """The order of slime's train_one_step: zero grads -> before-train-step hook -> forward/backward
    of every micro-batch (the loss observes log-ratios) -> optimizer.step -> scheduler.step."""
    hook(optimizer)
    for lr_ in log_ratios_per_microbatch:
        rt_getter().lr_scaler.observe(torch.as_tensor(lr_, dtype=torch.float64))
    if valid:
        optimizer.step()
        scheduler.step(1)


def test_lr_scaling_applies_to_exactly_one_step_and_restores():
    vcpo.reset_runtime()
    args = SimpleNamespace(april_vcpo_lr_scaling=True, april_vcpo_lr_scale_min=0.0,
                           april_vcpo_lr_scale_max=1.0, april_vcpo_rho_on_estimate=True,
                           custom_megatron_before_train_step_hook_path="april_slime.vcpo.before_train_step")
    opt = FakeMegatronOptimizer()
    sched = FakeScheduler(opt)

    def hook(o):
        vcpo.before_train_step(args, 0, 0, [], o, sched)

    on_policy = [[0.0, 0.1, -0.1], [0.05]]
    rho_on = EssStats()
    rho_on.add(torch.tensor([0.0, 0.1, -0.1, 0.05]))
    slime_train_one_step(hook, opt, sched, on_policy, vcpo.runtime)
    rt = vcpo.runtime()
    assert rt.lr_scaler.rho_on == pytest.approx(rho_on.ess_ratio)
    assert rt.lr_scaler.last_scale == pytest.approx(1.0)  # first step defines rho_on
    assert opt.used[-1] == pytest.approx([1e-3, 0.5e-3])

    skewed = [[3.0, 0.0, -2.0, 0.0]]
    stats = EssStats()
    stats.add(torch.tensor(skewed[0]))
    factor = math.sqrt(stats.ess_ratio / rho_on.ess_ratio)
    assert 0.0 < factor < 1.0
    slime_train_one_step(hook, opt, sched, skewed, vcpo.runtime)
    assert opt.used[-1] == pytest.approx([2e-3 * factor, 1e-3 * factor])  # scaled in that step only
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([3e-3, 1.5e-3])  # the schedule's again

    # a step whose optimizer.step fails: lr restored by the context, not left scaled
    opt.fail_next = True
    with pytest.raises(RuntimeError):
        slime_train_one_step(hook, opt, sched, skewed, vcpo.runtime)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([3e-3, 1.5e-3])
    # a skipped step (no optimizer.step): the next step starts from fresh statistics
    slime_train_one_step(hook, opt, sched, skewed, vcpo.runtime, valid=False)
    slime_train_one_step(hook, opt, sched, on_policy, vcpo.runtime)
    assert opt.used[-1] == pytest.approx([3e-3, 1.5e-3])
    # the optimizer wrapper is installed once, whatever the number of hook calls
    assert opt.step._vcpo_original.__name__ == "step"
    assert set(rt.metrics()) == {"vcpo/ess_ratio", "vcpo/ess_ratio_clipped", "vcpo/lr_scale", "vcpo/rho_on"}
    vcpo.reset_runtime()


def test_lr_scale_clamps_and_given_rho_on():
    opt = FakeMegatronOptimizer()
    opt.param_groups[0]["lr"] = 1.0
    scaler = EssLrScaler(rho_on=0.5, scale_min=0.3, scale_max=1.0)
    scaler.wrap_optimizer(opt)
    scaler.begin_step()
    scaler.observe(torch.tensor([0.0, 0.0]))  # ratio 1 -> sqrt(2) -> clamped to 1
    opt.step()
    assert opt.used[-1][0] == pytest.approx(1.0)
    scaler.begin_step()
    scaler.observe(torch.tensor([50.0, 0.0, 0.0, 0.0]))  # ratio ~1/4 -> sqrt(0.5)
    opt.step()
    assert opt.used[-1][0] == pytest.approx(math.sqrt(0.25 / 0.5), rel=1e-6)
    scaler.begin_step()
    scaler.observe(torch.tensor([500.0] + [0.0] * 99))  # ratio 1/100 -> 0.141 -> floor 0.3
    opt.step()
    assert opt.used[-1][0] == pytest.approx(0.3)
    scaler.begin_step()  # nothing observed: unscaled, rho_on kept
    opt.step()
    assert opt.used[-1][0] == pytest.approx(1.0) and scaler.rho_on == 0.5
    state = scaler.state_dict()
    other = EssLrScaler()
    other.load_state_dict(state)
    assert other.rho_on == 0.5 and other.steps_scaled == 4
    with pytest.raises(ValueError):
        EssLrScaler(rho_on=0.0)


def test_opob_advantages_broadcast_raw_rewards_and_write_the_groups():
    """slime's group-normalised rewards are not what the baseline takes: the raw ones are, from
    the whole rollout's list and this rank's partition; each sample's group gets its std."""
    args = SimpleNamespace(n_samples_per_prompt=2)
    data = {"rewards": [0.7, -0.7, 0.0, 0.0], "raw_reward": [1.0, 0.0, 0.5, 0.5], "partition": [1, 2],
            "kl": [torch.zeros(3), torch.zeros(2)], "metadata": [{"april_policy_version": 3}, None]}
    opob_advantages(args, data)
    assert [a.tolist() for a in data["advantages"]] == [[0.0] * 3, [0.5] * 2]
    assert data["returns"][0] is not data["advantages"][0]
    assert data["metadata"][0] == {"april_policy_version": 3,
                                   "april_opob_group": {"group": 0, "size": 2, "reward_std": 0.5}}
    assert data["metadata"][1] == {"april_opob_group": {"group": 1, "size": 2, "reward_std": 0.0}}
    data = {"raw_reward": [1.0, 0.0], "partition": [0, 1], "kl": [torch.zeros(1), torch.zeros(1)]}
    opob_advantages(args, data)  # no metadata from the rollout: written anyway
    assert [m["april_opob_group"]["group"] for m in data["metadata"]] == [0, 0]
    with pytest.raises(ValueError, match="non-finite"):
        opob_advantages(args, {"raw_reward": [float("nan")], "partition": [0], "kl": [torch.zeros(1)]})
    with pytest.raises(ValueError, match="raw rewards"):
        opob_advantages(args, {"rewards": [1.0], "kl": [torch.zeros(1)]})


def test_before_train_step_refuses_unsupported_parallelism():
    vcpo.reset_runtime()
    args = SimpleNamespace(april_vcpo_baseline=True, pipeline_model_parallel_size=2,
                           overlap_grad_reduce=True,
                           custom_megatron_before_train_step_hook_path="april_slime.vcpo.before_train_step",
                           custom_advantage_function_path="april_slime.vcpo.opob_advantages")
    with pytest.raises(AprilConfigError, match="pipeline parallelism.*overlap-grad-reduce"):
        vcpo.before_train_step(args, 0, 0, [nn.Linear(2, 2)], FakeMegatronOptimizer(), None)
    assert vcpo.runtime() is None


def test_gpu_bench_script_runs_tiny_on_cpu(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_vcpo_bench.py"
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(script), "--tiny", "--device", "cpu", "--steps", "1",
                           "--warmup", "0", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["rows"]] == ["plain", "plain_single", "opob_single", "opob_packed"]
    assert all(r["step_s_median"] > 0 for r in result["rows"])
    assert result["commit"] and "per-sample (varlen)" in result["baseline"]


# ------------------------------------------------------------- Transformer Engine's fused layers
class LayerNormLinear(nn.Module):
    """Transformer Engine's LayerNormLinear as Megatron's TELayerNormColumnParallelLinear sees it,
    in plain torch (TE does not run on the CPU): parameters ``layer_norm_weight`` /
    ``layer_norm_bias`` / ``weight`` / ``bias``, attributes ``normalization``, ``eps``,
    ``zero_centered_gamma``; returns ``(output, bias)`` like Megatron's wrapper."""

    def __init__(self, d_in, d_out, normalization, zero_centered_gamma):
        super().__init__()
        self.normalization, self.eps, self.zero_centered_gamma = normalization, 1e-5, zero_centered_gamma
        g = torch.Generator().manual_seed(d_out)
        self.layer_norm_weight = nn.Parameter(0.1 * torch.randn(d_in, generator=g, dtype=torch.float64))
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(0.1 * torch.randn(d_in, generator=g, dtype=torch.float64))
        self.weight = nn.Parameter(torch.randn(d_out, d_in, generator=g, dtype=torch.float64) / d_in ** 0.5)
        self.bias = nn.Parameter(0.1 * torch.randn(d_out, generator=g, dtype=torch.float64))

    def forward(self, x):
        gamma = self.layer_norm_weight + (1.0 if self.zero_centered_gamma else 0.0)
        if self.normalization == "LayerNorm":
            n = nn.functional.layer_norm(x, (x.shape[-1],), gamma, self.layer_norm_bias, self.eps)
        else:
            n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * gamma
        return nn.functional.linear(n, self.weight, self.bias), None


class TEBlockLM(nn.Module):
    """Embedding -> fused norm+qkv -> per-head RMSNorm on q (Qwen3's q_layernorm) -> fused
    norm+fc1 -> fc2 -> head; token-wise, so packed samples do not interact."""

    def __init__(self, normalization, zero_centered_gamma):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D, dtype=torch.float64)
        self.qkv = LayerNormLinear(D, D, normalization, zero_centered_gamma)
        self.q_norm = nn.RMSNorm(D // HEADS, dtype=torch.float64)
        self.fc1 = LayerNormLinear(D, FF, normalization, zero_centered_gamma)
        self.fc2 = nn.Linear(FF, D, dtype=torch.float64)
        self.head = nn.Linear(D, VOCAB, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.q_norm.weight.add_(0.1 * torch.randn(D // HEADS, generator=torch.Generator().manual_seed(5),
                                                      dtype=torch.float64))

    def forward(self, tokens):
        x = self.embed(tokens)
        h, _ = self.qkv(x)
        h = self.q_norm(h.view(*h.shape[:-1], HEADS, D // HEADS)).view(h.shape)
        x = x + h
        f, _ = self.fc1(x)
        return self.head(x + self.fc2(torch.nn.functional.gelu(f)))


@pytest.mark.parametrize("normalization,zero_centered", [("LayerNorm", False), ("RMSNorm", True)])
def test_fused_layernorm_linear_and_per_head_norm_match_per_sample_grad(normalization, zero_centered):
    model = TEBlockLM(normalization, zero_centered)
    lengths = [5, 3, 7]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (sum(lengths),), generator=g)
    segments = Packing.from_lengths(lengths).packed_segment_ids(sum(lengths) + 2)
    tokens = torch.cat([tokens, torch.zeros(2, dtype=torch.long)])  # padding
    coeffs = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)

    def per_sample_nll():
        lp = token_logprobs(model(tokens[None]), tokens[None])[0]
        # a sample's first token is predicted from the previous sample's last position: left out
        own = (segments[1:] == segments[:-1])
        return torch.stack([-lp[1:][(segments[1:] == i) & own].sum() for i in range(len(lengths))])

    params = [p for p in model.parameters()]
    ref_sq, ref_q = torch.zeros(len(lengths), dtype=torch.float64), [torch.zeros_like(p) for p in params]
    for i in range(len(lengths)):
        grads = torch.autograd.grad(per_sample_nll()[i], params)
        ref_sq[i] = sum(gr.pow(2).sum() for gr in grads)
        ref_q = [q + coeffs[i] * gr for q, gr in zip(ref_q, grads)]
    tracker = PerSampleGradNorms(model, weighted=True)
    tracker.set_microbatch(segments, len(lengths), coeffs)
    per_sample_nll().sum().backward()
    torch.testing.assert_close(tracker.last_sq_norms, ref_sq, rtol=1e-9, atol=0)
    for p, q in zip(params, ref_q):
        torch.testing.assert_close(tracker.weighted_grads[p], q, rtol=1e-9, atol=1e-12)
    tracker.remove()


def launcher_arguments(tmp_path, **env) -> list[str]:
    """The slime arguments examples/qwen3-4B-dapo-math/common.sh builds (a stand-in slime checkout
    provides the model script it sources)."""
    import os
    import pathlib
    import subprocess

    models = tmp_path / "scripts" / "models"
    models.mkdir(parents=True, exist_ok=True)
    (models / "qwen3-4B.sh").write_text("MODEL_ARGS=()\n")
    common = pathlib.Path(__file__).parents[1] / "examples" / "qwen3-4B-dapo-math" / "common.sh"
    out = subprocess.run(["bash", "-c", f'source "{common}" && printf "%s\\n" "${{PERF_ARGS[@]}}" '
                          '"${APRIL_ARGS[@]}" "${GRPO_ARGS[@]}" "${ROLLOUT_ARGS[@]}"'],
                         env={**os.environ, "SLIME_DIR": str(tmp_path), **env}, capture_output=True, text=True,
                         check=True)
    return out.stdout.split("\n")


def flag_values(argv: list[str]) -> dict:
    out, i = {}, 0
    while i < len(argv):
        if argv[i].startswith("--"):
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            out[argv[i][2:].replace("-", "_")] = argv[i + 1] if has_value else True
            i += 2 if has_value else 1
        else:
            i += 1
    return out


@pytest.mark.parametrize("mode", ["april", "copris"])
def test_launcher_vcpo_configuration_runs_the_baseline(mode, tmp_path):
    """What examples/qwen3-4B-dapo-math/common.sh passes with VCPO_HOOK=1 (the <mode>-vcpo.yaml keys on
    args, custom loss, no KL loss, TP 2 with sequence parallelism, static one-sample micro-batches on
    4 data-parallel ranks) is what VCPO's group baseline accepts; the launcher without its VCPO
    batching would be refused, naming the flag."""
    import pathlib

    import yaml

    argv = launcher_arguments(tmp_path, MODE=mode, VCPO_HOOK="1")
    flags = flag_values(argv)
    assert "use_dynamic_batch_size" not in flags and flags["micro_batch_size"] == "1"
    assert "use_kl_loss" not in flags and flags["custom_config_path"].endswith(f"{mode}-vcpo.yaml")
    args = SimpleNamespace(**yaml.safe_load(pathlib.Path(flags["custom_config_path"]).read_text()),
                           loss_type=flags["loss_type"], use_kl_loss=False, entropy_coef=0.0,
                           advantage_estimator=flags["advantage_estimator"], sequence_parallel=True,
                           tensor_model_parallel_size=int(flags["tensor_model_parallel_size"]),
                           pipeline_model_parallel_size=1, context_parallel_size=1, use_rollout_logprobs=True,
                           micro_batch_size=int(flags["micro_batch_size"]), use_dynamic_batch_size=False,
                           n_samples_per_prompt=int(flags["n_samples_per_prompt"]),
                           global_batch_size=int(flags["global_batch_size"]))
    from april_slime.job import read_settings
    from april_slime.slime_args import SlimeArgs

    config = read_settings(args).loss
    assert config.vcpo_baseline and config.vcpo_lr_scaling and config.vcpo_baseline_scope == "group"
    assert config.is_high == 8.0 and config.vcpo_rho_on == 1.0
    check_vcpo(SlimeArgs.read(args), config, dp_size=4)  # nothing refused
    assert groups_across_ranks(SlimeArgs.read(args), 4)  # each group lies two samples on each rank
    args.use_dynamic_batch_size = True
    with pytest.raises(AprilConfigError, match="group with --use-dynamic-batch-size"):
        check_vcpo(SlimeArgs.read(args), config, dp_size=4)
    args.use_dynamic_batch_size, args.micro_batch_size = False, 4
    with pytest.raises(AprilConfigError, match="--micro-batch-size 4 on 4 data-parallel ranks .* multiple of 16"):
        check_vcpo(SlimeArgs.read(args), config, dp_size=4)
    check_vcpo(SlimeArgs.read(args), config, dp_size=1)  # a divisor is enough on one rank
    args.micro_batch_size = 8  # a whole group per micro-batch: on one rank
    check_vcpo(SlimeArgs.read(args), config, dp_size=4)
    assert not groups_across_ranks(SlimeArgs.read(args), 4)
    args.micro_batch_size = 3
    with pytest.raises(AprilConfigError, match="--micro-batch-size 3 .* must divide --n-samples-per-prompt 8"):
        check_vcpo(SlimeArgs.read(args), config, dp_size=1)
    args.micro_batch_size, args.balance_data = 2, True
    with pytest.raises(AprilConfigError, match="--balance-data"):
        check_vcpo(SlimeArgs.read(args), config, dp_size=4)
    plain = flag_values(launcher_arguments(tmp_path, MODE=mode))
    assert plain["use_dynamic_batch_size"] is True and "micro_batch_size" not in plain
