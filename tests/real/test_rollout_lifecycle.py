"""The plugin's life inside real slime against real engines: the staleness bound (restart and
drop), the partial buffer through slime's checkpoint path (``RolloutManager.save`` / ``load``),
evaluation through slime's eval path, and slime's own partial rollout on the same engines as a
reference, side by side with the plugin."""

from __future__ import annotations

import time

import pytest

from april_slime import rollout
from real_tier import SlimeRolloutManager, plugin_args
from test_rollout_policies import check_slime_contract

BATCH, N, MAX_LEN = 4, 2, 32


def buffered_group_ids(data_source) -> set[int]:
    return {g.payload["group_index"] for g in data_source.buffer.groups()}


def partials(data_source) -> dict[int, tuple]:
    """Buffered trajectories by slime sample index: (response ids, log-probs, version runs)."""
    return {g.payload["indices"][t.index_in_group]: (list(t.response_ids), list(t.logprobs),
                                                     [list(r) for r in t.version_runs])
            for g in data_source.buffer.groups() for t in g.trajectories}


def oldest_versions(samples) -> set[int]:
    return {min(v for v, _ in s.train_metadata[rollout.TOKEN_VERSIONS_KEY]) for s in samples}


@pytest.mark.parametrize("action", ["restart", "drop"])
def test_staleness_bound_restarts_or_drops_buffered_groups(real_stack, tmp_path, action):
    """max_staleness 0: after a weight push every buffered group is one version stale, so step 2
    either regenerates it from its prompt under the new version or discards it (counted)."""
    settings = {"april_policy": "april", "april_over_sampling_factor": 3.0, "april_max_staleness": 0,
                "april_stale_action": action}
    m = SlimeRolloutManager(plugin_args(real_stack, tmp_path, settings=settings, batch=BATCH, n=N,
                                        max_len=MAX_LEN))
    try:
        m.generate(0)
        # a group is stale by its oldest token: groups aborted before any token are not
        stale = {g.payload["group_index"] for g in m.data_source.buffer.groups()
                 if any(t.response_ids for t in g.trajectories)}
        assert stale, "nothing was buffered at the abort"
        version = real_stack.weight_version() + 1
        real_stack.push_weights(real_stack.model_path, version)
        samples, metrics, _ = m.generate(1)
    finally:
        rollout.shutdown()
        real_stack.wait_idle()
    assert oldest_versions(samples) == {version}, "a token older than the staleness bound was trained"
    trained = {s.group_index for s in samples}
    for g in m.data_source.buffer.groups():  # regenerated in step 1 and aborted again, or untouched new
        assert all(v == version for t in g.trajectories for v, _ in t.version_runs)
    if action == "restart":
        assert metrics["april/stale_restarted_groups"] == len(stale)
        restarted = [s for s in samples if s.group_index in stale]
        assert all(s.metadata["april_group_restarts"] >= 1 for s in restarted)
    else:
        assert metrics["april/stale_dropped_groups"] == len(stale)
        assert not trained & stale, "a dropped group was trained"
        assert not buffered_group_ids(m.data_source) & stale, "a dropped group is still buffered"


def test_partial_buffer_survives_slime_checkpoint_save_and_load(real_stack, tmp_path):
    """``RolloutManager.save`` after a step, a new job ``--load``-ing that checkpoint: every
    buffered partial comes back with its tokens, log-probs and versions, and is resumed first."""
    settings = {"april_policy": "april", "april_over_sampling_factor": 3.0}
    first = SlimeRolloutManager(plugin_args(real_stack, tmp_path / "a", settings=settings, batch=BATCH, n=N,
                                            max_len=MAX_LEN))
    try:
        first.generate(0)
        first.save(0)
    finally:
        rollout.shutdown()
        real_stack.wait_idle()
    saved = partials(first.data_source)
    assert any(ids for ids, _, _ in saved.values()), "no partial tokens were buffered"
    assert (tmp_path / "a" / "ckpt" / "rollout" / "april_state_0.json").exists()
    # the trainer's half of the checkpoint; slime only --load-s a folder Megatron has saved into
    (tmp_path / "a" / "ckpt" / "latest_checkpointed_iteration.txt").write_text("1")

    second = SlimeRolloutManager(plugin_args(real_stack, tmp_path / "b", settings=settings, batch=BATCH, n=N,
                                             max_len=MAX_LEN, load=str(tmp_path / "a" / "ckpt")))
    second.load(0)
    assert partials(second.data_source) == saved
    # slime's own data-source state came back too: no prompt of step 0 is handed out again
    try:
        samples, _, train = second.generate(1)
    finally:
        rollout.shutdown()
        real_stack.wait_idle()
    check_slime_contract(samples, train, tokenizer=real_stack.tokenizer, batch=BATCH, n=N, max_len=MAX_LEN,
                         prompt_of=lambda s: s.prompt)
    resumed = [s for s in samples if s.metadata["april_num_aborts"] > 0]
    assert resumed, "the restored partials were not resumed first"
    for s in resumed:
        before = saved[s.index]
        assert s.tokens[-s.response_length:][:len(before[0])] == before[0]
        assert s.rollout_log_probs[:len(before[1])] == before[1]


