"""The reply a generate function gets from the plugin, against the live engine's own reply to the
same request: text, output ids and finish reason for calls that end at a stop string (one that
ends inside a token included), at EOS and at their budget, with and without ``no_stop_trim`` and
``skip_special_tokens``.

A function such as slime's search-r1 appends the reply's *text* to its next prompt, so a text that
differs from SGLang's (a stop-completing token's trailing characters, EOS's text) changes every
later call of its episode.
"""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import pytest

from april_slime.core.episodes import CallRequest, Episode, ModelCall
from april_slime.core.types import Trajectory, TrajectoryStatus
from april_slime.generate_functions import GenerateFunctions
from tests.support.real_tier import http_json

PROMPT = "Question: what is 417 + 25? think step"
BUDGET = 48
TRIM = [dict(no_stop_trim=k, skip_special_tokens=s) for k, s in itertools.product((True, False), repeat=2)]


def engine_reply(url: str, prompt: list[int], params: dict) -> dict:
    status, reply = http_json("POST", f"{url}/generate", {"input_ids": prompt, "sampling_params": params})
    assert status == 200, reply
    return reply


def plugin_reply(tokenizer, prompt: list[int], engine: dict, params: dict) -> dict:
    """The plugin's reply to a call whose engine reply was ``engine`` (its ids and finish type)."""
    functions = GenerateFunctions.__new__(GenerateFunctions)
    functions.codec, functions.top_p_replay, functions.routed_width = SimpleNamespace(tokenizer=tokenizer), False, 0
    ids = engine["output_ids"]
    t = Trajectory(uid="0/0", group_uid="0", index_in_group=0, prompt_ids=prompt, max_new_tokens=BUDGET,
                   sampling_seed=0)
    t.append(ids, [0.0] * len(ids), 0)
    t.num_calls = 1
    t.finish_reason = engine["meta_info"]["finish_reason"]["type"]
    t.status = TrajectoryStatus.COMPLETED if t.finish_reason == "stop" else TrajectoryStatus.TRUNCATED
    stop = tuple(params.get("stop") or ())
    request = CallRequest(input_ids=prompt, max_new_tokens=BUDGET, sampling_params=params, stop=stop)
    loop = asyncio.new_event_loop()
    try:
        return functions.reply(ModelCall(Episode(t), request, t, loop.create_future()))
    finally:
        loop.close()


def stop_inside_a_token(tokenizer, ids: list[int]) -> str | None:
    """A stop string whose first occurrence in the greedy text ends inside a token (the engine stops
    at that token, which carries text past the string)."""
    special = set(tokenizer.all_special_ids)
    ids = list(itertools.takewhile(lambda i: i not in special, ids))
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for k in range(1, len(ids)):
        before = tokenizer.decode(ids[:k], skip_special_tokens=True)
        piece = tokenizer.decode(ids[k:k + 1], skip_special_tokens=True)
        if len(piece) < 2 or not text.startswith(before + piece):
            continue
        stop = (before + piece[:-1])[-4:]
        if len(stop) == 4 and text.find(stop) + len(stop) == len(before) + len(piece) - 1:
            return stop
    return None


@pytest.mark.parametrize("trim", TRIM, ids=lambda t: "-".join(k for k, v in t.items() if v) or "neither")
def test_the_reply_to_a_call_is_the_engines(real_stack, trim):
    tokenizer, url = real_stack.tokenizer, real_stack.engine_urls[0]
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    cases: dict[str, tuple[dict, dict]] = {}  # what ended the call -> (its parameters, the engine's reply)
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True, **trim}
    cases["budget"] = params, engine_reply(url, prompt, params)
    for seed in range(64):  # a sampled call that ends at EOS (the stack's weights end one in ~24 tokens)
        params = {"max_new_tokens": BUDGET, "temperature": 1.0, "sampling_seed": seed, **trim}
        reply = engine_reply(url, prompt, params)
        if reply["meta_info"]["finish_reason"].get("matched") == tokenizer.eos_token_id:
            cases["EOS"] = params, reply
            break
    # a stop string taken from a greedy output, then asked for; taken again where the second greedy
    # output went another way (on a loaded CPU, batch composition can flip a near-tie)
    for _ in range(8):
        greedy = engine_reply(url, prompt, {"max_new_tokens": BUDGET, "temperature": 0.0})
        stop = stop_inside_a_token(tokenizer, greedy["output_ids"])
        assert stop is not None, f"no token of the greedy output carries text past a 4-character stop: {greedy}"
        params = {"max_new_tokens": BUDGET, "temperature": 0.0, "stop": [stop], **trim}
        reply = engine_reply(url, prompt, params)
        if reply["meta_info"]["finish_reason"].get("matched") == stop:
            cases["stop string"] = params, reply
            break
    assert cases.keys() == {"budget", "EOS", "stop string"}, f"calls ended only by {sorted(cases)}"
    # made to happen: the token that completed the stop string carries text past it
    params, engine = cases["stop string"]
    assert not tokenizer.decode(engine["output_ids"], skip_special_tokens=True).endswith(params["stop"][0])
    assert cases["budget"][1]["meta_info"]["finish_reason"]["type"] == "length"
    for what, (params, engine) in cases.items():
        ours = plugin_reply(tokenizer, prompt, engine, params)
        assert ours["output_ids"] == engine["output_ids"], what
        assert ours["text"] == engine["text"], (what, ours["text"], engine["text"])
        assert ours["meta_info"]["finish_reason"] == engine["meta_info"]["finish_reason"], what
