"""The plugin through slime's own launcher, as users start it: ``examples/qwen3-4B-dapo-math/run-cpu.sh``
(common.sh's flag blocks: the README's ``--rollout-function-path`` / ``--data-source-path`` /
``--custom-config-path`` and the loss hook) submits slime's ``train.py`` with ``ray job submit`` to a
Ray cluster; slime starts its router and its ``SGLangEngine`` actors, registers the engines with
``POST /workers``, and calls the plugin under ``--debug-rollout-only`` (slime's Megatron trainer does
not start on a CPU: docs/real-stack.md says where it stops).

Every job runs two engines. The jobs share one Ray cluster. The first starts SGLang itself, as
slime does on a GPU node, under slime's fault tolerance (``--use-fault-tolerance``): one of its
engines is SIGKILLed while the plugin's requests run on it, slime's ``RolloutHealthMonitor`` kills
what is left of it, the rollout finishes on the other engine, and the engine slime recovers takes
requests again. The others use the session's two SGLang 0.5.15.post1 engines as slime's external
engines (``--rollout-external-engine-addrs``), which slime registers with its router the same way
and spares each job the engine starts. Everything is checked from what a user sees: slime's
``perf`` log lines (the plugin's ``april/*`` metrics), Ray's job status and log, the samples slime
hands to training (``--save-debug-rollout-data``) and the plugin's checkpoint files; the fault
tolerance also from inside the job (``tests/support/slime_faults.py``: which engine served each
request, and slime's recovery, which ``--debug-rollout-only`` skips, run where the weight update
would run it).

Also here: the router registration race itself, made to happen on the real sglang-router.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.support import ROOT
from tests.support.real_tier import http_json, write_prompts
from tests.support.slime_launcher import (
    ENGINES,
    JOB_TIMEOUT_S,
    RUN_CPU,
    Job,
    RayCluster,
    debug_samples,
    kill_engine,
    launch,
    launcher_missing,
    wait_for,
)
from tests.support.state_files import read_plain_state

BATCH, N = 4, 2
# responses end at EOS after 24 tokens on average (the stack's weights), some run for hundreds: at a
# step's target, requests are still generating, so the partials this tier checks do arise
LONG_BUDGET = 256
KILL_BY = 8  # the april job is killed at the first of its next 7 checkpoints that holds a partial
KILLS = 3  # kills until one leaves a checkpoint holding a partial (a save can land between check and kill)
# slime's fault tolerance: an engine is killed in rollout 0 once this many of the plugin's requests
# are in flight on it, and recovered at the top of rollout 1 (where the weight update would run it).
# Rollout 0 ends with more groups complete than it trains (its surplus: up to 3 rollouts' worth
# here), which the next rollouts return without a request; the rollouts after that send requests.
KILL_ROLLOUT, KILL_AT, RECOVER_BEFORE, FAULT_ROLLOUTS = 0, 2, 1, 6
ENGINE_KILLS = 3  # jobs until the kill lands while the plugin's requests run (else it came too late)
FAULT_TOLERANCE = (
    "--use-fault-tolerance",
    # a dead engine fails its check at once (connection refused); a live one loaded with the plugin's
    # requests on a busy machine may take long to answer, and must not be taken for dead
    "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "120",
    "--rollout-health-check-first-wait", "0",
)


@pytest.fixture(scope="module")
def cluster():
    missing = launcher_missing()
    if missing:
        pytest.skip(missing)
    cluster = RayCluster().start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("launcher-data") / "prompts.jsonl", 256)


def external(old_stack) -> list[str]:
    assert len(old_stack.engine_urls) == ENGINES, old_stack.engine_urls
    return ["--rollout-external-engine-addrs", *(u.removeprefix("http://") for u in old_stack.engine_urls)]


def write_config(path, **settings):
    path.write_text(yaml.safe_dump(settings), encoding="utf-8")
    return path


def run_job(cluster, tmp_path, name, *args, **env):
    save = tmp_path / name / "save"
    job = launch(cluster, tmp_path / name / "launcher.log", save,
                 "--save-debug-rollout-data", str(tmp_path / name / "trained" / "rollout_{rollout_id}.pt"),
                 *args, **env)
    return job, tmp_path / name / "trained"


def assert_succeeded(job, rc):
    assert rc == 0 and "succeeded" in job.log, f"the job failed ({rc}):\n{job.tail()}"


def check_batches(samples: dict[int, list[dict]], rollouts: range) -> list[int]:
    """Every rollout handed a whole batch to training; no group was handed over twice. Returns the
    groups trained, in order."""
    assert sorted(samples) == list(rollouts), sorted(samples)
    trained = []
    for rid in rollouts:
        groups: dict[int, list[dict]] = {}
        for s in samples[rid]:
            groups.setdefault(s["group_index"], []).append(s)
        assert len(groups) == BATCH and all(len(g) == N for g in groups.values()), (rid, groups.keys())
        for g in groups.values():
            assert len({s["index"] for s in g}) == N
            for s in g:
                assert len(s["rollout_log_probs"]) == s["response_length"] > 0
        trained += sorted(groups)
    assert len(trained) == len(set(trained)), f"a group was trained twice: {trained}"
    return trained


def buffered_partials(state_dir, rollout_id: int) -> set[int]:
    """The groups that the plugin's checkpoint of ``rollout_id`` holds with generated tokens."""
    groups = read_plain_state(state_dir, rollout_id)["buffer"]["groups"]
    return {int(g["uid"]) for g in groups if any(t["response_ids"] for t in g["trajectories"])}


