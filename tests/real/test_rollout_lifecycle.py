"""The plugin's life inside real slime against real engines: the staleness bound (restart and
drop), the partial buffer through slime's checkpoint path (``RolloutManager.save`` / ``load``),
evaluation through slime's eval path, and slime's own partial rollout on the same engines as a
reference, side by side with the plugin."""

from __future__ import annotations

import math
import time

import pytest

from april_slime import rollout
from april_slime.core.keys import TOKEN_VERSIONS_KEY
from tests.support.real_tier import (
    Placement,
    SlimeRolloutManager,
    abort_and_hold,
    check_slime_contract,
    continue_generation,
    plugin_args,
    prompt_token_bound,
)

BATCH, N, MAX_LEN = 4, 2, 32


def buffered_group_ids(data_source) -> set[int]:
    return {g.payload["group_index"] for g in data_source.buffer.groups()}


def partials(data_source) -> dict[int, tuple]:
    """Buffered trajectories by slime sample index: (response ids, log-probs, version runs)."""
    return {g.payload["indices"][t.index_in_group]: (list(t.response_ids), list(t.logprobs),
                                                     [list(r) for r in t.version_runs])
            for g in data_source.buffer.groups() for t in g.trajectories}


def oldest_versions(samples) -> set[int]:
    return {min(v for v, _ in s.train_metadata[TOKEN_VERSIONS_KEY]) for s in samples}


@pytest.mark.parametrize("action", ["restart", "drop"])
def test_staleness_bound_restarts_or_drops_buffered_groups(real_stack, tmp_path, action):
    """max_staleness 1 and a weight push that skips a version (what the staleness pacing cannot
    foresee): every buffered group is then two versions stale, so step 2 either regenerates it
    from its prompt under the new version or discards it (counted): the fallback."""
    settings = {"april_policy": "april", "april_over_sampling_factor": 3.0, "april_max_staleness": 1,
                "april_stale_action": action}
    m = SlimeRolloutManager(plugin_args(real_stack, tmp_path, settings=settings, batch=BATCH, n=N,
                                        max_len=MAX_LEN))
    try:
        m.generate(0)
        # a group is stale by its oldest token: groups aborted before any token are not
        stale = {g.payload["group_index"] for g in m.data_source.buffer.groups()
                 if any(t.response_ids for t in g.trajectories)}
        assert stale, "nothing was buffered at the abort"
        # the engines free aborted requests a moment after their replies; push_weights waits for them
        version = real_stack.weight_version() + 2
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


