"""The SGLang-protocol emulator: protocol over real loopback HTTP, determinism, abort/resume,
weight versions, KV retraction, router, virtual time, and the length model."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from april_slime.core.transport import TransportHTTPError
from april_workbench.emulator import (
    EngineConfig,
    LengthModel,
    SyntheticLM,
    TimeModel,
    build_cluster,
    reference_tokens,
    run_virtual,
    start_cluster,
)
from april_workbench.emulator.model import prompt_key

SHORT = LengthModel.preset("short")
LONG = LengthModel(kind="max-length")


async def call(session: aiohttp.ClientSession, method: str, url: str, path: str, body=None):
    """(status, parsed JSON body or None for SGLang's empty replies)."""
    async with session.request(method, url + path, json=body) as resp:
        raw = await resp.text()
        return resp.status, (json.loads(raw) if raw.strip() else None)


def error_message(reply) -> str:
    """SGLang's two error bodies: {"error": {"message": ...}} and, for schema errors, {"error": "..."}."""
    error = reply["error"]
    return error["message"] if isinstance(error, dict) else error


def gen_body(prompt, max_new_tokens, rid, seed=0, **params):
    return {"input_ids": list(prompt), "return_logprob": True, "rid": rid,
            "sampling_params": {"max_new_tokens": max_new_tokens, "sampling_seed": seed,
                                "temperature": 1.0, **params}}


def toks_and_lps(reply):
    meta = reply["meta_info"]
    return reply["output_ids"], [t[0] for t in meta["output_token_logprobs"]], meta["finish_reason"]["type"]


def check_reply_shape(reply, model: SyntheticLM, max_new_tokens):
    ids, lps, finish = toks_and_lps(reply)
    meta = reply["meta_info"]
    assert len(ids) == len(lps) == meta["completion_tokens"]
    assert [t[1] for t in meta["output_token_logprobs"]] == ids
    assert all(math.isfinite(lp) and lp < 0 for lp in lps)
    assert all(0 <= t < model.vocab_size for t in ids)
    assert model.eos_token_id not in ids[:-1]
    assert len(ids) <= max_new_tokens
    if finish == "stop":
        assert ids[-1] == model.eos_token_id
    elif finish == "length":
        assert len(ids) == max_new_tokens and model.eos_token_id not in ids
    return ids, lps, finish


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


# ------------------------------------------------------------------------------------------ protocol
async def test_generate_stops_or_hits_length_and_is_deterministic(session):
    prompts = [[11 + i, 12, 13, 14, 15, 16] for i in range(6)]
    replies = []
    for _ in range(2):  # two independent clusters with the same seed
        async with start_cluster(2, seed=7, time_scale=200, length=SHORT) as rc:
            model = rc.cluster.model
            out = await asyncio.gather(*[
                call(session, "POST", rc.router_url, "/generate", gen_body(p, 60, f"r{i}-{s}", seed=s))
                for i, p in enumerate(prompts) for s in range(3)])
            assert all(status == 200 for status, _ in out)
            replies.append([r for _, r in out])
    finishes = set()
    for first, second in zip(*replies):
        assert first["output_ids"] == second["output_ids"]
        assert first["meta_info"]["output_token_logprobs"] == second["meta_info"]["output_token_logprobs"]
        ids, lps, finish = check_reply_shape(first, model, 60)
        finishes.add(finish)
        assert first["meta_info"]["weight_version"] == "0"
        assert first["meta_info"]["prompt_tokens"] == 6
    assert finishes == {"stop", "length"}  # the short preset has both outcomes within 60 tokens
    # The reply is the public reference stream.
    ref_ids, ref_lps, ref_finish = model.complete(prompts[0], 0, 60)
    assert replies[0][0]["output_ids"] == ref_ids
    assert toks_and_lps(replies[0][0])[1] == pytest.approx(ref_lps, abs=0)
    # Another seed gives another stream; the prompt key only looks at the first four tokens.
    other = SyntheticLM(seed=8, length=SHORT)
    assert other.complete(prompts[0], 0, 60)[0] != ref_ids
    assert prompt_key([1, 2, 3, 4, 99]) == prompt_key([1, 2, 3, 4, 5, 6])


async def test_abort_returns_prefix_and_resume_reproduces_stream(session):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    async with start_cluster(1, seed=3, time_scale=20, length=LONG) as rc:
        model = rc.cluster.model
        url = rc.engine_urls[0]
        full_ids, full_lps, _ = model.complete(prompt, 42, 4000)
        task = asyncio.create_task(call(session, "POST", url, "/generate", gen_body(prompt, 4000, "a", seed=42)))
        await asyncio.sleep(0.15)
        status, _ = await call(session, "GET", url, "/v1/loads")
        assert status == 200
        status, ok = await call(session, "POST", url, "/abort_request", {"rid": "a"})
        assert status == 200 and ok is None  # SGLang: an empty body
        status, part = await task
        assert status == 200
        ids, lps, finish = check_reply_shape(part, model, 4000)
        assert finish == "abort" and 0 < len(ids) < 4000
        assert ids == full_ids[: len(ids)] and lps == full_lps[: len(ids)]
        # Resume: prompt + partial, with the budget reduced by what was generated.
        status, rest = await call(session, "POST", url, "/generate",
                                  gen_body(prompt + ids, 4000 - len(ids), "a2", seed=42))
        rest_ids, rest_lps, rest_finish = check_reply_shape(rest, model, 4000 - len(ids))
        assert rest_finish == "length" and rest["meta_info"]["prompt_tokens"] == len(prompt) + len(ids)
        assert ids + rest_ids == full_ids and lps + rest_lps == full_lps

        # Stop decisions are resume-invariant too: cut a stopping sample anywhere, resume, same end.
        short = SyntheticLM(seed=3, length=SHORT)
        stop_prompt = next([i, 1, 2, 3] for i in range(100) if short.complete([i, 1, 2, 3], 1, 200)[2] == "stop")
        whole = short.complete(stop_prompt, 1, 200)[0]
        cut = len(whole) // 2
        resumed = short.reference(stop_prompt, 1, len(stop_prompt) + cut, [0] * (200 - cut))[0]
        assert whole[:cut] + resumed == whole


async def test_weight_version_bump_resume_and_in_flight(session):
    prompt = [21, 22, 23, 24, 25]
    async with start_cluster(2, seed=5, time_scale=20, length=LONG) as rc:
        model = rc.cluster.model
        router = rc.router_url
        task = asyncio.create_task(call(session, "POST", router, "/generate", gen_body(prompt, 3000, "w", seed=9)))
        await asyncio.sleep(0.1)
        await call(session, "POST", router, "/abort_request", {"rid": "w"})
        _, part = await task
        ids, lps, finish = toks_and_lps(part)
        assert finish == "abort" and part["meta_info"]["weight_version"] == "0"
        status, body = await call(session, "POST", router, "/update_weight_version", {"new_version": "1"})
        assert status == 200 and body["new_version"] == "1"
        for url in rc.engine_urls:  # broadcast
            assert (await call(session, "GET", url, "/model_info"))[1]["weight_version"] == "1"
        _, rest = await call(session, "POST", router, "/generate",
                             gen_body(prompt + ids, 3000 - len(ids), "w2", seed=9))
        rest_ids, rest_lps, _ = check_reply_shape(rest, model, 3000 - len(ids))
        assert rest["meta_info"]["weight_version"] == "1"
        versions = [0] * len(ids) + [1] * len(rest_ids)
        ref_ids, ref_lps = reference_tokens(5, prompt, 9, len(prompt), versions, length=LONG)
        assert ids + rest_ids == ref_ids and lps + rest_lps == ref_lps
        # The new version really changes the stream.
        assert rest_ids != model.complete(prompt, 9, 3000, version=0)[0][len(ids):]

        # A bump while a request is running: it continues, later tokens carry the new version.
        task = asyncio.create_task(call(session, "POST", router, "/generate", gen_body(prompt, 3000, "x", seed=4)))
        await asyncio.sleep(0.1)
        await call(session, "POST", router, "/update_weight_version", {})  # no version: next one
        _, reply = await task
        out_ids, out_lps, finish = check_reply_shape(reply, model, 3000)
        assert finish == "length" and reply["meta_info"]["weight_version"] == "2"
        runs = reply["meta_info"]["emulator_version_runs"]
        assert [v for _, v in runs] == [1, 2] and 0 < runs[1][0] < 3000
        per_token = [1] * runs[1][0] + [2] * (3000 - runs[1][0])
        assert (out_ids, out_lps) == model.reference(prompt, 4, len(prompt), per_token)


async def test_loads_router_dispatch_and_stats(session):
    async with start_cluster(2, seed=1, time_scale=20, length=LONG, kv_capacity_tokens=100_000) as rc:
        status, workers = await call(session, "GET", rc.router_url, "/workers")
        assert status == 200 and [w["url"] for w in workers["workers"]] == rc.engine_urls
        tasks = [asyncio.create_task(call(session, "POST", rc.router_url, "/generate",
                                          gen_body([1, 2, 3, i, 5, 6, 7, 8], 1500, f"l{i}", seed=i)))
                 for i in range(8)]
        # wait for all 8 to arrive (a fixed sleep raced the HTTP requests on a busy machine)
        for _ in range(400):
            status, loads = await call(session, "GET", rc.router_url, "/v1/loads")
            in_flight = sum(e["num_running_reqs"] + e["num_waiting_reqs"] for e in loads["loads"])
            if in_flight == 8:
                break
            await asyncio.sleep(0.01)
        assert status == 200 and len(loads["loads"]) == 2
        assert in_flight == 8
        for load in loads["loads"]:
            assert 0 < load["num_used_tokens"] <= load["max_total_num_tokens"] == 100_000
            assert load["num_running_reqs"] == 4  # least-loaded dispatch splits them evenly
        status, one = await call(session, "GET", rc.engine_urls[0], "/v1/loads")
        assert {"num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens",
                "num_retractions"} <= set(one["loads"][0])
        await asyncio.gather(*tasks)
        status, stats = await call(session, "GET", rc.router_url, "/emulator/stats")
        assert status == 200 and len(stats["engines"]) == 2
        for s in stats["engines"]:
            assert s["finished_requests"] == 4 and s["generated_tokens"] == 4 * 1500
            assert s["prefill_tokens"] == 4 * 8 and s["retractions"] == 0
            assert 0 < s["busy_s"] <= s["emulated_time"]
            assert s["decode_s"] + s["prefill_s"] == pytest.approx(s["busy_s"])
            assert s["idle_s"] >= 0 and s["timeline"]["t"] and max(s["timeline"]["kv_used"]) <= 100_000
            assert s["load"]["num_used_tokens"] == 0
        local = rc.cluster.stats()
        assert local["totals"]["generated_tokens"] == 8 * 1500 and local["emulated_time"] > 0


async def test_bad_requests_get_400(session):
    async with start_cluster(1, seed=0, time_scale=20, length=LONG, kv_capacity_tokens=10_000) as rc:
        url = rc.engine_urls[0]
        bad = [
            {"sampling_params": {"max_new_tokens": 4}},
            {"input_ids": [1, 2, "x", 4], "sampling_params": {"max_new_tokens": 4}},
            {"input_ids": [1, 2, 3.5, 4], "sampling_params": {"max_new_tokens": 4}},
            {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": -1}},
            {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4, "temperature": -1}},
            {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4, "temperature": "hot"}},
            {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4, "tempreature": 1.0}},
            {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4}, "stream": True},
            {"input_ids": [], "sampling_params": {"max_new_tokens": 4}},
            {"input_ids": [1, 2, 3, -1], "sampling_params": {"max_new_tokens": 4}},
            {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 20_000}},  # never fits KV
            {"input_ids": [1, 2, 3, 4], "rid": 7},
        ]
        for body in bad:
            status, reply = await call(session, "POST", url, "/generate", body)
            assert status == 400 and error_message(reply), body
        async with session.post(url + "/generate", data=b"{not json") as resp:
            assert resp.status == 400
        task = asyncio.create_task(call(session, "POST", url, "/generate", gen_body([1, 2, 3, 4], 2000, "dup")))
        await asyncio.sleep(0.05)
        status, reply = await call(session, "POST", url, "/generate", gen_body([1, 2, 3, 4], 10, "dup"))
        assert status == 400 and reply == {"error": {"message": "Duplicate request ID detected: dup"}}
        assert await call(session, "POST", url, "/abort_request", {"rid": "nope"}) == (200, None)
        assert await call(session, "POST", url, "/abort_request", {}) == (200, None)  # a no-op, as in SGLang
        assert (await call(session, "POST", url, "/update_weight_version", {"new_version": "v2"}))[0] == 400
        assert (await call(session, "GET", url, "/generate"))[0] == 405
        assert await call(session, "GET", url, "/nowhere") == (404, {"detail": "Not Found"})
        assert await call(session, "GET", url, "/workers") == (404, {"detail": "Not Found"})  # no router here
        status, empty = await call(session, "POST", url, "/generate", gen_body([1, 2, 3, 4], 0, "zero"))
        assert status == 200 and empty["output_ids"] == [] and empty["meta_info"]["finish_reason"] == {
            "type": "length", "length": 0}
        assert (await call(session, "POST", url, "/abort_request", {"abort_all": True}))[0] == 200
        status, reply = await task
        assert status == 200 and reply["meta_info"]["finish_reason"]["type"] == "abort"