def kill_at_a_partial(job, state_dir, after: int) -> tuple[int, set[int]]:
    """SIGKILL ``job``'s driver once a checkpoint after rollout ``after`` holds a partial with
    tokens (made to happen: the long budget); returns the last checkpoint written when the kill
    landed and its partials (none when the job saved once more in between)."""
    for rollout_id in range(after + 2, after + 1 + KILL_BY):
        wait_for(state_dir / f"april_state_{rollout_id}.bin", job)
        if buffered_partials(state_dir, rollout_id):
            assert job.kill_driver() >= 1, "no train.py process of the job to kill"
            break
    else:
        raise AssertionError(f"no checkpoint of {KILL_BY - 1} rollouts held a partial with tokens:\n{job.tail()}")
    assert job.wait() != 0, "the job was not killed"
    last = max(int(p.stem.rsplit("_", 1)[1]) for p in state_dir.glob("april_state_*.bin"))
    return last, buffered_partials(state_dir, last)


def resumed_in_a_later_rollout(perf: dict[int, dict]) -> int:
    """Partials aborted at one rollout's target and resumed in a later one, counted by the plugin."""
    return sum(int(perf[r].get("april/resumed_trajectories", 0)) for r in perf if r > min(perf))


# ------------------------------------------------------------------- slime's fault tolerance
@dataclass
class FaultRun:
    """A copris job under slime's fault tolerance whose engine was killed (``copris_job``): the
    job, the samples slime handed to training, and, from inside the job, every generate the plugin
    sent (``slime_faults``: per rollout, each with its engine, when it was sent and ended, and its
    reply's tokens or its error), the engine killed, when, and what slime recovered."""

    job: Job
    trained: Path
    faults: Path
    killed: str  # the engine's URL
    killed_at: float  # wall clock, as the job's records
    recovered: dict

    def calls(self, rollout_id: int) -> list[dict]:
        return json.loads((self.faults / f"rollout_{rollout_id}.json").read_text())

    def replies(self, rollout_id: int) -> Counter:
        """Generates answered, per engine."""
        return Counter(c["url"] for c in self.calls(rollout_id) if "error" not in c)

    def sent(self, rollout_id: int) -> Counter:
        return Counter(c["url"] for c in self.calls(rollout_id))

    def cut_by_the_kill(self) -> list[dict]:
        """The plugin's requests that were running on the killed engine when it was killed: sent
        before the kill, ended after it, with an error."""
        return [c for c in self.calls(KILL_ROLLOUT) if c["url"] == self.killed and "error" in c
                and c["sent"] < self.killed_at < c["ended"]]


