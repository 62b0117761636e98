"""sync, april and copris inside real slime against real SGLang engines behind the real router:
exactly ``rollout_batch_size`` complete groups in slime's sample contract, partials aborted at
target buffered and resumed, and (greedy, unchanged weights) an aborted and resumed sample equal
token for token to the uninterrupted generation."""

from __future__ import annotations

import math

import pytest

from april_slime import rollout
from real_tier import SlimeRolloutManager, http_json, plugin_args

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


def test_aborted_greedy_samples_resume_to_the_uninterrupted_generation(real_stack, manager_for, tmp_path):
    """Greedy (top-k 1), weights unchanged, every request aborted by the engines mid-way (an
    ``abort_all`` sent to each engine while the step runs): the partials come back, are resumed
    with prompt + partial response and the remaining budget, and every resumed sample equals the
    uninterrupted greedy generation of its prompt, token for token.

    The engines serve plain random weights here (EOS as likely as any token), so greedy responses
    run to the budget and are mid-way when the abort lands. (With equal lengths nothing is mid-way
    at an abort at target, which the other tests cover with sampled lengths.)"""
    import threading
    import time

    from transformers import AutoTokenizer

    from april_slime.localstack import build_tiny_qwen3

    max_len = 64
    plain = build_tiny_qwen3(tmp_path / "plain", tokenizer=AutoTokenizer.from_pretrained(real_stack.model_path),
                             seed=2)
    real_stack.push_weights(plain, real_stack.weight_version() + 1)

    def abort_mid_way() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            loads = [http_json("GET", f"{u}/v1/loads")[1]["loads"][0] for u in real_stack.engine_urls]
            if sum(l["num_running_reqs"] for l in loads) > 0:
                break
            time.sleep(0.05)
        time.sleep(0.4)
        for url in real_stack.engine_urls:
            http_json("POST", f"{url}/abort_request", {"abort_all": True})

    try:
        m = manager_for(settings={"april_policy": "april", "april_over_sampling_factor": 2.0}, batch=BATCH, n=N,
                        max_len=max_len, extra_argv=["--rollout-top-k", "1"])
        resumed = []
        for rollout_id in (0, 1):
            aborter = threading.Thread(target=abort_mid_way)
            aborter.start()
            samples, _, _ = m.generate(rollout_id)
            aborter.join()
            resumed += [s for s in samples if s.metadata["april_num_aborts"] > 0]
        rollout.shutdown()
        real_stack.wait_idle()
        uninterrupted = {}
        for s in resumed:
            prompt_ids = real_stack.tokenizer.encode(s.prompt, add_special_tokens=False)
            status, reply = http_json("POST", f"{real_stack.engine_urls[0]}/generate", {
                "input_ids": prompt_ids, "sampling_params": {"max_new_tokens": max_len, "temperature": 1.0,
                                                             "top_k": 1, "no_stop_trim": True}})
            assert status == 200, reply
            uninterrupted[s.index] = (prompt_ids, reply["output_ids"])
    finally:
        rollout.shutdown()
        real_stack.wait_idle()
        real_stack.restore_weights()
    assert resumed, "no aborted sample was resumed into a trained sample"
    for s in resumed:
        prompt_ids, output_ids = uninterrupted[s.index]
        assert s.tokens[len(prompt_ids):] == output_ids, (
            f"resumed sample {s.index} ({s.metadata['april_num_calls']} calls) differs from the "
            "uninterrupted greedy generation")