async def test_client_disconnect_frees_the_request(session):
    async with start_cluster(1, seed=0, time_scale=20, length=LONG) as rc:
        url = rc.engine_urls[0]
        task = asyncio.create_task(call(session, "POST", url, "/generate", gen_body([1, 2, 3, 4], 5000, "gone")))
        await asyncio.sleep(0.1)
        assert rc.cluster.loads()[0]["num_running_reqs"] == 1
        task.cancel()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if rc.cluster.loads()[0]["num_running_reqs"] == 0:
                break
        load = rc.cluster.loads()[0]
        assert load["num_running_reqs"] == 0 and load["num_used_tokens"] == 0
        assert rc.cluster.engines[0].delivered_tokens == 0


async def test_local_transport_errors():
    async with start_cluster(2, seed=0, http=False, time_scale=1, length=SHORT) as rc:
        with pytest.raises(TransportHTTPError) as err:
            await rc.transport.request("POST", rc.engine_urls[0], "/generate", {"input_ids": []}, 5)
        assert err.value.status == 400
        with pytest.raises(ConnectionError):
            await rc.transport.request("GET", "http://emulator-engine-9", "/v1/loads", None, 5)
        await rc.cluster.engines[1].stop()
        with pytest.raises(TransportHTTPError) as err:
            await rc.transport.request("POST", rc.engine_urls[1], "/generate", gen_body([1, 2, 3, 4], 5, "s"), 5)
        assert err.value.status == 503
        rc.transport.unreachable.add(rc.engine_urls[0])
        with pytest.raises(ConnectionError):
            await rc.transport.request("GET", rc.engine_urls[0], "/v1/loads", None, 5)