@pytest.fixture(scope="module")
def copris_job(cluster, prompts, long_weights, tmp_path_factory) -> FaultRun:
    """The README's flags and examples/.../configs/copris.yaml on the two engines slime starts, with
    ``--use-fault-tolerance``: six rollouts, one engine SIGKILLed in rollout 0 as soon as two of the
    plugin's requests are in flight on it (its server process and every process it started; the
    test finds them by the port the engine serves), slime's recovery at the top of rollout 1. The
    weights almost never end a response early (``long_weights``): every request runs its whole
    budget, so the kill lands seconds before the requests could end. One that lands after the
    requests on that engine ended is no test of the fault: the job runs again (at most
    ``ENGINE_KILLS`` times)."""
    example = yaml.safe_load((RUN_CPU.parent / "configs" / "copris.yaml").read_text(encoding="utf-8"))
    for _ in range(ENGINE_KILLS):
        folder = tmp_path_factory.mktemp("copris")
        faults = folder / "faults"
        config = write_config(folder / "copris.yaml", **example, faults_dir=str(faults),
                              faults_kill_rollout=KILL_ROLLOUT, faults_kill_at=KILL_AT,
                              faults_recover_before=RECOVER_BEFORE)
        job, trained = run_job(cluster, folder, "copris", *FAULT_TOLERANCE,
                               "--rollout-function-path", "tests.support.slime_faults.generate_rollout",
                               MODE="copris", APRIL_CONFIG=config, NUM_ENGINES=ENGINES, EXTRA_PYTHONPATH=ROOT,
                               HF_CHECKPOINT=long_weights[0], PROMPT_DATA=prompts,
                               NUM_ROLLOUT=FAULT_ROLLOUTS, ROLLOUT_MAX_RESPONSE_LEN=LONG_BUDGET)
        wait_for(faults / "in_flight.json", job, poll_s=0.05)
        killed = json.loads((faults / "in_flight.json").read_text())["url"]
        killed_at = time.time()
        assert kill_engine(killed), f"no process of the engine {killed} to kill"
        assert_succeeded(job, job.wait())
        run = FaultRun(job, trained, faults, killed, killed_at, json.loads((faults / "recovered.json").read_text()))
        if run.cut_by_the_kill():
            return run
    pytest.fail(f"in {ENGINE_KILLS} jobs the kill never landed while the plugin's requests ran on the engine")


def test_copris_with_the_engines_slime_starts(copris_job):
    """Partials aborted at one target and resumed at the next, auto dispatch choosing direct
    (regular workers), whole batches, nothing trained twice, an engine's death and return
    included (``copris_job``)."""
    job = copris_job.job
    perf = job.perf()
    assert sorted(perf) == list(range(FAULT_ROLLOUTS)), job.tail()
    assert all(p["april/policy_version"] == 0 for p in perf.values())
    assert perf[0]["april/aborted_tokens"] > 0, perf[0]
    assert resumed_in_a_later_rollout(perf) > 0, perf
    assert "april_slime: direct dispatch" in job.log
    check_batches(debug_samples(copris_job.trained), range(FAULT_ROLLOUTS))


