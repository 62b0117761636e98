"""Weights pushed between steps with ``/update_weights_from_disk`` and integer versions, and in the
middle of a request (SGLang's in-place pause): every token's recorded policy version is exact, and
its rollout log-prob equals the one transformers computes under that version's weights; at
temperature != 1 SGLang returns log-probs of the temperature-scaled distribution, which is what
slime's trainer computes too (it divides the logits by ``--rollout-temperature``,
``slime/backends/megatron_utils/loss.py``), so the IS ratio compares like with like."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest

from april_slime import rollout
from april_slime.core.engine import EngineClient
from tests.support.real_tier import (
    LOGPROB_TOLERANCE,
    Placement,
    SlimeRolloutManager,
    continue_generation,
    engine_loads,
    http_json,
    load_weights,
    pause_in_place,
    plugin_args,
    post_ok,
    prompt_token_bound,
    steps_across_weight_pushes,
    token_logprobs,
    version_spans,
    wait_for_progress,
)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_versions_exact_and_logprobs_match_transformers_across_weight_pushes(real_stack, hf_models, tmp_path,
                                                                             temperature):
    """Three steps of copris; weights B then A pushed between steps under new integer versions.
    Partials aborted in one step resume in the next under other weights, so samples mix versions
    (the long budget over long-tailed lengths keeps requests in flight at every target, however
    fast the engines);
    each token's log-prob must come from the weights of the version recorded for it. At
    temperature 0.7 every log-prob, the resumed samples' included, is of the temperature-scaled
    distribution of its version's weights (what slime's trainer recomputes)."""
    m = SlimeRolloutManager(plugin_args(real_stack, tmp_path, settings={"april_policy": "copris",
                                                                        "april_concurrency": 16},
                                        batch=4, n=2, max_len=200,
                                        extra_argv=["--rollout-temperature", str(temperature)]))
    steps, mixed = steps_across_weight_pushes(real_stack, m, hf_models, temperature=temperature,
                                              check_step=lambda samples, train: None)
    assert m.manager.args.rollout_temperature == temperature
    assert mixed > 0, f"no sample mixed policy versions in {steps} steps; the cross-version check did not happen"


def test_versions_exact_when_weights_change_mid_request(real_stack, hf_models):
    """SGLang's in-place update (pause generation, load weights, continue) changes the weights in
    the middle of a request; the reply's ``meta_info.weight_versions`` spans say where, and the
    engine client's per-token versions follow them. Every log-prob is reproduced exactly, which
    also shows what a version-B token after the switch really is (see below).

    The update is placed, not timed: the request may run 3000 tokens; the engine is paused in place
    once its loads show the request running with at least 16 tokens generated, checked again while
    paused (nothing moves then), updated, continued, and the request is cut by an abort once 16
    more tokens came under B. A lone request on a tiny model decodes fast (a few seconds for 3000
    tokens), so on a starved machine the poll can miss it whole: then nothing was changed yet, and
    the attempt is made again with a new request (at most 3 attempts; the test fails if all miss)."""
    v0 = real_stack.weight_version()
    url = real_stack.engine_urls[0]
    prompt = real_stack.tokenizer.encode("Question: what is 1 + 2? Answer:", add_special_tokens=False)
    each, attempts = 16, 3

    async def attempt(rid: str):
        """The request's result, or None when it ended before the poll saw it mid-way."""
        client = EngineClient([url])
        try:
            call = asyncio.create_task(client.generate(
                url, prompt, max_new_tokens=3000, rid=rid, sampling_seed=0,
                sampling_params={"temperature": 1.0, "ignore_eos": True}))
            gone = threading.Event()
            call.add_done_callback(lambda _: gone.set())  # the request ended: stop waiting for it

            def update_inside() -> bool:
                try:
                    wait_for_progress([url], running=1, tokens_each=each, prompt_tokens=len(prompt), stop=gone)
                except AssertionError:
                    if gone.is_set():
                        return False  # missed: the weights were not touched
                    raise
                pause_in_place([url])
                try:
                    frozen = engine_loads([url])[0]
                    assert frozen["num_running_reqs"] == 1, f"the request ended before the pause: {frozen}"
                    load_weights([url], real_stack.other_model_path, v0 + 1, flush_cache=False)
                finally:
                    continue_generation([url])
                wait_for_progress([url], running=1, tokens_each=frozen["num_used_tokens"] - len(prompt) + each,
                                  prompt_tokens=len(prompt), stop=gone)
                post_ok(f"{url}/abort_request", {"rid": rid})
                return True

            placed = await asyncio.to_thread(update_inside)
            result = await call
            return result if placed else None
        finally:
            # whatever failed, the request does not run on after the test
            await asyncio.to_thread(http_json, "POST", f"{url}/abort_request", {"rid": rid})
            await client.close()

    async def run():
        for i in range(attempts):
            result = await attempt(f"mid-request-update-{i}")
            if result is not None:
                return result
        raise AssertionError(f"in {attempts} attempts the poll never saw the request running with {each} tokens")

    try:
        result = asyncio.run(run())
    finally:
        real_stack.restore_weights()
    versions = [v for v, c in result.version_runs for _ in range(c)]
    assert set(versions) == {v0, v0 + 1}, f"the update did not land inside the request: {result.version_runs}"
    switch = versions.index(v0 + 1)
    assert versions == [v0] * switch + [v0 + 1] * (len(versions) - switch)
    # what the loads promised: tokens under A before the pause, under B after it (the loads count
    # KV slots, which may run a token or two ahead of the tokens returned; and see the label below)
    assert switch >= each // 2 and len(versions) - switch >= each // 2, result.version_runs
    tokens = prompt + result.output_ids.tolist()
    under_a = token_logprobs(hf_models["A"], tokens, len(versions))
    # The first token really computed under B: the first one A's log-prob does not explain.
    first_b = next(i for i, (got, a) in enumerate(zip(result.logprobs, under_a)) if abs(got - a) > LOGPROB_TOLERANCE)
    # SGLang 0.5.23 (overlap scheduler) labels the last token computed before the pause with the
    # new version already: its span starts one token early. Exact otherwise.
    assert first_b - switch in (0, 1), f"span says version {v0 + 1} from token {switch}, B from {first_b}"
    # From there the engine computes with B on top of the KV cache A wrote for the prefix (the
    # in-place update keeps it): those tokens are B reading A's keys and values, not B alone.
    after = stale_cache_logprobs(hf_models["A"], hf_models["B"], tokens, len(prompt) + first_b)
    assert max(abs(a - b) for a, b in zip(result.logprobs[first_b:], after)) < LOGPROB_TOLERANCE
    pure_b = token_logprobs(hf_models["B"], tokens, len(versions))[first_b:]
    assert max(abs(a - b) for a, b in zip(result.logprobs[first_b:], pure_b)) > 100 * LOGPROB_TOLERANCE


