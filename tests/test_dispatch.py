"""Dispatch modes (april_slime.core.dispatch): what the router's worker list and slime's arguments
choose, and router dispatch end to end on the emulator: generates through the router, aborts fanned
out to the engines (the router is never asked to abort), nothing lost or duplicated, every token
the reference stream of the version that generated it."""

from __future__ import annotations

import asyncio

import pytest

from april_slime.core.buffer import PartialBuffer
from april_slime.core.config import AprilConfig, AprilConfigError
from april_slime.core.dispatch import DeploymentHints, DispatchError, Worker, choose, parse_workers
from april_slime.core.engine import EngineClient
from april_slime.core.scheduler import RolloutScheduler
from april_slime.core.sglang_protocol import EngineError, RequestRejected
from april_slime.core.transport import TransportHTTPError
from april_workbench.emulator.testing import start_cluster
from april_workbench.emulator.vclock import run_virtual
from tests.support.numbered_prompts import NumberedPrompts

ROUTER = "http://router:1"
E1, E2 = "http://e1:2", "http://e2:3"


# ------------------------------------------------------------------ the router's worker list
def test_worker_list_shapes_of_sglang_router():
    """The shapes sglang-router 0.3.2 answers (recorded from it): a DP-aware router lists each
    engine once per DP rank as url@rank; a PD router types its workers."""
    dp = {"workers": [{"url": "http://h:1@1", "worker_type": "regular"}, {"url": "http://h:1@0"}], "total": 2}
    assert parse_workers(dp, ROUTER) == [Worker("http://h:1@1", "http://h:1", "regular", 1),
                                         Worker("http://h:1@0", "http://h:1", "regular", 0)]
    pd = {"workers": [{"url": E1, "worker_type": "prefill"}, {"url": E2 + "/", "worker_type": "decode"}]}
    assert [(w.url, w.worker_type) for w in parse_workers(pd, ROUTER)] == [(E1, "prefill"), (E2, "decode")]
    assert parse_workers({"urls": [E1]}, ROUTER) == [Worker(E1, E1)]
    assert parse_workers([{"url": "http://user@host:5"}], ROUTER)[0].url == "http://user@host:5"


def test_auto_chooses_router_only_where_direct_dispatch_bypasses_the_router():
    regular = [Worker(E1, E1), Worker(E2, E2)]
    auto = choose("auto", ROUTER, regular)
    assert auto.mode == "direct" and auto.targets == [E1, E2] and auto.abort_urls(E1) == [E1]
    pd = [Worker(E1, E1, "prefill"), Worker(E2, E2, "decode")]
    chosen = choose("auto", ROUTER, pd)
    assert chosen.mode == "router" and chosen.targets == [ROUTER] and "PD disaggregation" in chosen.reason
    assert chosen.abort_urls(ROUTER) == [E1, E2]
    ranked = [Worker("http://h:1@0", "http://h:1", dp_rank=0), Worker("http://h:1@1", "http://h:1", dp_rank=1)]
    chosen = choose("auto", ROUTER, ranked)
    assert chosen.mode == "router" and chosen.engines == ("http://h:1",) and "DP-aware" in chosen.reason
    # what slime's arguments say counts too (a PD job whose router lists its workers later)
    assert choose("auto", ROUTER, regular, DeploymentHints(pd_disaggregation=True)).mode == "router"
    assert choose("auto", ROUTER, regular, DeploymentHints(dp_aware_router=True)).mode == "router"
    # sglang-router's default policy: reported, not followed (it is every slime job's)
    cache = choose("auto", ROUTER, regular, DeploymentHints(router_policy="cache_aware"))
    assert cache.mode == "direct" and "cache_aware" in cache.notes[0]


def test_explicit_modes_and_refusals():
    regular = [Worker(E1, E1)]
    assert choose("router", ROUTER, regular).mode == "router"
    assert choose("direct", ROUTER, regular).mode == "direct"
    with pytest.raises(DispatchError, match="direct cannot reach these engines: PD disaggregation"):
        choose("direct", ROUTER, [Worker(E1, E1, "prefill"), Worker(E2, E2, "decode")])
    with pytest.raises(DispatchError, match="DP-aware"):
        choose("direct", ROUTER, [Worker("http://h:1@0", "http://h:1", dp_rank=0)])
    with pytest.raises(DispatchError, match="must be one of"):
        choose("routr", ROUTER, regular)
    with pytest.raises(AprilConfigError, match="april_dispatch: must be one of auto, direct, router"):
        AprilConfig.from_dict({"dispatch": "routr"})