# --------------------------------------------------------------------------------- KV and retraction
async def test_kv_overflow_retracts_and_every_request_finishes_correctly(session):
    # 16 requests of 30 + up to 400 tokens on a 3000-token budget: admission fits many, decode
    # growth overflows, the newest are retracted and recomputed, every reply is still exact.
    length = LengthModel(median_tokens=350, prompt_sigma=0.3, sample_sigma=0.2, truncation_fraction=0.2)
    async with start_cluster(1, seed=2, time_scale=100, length=length, kv_capacity_tokens=3000,
                             admission_reserve_tokens=64) as rc:
        model = rc.cluster.model
        prompts = [[100 + i, 2, 3, 4] + [9] * 26 for i in range(16)]
        out = await asyncio.gather(*[
            call(session, "POST", rc.router_url, "/generate", gen_body(p, 400, f"k{i}", seed=i))
            for i, p in enumerate(prompts)])
        for i, (status, reply) in enumerate(out):
            assert status == 200
            ids, lps, finish = check_reply_shape(reply, model, 400)
            assert finish in ("stop", "length")
            assert (ids, lps, finish) == model.complete(prompts[i], i, 400)
        stats = rc.cluster.stats()["engines"][0]
        assert stats["retractions"] > 0 and stats["recomputed_tokens"] > 0
        assert stats["prefill_tokens"] == 16 * 30 + stats["recomputed_tokens"]
        assert max(stats["timeline"]["kv_used"]) <= 3000
        assert stats["load"]["num_retractions"] == stats["retractions"]


