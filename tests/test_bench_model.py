"""The bench's model of the papers' systems: veRL's split dispatch, the training phase with its
log-prob recompute of buffered partials, the length laws' published statistics, and the fit's
training calibration. Structural checks on small runs; the published figures are the reproduce
table's business (docs/bench.md)."""

from dataclasses import replace

import numpy as np
import pytest

from april_slime.core.versions import VersionRuns
from april_workbench.bench import ENGINE_PRESETS, Workload, run_benchmark
from april_workbench.bench.dispatch import SplitDispatch
from april_workbench.bench.fit import step_seconds, verl_training
from april_workbench.bench.laws import solve, statistics, with_fields
from april_workbench.bench.reproduce import dapo_arm, published_statistic
from april_workbench.bench.runner import _carried_tokens, run_policy
from april_workbench.emulator import run_virtual
from april_workbench.emulator.model import LengthModel


def tiny(**kw):
    args = dict(name="tiny", length="short:median_tokens=150,truncation_fraction=0.05", max_response_len=600,
                prompt_len=16, rollout_batch_size=8, n_samples_per_prompt=4, steps=3, warmup_steps=1,
                policies=("sync-split",), timeline_interval_s=0.5, load_poll_interval_s=1.0)
    args.update(kw)
    return Workload(**args)


SPEC = replace(ENGINE_PRESETS["h100-qwen3-4b"], num_engines=4, kv_capacity_tokens=12_000, decode_t0=0.03,
               prefill_t0=0.001)


class Recording:
    """A transport that records which engine each generate went to."""

    def __init__(self):
        self.sent: list[tuple[str, str]] = []

    async def request(self, method, url, path, payload, timeout_s):
        self.sent.append((url, payload["rid"] if payload else ""))
        return {}

    async def close(self):
        pass