def test_an_engine_killed_mid_rollout_through_slimes_fault_tolerance(copris_job):
    """Through slime's ``train.py`` with ``--use-fault-tolerance`` on two engines: the plugin's
    requests run on both; one engine is SIGKILLed while they run on it; slime's health monitor finds
    it dead and kills it (``RolloutHealthMonitor``: the actor shut down, the engine deleted from the
    router); the rollout finishes on the other engine alone; the engine
    ``recover_updatable_engines`` starts in its place takes requests again in the rollouts after.
    What each engine was sent and served, per rollout, is in the assertion messages (and printed).

    Recovery: slime's trainer calls ``recover_updatable_engines`` from ``update_weights``, which
    returns first under ``--debug-rollout-only`` (slime/backends/megatron_utils/actor.py), so a CPU
    job never recovers by itself; ``slime_faults`` calls that same method of the job's
    ``RolloutManager`` where the weight update would, once the monitor has marked the engine dead."""
    run = copris_job
    log = run.job.log
    served = {r: dict(run.replies(r)) for r in range(FAULT_ROLLOUTS)}
    before = Counter(c["url"] for c in run.calls(KILL_ROLLOUT) if c["sent"] < run.killed_at)
    assert len(before) == ENGINES and run.killed in before, f"before the kill the requests went to {dict(before)}"
    (survivor,) = set(before) - {run.killed}

    # the kill landed while the plugin's requests ran on the engine; they went on on the other one
    cut = run.cut_by_the_kill()
    assert cut, "no request was running on the engine when it was killed"
    after_kill = [c for c in run.calls(KILL_ROLLOUT) if "error" not in c and c["ended"] > run.killed_at]
    assert after_kill and {c["url"] for c in after_kill} == {survivor}, served[KILL_ROLLOUT]
    perf = run.job.perf()
    assert perf[KILL_ROLLOUT]["april/engine_errors"] > 0, perf[KILL_ROLLOUT]

    # slime's health monitor found the engine dead and killed it
    assert "Health check failed for rollout engine" in log, run.job.tail()
    assert run.killed not in run.recovered["listed_before"], run.recovered

    # the engine slime recovered (on whatever port was free: the killed engine's own, or another)
    # takes requests again, from the first rollout after the recovery that sends any: at its start
    # the plugin reads the router's list (a new address) or probes the engines out of dispatch (the
    # same address) before the first of its requests, which can be all of them
    assert "Recovered 1 dead rollout engines" in log, run.job.tail()
    (recovered,) = set(run.recovered["engines"]) - {survivor}
    later = range(RECOVER_BEFORE, FAULT_ROLLOUTS)
    generating = [r for r in later if run.calls(r)]
    assert generating, f"no rollout after the recovery sent a request (all from rollout 0's surplus): {served}"
    first_sent = dict(run.sent(generating[0]))
    assert first_sent.get(recovered, 0) > 0, (
        f"rollout {generating[0]}, the first after the recovery to send requests, sent none to the recovered "
        f"engine {recovered} ({'the killed one' if recovered == run.killed else 'not the killed one'}'s "
        f"address): {first_sent}")
    recovered_served = sum(served[r].get(recovered, 0) for r in later)
    assert recovered_served > 0, f"the recovered engine {recovered} served nothing: {served}"
    assert all(c["url"] in (survivor, recovered) for r in later for c in run.calls(r)), served
    print(f"requests sent per engine before the kill {dict(before)}; served per engine and rollout (killed "
          f"{run.killed} in rollout {KILL_ROLLOUT}, {len(cut)} of its requests cut; recovered as {recovered} "
          f"before rollout {RECOVER_BEFORE}): {served}; "
          f"recovery waited {run.recovered['waited_for_monitor_s']:.1f} s for the monitor, "
          f"{run.recovered['waited_for_router_s']:.1f} s for the router")


# -------------------------------------------------------------------------------- other jobs
def test_april_with_router_dispatch_killed_and_restarted_from_its_checkpoint(cluster, prompts, old_stack,
                                                                            tmp_path):
    """april through the router (april_dispatch: router), saving every rollout; the driver is
    SIGKILLed once a saved checkpoint holds partials with tokens, and the launcher restarts the job
    from its last checkpoint: no group is lost or trained twice, and the partials buffered at the
    kill come back and are trained. A kill that lands just after a save of a checkpoint without
    partials is restarted and made again (at most ``KILLS`` times).

    ``--debug-rollout-only`` writes no Megatron checkpoint, so slime reads ``--load`` as none and
    starts at rollout 0 unless told (``--start-rollout-id``); the plugin's state is written to and
    read from ``april_buffer_dir``. A training job restarts from its Megatron checkpoint instead."""
    state_dir = tmp_path / "april" / "state"
    # protected after one cut: a partial restored at the restart runs to completion in the restart's
    # first rollout, however long its response and however slow the machine
    config = write_config(tmp_path / "april.yaml", april_policy="april", april_dispatch="router",
                          april_buffer_dir=str(state_dir), april_max_interruptions=1)
    env = dict(MODE="april", APRIL_CONFIG=config, HF_CHECKPOINT=old_stack.model_path, PROMPT_DATA=prompts,
               ROLLOUT_MAX_RESPONSE_LEN=LONG_BUDGET)
    first, trained, last, partial = None, None, -1, set()
    for _ in range(KILLS):
        # far more rollouts than it gets to run: the kill lands while it runs, however fast the machine
        resume = ("--start-rollout-id", str(last + 1)) if last >= 0 else ()
        job, trained = run_job(cluster, tmp_path, "april", *external(old_stack), *resume, NUM_ROLLOUT=1000, **env)
        first = first or job
        last, partial = kill_at_a_partial(job, state_dir, after=last)
        # what the killed job handed to training after its last checkpoint is redone from that checkpoint
        for path in trained.glob("rollout_*.pt"):
            if int(path.stem.split("_")[1]) > last:
                path.unlink()
        if partial:
            break
        # the job saved once more before the kill landed, and that checkpoint held no partial: the
        # restart is checked all the same, and the job is run and killed again
    assert partial, f"{KILLS} kills, and none left a checkpoint holding a partial with tokens"

    second, _ = run_job(cluster, tmp_path, "april", *external(old_stack), "--start-rollout-id", str(last + 1),
                        NUM_ROLLOUT=last + 4, **env)
    assert_succeeded(second, second.wait())
    assert "april_slime: router dispatch" in first.log and "april_slime: router dispatch" in second.log
    perf = second.perf()
    assert sorted(perf) == list(range(last + 1, last + 4)), second.tail()
    assert sum(p["april/resumed_trajectories"] for p in perf.values()) > 0, perf
    trained_groups = check_batches(debug_samples(trained), range(last + 4))
    final = read_plain_state(state_dir, last + 3)["buffer"]["groups"]
    still_buffered = {int(g["uid"]) for g in final}
    assert partial <= set(trained_groups) | still_buffered, "a buffered partial was lost in the restart"
    assert partial & set(trained_groups[BATCH * (last + 1):]), "no partial buffered at the kill was trained after it"