def test_partial_buffer_survives_slime_checkpoint_save_and_load(real_stack, long_weights, tmp_path):
    """``RolloutManager.save`` after a step, a new job ``--load``-ing that checkpoint: every
    buffered partial comes back with its tokens, log-probs and versions, and is resumed first.

    The partials are placed, not hoped for (a budget of 32 can finish every request before the
    abort at target on a busy machine, and leave only finished samples and untouched ones). One
    sample per prompt, so a group lives on one engine: direct dispatch puts the step's six groups
    three and three on the two engines, whose weights never end a response before its 256-token
    budget. Once the second engine's requests are seen running with tokens, SGLang's abort pause
    cuts them there (their replies carry the tokens) and holds what the plugin sends it again; the
    first engine's groups run to their budget and meet the target; the drain leaves the held calls
    with the tokens they had. The checkpoint saved after that step holds unfinished samples with
    tokens (checked), and the new job's step, asking for exactly as many groups as were buffered
    with no over-provisioning, must take them first and finish every one: each restored partial
    is then resumed and trained. A step whose requests the poll missed is followed by another, at
    most 3 steps (see ``Placement``)."""
    n, max_len, each, attempts = 1, 256, 4, 3
    real_stack.push_weights(long_weights[0], real_stack.weight_version() + 1)
    held = real_stack.engine_urls[1]
    settings = {"april_policy": "april", "april_over_sampling_factor": 3.0}
    try:
        first = SlimeRolloutManager(plugin_args(real_stack, tmp_path / "a", settings=settings, batch=2, n=n,
                                                max_len=max_len))
        prompt_tokens = prompt_token_bound(real_stack, first.manager.args.prompt_data)
        placed = False
        try:
            for saved_id in range(attempts):
                placement = Placement([held], lambda: abort_and_hold([held]), running=2, tokens_each=each,
                                      prompt_tokens=prompt_tokens)
                try:
                    first.generate(saved_id)
                finally:
                    placed = placement.finish()
                    continue_generation([held])
                if placed:
                    break
            first.save(saved_id)
        finally:
            rollout.shutdown()
            real_stack.wait_idle()
        assert placed, f"in {attempts} steps the poll never saw the requests on {held} running with {each} tokens each"
        saved = partials(first.data_source)
        unfinished = [i for g in first.data_source.buffer.groups() for t in g.trajectories
                      if t.response_ids and not t.status.finished
                      for i in [g.payload["indices"][t.index_in_group]]]
        assert unfinished, f"the abort on {held} left no unfinished sample with tokens in the buffer: {saved}"
        assert (tmp_path / "a" / "ckpt" / "rollout" / f"april_state_{saved_id}.bin").exists()
        # the trainer's half of the checkpoint; slime only --load-s a folder Megatron has saved into
        (tmp_path / "a" / "ckpt" / "latest_checkpointed_iteration.txt").write_text(str(saved_id + 1))

        n_buffered = len(buffered_group_ids(first.data_source))
        second = SlimeRolloutManager(plugin_args(real_stack, tmp_path / "b", batch=n_buffered, n=n, max_len=max_len,
                                                 settings={"april_policy": "april", "april_over_sampling_factor": 1.0},
                                                 load=str(tmp_path / "a" / "ckpt")))
        second.load(saved_id)
        assert partials(second.data_source) == saved
        # slime's own data-source state came back too: no prompt of step 0 is handed out again
        try:
            samples, _, train = second.generate(saved_id + 1)
        finally:
            rollout.shutdown()
            real_stack.wait_idle()
    finally:
        real_stack.restore_weights()
    check_slime_contract(samples, train, tokenizer=real_stack.tokenizer, batch=n_buffered, n=n, max_len=max_len,
                         prompt_of=lambda s: s.prompt)
    assert {s.index for s in samples} == set(saved), "the step did not take the restored groups first"
    for s in samples:
        before = saved[s.index]
        assert s.tokens[-s.response_length:][:len(before[0])] == before[0], f"sample {s.index} lost its partial"
        assert s.rollout_log_probs[:len(before[1])] == before[1]
    resumed = [s for s in samples if saved[s.index][0] and saved[s.index][0] != s.tokens[-s.response_length:]]
    assert {s.index for s in resumed} == set(unfinished), "a restored partial was not resumed"
    assert all(s.metadata["april_num_aborts"] > 0 for s in resumed)