def test_split_dispatch_sends_each_prompt_to_its_chunk_engine():
    urls = [f"http://e{i}" for i in range(4)]
    inner = Recording()
    split = SplitDispatch(inner, urls, prompts_per_step=8)

    async def go():
        for index in range(16):  # two steps of 8 prompts: chunks of 2 prompts per engine, every step
            for j in range(2):
                await split.request("POST", urls[3], "/generate", {"rid": f"p{index}/{j}#0"}, 1.0)
        # anything else passes through: other endpoints, and the scheduler's health probes
        await split.request("GET", urls[3], "/v1/loads", None, 1.0)
        await split.request("POST", urls[2], "/generate", {"rid": "april-probe-1f2e"}, 1.0)

    run_virtual(go())
    engines = [urls.index(url) for url, _ in inner.sent[:-2]]
    assert engines == [(i % 8) // 2 for i in range(16) for _ in range(2)]
    assert [url for url, _ in inner.sent[-2:]] == [urls[3], urls[2]] and split.routed == [8, 8, 8, 8]
    assert split.engine_of("episode-7#0") is None and split.engine_of("p12/3#1") == 2


def test_sync_split_waits_for_the_slowest_chunk():
    w = tiny(policies=("sync", "sync-split"))
    result = run_benchmark(w, SPEC)
    split, balanced = result.summaries["sync-split"], result.summaries["sync"]
    # the same samples are trained; a static split can only lose to least-loaded dispatch
    assert split["trained_tokens"] == balanced["trained_tokens"]
    assert split["rollout_s_per_step"] >= balanced["rollout_s_per_step"] * 0.999
    with pytest.raises(ValueError, match="sync-split"):
        tiny(policies=("sync-split",), turns_min=2, turns_max=3)


def test_training_phase_charges_the_buffer_only_where_the_trainer_recomputes_it():
    verl = ENGINE_PRESETS["a800-r1-distill-1.5b-vllm"]
    slime = ENGINE_PRESETS["h100-qwen3-4b"]
    assert verl.logprob_buffered and not slime.logprob_buffered
    parts = verl.train_parts(10**6, 2 * 10**6)
    assert parts["buffered"] == pytest.approx(2 * 10**6 * verl.logprob_seconds_per_token())
    assert slime.train_parts(10**6, 2 * 10**6)["buffered"] == 0.0
    assert verl.train_time(10**6, 2 * 10**6) == pytest.approx(sum(parts.values()))
    # the update and the log-prob forward each at their MFU, on every GPU of the job
    per_token = (verl.train_flops_per_token_param / verl.train_mfu
                 + verl.logprob_flops_per_token_param / verl.logprob_mfu) * verl.params / (
        verl.num_gpus * verl.bf16_flops)
    assert verl.train_seconds_per_token() == pytest.approx(per_token)
    # a copris run on a spec that recomputes buffered log-probs pays for what its buffer holds
    w = tiny(policies=("copris",), steps=4, concurrency=48)
    charged = replace(SPEC, logprob_buffered=True, train_s_per_token=0.0, logprob_s_per_token=1e-4)
    summary = run_benchmark(w, charged).summaries["copris"]
    assert summary["buffer_tokens_mean"] > 0
    assert summary["buffered_logprob_s_per_step"] == pytest.approx(1e-4 * summary["buffer_tokens_mean"])


def test_verl_training_reproduces_copris_table_2_split():
    spec = ENGINE_PRESETS["a800-r1-distill-1.5b-vllm"]
    reference = {"train_tokens_per_step": 1.5e6, "buffer_tokens_mean": 2.0e6, "rollout_s_per_step": 75.0,
                 "step_s": 100.0, "steps_per_hour_all": 36.0}
    fitted = replace(spec, **verl_training(reference, spec))
    parts = fitted.train_parts(1.5e6, 2.0e6)
    logprob = fitted.logprob_seconds_per_token() * (1.5e6 + 2.0e6)
    assert logprob == pytest.approx(published_statistic("CoPRIS tab. 2 N'=1024 log-prob seconds")["published"])
    assert sum(parts.values()) - logprob == pytest.approx(
        published_statistic("CoPRIS tab. 2 N'=1024 other training seconds")["published"])
    redone = step_seconds(reference, fitted)
    assert redone["step_s"] == pytest.approx(75.0 + sum(parts.values()))


def test_laws_meet_the_statistics_they_are_solved_for():
    law = solve(with_fields("dapo-math-qwen3-4b-16k", median_tokens=4000), "prompt_sigma", "sigma_batch", 4250,
                0.0, 2.5)
    assert statistics(law)["sigma_batch"] == pytest.approx(4250, rel=0.01)
    assert LengthModel.parse(law).median_tokens == 4000
    dapo = dapo_arm("dapo-math-qwen3-4b-16k")
    assert statistics(dapo)["sigma_group"] == pytest.approx(2400, rel=0.01)
    # with_fields keeps the preset's name and refuses what the emulator refuses
    assert with_fields("short:median_tokens=10", shape=3) == "short:median_tokens=10,shape=3"
    with pytest.raises(ValueError):
        with_fields("short", bogus=1)
    # the fitted DAPO-Math law is what APRIL measured: batch spread 4,000-4,500, groups < 1,500
    fitted = statistics("dapo-math-qwen3-4b-16k")
    assert 4000 <= fitted["sigma_batch"] <= 4500 and fitted["sigma_group"] < 1500


def test_carried_tokens_count_what_a_resumed_sample_made_before_its_abort():
    class T:
        def __init__(self, runs):
            self.version_runs = VersionRuns.of(runs)

    class G:
        def __init__(self, *t):
            self.trajectories = list(t)

    groups = [G(T([[3, 100], [4, 50]]), T([[4, 70]])), G(T([[2, 10], [3, 20], [4, 5]]), T([]))]
    assert _carried_tokens(groups) == 100 + 30
    # in a run: april parks partials, sync never does
    w = tiny(policies=("april",), steps=4)

    async def go():
        return await run_policy("april", "april", w, SPEC)

    run = run_virtual(go())
    assert sum(s.carried_tokens for s in run.steps) > 0
    assert np.all([s.carried_tokens <= s.metrics["april/returned_tokens"] for s in run.steps])


def test_the_dapo_baseline_aborts_at_its_target_and_keeps_nothing():
    """``sync-oversample`` is slime's baseline under dynamic sampling: over-sample, abort at the
    target, discard the partials. It carries no token into a later step, and its steps are not
    paced (a staleness bound of 0 would hold every opened group until it finished: no abort)."""
    w = tiny(policies=("sync-oversample",), steps=4)

    async def go():
        return await run_policy("sync-oversample", "sync-oversample", w, SPEC)

    run = run_virtual(go())
    assert all(s.carried_tokens == 0 and s.buffer_tokens == 0 for s in run.steps)
    assert sum(s.metrics["april/abort_calls"] for s in run.steps) > 0
    assert run.settings["max_staleness"] is None