# ------------------------------------------------------------------------------------- virtual time
def _workload_virtual(stagger_s: float = 0.0, events: bool = False, arrivals=None, **overrides):
    """16 requests (optionally arriving ``stagger_s`` apart, or at the emulated times
    ``arrivals[i]``, with aborts and a weight bump in between) on one engine under the virtual
    clock; returns the replies and the engine's stats."""
    async def main():
        cluster = build_cluster(1, seed=4, length=LengthModel(median_tokens=150), time_scale=1.0, **overrides)
        await cluster.start()
        transport = cluster.transport()
        loop = asyncio.get_running_loop()
        if events:
            loop.call_at(loop.time() + 0.31, cluster.engines[0].abort, "v3")
            loop.call_at(loop.time() + 0.77, cluster.bump_weight_version)
            loop.call_at(loop.time() + 0.93, cluster.engines[0].abort, "v5")

        async def one(i):
            await asyncio.sleep(stagger_s * i if arrivals is None else arrivals[i])
            return await transport.request("POST", cluster.router_url, "/generate",
                                           gen_body([7, 7, i, 7, 7], 300, f"v{i}", seed=i), 1e6)
        try:
            out = await asyncio.gather(*[one(i) for i in range(16)])
            return out, cluster.stats()["engines"][0]
        finally:
            await cluster.close()
    return run_virtual(main())