def test_evaluation_goes_through_slimes_eval_path(real_stack, tmp_path):
    """``--eval-prompt-data`` with the plugin's rollout function: slime's own eval path generates
    ``--n-samples-per-eval-prompt`` complete samples of each eval prompt under the eval budget,
    rewards them with the job's reward function, and leaves the training data source alone (no
    prompt taken, no partial buffered or resumed)."""
    import json

    from slime.rollout.base_types import call_rollout_fn
    from slime.utils.types import Sample

    from tests.support.real_tier import write_prompts

    eval_data = write_prompts(tmp_path / "eval.jsonl", 3, seed=7)
    eval_rows = [json.loads(line) for line in eval_data.read_text(encoding="utf-8").splitlines()]
    eval_len, per_prompt = 16, 2
    args = plugin_args(real_stack, tmp_path, settings={"april_policy": "copris"}, batch=BATCH, n=N,
                       max_len=MAX_LEN, extra_argv=["--eval-prompt-data", "arith", str(eval_data),
                                                    "--n-samples-per-eval-prompt", str(per_prompt),
                                                    "--eval-max-response-len", str(eval_len)])
    m = SlimeRolloutManager(args)
    try:
        m.generate(0)
        buffer_before = m.data_source.buffer.state_dict()
        pointer_before = m.data_source._prompts.sample_group_index
        out = call_rollout_fn(m.manager.eval_generate_rollout, args, 0, m.data_source, evaluation=True)
        m.eval(0)  # slime's RolloutManager.eval: the same call plus its eval logging
    finally:
        rollout.shutdown()
        real_stack.wait_idle()
    assert m.data_source.buffer.state_dict() == buffer_before, "evaluation touched the partial buffer"
    assert m.data_source._prompts.sample_group_index == pointer_before, "evaluation took training prompts"
    assert set(out.data) == {"arith"}
    data = out.data["arith"]
    samples = data["samples"]
    tok = real_stack.tokenizer
    assert len(samples) == len(data["rewards"]) == len(data["truncated"]) == len(eval_rows) * per_prompt
    assert [s.index for s in samples] == list(range(len(samples)))
    for s, reward, truncated in zip(samples, data["rewards"], data["truncated"]):
        row = eval_rows[s.index // per_prompt]  # slime numbers an eval prompt's samples consecutively
        assert (s.prompt, s.label) == (row["prompt"], row["label"])
        assert s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED), f"sample {s.index}: {s.status}"
        prompt_ids = tok.encode(s.prompt, add_special_tokens=False)
        response = s.tokens[len(prompt_ids):]
        assert s.tokens[:len(prompt_ids)] == prompt_ids and len(response) == s.response_length
        assert 0 < s.response_length <= eval_len, "the eval budget, not the training one"
        assert s.response == tok.decode(response)
        assert truncated == (s.status == Sample.Status.TRUNCATED)
        if truncated:
            assert s.response_length == eval_len and tok.eos_token_id not in response
        else:
            assert response[-1] == tok.eos_token_id
        # the job's --custom-rm-path, computed from this response
        assert reward == s.reward == float(s.response_length % 2)
        assert s.metadata.get("april_num_aborts", 0) == 0, "an eval sample was aborted and resumed"


def response_of(sample) -> tuple[list[int], list[float]]:
    """(response ids, rollout log-probs) of a slime sample, also of a partial one."""
    ids = sample.tokens[len(sample.tokens) - sample.response_length:] if sample.response_length else []
    return list(ids), list(sample.rollout_log_probs or [])


def buffered_partials(data_source) -> dict[int, tuple[list[int], list[float]]]:
    """Buffered samples by index, (response ids, log-probs), for slime's buffer or the plugin's."""
    if hasattr(data_source, "codec"):  # the plugin's AprilDataSource
        return {i: (ids, lps) for i, (ids, lps, _) in partials(data_source).items()}
    return {s.index: response_of(s) for group in data_source.buffer for s in group}


@pytest.mark.parametrize("data_source", ["slime.rollout.data_source.RolloutDataSourceWithBuffer",
                                         "april_slime.rollout.AprilDataSource"])