# ------------------------------------------------------------------ the client in router mode
class Recording:
    """A transport that records every call and answers from ``handlers[(url, path)]``."""

    def __init__(self, handlers):
        self.handlers = handlers
        self.calls: list[tuple[str, str, dict | None]] = []

    async def request(self, method, url, path, payload, timeout_s):
        self.calls.append((url, path, payload))
        handler = self.handlers.get((url, path))
        if handler is None:
            raise TransportHTTPError(404, {"detail": "Not Found"})
        return await handler(payload)


def reply(rid, tokens=(5, 6), version="7"):
    return {"output_ids": list(tokens), "meta_info": {
        "id": rid, "finish_reason": {"type": "length"}, "prompt_tokens": 3, "completion_tokens": len(tokens),
        "weight_version": version, "output_token_logprobs": [[-0.5, t, None] for t in tokens]}}


async def answer(value):
    return value


def router_client(handlers, **kw):
    workers = {"workers": [{"url": E1, "worker_type": "prefill"}, {"url": E2, "worker_type": "decode"}]}
    transport = Recording({(ROUTER, "/workers"): lambda _: answer(workers), **handlers})
    return transport, EngineClient.from_router(ROUTER, dispatch="auto", transport=transport, max_retries=1,
                                               retry_backoff_s=0.0, **kw)


async def test_router_mode_sends_generates_to_the_router_and_aborts_to_every_engine():
    async def abort_ok(_):
        return None

    async def e2_down(_):
        raise ConnectionError("refused")

    transport, pending = router_client({
        (ROUTER, "/generate"): lambda p: answer(reply(p["rid"])),
        (E1, "/abort_request"): abort_ok, (E2, "/abort_request"): e2_down,
        (E1, "/model_info"): lambda _: answer({"weight_version": "7"}),
        (E2, "/model_info"): lambda _: answer({"weight_version": "8"})})
    client = await pending
    assert client.engine_urls == [ROUTER] and client.worker_urls == [E1, E2]
    result = await client.generate(ROUTER, [1, 2, 3], max_new_tokens=4, rid="a#0", sampling_params={},
                                   sampling_seed=1)
    assert result.output_ids.tolist() == [5, 6]
    # one engine that does not answer the fan-out is tolerated (the other may hold the rid) ...
    await client.abort(ROUTER, rid="a#0", max_retries=0)
    assert [(u, p["rid"]) for u, path, p in transport.calls if path == "/abort_request"] == [(E1, "a#0"), (E2, "a#0")]
    assert not [c for c in transport.calls if c[0] == ROUTER and c[1] == "/abort_request"]
    # ... none answering is a failed abort
    transport.handlers[(E1, "/abort_request")] = e2_down
    with pytest.raises(EngineError):
        await client.abort(ROUTER, abort_all=True, max_retries=0)
    # the router answers no weight version: the newest its engines report
    assert await client.weight_version(ROUTER) == 8
    await client.close()


async def test_router_mode_refuses_fields_the_router_drops():
    transport, pending = router_client({(ROUTER, "/generate"): lambda p: answer(reply(p["rid"]))}, vocab_size=50)
    client = await pending
    with pytest.raises(RequestRejected, match="drops sampling_params.custom_params"):
        await client.generate(ROUTER, [1, 2], max_new_tokens=2, rid="b#0", sampling_seed=1,
                              sampling_params={"custom_params": {"return_top_p_token_ids": True}})
    # the engine-safety check holds through the router too: an id outside the vocabulary never leaves
    with pytest.raises(RequestRejected, match="token id 50 at position 1"):
        await client.generate(ROUTER, [1, 50], max_new_tokens=2, rid="b#1", sampling_seed=1, sampling_params={})
    assert not [c for c in transport.calls if c[1] == "/generate"], "nothing was sent"
    await client.close()


async def test_router_mode_retry_after_timeout_aborts_the_rid_on_every_engine():
    """A timed-out generate may still run on whichever engine the router chose: the rid is
    aborted on every engine before the retry, so at most one copy runs at a time."""
    calls = {"n": 0}

    async def slow_then_fast(payload):
        calls["n"] += 1
        if calls["n"] == 1:
            await asyncio.sleep(10)
        return reply(payload["rid"])

    transport, pending = router_client({(ROUTER, "/generate"): slow_then_fast,
                                        (E1, "/abort_request"): answer, (E2, "/abort_request"): answer},
                                       timeout_s=0.2)
    client = await pending
    result = await client.generate(ROUTER, [1, 2], max_new_tokens=4, rid="c#0", sampling_params={}, sampling_seed=1)
    assert result.output_ids.tolist() == [5, 6]
    paths = [(u, path) for u, path, _ in transport.calls if path != "/workers"]
    assert paths == [(ROUTER, "/generate"), (E1, "/abort_request"), (E2, "/abort_request"), (ROUTER, "/generate")]
    await client.close()