@pytest.mark.parametrize("scenario", [
    dict(kv_capacity_tokens=800, admission_reserve_tokens=16),
    dict(kv_capacity_tokens=700, admission_reserve_tokens=16, stagger_s=0.037, events=True),
    dict(kv_capacity_tokens=700, admission_reserve_tokens=16, stagger_s=0.021, events=True,
         admission_new_token_ratio=0.3, max_running_requests=6),
])
def test_macro_steps_account_time_exactly_as_single_steps(scenario):
    out_macro, stats_macro = _workload_virtual(max_macro_steps=32, **scenario)
    out_single, stats_single = _workload_virtual(max_macro_steps=1, **scenario)
    for macro, single in zip(out_macro, out_single):
        latency = macro["meta_info"].pop("e2e_latency")
        assert latency == pytest.approx(single["meta_info"].pop("e2e_latency"), rel=1e-9)
        for reply in (macro, single):  # wall-clock time of the reply, as SGLang stamps it
            reply["meta_info"].pop("response_sent_to_client_ts")
        assert macro == single
    assert stats_macro["retractions"] > 0
    assert stats_macro["decode_steps"] == stats_single["decode_steps"]
    for key in ("busy_s", "prefill_tokens", "recomputed_tokens", "retractions", "decoded_tokens",
                "generated_tokens", "last_reply_t", "aborted_requests"):
        assert stats_macro[key] == pytest.approx(stats_single[key], rel=1e-9), key
    if scenario.get("events"):
        finishes = [r["meta_info"]["finish_reason"]["type"] for r in out_macro]
        assert finishes.count("abort") == 2
        assert {r["meta_info"]["weight_version"] for r in out_macro} == {"0", "1"}


def test_abort_inside_a_macro_step_returns_tokens_of_completed_steps():
    tm = TimeModel(decode_t0=0.01, decode_per_request=0.001, decode_per_kv_token=1e-5,
                   prefill_t0=0.005, prefill_per_token=1e-4)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    abort_at = 0.5  # emulated seconds after submission

    async def main():
        cluster = build_cluster(1, seed=0, length=LONG, time=tm, time_scale=1.0, max_macro_steps=32)
        await cluster.start()
        transport = cluster.transport()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        loop.call_at(t0 + abort_at, cluster.engines[0].abort, "z")
        reply = await transport.request("POST", cluster.router_url, "/generate", gen_body(prompt, 1000, "z"), 1e6)
        await cluster.close()
        return reply, loop.time() - t0

    reply, elapsed = run_virtual(main())
    t = tm.prefill_step(len(prompt))
    expected = 0
    while t + tm.decode_step(1, len(prompt) + expected) <= abort_at:
        t += tm.decode_step(1, len(prompt) + expected)
        expected += 1
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(reply["output_ids"]) == expected > 32
    assert elapsed == pytest.approx(abort_at)  # the abort reply is immediate


