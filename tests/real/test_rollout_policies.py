"""sync, april and copris inside real slime against real SGLang engines behind the real router:
exactly ``rollout_batch_size`` complete groups in slime's sample contract, partials aborted at
target buffered and resumed, and (greedy, unchanged weights) an aborted and resumed sample equal
token for token to the uninterrupted generation."""

from __future__ import annotations

import pytest

from april_slime import rollout
from tests.support.real_tier import (
    Placement,
    SlimeRolloutManager,
    abort_and_hold,
    check_slime_contract,
    continue_generation,
    http_json,
    load_weights,
    plugin_args,
    prompt_token_bound,
    version_spans,
)

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


def test_aborted_greedy_samples_resume_to_the_uninterrupted_generation(real_stack, manager_for, long_weights):
    """Greedy (top-k 1), every request aborted by the engines mid-way: the partials come back, are
    resumed with prompt + partial response and the remaining budget, and every resumed sample
    equals the uninterrupted greedy generation of its prompt, token for token.

    The abort is placed, not timed. The engines serve weights whose greedy choice is never EOS, so
    every response runs to its 256-token budget; once their loads show the step's requests (8
    groups of 2: over-sampling 2) running, none waiting, with at least 6 tokens each on average
    (far from 256), SGLang's abort pause aborts them all and holds new requests while the same
    weights are loaded again under the next version, so that the resumed calls run under another
    version than the partials: the version runs of a resumed sample then show how many tokens it
    had before the abort, and the test requires some to have had more than none (an abort that
    found no token to return proves nothing about stitching). A step whose requests the poll
    missed (see ``Placement``) is followed by another, at most 3 steps."""
    max_len, each, attempts = 256, 6, 3
    weights = long_weights[0]
    v1 = real_stack.weight_version() + 1
    real_stack.push_weights(weights, v1)
    urls = real_stack.engine_urls

    def abort_and_reload() -> None:
        abort_and_hold(urls)
        try:
            load_weights(urls, weights, v1 + 1)
        finally:
            continue_generation(urls)

    try:
        m = manager_for(settings={"april_policy": "april", "april_over_sampling_factor": 2.0}, batch=BATCH, n=N,
                        max_len=max_len, extra_argv=["--rollout-top-k", "1"])
        prompt_tokens = prompt_token_bound(real_stack, m.manager.args.prompt_data)
        resumed, placed, step = [], False, 0
        for step in range(attempts):
            placement = Placement(urls, abort_and_reload, running=N, tokens_each=each, prompt_tokens=prompt_tokens)
            try:
                samples, _, _ = m.generate(step)
            finally:
                # the step cannot end while the engines are held, so the abort has happened or never will
                placed = placement.finish()
            aborted = [s for s in samples if s.metadata["april_num_aborts"] > 0]
            resumed += aborted
            if placed and aborted:
                break  # a starved machine can place the abort after the requests ended: then retry
        assert placed and resumed, (f"in {attempts} steps the poll never saw the requests running with {each} "
                                    "tokens each and then aborted")
        # the groups cut by the abort at target resume from the buffer in the next step
        samples, _, _ = m.generate(step + 1)
        resumed += [s for s in samples if s.metadata["april_num_aborts"] > 0]
        rollout.shutdown()
        real_stack.wait_idle()
        # the uninterrupted greedy generations, in one batch, under the same weights
        prompts = [real_stack.tokenizer.encode(s.prompt, add_special_tokens=False) for s in resumed]
        status, replies = http_json("POST", f"{urls[0]}/generate", {
            "input_ids": prompts, "sampling_params": {"max_new_tokens": max_len, "temperature": 1.0,
                                                      "top_k": 1, "no_stop_trim": True}})
        assert status == 200 and len(replies) == len(resumed), replies
    finally:
        rollout.shutdown()
        real_stack.restore_weights()
    # the abort hit requests that had tokens: resumed samples whose first call, under v1, returned
    # a non-empty partial, and whose resumption ran under v1 + 1
    cut = [s for s in resumed if s.metadata["april_num_calls"] >= 2 and len(version_spans(s)) == 2
           and version_spans(s)[0][0] == v1 and version_spans(s)[0][1] > 0]
    assert cut, ("no resumed sample had tokens before the abort: "
                 f"{[(s.index, version_spans(s), s.metadata['april_num_calls']) for s in resumed]}")
    assert all(s.response_length == max_len for s in resumed), "greedy never stops here: every response is full"
    for s, prompt_ids, reply in zip(resumed, prompts, replies):
        assert s.tokens[:len(prompt_ids)] == prompt_ids
        assert s.tokens[len(prompt_ids):] == reply["output_ids"], (
            f"resumed sample {s.index} ({s.metadata['april_num_calls']} calls, versions {version_spans(s)}) "
            "differs from the uninterrupted greedy generation")
