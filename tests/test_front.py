"""The episode front: SGLang's ``/generate`` parsed into ``CallRequest``s for the runner, refusals, bounds."""

from __future__ import annotations

import asyncio
import importlib.util

import aiohttp
import pytest

from april_slime.core.episodes import CallRequest, EpisodeError
from april_slime.core.front import EpisodeFront

REPLY = {"text": "ok", "output_ids": [5], "meta_info": {"finish_reason": {"type": "stop"},
                                                         "output_token_logprobs": [[-0.1, 5, None]]}}
MARK = {"custom_params": {"april_episode": "ep-1"}}


class FakeRunner:
    """Records each call; answers at once, or once ``gate`` is set when there is one."""

    def __init__(self, episodes=("ep-1",)):
        self.episodes = set(episodes)
        self.calls: list[tuple[str, CallRequest]] = []
        self.gate: asyncio.Event | None = None
        self.entered = 0

    async def call(self, uid: str, request: CallRequest) -> dict:
        if uid not in self.episodes:
            raise EpisodeError(f"no live episode {uid!r} (pass the sampling_params the generate function was "
                               "given on to /generate)")
        self.calls.append((uid, request))
        self.entered += 1
        if self.gate is not None:
            await self.gate.wait()
        return REPLY


async def until(predicate, timeout_s: float = 5.0) -> None:
    """Yield to the loop until ``predicate()`` holds (bounded, so a broken front fails instead of hanging)."""
    async def wait():
        while not predicate():
            await asyncio.sleep(0)
    await asyncio.wait_for(wait(), timeout_s)


def tokenize(text: str) -> list[int]:
    return [ord(c) % 100 for c in text]


@pytest.fixture
async def front():
    runner = FakeRunner()
    server = EpisodeFront(runner, tokenize=tokenize, vocab_size=100, default_max_new_tokens=16, max_pending=3,
                          max_body_bytes=4096)
    await server.start()
    async with aiohttp.ClientSession() as session:
        server.session = session
        yield server
    await server.close()


async def post(front, payload=None, *, data=None):
    async with front.session.post(f"{front.url}/generate", json=payload, data=data) as r:
        return r.status, await r.json(content_type=None)


async def test_ids_round_trip_removes_marker_and_empty_custom_params(front):
    params = {"temperature": 0.7, "stop": "</tool>", **MARK}
    status, body = await post(front, {"input_ids": [1, 2, 3], "sampling_params": params, "return_logprob": True,
                                      "rid": "x"})
    assert (status, body) == (200, REPLY)
    uid, req = front.runner.calls[-1]
    assert uid == "ep-1" and req.input_ids == [1, 2, 3] and req.text is None
    assert req.max_new_tokens == 16  # the default
    assert req.stop == ("</tool>",)
    assert req.sampling_params == {"temperature": 0.7, "stop": "</tool>"}  # no marker, no custom_params


async def test_explicit_max_new_tokens_stop_list_and_other_custom_params_kept(front):
    params = {"max_new_tokens": 7, "stop": ["a", "b"], "custom_params": {"april_episode": "ep-1", "k": 1}}
    status, _ = await post(front, {"input_ids": [4], "sampling_params": params})
    assert status == 200
    _, req = front.runner.calls[-1]
    assert req.max_new_tokens == 7 and req.stop == ("a", "b")
    assert req.sampling_params == {"stop": ["a", "b"], "custom_params": {"k": 1}}


@pytest.mark.parametrize("extra, start", [({}, None), ({"return_routed_experts": False}, None),
                                          ({"return_routed_experts": True}, 0),
                                          ({"return_routed_experts": True, "routed_experts_start_len": 9}, 9)])
async def test_routed_experts_asked_for_from_a_position(front, extra, start):
    status, _ = await post(front, {"input_ids": [1], "sampling_params": MARK, **extra})
    assert status == 200
    assert front.runner.calls[-1][1].routed_experts_from == start


async def test_text_is_tokenized(front):
    status, _ = await post(front, {"text": "hi", "sampling_params": MARK})
    assert status == 200
    _, req = front.runner.calls[-1]
    assert req.text == "hi" and req.input_ids == tokenize("hi") and req.stop == ()