def _hold_arrivals(engine, count: int) -> dict[str, float]:
    """Make ``engine`` take its next ``count`` requests in one go: each submit is held until the
    last has come, then all are submitted in one callback, so the engine admits them together,
    however far apart (in wall time, over HTTP) they came. Returns the dict the emulated arrival
    time of each request id will be written to."""
    submit = engine.submit
    held, arrivals = [], {}

    def chain(source: asyncio.Future, target: asyncio.Future) -> None:
        if source.cancelled():
            target.cancel()
        elif source.exception() is not None:
            target.set_exception(source.exception())
        else:
            target.set_result(source.result())

    def holding_submit(rid, *args, **kwargs):
        target = asyncio.get_running_loop().create_future()
        held.append((rid, args, kwargs, target))
        if len(held) == count:
            for rid_, args_, kwargs_, target_ in held:
                future = submit(rid_, *args_, **kwargs_)
                arrivals[rid_] = engine._requests[rid_].arrival_t  # the time the engine itself used
                future.add_done_callback(lambda f, t=target_: chain(f, t))
        return target

    engine.submit = holding_submit
    return arrivals


def _held_workload(engine_url: str, request, count: int = 16):
    return [request(engine_url, gen_body([7, 7, i, 7, 7], 300, f"v{i}", seed=i)) for i in range(count)]


def test_virtual_time_matches_real_time_emulation():
    """The engine on the real clock (over loopback HTTP) and on the virtual clock, given the same
    16 requests admitted together, schedules them identically: same tokens and the same reply
    times, counted from the first reply, however loaded the machine is.

    The arrivals are the one thing wall time decides in the real run (the HTTP requests reach the
    engine milliseconds apart, more on a loaded machine), so both runs hold them until all 16 have
    come and admit them in one callback. Once busy the engine accounts its steps back to back on
    the emulated clock whatever the real loop's lag, so nothing else may differ but when the first
    step starts (the real loop may wake late after the submits). The replies never
    come before the emulated time they carry divided by the time scale (a loaded machine only makes
    them later); that the scale maps emulated time to loop time exactly, neither twice, nor not at
    all, nor inverted, is checked on the virtual clock (test_time_scale_maps_emulated_time_to_loop_time)."""

    SCALE = 2.0

    async def real_time_run():
        async with aiohttp.ClientSession() as session, start_cluster(
                1, seed=4, time_scale=SCALE, length=LengthModel(median_tokens=150)) as rc:
            engine = rc.cluster.engines[0]
            arrivals = _hold_arrivals(engine, 16)
            loop = asyncio.get_running_loop()
            sent = loop.time()
            received = {}

            async def one(body):
                reply = (await call(session, "POST", rc.router_url, "/generate", body))[1]
                received[body["rid"]] = loop.time()
                return reply

            out = await asyncio.gather(*_held_workload(rc.router_url, lambda _, body: one(body)))
            return out, rc.cluster.stats()["engines"][0], arrivals, sent, received, engine

    async def virtual_run():
        cluster = build_cluster(1, seed=4, length=LengthModel(median_tokens=150), time_scale=1.0)
        await cluster.start()
        arrivals = _hold_arrivals(cluster.engines[0], 16)
        transport = cluster.transport()
        try:
            out = await asyncio.gather(*_held_workload(
                cluster.router_url, lambda url, body: transport.request("POST", url, "/generate", body, 1e6)))
            return out, cluster.stats()["engines"][0], arrivals
        finally:
            await cluster.close()

    out_real, real, arrivals, sent, received, engine = asyncio.run(real_time_run())
    out_virtual, virtual, arrivals_virtual = run_virtual(virtual_run())
    assert len(arrivals) == 16
    assert [r["output_ids"] for r in out_real] == [r["output_ids"] for r in out_virtual]
    assert real["generated_tokens"] == virtual["generated_tokens"]
    # The schedule: each reply's emulated time, counted from the first reply, is the same in both
    # runs (up to float rounding); a request put in another batch, or a step lost to the loop's lag,
    # moves one by a decode step at least. What load may change is when the first step starts after
    # the 16 submits (the real loop wakes late): that delays every reply alike, never makes one
    # earlier.
    def reply_times(out, arrived):
        return [arrived[f"v{i}"] + r["meta_info"]["e2e_latency"] for i, r in enumerate(out)]

    times_real = reply_times(out_real, arrivals)
    times_virtual = reply_times(out_virtual, arrivals_virtual)
    assert len(set(arrivals_virtual.values())) == 1  # one instant on the virtual clock
    assert max(times_virtual) - min(times_virtual) > 1.0
    assert [t - min(times_real) for t in times_real] == pytest.approx(
        [t - min(times_virtual) for t in times_virtual], rel=0, abs=1e-6)
    latencies_real = [r["meta_info"]["e2e_latency"] for r in out_real]
    latencies_virtual = [r["meta_info"]["e2e_latency"] for r in out_virtual]
    assert all(lr >= lv - 1e-6 for lr, lv in zip(latencies_real, latencies_virtual))
    # On time in wall terms: a reply comes no earlier than its emulated time at SCALE emulated
    # seconds per wall second; load can only make it later.
    origin = engine._origin
    for reply, emulated in zip(out_real, times_real):
        rid = reply["meta_info"]["id"]
        assert received[rid] >= origin + emulated / SCALE - 1e-6, rid
    assert min(received.values()) > sent


