"""Router dispatch inside real slime against real SGLang CPU engines behind the real sglang-router:
every generate goes through the router, every abort is fanned out to the engines (sglang-router has
no /abort_request), and the guarantees hold as with direct dispatch: exactly ``rollout_batch_size``
groups in slime's sample contract, no group trained twice, partials aborted at target resumed under
other weights, and every token's log-prob the one transformers computes under its recorded version."""

from __future__ import annotations

import pytest

from april_slime import rollout
from april_slime.core.keys import TOKEN_VERSIONS_KEY
from april_slime.core.transport import HttpTransport
from tests.support.real_tier import SlimeRolloutManager, check_slime_contract, plugin_args, token_logprobs

TOLERANCE = 1e-4  # float32 CPU engine vs float32 transformers (as in test_rollout_weights)


@pytest.fixture(scope="module")
def hf_models(real_stack):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    return {"A": load(real_stack.model_path), "B": load(real_stack.other_model_path)}


def test_router_dispatch_through_the_real_router(real_stack, hf_models, tmp_path, monkeypatch):
    calls: list[tuple[str, str]] = []
    request = HttpTransport.request

    async def recording(self, method, url, path, payload, timeout_s):
        calls.append((url.rstrip("/"), path))
        return await request(self, method, url, path, payload, timeout_s)

    monkeypatch.setattr(HttpTransport, "request", recording)
    v0 = real_stack.weight_version()
    # three steps at least, weights B and A pushed in turn; a fast engine can end every request of
    # a step before its target aborts one with tokens, so steps go on (at most eight) until a
    # sample was resumed across a weight push
    weights_of = {v0 + k: "AB"[k % 2] for k in range(8)}
    batch, n = 4, 2
    m = SlimeRolloutManager(plugin_args(real_stack, tmp_path, settings={
        "april_policy": "copris", "april_concurrency": 16, "april_dispatch": "router"}, batch=batch, n=n, max_len=200))
    seen, mixed = set(), 0
    try:
        for step, version in enumerate(weights_of):
            if step >= 3 and mixed:
                break
            if version != v0:
                real_stack.wait_idle()  # SGLang refuses to flush its cache while a request is on the engine
                real_stack.push_weights(real_stack.other_model_path if weights_of[version] == "B"
                                        else real_stack.model_path, version)
            samples, metrics, train = m.generate(step)
            assert metrics["april/policy_version"] == version
            check_slime_contract(samples, train, tokenizer=real_stack.tokenizer, batch=batch, n=n, max_len=200,
                                 prompt_of=lambda s: s.prompt)
            groups = {s.group_index for s in samples}
            assert not groups & seen, "a prompt group trained twice"
            seen |= groups
            for s in samples:
                versions = [v for v, c in s.train_metadata[TOKEN_VERSIONS_KEY] for _ in range(c)]
                mixed += len(set(versions)) > 1
                for v in set(versions):
                    expected = token_logprobs(hf_models[weights_of[v]], s.tokens, s.response_length)
                    for i, (got, want, tv) in enumerate(zip(s.rollout_log_probs, expected, versions)):
                        if tv == v:
                            assert abs(got - want) < TOLERANCE, f"sample {s.index} token {i} (version {v})"
        client = rollout._RUNTIME.client.client
        assert client.dispatch.mode == "router" and client.engine_urls == [real_stack.router_url]
    finally:
        rollout.shutdown()
        real_stack.wait_idle()
        real_stack.restore_weights()
    assert mixed > 0, "no sample was resumed across a weight push; the abort-at-target path did not run"
    router, engines = real_stack.router_url, set(real_stack.engine_urls)
    generates = {url for url, path in calls if path == "/generate"}
    assert generates == {router}, f"generates went to {generates}, not only through the router"
    aborted = {url for url, path in calls if path == "/abort_request"}
    assert aborted == engines, f"aborts went to {aborted}: every engine and never the router"
