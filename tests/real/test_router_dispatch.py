"""Router dispatch inside real slime against real SGLang CPU engines behind the real sglang-router:
every generate goes through the router, every abort is fanned out to the engines (sglang-router has
no /abort_request), and the guarantees hold as with direct dispatch: exactly ``rollout_batch_size``
groups in slime's sample contract, no group trained twice, partials aborted at target resumed under
other weights, and every token's log-prob the one transformers computes under its recorded version;
the router places the requests on every engine behind it (its own per-engine counts)."""

from __future__ import annotations

from april_slime import rollout
from april_slime.core.transport import HttpTransport
from tests.support.real_tier import SlimeRolloutManager, check_slime_contract, plugin_args, steps_across_weight_pushes


def test_router_dispatch_through_the_real_router(real_stack, hf_models, tmp_path, monkeypatch):
    calls: list[tuple[str, str]] = []
    request = HttpTransport.request

    async def recording(self, method, url, path, payload, timeout_s):
        calls.append((url.rstrip("/"), path))
        return await request(self, method, url, path, payload, timeout_s)

    monkeypatch.setattr(HttpTransport, "request", recording)
    answered_before = real_stack.router_answered()
    batch, n = 4, 2
    m = SlimeRolloutManager(plugin_args(real_stack, tmp_path, settings={
        "april_policy": "copris", "april_concurrency": 16, "april_dispatch": "router"}, batch=batch, n=n, max_len=200))
    seen: set[int] = set()

    def check_step(samples, train):
        check_slime_contract(samples, train, tokenizer=real_stack.tokenizer, batch=batch, n=n, max_len=200,
                             prompt_of=lambda s: s.prompt)
        groups = {s.group_index for s in samples}
        assert not groups & seen, "a prompt group trained twice"
        seen.update(groups)
        client = rollout._RUNTIME.client
        assert client.dispatch.mode == "router" and client.engine_urls == [real_stack.router_url]

    steps, mixed = steps_across_weight_pushes(real_stack, m, hf_models, check_step=check_step)
    assert mixed > 0, (f"no sample was resumed across a weight push in {steps} steps; the abort-at-target path "
                       "did not run")
    router, engines = real_stack.router_url, set(real_stack.engine_urls)
    generates = {url for url, path in calls if path == "/generate"}
    assert generates == {router}, f"generates went to {generates}, not only through the router"
    aborted = {url for url, path in calls if path == "/abort_request"}
    assert aborted == engines, f"aborts went to {aborted}: every engine and never the router"
    # the router reached every engine (its cache_aware policy spreads distinct prompts; how evenly is
    # the router's business, so only that each engine answered some)
    answered = real_stack.router_answered() - answered_before
    assert all(answered[url] > 0 for url in engines), f"the router placed requests on {dict(answered)} only"