# ------------------------------------------------------------------ a job in router mode, on the emulator
class RecordingLocal:
    def __init__(self, inner):
        self.inner, self.calls = inner, []

    async def request(self, method, url, path, payload, timeout_s):
        self.calls.append((url, path))
        return await self.inner.request(method, url, path, payload, timeout_s)


@pytest.mark.parametrize("policy", ["april", "copris"])
def test_router_dispatch_job_loses_nothing_and_aborts_only_engines(policy):
    async def run():
        async with start_cluster(num_engines=2, seed=11, time_scale=1.0, http=False, length="short") as running:
            transport = RecordingLocal(running.transport)
            client = await EngineClient.from_router(running.router_url, dispatch="router", transport=transport,
                                                    timeout_s=60.0, max_retries=1, retry_backoff_s=0.01)
            settings = {"policy": policy, **({"concurrency": 6} if policy == "copris" else {})}
            config = AprilConfig.from_dict(settings)
            buffer = PartialBuffer.from_config(config)
            sched = RolloutScheduler(config, client, buffer, rollout_batch_size=4, n_samples_per_prompt=2,
                                     sampling_params={"temperature": 1.0})
            prompts = NumberedPrompts("p", 2, 96, first_seed=1000, tail=(5, 6), stamp_version=True)
            returned, resumed = [], 0
            model = running.cluster.model
            for step in range(3):
                result = await sched.run_step(prompts, current_version=step)
                assert len(result.groups) == 4 and all(g.complete for g in result.groups)
                returned += [g.uid for g in result.groups]
                buffered = [g.uid for g in buffer.groups()]
                assert len(set(returned)) == len(returned) and not set(buffered) & set(returned)
                assert len(returned) + len(buffered) == len(prompts.made), "a group was lost"
                for g in [*result.groups, *buffer.groups()]:
                    for t in g.trajectories:
                        ids, lps = model.reference(t.prompt_ids, t.sampling_seed, len(t.prompt_ids),
                                                   t.token_versions())
                        assert t.response_ids == ids and t.logprobs == pytest.approx(lps, abs=0, rel=1e-12)
                        resumed += len(t.version_runs) > 1
                running.cluster.bump_weight_version()
            await client.close()
            return transport.calls, running.router_url, list(running.engine_urls), resumed

    calls, router, engines, resumed = run_virtual(run())
    assert resumed > 0, "no trajectory was resumed across a weight update"
    generates = {u for u, path in calls if path == "/generate"}
    assert generates == {router}
    aborted = [u for u, path in calls if path == "/abort_request"]
    assert aborted and set(aborted) == set(engines), "aborts go to every engine, never to the router"


async def test_router_mode_reads_loads_from_the_engines_with_the_replies_retractions():
    """The router has no /v1/loads; the engines' loads are read instead, and the retractions the
    replies reported through the router count once over the engines (the adaptive N' reads them)."""
    def loads(_):
        return answer({"loads": [{"num_running_reqs": 1, "num_waiting_reqs": 0, "num_used_tokens": 5,
                                  "max_total_num_tokens": 100}]})

    def retracted(payload):
        body = reply(payload["rid"])
        body["meta_info"]["num_retractions"] = 2
        return answer(body)

    transport, pending = router_client({(ROUTER, "/generate"): retracted, (E1, "/v1/loads"): loads,
                                        (E2, "/v1/loads"): loads})
    client = await pending
    await client.generate(ROUTER, [1, 2], max_new_tokens=4, rid="d#0", sampling_params={}, sampling_seed=1)
    got = await client.loads()
    assert [load.url for load in got] == [E1, E2]
    assert sum(load.retractions for load in got) == 2 and sum(load.num_running for load in got) == 2
    assert not [c for c in transport.calls if c[0] == ROUTER and c[1] == "/v1/loads"]
    await client.close()


def test_a_job_needing_what_the_router_drops_stops_before_its_first_call():
    from april_slime.core.connection import check_router_fields
    from april_slime.core.replay import ReplaySpec
    from april_slime.slime_args import SlimeArgs

    router = choose("router", ROUTER, [Worker(E1, E1)])
    params = SlimeArgs(rollout_temperature=1.0).sampling_params()
    routed = ReplaySpec(routed_layers=2, routed_topk=2)
    with pytest.raises(AprilConfigError, match="the router drops return_routed_experts"):
        check_router_fields(router, params, routed)
    check_router_fields(choose("direct", ROUTER, [Worker(E1, E1)]), params, routed)  # direct carries it
    check_router_fields(router, params, ReplaySpec())
    hints = SlimeArgs(prefill_num_servers=2, router_dp_aware=False, router_policy="cache_aware").deployment_hints
    assert hints == DeploymentHints(pd_disaggregation=True, dp_aware_router=False, router_policy="cache_aware")