@pytest.mark.parametrize("extra, field", [
    ({"text": ["a", "b"]}, "text"),
    ({"input_ids": [[1], [2]]}, "input_ids"),
    ({"input_ids": [1], "stream": True}, "stream"),
    ({"input_ids": [1], "image_data": "x.png"}, "image_data"),
    ({"input_ids": [1], "audio_data": ["a.wav"]}, "audio_data"),
    ({"input_ids": [1], "video_data": "v.mp4"}, "video_data"),
    ({"input_ids": [1], "input_embeds": [[0.1]]}, "input_embeds"),
    ({"input_ids": [1], "lora_path": "lora"}, "lora_path"),
    ({"input_ids": [1], "return_hidden_states": True}, "return_hidden_states"),
    ({"input_ids": [1], "text": "a"}, "input_ids"),
    ({}, "input_ids"),
    ({"input_ids": [1, 100]}, "input_ids"),  # out of vocab
    ({"input_ids": [1, -1]}, "input_ids"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 0, **MARK}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "8", **MARK}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"stop": 3, **MARK}}, "stop"),
    ({"input_ids": [1], "return_routed_experts": True, "routed_experts_start_len": -1}, "routed_experts_start_len"),
])
async def test_refused_shapes_name_the_field(front, extra, field):
    payload = {"sampling_params": MARK, **extra}
    status, body = await post(front, payload)
    assert status == 400, body
    assert field in body["error"]["message"]
    assert not front.runner.calls


@pytest.mark.parametrize("params", [{}, {"custom_params": {}}, {"custom_params": {"april_episode": "nope"}}])
async def test_missing_or_unknown_marker_says_to_pass_sampling_params_on(front, params):
    status, body = await post(front, {"input_ids": [1], "sampling_params": params})
    assert status == 400
    assert "pass the sampling_params" in body["error"]["message"]


async def test_stream_false_is_accepted(front):
    status, _ = await post(front, {"input_ids": [1], "stream": False, "sampling_params": MARK})
    assert status == 200


async def test_not_json_is_400(front):
    status, body = await post(front, data=b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    status, body = await post(front, [1, 2])
    assert status == 400 and "object" in body["error"]["message"]


async def test_too_large_body_is_413(front):
    status, _ = await post(front, {"input_ids": [1] * 4096, "sampling_params": MARK})
    assert status == 413
    assert not front.runner.calls


async def test_past_max_pending_is_503_and_open_calls_still_answer(front):
    runner = front.runner
    runner.gate = asyncio.Event()
    payload = {"input_ids": [1], "sampling_params": MARK}
    blocked = [asyncio.create_task(post(front, payload)) for _ in range(front.max_pending)]
    await until(lambda: runner.entered == front.max_pending)  # every open request has reached the runner
    assert front.pending == front.max_pending
    status, body = await post(front, payload)
    assert status == 503 and "max_pending" in body["error"]["message"]
    runner.gate.set()
    assert [s for s, _ in await asyncio.gather(*blocked)] == [200] * front.max_pending
    assert front.pending == 0
    assert (await post(front, payload))[0] == 200  # room again


async def test_episode_stopped_is_503_and_other_errors_500(front):
    stop = asyncio.get_running_loop().create_future()

    async def stopped(uid, request):
        return await stop  # the runner cancels the reply future when it stops the episode

    front.runner.call = stopped
    task = asyncio.create_task(post(front, {"input_ids": [1], "sampling_params": MARK}))
    await until(lambda: front.pending == 1)
    stop.cancel()
    assert (await task)[0] == 503

    async def broken(uid, request):
        raise RuntimeError("boom")

    front.runner.call = broken
    status, body = await post(front, {"input_ids": [1], "sampling_params": MARK})
    assert status == 500 and "boom" in body["error"]["message"]


async def test_binds_loopback_only_and_health(front):
    assert front.host == "127.0.0.1"
    assert front.sock.getsockname() == ("127.0.0.1", front.port)
    async with front.session.get(f"{front.url}/health") as r:
        assert r.status == 200


async def test_close_stops_listening():
    server = EpisodeFront(FakeRunner(), tokenize=tokenize, vocab_size=None, default_max_new_tokens=4)
    await server.start()
    url = server.url
    await server.close()
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(f"{url}/health")


@pytest.mark.skipif(importlib.util.find_spec("httpx") is None, reason="httpx is not installed")
async def test_httpx_client_as_slime_posts(front):
    import httpx

    payload = {"text": "q", "sampling_params": {"max_new_tokens": 3, **MARK}, "return_logprob": True}
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), trust_env=False) as client:
        r = await client.post(f"{front.url}/generate", json=payload)  # what slime's http_utils._post does
        assert r.status_code == 200 and r.json() == REPLY
        if importlib.util.find_spec("slime") is not None:
            from slime.utils import http_utils

            assert await http_utils._post(client, f"{front.url}/generate", payload, max_retries=1) == REPLY
    assert len(front.runner.calls) >= 1 and front.runner.calls[-1][1].max_new_tokens == 3