def test_time_scale_maps_emulated_time_to_loop_time():
    """At time_scale 2 the engine's emulated clock runs at twice its loop's: on the virtual clock
    (exact, whatever the machine) the same workload spans the same emulated time as at scale 1 and
    half of it in loop time. A scale applied twice, not at all or inverted gives a quarter, the
    whole, or twice the span."""

    async def run(scale: float):
        cluster = build_cluster(1, seed=4, length=LengthModel(median_tokens=150), time_scale=scale)
        await cluster.start()
        _hold_arrivals(cluster.engines[0], 16)
        transport = cluster.transport()
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            out = await asyncio.gather(*_held_workload(
                cluster.router_url, lambda url, body: transport.request("POST", url, "/generate", body, 1e6)))
            return out, cluster.stats()["engines"][0], loop.time() - start
        finally:
            await cluster.close()

    out_1, stats_1, loop_span_1 = run_virtual(run(1.0))
    out_2, stats_2, loop_span_2 = run_virtual(run(2.0))
    assert [r["output_ids"] for r in out_1] == [r["output_ids"] for r in out_2]
    span_1 = stats_1["last_reply_t"] - stats_1["first_arrival_t"]
    span_2 = stats_2["last_reply_t"] - stats_2["first_arrival_t"]
    assert span_1 > 1.0
    assert span_2 == pytest.approx(span_1, rel=1e-9)
    assert loop_span_1 == pytest.approx(span_1, rel=1e-6)
    assert loop_span_2 == pytest.approx(span_1 / 2.0, rel=1e-6)


# ------------------------------------------------------------------------------------- length model
def test_default_length_model_correlates_samples_of_a_prompt():
    model = SyntheticLM(seed=11)  # default LengthModel
    lengths = np.array([[model.response_length([p, 3, 5, 7, 11], s, 16384) for s in range(8)]
                        for p in range(120)])
    between = lengths.mean(axis=1).var()
    within = lengths.var(axis=1).mean()
    assert between > 3 * within
    assert 500 < np.median(lengths) < 4000 and lengths.max() == 16384  # long tail into the budget
    # The bench's DAPO-Math law (fitted with its tail on APRIL's statistics, tests/test_bench_model.py):
    # most samples stop inside the 16K budget, a tail runs into it.
    dapo = SyntheticLM(seed=11, length=LengthModel.preset("dapo-math-qwen3-4b-16k"))
    dapo_lengths = np.array([dapo.response_length([p, 3, 5, 7] + [1] * 150, 0, 16384) for p in range(200)])
    assert 1500 < np.median(dapo_lengths) < 12000
    assert 0.01 < np.mean(dapo_lengths == 16384) < 0.5


def test_length_model_validation_and_parse():
    with pytest.raises(ValueError):
        LengthModel(kind="uniform")
    with pytest.raises(ValueError):
        LengthModel(truncation_fraction=1.5)
    with pytest.raises(ValueError):
        EngineConfig(kv_capacity_tokens=0)
    with pytest.raises(ValueError):
        TimeModel(decode_t0=float("nan"))
    parsed = LengthModel.parse("dapo-math-qwen3-4b-16k:median_tokens=2000,truncation_fraction=0.1")
    assert parsed.median_tokens == 2000 and parsed.truncation_fraction == 0.1
    assert parsed.shape == LengthModel.preset("dapo-math-qwen3-4b-16k").shape
    with pytest.raises(ValueError):
        LengthModel.parse("default:bogus=1")