def test_versions_exact_when_weights_change_mid_request_inside_a_rollout(real_stack, long_weights, tmp_path):
    """The same in-place update, inside a rollout of the plugin in slime: the spans each reply
    carries must reach the trained sample, so a sample generated by one call that straddles the
    update has two version runs, and every token of the first is A's.

    Placed, not timed: weights whose EOS is practically never sampled make the requests run far
    past the point of the update (their budget is 1024 tokens); the update is made once the
    engines' loads show all 8 requests running with 8 tokens each on average, and the samples must
    show it landed inside every request (each ends under the new version, none is one run of the
    old) and inside some with tokens on both sides. A step whose requests the poll missed (see
    ``Placement``) is followed by another, at most 3 steps.

    Dropping the reply's spans where the scheduler appends a reply (every token then gets the
    call's final version) makes this test fail: no sample has two runs."""
    import torch
    from transformers import AutoModelForCausalLM

    batch, n, max_len, each, attempts = 4, 2, 1024, 8, 3
    a, b = long_weights
    urls = real_stack.engine_urls
    v1 = real_stack.weight_version() + 1

    def update() -> None:
        pause_in_place(urls)
        try:
            load_weights(urls, b, v1 + 1, flush_cache=False)
        finally:
            continue_generation(urls)

    m = SlimeRolloutManager(plugin_args(real_stack, tmp_path, settings={"april_policy": "sync"}, batch=batch, n=n,
                                        max_len=max_len))
    placed = False
    try:
        prompt_tokens = prompt_token_bound(real_stack, m.manager.args.prompt_data)
        for step in range(attempts):
            # each attempt from A again, under versions of its own
            v1 = real_stack.weight_version() + 1
            real_stack.push_weights(a, v1)
            placement = Placement(urls, update, running=batch * n, tokens_each=each, prompt_tokens=prompt_tokens)
            try:
                samples, _, _ = m.generate(step)
            finally:
                placed = placement.finish()  # sync: one step's requests, all ended by now
            # On a loaded machine the update can land after a sample already ended (its rare EOS):
            # the event missed that request, so the step is made again, as when the poll missed.
            placed = placed and all(version_spans(s)[-1][0] == v1 + 1 for s in samples)
            if placed:
                break
    finally:
        rollout.shutdown()
        real_stack.restore_weights()
    assert placed, (f"in {attempts} steps the update never landed inside every request (the poll never saw "
                    f"them running with {each} tokens each, or a sample ended before it)")
    hf_a = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).eval()
    spans = {s.index: version_spans(s) for s in samples}
    # sync: one call per sample, so a second run inside a sample can only come from a reply's spans
    assert all(s.metadata["april_num_calls"] == 1 for s in samples), spans
    assert all(sp[-1][0] == v1 + 1 and [v for v, _ in sp] in ([v1 + 1], [v1, v1 + 1]) for sp in spans.values()), (
        f"every request was running at the update, so every sample ends under version {v1 + 1}: {spans}")
    straddling = [s for s in samples if len(spans[s.index]) == 2]
    assert straddling, f"no sample recorded the update inside its one call: {spans}"
    for s in straddling:
        under_a = token_logprobs(hf_a, s.tokens, s.response_length)
        n_a = spans[s.index][0][1]
        worst = max(abs(x - y) for x, y in zip(s.rollout_log_probs[:n_a], under_a[:n_a]))
        assert worst < LOGPROB_TOLERANCE, (f"sample {s.index}: a token recorded under A is not A's ({worst}); "
                                           f"{spans[s.index]}")
        # SGLang labels the last token before the pause with the new version already (see above);
        # from the next one on, the tokens are computed by B
        later = max(abs(x - y) for x, y in zip(s.rollout_log_probs[n_a + 1:], under_a[n_a + 1:]))
        assert later > 100 * LOGPROB_TOLERANCE, f"sample {s.index}: tokens recorded under B are A's; {spans[s.index]}"


