"""Bounded staleness inside real slime against real SGLang engines, weights pushed before every
step under a new version: pacing keeps every trained token within ``april_max_staleness`` versions
without the restart fallback, and protection lets a response that is cut at every target finish."""

from __future__ import annotations

import pytest

from april_slime import rollout
from april_slime.core.keys import TOKEN_VERSIONS_KEY
from tests.support.real_tier import SlimeRolloutManager, plugin_args

BATCH, N = 4, 2


@pytest.fixture
def pushed_every_step(real_stack):
    """``push(step, weights)``: before every step but the first, the engines load the other of
    ``weights`` under the next version; the stack's weights are put back afterwards."""
    v0 = real_stack.weight_version()

    def push(step: int, weights: tuple) -> int:
        if step:
            real_stack.push_weights(weights[step % 2], v0 + step)
        return v0 + step

    yield push
    rollout.shutdown()
    real_stack.restore_weights()


def token_versions(sample) -> list[int]:
    return [v for v, c in sample.train_metadata[TOKEN_VERSIONS_KEY] for _ in range(c)]


def test_copris_at_max_staleness_1_keeps_every_token_within_one_version_by_pacing(real_stack, tmp_path,
                                                                                  pushed_every_step):
    """copris, max_staleness 1, long-tailed lengths (budget 200): partials are carried across
    weight pushes, every trained token lags at most one version, and no group was restarted or
    dropped (the fallback counters stay 0 on healthy engines). Steps continue (8 at most) until
    some trained sample holds tokens of two versions, so the bound was actually reached."""
    m = SlimeRolloutManager(plugin_args(real_stack, tmp_path, settings={
        "april_policy": "copris", "april_concurrency": 16, "april_max_staleness": 1},
        batch=BATCH, n=N, max_len=200))
    weights = (real_stack.model_path, real_stack.other_model_path)
    mixed = steps = 0
    for step in range(8):
        if step >= 3 and mixed:
            break
        version = pushed_every_step(step, weights)
        samples, metrics, _ = m.generate(step)
        steps += 1
        assert metrics["april/policy_version"] == version
        assert len(samples) == BATCH * N
        for s in samples:
            versions = token_versions(s)
            assert version - min(versions) <= 1, f"sample {s.index}: versions {sorted(set(versions))} at {version}"
            mixed += len(set(versions)) > 1
        assert metrics["april/token_staleness_max"] <= 1
        assert metrics["april/stale_fallback_groups"] == 0 and metrics["april/stale_discarded_tokens"] == 0
    buffer = m.data_source.buffer
    assert buffer.restarted_groups == buffer.dropped_groups == 0
    assert mixed > 0, f"no trained sample spanned two versions in {steps} steps: the bound was never reached"


def test_protected_long_responses_finish_after_one_interruption(real_stack, tmp_path, long_weights,
                                                                pushed_every_step):
    """Weights whose responses run to their 160-token budget, copris with 3 calls in flight for 4
    groups a step: the groups still running at every target are cut. With max_interruptions 1 a
    group cut once is protected at its next step and runs to its budget there: every trained
    sample was interrupted at most once, and some were, and were trained whole.

    A step protects at most its batch's worth of groups (the others wait for a later step, and may
    be cut again meanwhile). copris holds at most ``concurrency + n - 1`` calls in flight or queued
    (it opens whole groups), so at most that many groups are cut at a target: 3 + 2 - 1 = 4 =
    BATCH, so every group cut once is protected at its next step, however the machine's speed
    spreads the calls' progress."""
    max_len = 160
    concurrency = BATCH - N + 1
    m = SlimeRolloutManager(plugin_args(real_stack, tmp_path, settings={
        "april_policy": "copris", "april_concurrency": concurrency, "april_max_interruptions": 1},
        batch=BATCH, n=N, max_len=max_len))
    protected = finished_after_cut = 0
    for step in range(4):
        pushed_every_step(step + 1, long_weights)  # the long weights from the first step on
        samples, metrics, _ = m.generate(step)
        protected += metrics["april/protected_groups"]
        for s in samples:
            assert s.metadata["april_num_aborts"] <= 1, f"sample {s.index} cut {s.metadata['april_num_aborts']} times"
            if s.metadata["april_num_aborts"] == 1 and s.response_length == max_len:
                finished_after_cut += 1
        assert metrics["april/interruptions_max"] <= 1
    assert protected > 0 and finished_after_cut > 0
