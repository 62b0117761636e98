"""sync, april and copris inside real slime against real SGLang engines behind the real router:
exactly ``rollout_batch_size`` complete groups in slime's sample contract, aborted partials
buffered and resumed, and (greedy, unchanged weights) a resumed sample equal token for token to the
uninterrupted generation."""

from __future__ import annotations

import math

import pytest

from april_slime import rollout
from conftest import SlimeRolloutManager, http_json, plugin_args

BATCH, N, MAX_LEN = 4, 2, 32


@pytest.fixture
def manager_for(real_stack, tmp_path):
    """Builds a ``SlimeRolloutManager`` for the plugin; leaves the engines idle afterwards."""
    built = []

    def make(**kw) -> SlimeRolloutManager:
        m = SlimeRolloutManager(plugin_args(real_stack, tmp_path / f"job{len(built)}", **kw))
        built.append(m)
        return m

    yield make
    rollout.shutdown()
    real_stack.wait_idle()


def check_slime_contract(samples, train, *, tokenizer, batch: int, n: int, max_len: int, prompt_of) -> None:
    """What slime's trainer relies on, checked sample by sample."""
    from slime.utils.types import Sample

    eos = tokenizer.eos_token_id
    assert len(samples) == batch * n
    groups = [samples[i:i + n] for i in range(0, len(samples), n)]
    assert len({g[0].group_index for g in groups}) == batch
    for group in groups:
        assert len({s.group_index for s in group}) == 1, "a group's samples are consecutive"
    assert [s.index for s in samples] == sorted(s.index for s in samples), "sorted by index as slime sorts"
    assert len({s.index for s in samples}) == len(samples)
    for s in samples:
        prompt_ids = tokenizer.encode(prompt_of(s), add_special_tokens=False)
        response = s.tokens[len(prompt_ids):]
        assert s.tokens[:len(prompt_ids)] == prompt_ids
        assert len(response) == s.response_length == len(s.rollout_log_probs) == len(s.loss_mask)
        assert 0 < s.response_length <= max_len
        assert s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED), s.status
        if s.status == Sample.Status.COMPLETED:
            assert response[-1] == eos, "COMPLETED ends with EOS (the model's only stop)"
            assert eos not in response[:-1], "a stop inside the response: two responses trained as one"
        else:
            assert s.response_length == max_len and eos not in response
        assert all(math.isfinite(lp) and lp <= 0 for lp in s.rollout_log_probs)
        assert s.response == tokenizer.decode(response)
        assert s.weight_versions and all(str(int(v)) == v for v in s.weight_versions)
        runs = s.train_metadata[rollout.TOKEN_VERSIONS_KEY]
        assert sum(c for _, c in runs) == s.response_length
        assert s.reward == float(s.response_length % 2)
    assert train["tokens"] == [s.tokens for s in samples]
    assert train["rollout_log_probs"] == [s.rollout_log_probs for s in samples]
    assert train["loss_masks"] == [[1] * s.response_length for s in samples]
    assert train["metadata"] == [s.train_metadata for s in samples]


@pytest.mark.parametrize("policy", ["sync", "april", "copris"])
def test_policy_delivers_exact_batch_in_slime_contract(real_stack, manager_for, policy):
    m = manager_for(settings={"april_policy": policy}, batch=BATCH, n=N, max_len=MAX_LEN)
    seen_groups: set[int] = set()
    resumed = 0
    for rollout_id in range(3):
        samples, metrics, train = m.generate(rollout_id)
        check_slime_contract(samples, train, tokenizer=real_stack.tokenizer, batch=BATCH, n=N, max_len=MAX_LEN,
                             prompt_of=lambda s: s.prompt)
        groups = {s.group_index for s in samples}
        assert not groups & seen_groups, "a prompt group trained twice"
        seen_groups |= groups
        resumed += sum(1 for s in samples if s.metadata["april_num_aborts"] > 0)
        if policy == "sync":
            assert len(m.data_source.buffer) == 0, "sync never aborts, so never buffers"
            assert all(s.metadata["april_num_calls"] == 1 for s in samples)
    if policy != "sync":
        # over-provisioned policies abort at target; some partials came back and finished
        assert resumed > 0 or len(m.data_source.buffer) > 0


def test_abort_at_target_buffers_partials_and_greedy_resume_equals_uninterrupted(real_stack, manager_for):
    """april with twice the groups in flight, greedy (top-k 1), weights unchanged: step 1 aborts
    the surplus and buffers its partial samples; step 2 resumes them first; every resumed sample
    equals the uninterrupted greedy generation of its prompt, token for token."""
    max_len = 48
    m = manager_for(settings={"april_policy": "april", "april_over_sampling_factor": 3.0}, batch=BATCH, n=N,
                    max_len=max_len, extra_argv=["--rollout-top-k", "1"])
    m.generate(0)
    buffer = m.data_source.buffer
    partial = buffer.num_partial_trajectories()
    assert partial > 0, "the abort at target left no partial sample to buffer"
    resumed = []
    for rollout_id in (1, 2):
        samples, _, _ = m.generate(rollout_id)
        resumed += [s for s in samples if s.metadata["april_num_aborts"] > 0 and s.response_length > 0]
    assert resumed, "no buffered partial was resumed into a trained sample"
    tok = real_stack.tokenizer
    for s in resumed:
        prompt_ids = tok.encode(s.prompt, add_special_tokens=False)
        status, reply = http_json("POST", f"{real_stack.engine_urls[0]}/generate", {
            "input_ids": prompt_ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_len, "temperature": 1.0, "top_k": 1, "no_stop_trim": True,
                                "skip_special_tokens": False}})
        assert status == 200, reply
        assert s.tokens[len(prompt_ids):] == reply["output_ids"], (
            f"resumed sample {s.index} ({s.metadata['april_num_calls']} calls) differs from the "
            "uninterrupted greedy generation")