# ------------------------------------------------------------------ golden replies of SGLang 0.5.23
GOLDEN = Path(__file__).parent / "data" / "sglang-0.5.23-golden.json"
# Where the emulator knowingly differs: it stops on EOS only (stop_token_ids is refused with a 400).
EMULATOR_DIVERGES = ("generate_stop_token",)


async def test_emulator_replies_like_sglang_0_5_23_field_by_field():
    """The protocol scenarios against the emulator, compared with the replies recorded from a real
    SGLang 0.5.23 CPU engine (scripts/real-stack/record_golden.py): every field, its type, the
    finish reasons, error bodies word for word, empty abort bodies, queued-abort replies without
    prompt_tokens, weight_versions spans, /model_info's version after a weight update, 404s."""
    from april_workbench.emulator.testing import golden_differences, golden_replies

    recorded = json.loads(GOLDEN.read_text())
    want = recorded["scenarios"]
    async with start_cluster(1, seed=3, time_scale=50, length=LONG,
                             max_running_requests=recorded["max_running_requests"]) as rc:
        got = await golden_replies(rc.engine_urls[0], max_running_requests=recorded["max_running_requests"],
                                   new_weights_path="/any/path", weight_version=0)
    assert golden_differences(got, want, skip=EMULATOR_DIVERGES) == []
    for name, scenario in want.items():
        if name.startswith("bad_") and name != "bad_duplicate_rid":
            assert got[name]["reply"] == scenario["reply"], name
    duplicate = got["bad_duplicate_rid"]["reply"]["body"]
    assert duplicate == {"error": {"message": "Duplicate request ID detected: golden-dup"}}
    assert "queued_reply" in got["abort_all"]
    assert "prompt_tokens" not in got["abort_all"]["queued_reply"]["body"]["meta_info"]
    # weight versions after /update_weights_from_disk, relative to where each engine started
    for side, start in ((got, 0), (want, int(want["generate_length"]["reply"]["body"]["meta_info"]["weight_version"]))):
        assert side["model_info_after_update"]["reply"]["body"]["weight_version"] == str(start + 1)
        meta = side["generate_after_update"]["reply"]["body"]["meta_info"]
        assert meta["weight_version"] == str(start + 1)
        assert meta["weight_versions"] == [{"version": str(start + 1), "start": 0, "end": 4}]
    stop = got["generate_stop_token"]["reply"]
    assert stop["status"] == 400 and "stop_token_ids" in stop["body"]["error"]["message"]


@pytest.mark.parametrize("max_lag_s", [None, 0.0])
def test_a_starved_engine_catches_up_unless_its_lag_is_bounded(max_lag_s):
    """Real clock: the loop is blocked (a starved process) for twice the time a request needs. An
    engine that catches up finishes it in the next few loop turns; one with ``max_lag_s`` counts
    the lost time as its own pause and has produced almost nothing when the loop comes back."""
    import time as wall

    from april_workbench.emulator import EngineConfig, TimeModel
    from april_workbench.emulator.batching import EmulatedEngine

    async def main():
        config = EngineConfig(time=TimeModel(decode_t0=0.01), kv_capacity_tokens=100_000, max_lag_s=max_lag_s)
        engine = EmulatedEngine(SyntheticLM(seed=0), config)
        engine.start()
        task = asyncio.get_running_loop().create_task(
            engine.generate("r", [1, 2, 3, 4], 100, 0, ignore_eos=True))  # 100 steps of 10 ms: 1 s
        while engine.decoded_tokens == 0:  # the engine is decoding it
            await asyncio.sleep(0.01)
        wall.sleep(2.0)  # the loop gets no turn
        for _ in range(50):
            await asyncio.sleep(0)
        finished = task.done()
        await engine.stop()
        reply = await task
        return finished, reply["meta_info"]["completion_tokens"]

    finished, tokens = asyncio.run(main())
    if max_lag_s is None:
        assert finished and tokens == 100
    else:
        assert not finished and tokens < 100
