"""Engines that slime's fault tolerance takes away and brings back, as the plugin's rollout function
meets them between steps.

slime's ``RolloutHealthMonitor`` kills an engine that fails its health check (``SGLangEngine.shutdown``
deletes it from the router's ``/workers`` and kills its process); at the next weight update
``recover_updatable_engines`` starts a new one, which registers with the router, on whatever port
is free then (the old one, or another). The rollout function reads the router's list at the start
of every step, so a dead engine gets no request once the router stops listing it, and a recovered
one takes requests from the first step it is listed in. Emulated engines over loopback HTTP; the
same path on real slime, Ray and SGLang: ``tests/real/test_slime_launcher.py``.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from april_slime import rollout
from april_slime.core.transport import HttpTransport
from tests.support.slime_jobs import Cluster, loop_run, make_args, point_at


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q{i:03d}", "label": str(i)}) + "\n" for i in range(64)))
    return path


@pytest.fixture
def three_engines(slime_mode):
    """Three emulated engines; the router lists the first two, as slime's router lists the two
    engines a job started (the third stands for the engine recovery will start)."""
    c = Cluster(num_engines=3)
    c.bump(1)
    c.emulator.router_handler.urls = c.emulator.engine_urls[:2]
    yield c
    rollout.shutdown()
    c.stop()


@pytest.fixture
def generates(monkeypatch) -> list[Counter]:
    """The /generate calls of each step, counted per engine URL (one Counter per step)."""
    steps: list[Counter] = []
    request = HttpTransport.request

    async def counting(self, method, url, path, payload, timeout_s):
        if path == "/generate" and not str(payload.get("rid", "")).startswith("april-probe-"):
            steps[-1][url.rstrip("/")] += 1
        return await request(self, method, url, path, payload, timeout_s)

    monkeypatch.setattr(HttpTransport, "request", counting)
    return steps


@pytest.mark.parametrize("policy", ["april", "copris"])
def test_a_killed_engine_gets_nothing_and_its_recovered_successor_takes_requests(three_engines, generates,
                                                                                tmp_path, prompts, policy):
    cluster = three_engines
    first, second, recovered = cluster.emulator.engine_urls
    args = point_at(make_args(tmp_path, prompts, april_policy=policy), cluster)
    source = rollout.AprilDataSource(args)
    trained: list[int] = []

    rollouts = iter(range(100))

    def step() -> Counter:
        """The requests of the next rollout that sends any: a rollout can be served whole from the
        groups the one before completed beyond its target (its surplus), sending none."""
        for _ in range(4):
            generates.append(Counter())
            output = rollout.generate_rollout(args, next(rollouts), source)
            trained.extend(g[0].group_index for g in output.samples)
            assert len(output.samples) == args.rollout_batch_size
            if generates[-1]:
                return generates[-1]
        raise AssertionError("four rollouts in a row sent no request")

    both = step()
    assert both[first] > 0 and both[second] > 0, both

    # the health monitor's kill: the engine's process is gone and the router no longer lists it
    dead_server = cluster.emulator._servers[0]
    assert dead_server.url == first
    loop_run(dead_server.close())
    cluster.emulator.router_handler.urls = [second]
    survivor_only = step()
    assert survivor_only[first] == 0 and survivor_only[second] > 0, survivor_only
    assert rollout._RUNTIME.client.worker_urls == [second]

    # recovery at the weight update: a new engine on another port registers with the router
    cluster.emulator.router_handler.urls = [second, recovered]
    after = step()
    assert after[recovered] > 0, f"the recovered engine {recovered} took no request: {after}"
    assert after[first] == 0
    assert sorted(rollout._RUNTIME.client.worker_urls) == sorted([second, recovered])

    # nothing lost or trained twice across the changes
    assert len(trained) == len(set(trained)) == len(generates) * args.rollout_batch_size
    handed_out = set(range(source._prompts.sample_group_index))
    assert handed_out == set(trained) | {int(g.uid) for g in source.buffer.groups()}
