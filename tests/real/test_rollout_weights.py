"""Weights pushed between steps with ``/update_weights_from_disk`` and integer versions, and in the
middle of a request (SGLang's in-place pause): every token's recorded policy version is exact, and
its rollout log-prob equals the one transformers computes under that version's weights; at
temperature != 1 SGLang returns log-probs of the temperature-scaled distribution, which is what
slime's trainer computes too (it divides the logits by ``--rollout-temperature``,
``slime/backends/megatron_utils/loss.py``), so the IS ratio compares like with like."""

from __future__ import annotations

import asyncio
import math

import pytest

from april_slime import rollout
from april_slime.engine import EngineClient
from real_tier import SlimeRolloutManager, http_json, plugin_args

TOLERANCE = 1e-4  # float32 CPU engine vs float32 transformers; measured differences are ~3e-6


@pytest.fixture(scope="module")
def hf_models(real_stack):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    return {"A": load(real_stack.model_path), "B": load(real_stack.other_model_path)}


def token_logprobs(model, tokens: list[int], response_length: int, temperature: float = 1.0) -> list[float]:
    """log p(token_t | tokens_<t) for the response tokens, from logits / temperature."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    start = len(tokens) - response_length
    return [float(logp[t - 1, tokens[t]]) for t in range(start, len(tokens))]


def per_token_versions(sample) -> list[int]:
    runs = sample.train_metadata[rollout.TOKEN_VERSIONS_KEY]
    return [v for v, c in runs for _ in range(c)]


def test_versions_exact_and_logprobs_match_transformers_across_weight_pushes(real_stack, hf_models, tmp_path):
    """Three steps of copris; weights B then A pushed between steps under new integer versions.
    Partials aborted in one step resume in the next under other weights, so samples mix versions;
    each token's log-prob must come from the weights of the version recorded for it."""
    v0 = real_stack.weight_version()
    weights_of = {v0: "A", v0 + 1: "B", v0 + 2: "A"}
    m = SlimeRolloutManager(plugin_args(real_stack, tmp_path, settings={"april_policy": "copris",
                                                                        "april_concurrency": 16},
                                        batch=4, n=2, max_len=40))
    mixed = 0
    try:
        for step, version in enumerate(weights_of):
            if version != v0:
                model = real_stack.other_model_path if weights_of[version] == "B" else real_stack.model_path
                real_stack.push_weights(model, version)
            samples, metrics, _ = m.generate(step)
            assert metrics["april/policy_version"] == version
            for s in samples:
                versions = per_token_versions(s)
                assert set(versions) <= set(weights_of) and max(versions) <= version
                assert [int(v) for v in s.weight_versions] == sorted(int(v) for v in s.weight_versions)
                mixed += len(set(versions)) > 1
                for v in set(versions):
                    expected = token_logprobs(hf_models[weights_of[v]], s.tokens, s.response_length)
                    for i, (got, want, tv) in enumerate(zip(s.rollout_log_probs, expected, versions)):
                        if tv == v:
                            assert abs(got - want) < TOLERANCE, (
                                f"sample {s.index} token {i} (version {v}, weights {weights_of[v]}): "
                                f"rollout log-prob {got} vs transformers {want}")
    finally:
        rollout.shutdown()
        real_stack.wait_idle()
        real_stack.restore_weights()
    assert mixed > 0, "no sample mixed policy versions; the cross-version check did not happen"


def test_versions_exact_when_weights_change_mid_request(real_stack, hf_models):
    """SGLang's in-place update (pause generation, load weights, continue) changes the weights in
    the middle of a request; the reply's ``meta_info.weight_versions`` spans say where, and the
    engine client's per-token versions follow them. Every log-prob is reproduced exactly, which
    also shows what a version-B token after the switch really is (see below)."""
    v0 = real_stack.weight_version()
    url = real_stack.engine_urls[0]
    prompt = real_stack.tokenizer.encode("Question: what is 1 + 2? Answer:", add_special_tokens=False)

    async def run():
        client = EngineClient([url])
        try:
            call = asyncio.create_task(client.generate(
                url, prompt, max_new_tokens=200, rid="mid-request-update", sampling_seed=0,
                sampling_params={"temperature": 1.0, "ignore_eos": True}))
            await asyncio.sleep(0.5)
            for path, body in (("/pause_generation", {"mode": "in_place"}),
                               ("/update_weights_from_disk", {"model_path": str(real_stack.other_model_path),
                                                              "weight_version": str(v0 + 1),
                                                              "flush_cache": False}),
                               ("/continue_generation", {})):
                status, reply = await asyncio.to_thread(http_json, "POST", url + path, body)
                assert status == 200, (path, reply)
            return await call
        finally:
            await client.close()

    try:
        result = asyncio.run(run())
    finally:
        real_stack.wait_idle()
        real_stack.restore_weights()
    versions = [v for v, c in result.version_runs for _ in range(c)]
    assert set(versions) == {v0, v0 + 1}, "the update did not land inside the request"
    switch = versions.index(v0 + 1)
    assert versions == [v0] * switch + [v0 + 1] * (len(versions) - switch)
    tokens = prompt + list(result.output_ids)
    under_a = token_logprobs(hf_models["A"], tokens, len(versions))
    # The first token really computed under B: the first one A's log-prob does not explain.
    first_b = next(i for i, (got, a) in enumerate(zip(result.logprobs, under_a)) if abs(got - a) > TOLERANCE)
    # SGLang 0.5.23 (overlap scheduler) labels the last token computed before the pause with the
    # new version already: its span starts one token early. Exact otherwise.
    assert first_b - switch in (0, 1), f"span says version {v0 + 1} from token {switch}, B from {first_b}"
    # From there the engine computes with B on top of the KV cache A wrote for the prefix (the
    # in-place update keeps it): those tokens are B reading A's keys and values, not B alone.
    after = stale_cache_logprobs(hf_models["A"], hf_models["B"], tokens, len(prompt) + first_b)
    assert max(abs(a - b) for a, b in zip(result.logprobs[first_b:], after)) < TOLERANCE
    pure_b = token_logprobs(hf_models["B"], tokens, len(versions))[first_b:]
    assert max(abs(a - b) for a, b in zip(result.logprobs[first_b:], pure_b)) > 100 * TOLERANCE


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
    assert worst_scaled < TOLERANCE, worst_scaled
    assert worst_raw > 100 * TOLERANCE, "at this temperature raw and scaled log-probs should differ"
    assert all(math.isfinite(x) for s in samples for x in s.rollout_log_probs)
