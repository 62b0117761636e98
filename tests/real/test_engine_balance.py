"""Direct dispatch keeps every engine loaded: april and copris through the plugin inside real slime,
on the real stack's two SGLang CPU engines (router dispatch reaching both:
``tests/real/test_router_dispatch.py``).

Direct dispatch sends each request to the healthy engine with the fewest of the step's requests in
flight, so with E engines each gets about 1/E of the requests and is busy about as long as the
others. The test counts, from the plugin's own calls (``tests.support.engine_spans``), each
engine's share of the requests and of its busy engine-seconds (the time it had at least one of the
job's requests on it), over a few steps.

The bound: every engine's share of each is at least half its fair share (1/(2E): 0.25 of 2). It
holds on a busy machine because neither count compares speeds. An engine starved by the machine
finishes fewer requests and so gets fewer refills, but it keeps its slots filled: its share of the
requests falls below a quarter only if, over every step, it finished less than a third of what the
other did; its busy share counts time with requests on it, which a slow engine has more of, not
less. What breaks it: a dispatch that leaves an engine out (share 0), or that sends three requests in
four to one engine (share 0.25 on the other, just outside: the bound is strict).
"""

from __future__ import annotations

import pytest

from april_slime import rollout
from tests.support.engine_spans import record_spans, shares
from tests.support.real_tier import SlimeRolloutManager, check_slime_contract, plugin_args

BATCH, N, MAX_LEN, STEPS = 8, 2, 64, 3


@pytest.mark.parametrize("policy", ["april", "copris"])
def test_direct_dispatch_keeps_both_engines_loaded(real_stack, tmp_path, monkeypatch, policy):
    engines = sorted(real_stack.engine_urls)
    assert len(engines) >= 2, "the stack runs one engine: nothing to balance"
    spans = record_spans(monkeypatch)
    m = SlimeRolloutManager(plugin_args(real_stack, tmp_path, settings={
        "april_policy": policy, "april_dispatch": "direct"}, batch=BATCH, n=N, max_len=MAX_LEN))
    try:
        for rollout_id in range(STEPS):
            samples, _, train = m.generate(rollout_id)
            check_slime_contract(samples, train, tokenizer=real_stack.tokenizer, batch=BATCH, n=N, max_len=MAX_LEN,
                                 prompt_of=lambda s: s.prompt)
        assert rollout._RUNTIME.client.dispatch.mode == "direct"
    finally:
        rollout.shutdown()
        real_stack.wait_idle()
    fair = 1 / len(engines)
    split = shares(spans, engines)
    summary = {u: {k: round(v, 3) for k, v in s.items()} for u, s in split.items()}
    print(f"{policy}: {len(spans)} requests over {len(engines)} engines; shares {summary}")
    for url, share in split.items():
        for what in ("requests", "busy"):
            assert share[what] > fair / 2, (f"{policy}: engine {url} had {share[what]:.2f} of the {what}, not "
                                            f"above {fair / 2:.2f}, half its fair share: {summary}")