def stale_cache_logprobs(old, new, tokens: list[int], first_new: int) -> list[float]:
    """Log-probs of ``tokens[first_new:]`` when ``new`` decodes them on the KV cache ``old`` wrote
    for every position before the first forward pass under ``new`` (position ``first_new - 1``)."""
    import torch

    with torch.no_grad():
        cache = old(input_ids=torch.tensor([tokens[:first_new - 1]]), use_cache=True).past_key_values
        logits = new(input_ids=torch.tensor([tokens[first_new - 1:-1]]), past_key_values=cache).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return [float(logp[i, tokens[first_new + i]]) for i in range(len(tokens) - first_new)]


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_rollout_logprobs_at_temperature_are_of_the_scaled_distribution(real_stack, hf_models, tmp_path, temperature):
    m = SlimeRolloutManager(plugin_args(real_stack, tmp_path, settings={"april_policy": "sync"}, batch=2, n=2,
                                        max_len=24, extra_argv=["--rollout-temperature", str(temperature)]))
    try:
        samples, _, _ = m.generate(0)
    finally:
        rollout.shutdown()
        real_stack.wait_idle()
    assert m.manager.args.rollout_temperature == temperature
    worst_scaled = worst_raw = 0.0
    for s in samples:
        got = s.rollout_log_probs
        scaled = token_logprobs(hf_models["A"], s.tokens, s.response_length, temperature)
        raw = token_logprobs(hf_models["A"], s.tokens, s.response_length, 1.0)
        worst_scaled = max(worst_scaled, max(abs(a - b) for a, b in zip(got, scaled)))
        worst_raw = max(worst_raw, max(abs(a - b) for a, b in zip(got, raw)))
    # slime's trainer recomputes log_softmax(logits / rollout_temperature): like with like
    assert worst_scaled < LOGPROB_TOLERANCE, worst_scaled
    assert worst_raw > 100 * LOGPROB_TOLERANCE, "at this temperature raw and scaled log-probs should differ"
    assert all(math.isfinite(x) for s in samples for x in s.rollout_log_probs)