def test_slime_builtin_partial_rollout_side_by_side(real_stack, tmp_path, data_source):
    """slime's own ``--partial-rollout`` (batch-granular over-sampling, abort, FIFO buffer) on the
    same engines, as the reference: with its own data source and with the plugin's (whose
    ``get_samples`` / ``add_samples`` it then drives); then the plugin's april policy with the same
    batch and over-sampling, timed in the same run.

    All three must meet what slime's trainer relies on (tokens = prompt + response, one loss-mask
    entry and one rollout log-prob per response token, only complete or truncated samples, exact
    batch) and stitch exactly: a partial buffered at the end of step 0 is, after step 1 (trained,
    or buffered again), its old tokens and log-probs followed by the new ones."""
    from slime.utils.types import Sample

    # a long budget over the stack's long-tailed lengths (EOS ~1/24 per token): when the target is
    # reached the slowest requests are far from done, so partials with tokens are buffered however
    # fast the engines run (with a budget of 32 a fast engine can finish every request first)
    over, max_len = 2 * BATCH, 256
    slime_args_ = plugin_args(real_stack, tmp_path / "slime", settings={"april_policy": "april"}, batch=BATCH,
                              n=N, max_len=max_len,
                              extra_argv=["--rollout-function-path", "slime.rollout.sglang_rollout.generate_rollout",
                                          "--data-source-path", data_source, "--partial-rollout",
                                          "--over-sampling-batch-size", str(over)])
    ours_args = plugin_args(real_stack, tmp_path / "ours", settings={"april_policy": "april"}, batch=BATCH, n=N,
                            max_len=max_len, extra_argv=["--over-sampling-batch-size", str(over)])
    tok = real_stack.tokenizer
    times = {}
    for name, args in (("slime", slime_args_), ("april_slime", ours_args)):
        m = SlimeRolloutManager(args)
        start = time.monotonic()
        stitched, lost, steps = 0, [], 0
        try:
            # two steps, and more (at most 4) until a buffered partial has been resumed: slime's
            # FIFO buffer resumes its partials first, but they need not finish within one step
            for rollout_id in range(4):
                before = {i: p for i, p in buffered_partials(m.data_source).items() if p[0]}
                samples, _, train = m.generate(rollout_id)
                steps += 1
                assert len(samples) == BATCH * N and len({s.group_index for s in samples}) == BATCH, name
                for s in samples:
                    prompt_ids = tok.encode(s.prompt, add_special_tokens=False)
                    assert s.tokens[:len(prompt_ids)] == prompt_ids, (name, s.index)
                    assert len(s.tokens) == len(prompt_ids) + s.response_length, (name, s.index)
                    assert 0 < s.response_length <= max_len, (name, s.index)
                    assert s.loss_mask == [1] * s.response_length, (name, s.index)
                    assert len(s.rollout_log_probs) == s.response_length, (name, s.index)
                    assert all(math.isfinite(x) and x <= 0 for x in s.rollout_log_probs), (name, s.index)
                    assert s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED), (name, s.index, s.status)
                    assert s.response == tok.decode(s.tokens[len(prompt_ids):]), (name, s.index)
                    assert s.reward == float(s.response_length % 2), (name, s.index)
                assert train["tokens"] == [s.tokens for s in samples]
                assert train["rollout_log_probs"] == [s.rollout_log_probs for s in samples]
                assert train["loss_masks"] == [s.loss_mask for s in samples]
                # every partial buffered before the step: trained or buffered again, its old tokens
                # and log-probs followed by the new ones
                after = {**buffered_partials(m.data_source), **{s.index: response_of(s) for s in samples}}
                for index, (ids, lps) in before.items():
                    if index not in after:
                        lost.append(index)
                        continue
                    new_ids, new_lps = after[index]
                    assert new_ids[:len(ids)] == ids and new_lps[:len(lps)] == lps, (
                        f"{name}: sample {index} does not continue its buffered partial")
                    stitched += len(new_ids) > len(ids)
                if rollout_id >= 1 and stitched:
                    break
        finally:
            rollout.shutdown()
            real_stack.wait_idle()
        times[name] = (time.monotonic() - start) / steps
        assert stitched, f"{name}: no buffered partial with tokens was resumed in {steps} steps"
        # slime's rollout drops groups that complete beyond the target ("not stored back to the data
        # buffer", sglang_rollout.py), a resumed one included; the plugin's april policy returns them
        if name == "april_slime":
            assert not lost, f"the plugin lost buffered partials {lost}"
    print(f"\nmean step time, {BATCH}x{N} samples, over-sampling {over}: "
          + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()))
