"""The step deadline on a real SGLang engine, inside slime: a custom generate function whose tool
never returns for one sample, at ``april_max_staleness: 1``. The sample's group, carried from step
0 with tokens of that step's version, is due at step 1 under new weights; at
``april_step_deadline_s`` the sample is masked (``april_mask_failed_samples``), its group trains
with its other samples, and the step ends, counted in ``april/deadline_failed_samples``."""

from __future__ import annotations

from april_slime import rollout
from april_slime.masking import is_masked
from tests.support import hanging_tool as ht
from tests.support.real_tier import SlimeRolloutManager, plugin_args

DEADLINE_S = 30.0
BATCH, N = 2, 4


def test_a_due_groups_hung_tool_is_masked_at_the_step_deadline_and_the_step_ends(real_stack, tmp_path):
    settings = {"april_policy": "copris", "april_concurrency": 8, "april_max_staleness": 1,
                "april_step_deadline_s": DEADLINE_S, "april_mask_failed_samples": True}
    m = SlimeRolloutManager(plugin_args(
        real_stack, tmp_path, settings=settings, batch=BATCH, n=N, max_len=2 * ht.REAL_PER_CALL + 16,
        extra_argv=["--custom-generate-function-path", "tests.support.hanging_tool.call_then_hung_tool",
                    "--custom-reward-post-process-path", "april_slime.masking.post_process_rewards"]))
    ht.HANG_INDICES.clear()
    ht.HUNG_INDICES.clear()
    ht.HANG_INDICES.add(0)  # the first sample of the first group
    v0 = real_stack.weight_version()
    real_stack.wait_idle()  # requests an earlier test left on the shared engines end first
    try:
        samples, metrics, _ = m.generate(0)
        assert ht.HUNG_INDICES == [0], "the tool of sample 0 never started hanging"
        assert metrics["april/deadline_failed_samples"] == 0
        assert 0 not in {s.index for s in samples}
        # sample 0's group, carried with tokens of version v0: due at the next version
        hung_group = next((g for g in m.data_source.buffer.groups() if 0 in g.payload["indices"]), None)
        assert hung_group is not None and hung_group.staleness(v0 + 1) == 1, "sample 0's group is not due at step 1"

        real_stack.push_weights(real_stack.other_model_path, v0 + 1)
        samples, metrics, _ = m.generate(1)
        assert metrics["april/policy_version"] == v0 + 1
        assert metrics["april/deadline_failed_samples"] >= 1
        assert DEADLINE_S <= metrics["april/step_time_s"] < DEADLINE_S + 120, metrics["april/step_time_s"]
        by_index = {s.index: s for s in samples}
        assert 0 in by_index and is_masked(by_index[0]), "sample 0 was not trained masked in its step"
        assert metrics["april/masked_samples"] >= 1
        assert len(samples) == BATCH * N
        assert ht.HUNG_INDICES == [0], "a masked sample is not re-run"
    finally:
        rollout.shutdown()
        real_stack.restore_weights()
        ht.HANG_INDICES.clear()
