"""The engine client held to what each SGLang version the plugin meets answers: the replies recorded
from SGLang 0.5.23 and from 0.5.15.post1 (slime's image SGLang) to the same protocol scenarios
(``scripts/real-stack/record_golden.py``; the real tier re-checks both against live engines).

Every generate reply of either version parses into a consistent result; the control replies (abort,
loads, weight version) are read the same way; and where the two versions' replies differ, no
difference touches a field the client reads, except the per-token version spans, which 0.5.15.post1
never sends (the client's fallback then gives every token the reply's version). The one difference
in behaviour: 0.5.15.post1 answers a request its schema refuses with HTTP 500, not 400."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from april_slime.core.engine import EngineClient
from april_slime.core.sglang_protocol import (
    EngineUnavailable,
    RequestRejected,
    parse_generate_reply,
    parse_load,
    parse_weight_version,
)
from april_slime.core.transport import TransportHTTPError
from april_workbench.emulator.testing import golden_differences

DATA = Path(__file__).resolve().parent / "data"
VERSIONS = ("0.5.23", "0.5.15.post1")
# meta_info fields the client reads (sglang_protocol.parse_generate_reply)
READ = ("id", "finish_reason", "output_token_logprobs", "completion_tokens", "prompt_tokens", "weight_version",
        "weight_versions", "num_retractions")


def golden(version: str) -> dict:
    return json.loads((DATA / f"sglang-{version}-golden.json").read_text(encoding="utf-8"))


def generate_replies(scenarios: dict) -> list[tuple[str, dict, int]]:
    """(where, reply body, max_new_tokens) of every 200 generate reply of the scenarios."""
    out = []
    for name, scenario in scenarios.items():
        budget = ((scenario.get("request") or {}).get("sampling_params") or {}).get("max_new_tokens", 1 << 20)
        for key in ("reply", "running_reply", "queued_reply"):
            reply = scenario.get(key)
            if (name.startswith("generate") or name.startswith("abort")) and reply and reply["status"] == 200 \
                    and isinstance(reply["body"], dict) and "meta_info" in reply["body"]:
                out.append((f"{name}.{key}", reply["body"], budget))
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_every_recorded_reply_reads_as_the_client_expects(version):
    recorded = golden(version)
    assert recorded["sglang_version"] == version
    scenarios = recorded["scenarios"]
    replies = generate_replies(scenarios)
    assert len(replies) >= 6
    finishes = set()
    for where, body, budget in replies:
        rid = body["meta_info"]["id"]
        result = parse_generate_reply(body, engine_url="http://e", rid=rid, max_new_tokens=max(budget, 1))
        finishes.add(result.finish_reason)
        assert sum(n for _, n in result.version_runs) == len(result.output_ids), where
        if version == "0.5.15.post1":
            assert "weight_versions" not in body["meta_info"], where  # the fallback path, always
            assert result.version_runs.plain() == ([[result.weight_version, len(result.output_ids)]]
                                           if len(result.output_ids) else [])
    assert finishes == {"stop", "length", "abort"}
    queued = scenarios["abort_all"]["queued_reply"]["body"]["meta_info"]
    assert queued["finish_reason"]["type"] == "abort"
    for name in ("abort_all", "abort_running", "abort_unknown_rid", "abort_empty_body"):
        assert scenarios[name]["abort_reply"]["status"] == 200, name
    assert scenarios["get_weight_version"]["reply"]["status"] == 404  # the client then asks /model_info
    before = parse_weight_version(scenarios["model_info"]["reply"]["body"]["weight_version"], version)
    after = parse_weight_version(scenarios["model_info_after_update"]["reply"]["body"]["weight_version"], version)
    assert after == before + 1
    load = parse_load(scenarios["loads"]["reply"]["body"], "http://e")
    assert load.capacity_tokens > 0
    statuses = {n: scenarios[n]["reply"]["status"] for n in scenarios if n.startswith("bad_")}
    # 0.5.15.post1 answers a request its schema refuses (a sampling parameter of the wrong type, or
    # unknown) with HTTP 500 and an empty body, where 0.5.23 answers 400
    server_errors = {"bad_temperature_string", "bad_unknown_sampling_param"} if version == "0.5.15.post1" else set()
    assert {n for n, status in statuses.items() if status != 400} == server_errors, statuses
    assert all(statuses[n] == 500 and scenarios[n]["reply"]["body"] is None for n in server_errors)


@pytest.mark.parametrize("version", VERSIONS)
async def test_what_the_client_makes_of_a_refused_request(version):
    """400: refused at once, never retried (the request is wrong). 0.5.15.post1's 500 for a schema
    error: taken for an engine failure and retried, then ``EngineUnavailable``; the plugin's own
    requests never carry such parameters (slime types them), a custom generate function's could."""
    recorded = golden(version)["scenarios"]
    for name in ("bad_temperature_negative", "bad_unknown_sampling_param"):
        reply = recorded[name]["reply"]
        tries = []

        class Replay:
            # used only within this iteration, so the loop's current tries and reply are the ones meant
            async def request(self, method, url, path, payload, timeout_s):
                tries.append(path)  # noqa: B023
                raise TransportHTTPError(reply["status"], reply["body"])  # noqa: B023

        client = EngineClient(["http://e"], transport=Replay(), max_retries=2, retry_backoff_s=0.0)
        expected = RequestRejected if reply["status"] == 400 else EngineUnavailable
        with pytest.raises(expected):
            await client.generate("http://e", [1, 2], max_new_tokens=2, rid="r", sampling_params={}, sampling_seed=1)
        assert len(tries) == (1 if expected is RequestRejected else 3), (version, name, tries)


def test_where_the_versions_differ_the_client_reads_nothing_else():
    differences = golden_differences(golden("0.5.15.post1")["scenarios"], golden("0.5.23")["scenarios"])
    touching = [d for d in differences
                if any(f"meta_info.{field}" in d.split(":")[0] for field in READ if field != "weight_versions")]
    assert touching == [], touching