def test_evaluation_goes_through_slimes_eval_path(real_stack, tmp_path):
    from slime.rollout.base_types import call_rollout_fn

    from real_tier import write_prompts

    eval_data = write_prompts(tmp_path / "eval.jsonl", 3, seed=7)
    args = plugin_args(real_stack, tmp_path, settings={"april_policy": "copris"}, batch=BATCH, n=N,
                       max_len=MAX_LEN, extra_argv=["--eval-prompt-data", "arith", str(eval_data),
                                                    "--n-samples-per-eval-prompt", "2",
                                                    "--eval-max-response-len", "16"])
    m = SlimeRolloutManager(args)
    try:
        m.generate(0)
        out = call_rollout_fn(m.manager.eval_generate_rollout, args, 0, m.data_source, evaluation=True)
        m.eval(0)  # slime's RolloutManager.eval: the same call plus its eval logging
    finally:
        rollout.shutdown()
        real_stack.wait_idle()
    data = out.data["arith"]
    assert len(data["rewards"]) == 3 * 2
    assert all(r in (0.0, 1.0) for r in data["rewards"])
    assert all(s.response_length <= 16 for s in data["samples"])


@pytest.mark.parametrize("data_source", ["slime.rollout.data_source.RolloutDataSourceWithBuffer",
                                         "april_slime.rollout.AprilDataSource"])
def test_slime_builtin_partial_rollout_side_by_side(real_stack, tmp_path, data_source):
    """slime's own ``--partial-rollout`` (batch-granular over-sampling, abort, FIFO buffer) on the
    same engines, as the reference: with its own data source and with the plugin's (whose
    ``get_samples`` / ``add_samples`` it then drives); then the plugin's april policy with the same
    batch and over-sampling, timed in the same run."""
    over = 2 * BATCH
    slime_args_ = plugin_args(real_stack, tmp_path / "slime", settings={"april_policy": "april"}, batch=BATCH,
                              n=N, max_len=MAX_LEN,
                              extra_argv=["--rollout-function-path", "slime.rollout.sglang_rollout.generate_rollout",
                                          "--data-source-path", data_source, "--partial-rollout",
                                          "--over-sampling-batch-size", str(over)])
    ours_args = plugin_args(real_stack, tmp_path / "ours", settings={"april_policy": "april"}, batch=BATCH, n=N,
                            max_len=MAX_LEN, extra_argv=["--over-sampling-batch-size", str(over)])
    times = {}
    for name, args in (("slime", slime_args_), ("april_slime", ours_args)):
        m = SlimeRolloutManager(args)
        start = time.monotonic()
        try:
            for rollout_id in range(2):
                samples, _, train = m.generate(rollout_id)
                assert len(samples) == BATCH * N
                assert all(len(s.loss_mask) == s.response_length == len(s.rollout_log_probs) for s in samples)
                assert train["rollout_log_probs"] == [s.rollout_log_probs for s in samples]
        finally:
            rollout.shutdown()
            real_stack.wait_idle()
        times[name] = (time.monotonic() - start) / 2
    print(f"\nmean step time, {BATCH}x{N} samples, over-sampling {over}: "
          + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()))