def test_sync_with_search_r1_through_the_launcher(cluster, old_stack, tmp_path):
    """sync, with slime's search-r1 (unedited: its retrieval URL is its default, 127.0.0.1:8000,
    where a local stub answers) as the job's custom generate function: whole batches, nothing
    aborted or carried over, every episode through the plugin's front."""
    from tests.support import tag_policy
    from tests.support.slime_examples import RetrievalStub, extract_examples

    folder = extract_examples(tmp_path / "examples")
    try:
        stub = RetrievalStub(port=8000)
    except OSError as e:
        pytest.fail(f"search-r1 retrieves from 127.0.0.1:8000, which is taken here: {e}")
    try:
        search = tag_policy.write_search_prompts(tmp_path / "search.jsonl", 64)
        job, trained = run_job(
            cluster, tmp_path, "search", *external(old_stack),
            "--custom-generate-function-path", "generate_with_search.generate",
            "--custom-rm-path", "generate_with_search.reward_func",
            MODE="sync", HF_CHECKPOINT=old_stack.model_path, PROMPT_DATA=search, NUM_ROLLOUT=3,
            EXTRA_PYTHONPATH=folder / "search-r1")
        assert_succeeded(job, job.wait())
    finally:
        stub.close()
    perf = job.perf()
    assert sorted(perf) == [0, 1, 2], job.tail()
    assert sum(p["april/episodes/started"] for p in perf.values()) >= 3 * BATCH * N, perf
    for p in perf.values():  # sync: the whole batch, nothing aborted or carried
        assert p["april/aborted_tokens"] == 0 and p["april/resumed_trajectories"] == 0, p
    check_batches(debug_samples(trained), range(3))


# ------------------------------------------------------------------------ the registration race
async def test_the_plugin_waits_for_an_engine_the_real_router_lists_late(real_stack):
    """sglang-router answers ``POST /workers`` with 202 and lists the engine only after its own
    health check. The race made to happen: a router with no engine, the plugin's client already
    reading its list, then the engine registered as slime registers it; the client must come back
    with that engine (a single read of the list would have found none)."""
    from april_slime.core.engine import EngineClient, EngineWait
    from april_slime.core.transport import HttpTransport
    from april_workbench.localstack import LocalRouter

    reads = asyncio.Event()

    class Counting(HttpTransport):
        async def request(self, method, url, path, payload, timeout_s):
            reply = await super().request(method, url, path, payload, timeout_s)
            if path == "/workers":
                reads.set()
            return reply

    engine = real_stack.engine_urls[0]
    with LocalRouter([]) as router:
        assert http_json("GET", f"{router.url}/workers")[1]["workers"] == []
        transport = Counting()
        waiting = asyncio.create_task(EngineClient.from_router(
            router.url, transport=transport, wait=EngineWait(expected=1, poll_s=0.2, deadline_s=JOB_TIMEOUT_S)))
        await reads.wait()  # the client has read an empty list and is waiting
        assert not waiting.done()
        status, body = await asyncio.to_thread(http_json, "POST", f"{router.url}/workers", {"url": engine})
        assert status in (200, 202), body
        client = await waiting
        try:
            assert client.worker_urls == [engine]
        finally:
            await client.close()
