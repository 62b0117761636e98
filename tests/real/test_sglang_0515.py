"""The plugin against SGLang 0.5.15.post1, the SGLang of slime's own CUDA images at the pinned commit,
served on CPU from the layer ``scripts/real-stack/setup.sh`` builds beside the shared one (its
interpreter is named in ``.venv/sglang-0.5.15.post1-python``), behind the real sglang-router:
``old_stack`` (tests/real/conftest.py), which slime's launcher tests share.

The rest of the real tier runs on SGLang 0.5.23 (the session's ``real_stack``); this module starts
one 0.5.15.post1 engine for what differs there:

* its replies carry ``meta_info.weight_version`` but never the per-token ``weight_versions`` spans
  (0.5.15.post1 has no such field), and ``/get_weight_version`` is gone (404, ``/model_info``
  answers): the client's fallback paths;
* inside slime, under copris with weights pushed between steps: slime's sample contract, partials
  aborted at target and resumed under other weights, and per-token versions by the fallback path
  (every token of a call gets the reply's version), each token's log-prob equal to transformers'
  under its recorded version.

In-place weight updates inside a request (SGLang's ``pause_generation`` in place) are not run
here: without spans no reply can say which tokens came before the update (see docs/real-stack.md).
"""

from __future__ import annotations

import json

import pytest

from april_slime.core.engine import EngineClient
from tests.support import ROOT
from tests.support.real_tier import (
    MAX_RUNNING_REQUESTS,
    SGLANG_0515,
    SlimeRolloutManager,
    check_slime_contract,
    http_json,
    plugin_args,
    steps_across_weight_pushes,
)


async def test_replies_and_control_paths_of_0515(old_stack):
    """What the client reads from 0.5.15.post1: a reply with the version and no spans, a queued
    abort, the weight version from /model_info after /get_weight_version's 404."""
    url = old_stack.engine_urls[0]
    status, raw = http_json("POST", f"{url}/generate", {
        "input_ids": [11, 12, 13], "rid": "probe-0515", "return_logprob": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "no_stop_trim": True}})
    assert status == 200 and "weight_versions" not in raw["meta_info"], json.dumps(raw["meta_info"])[:300]
    assert http_json("GET", f"{url}/get_weight_version")[0] == 404
    client = await EngineClient.from_router(old_stack.router_url, dispatch="auto")
    try:
        assert client.dispatch.mode == "direct" and sorted(client.engine_urls) == sorted(old_stack.engine_urls)
        assert await client.weight_version(url) == old_stack.weight_version()
        result = await client.generate(url, [11, 12, 13], max_new_tokens=4, rid="probe-0515-b",
                                       sampling_params={"temperature": 1.0}, sampling_seed=1)
        assert result.version_runs.plain() == [[old_stack.weight_version(), len(result.output_ids)]]
        await client.abort(url, abort_all=True)  # 200, whatever the body
    finally:
        await client.close()


@pytest.mark.parametrize("dispatch", ["direct"])
def test_rollout_contract_and_fallback_versions_on_0515(old_stack, hf_models, tmp_path, dispatch):
    batch, n, max_len = 4, 2, 200
    m = SlimeRolloutManager(plugin_args(old_stack, tmp_path, settings={
        "april_policy": "copris", "april_concurrency": 16, "april_dispatch": dispatch},
        batch=batch, n=n, max_len=max_len))
    seen: set[int] = set()

    def check_step(samples, train):
        check_slime_contract(samples, train, tokenizer=old_stack.tokenizer, batch=batch, n=n, max_len=max_len,
                             prompt_of=lambda s: s.prompt)
        groups = {s.group_index for s in samples}
        assert not groups & seen, "a prompt group trained twice"
        seen.update(groups)

    old_stack.wait_idle()
    steps, mixed = steps_across_weight_pushes(old_stack, m, hf_models, check_step=check_step)
    assert mixed > 0, f"no sample was resumed across a weight push in {steps} steps; the abort-and-resume " \
                      "path did not run"


def test_recorded_0515_replies_match_the_live_engine(old_stack):
    """tests/data/sglang-0.5.15.post1-golden.json (which tests/test_sglang_versions.py holds the
    client to) still describes the live 0.5.15.post1 engine, scenario by scenario."""
    import asyncio

    from april_workbench.emulator.testing import golden_differences, golden_replies

    recorded = json.loads((ROOT / "tests" / "data" / f"sglang-{SGLANG_0515}-golden.json").read_text())
    assert recorded["sglang_version"] == SGLANG_0515
    start = old_stack.weight_version()
    try:
        live = asyncio.run(golden_replies(old_stack.engine_urls[0], max_running_requests=MAX_RUNNING_REQUESTS,
                                          new_weights_path=str(old_stack.other_model_path), weight_version=start))
    finally:
        old_stack.restore_weights()
    assert golden_differences(live, recorded["scenarios"]) == []
