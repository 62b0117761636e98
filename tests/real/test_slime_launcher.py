"""The plugin through slime's own launcher, as users start it: ``examples/qwen3-4B-dapo-math/run-cpu.sh``
(common.sh's flag blocks: the README's ``--rollout-function-path`` / ``--data-source-path`` /
``--custom-config-path`` and the loss hook) submits slime's ``train.py`` with ``ray job submit`` to a
Ray cluster; slime starts its router and its ``SGLangEngine`` actors, registers the engines with
``POST /workers``, and calls the plugin under ``--debug-rollout-only`` (slime's Megatron trainer does
not start on a CPU: docs/real-stack.md says where it stops).

The jobs share one Ray cluster. The first starts SGLang itself, as slime does on a GPU node; the
others use the session's SGLang 0.5.15.post1 engine as slime's external engine
(``--rollout-external-engine-addrs``), which slime registers with its router the same way and
spares each job an engine start. Everything is checked from what a user sees: slime's ``perf`` log
lines (the plugin's ``april/*`` metrics), Ray's job status, the samples slime hands to training
(``--save-debug-rollout-data``) and the plugin's checkpoint files.

Also here: the router registration race itself, made to happen on the real sglang-router.
"""

from __future__ import annotations

import asyncio

import pytest
import yaml

from tests.support.real_tier import http_json, write_prompts
from tests.support.slime_launcher import (
    JOB_TIMEOUT_S,
    RayCluster,
    debug_samples,
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
    return ["--rollout-external-engine-addrs", old_stack.engine_urls[0].removeprefix("http://")]


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


# ---------------------------------------------------------------------------------------- jobs
def test_copris_with_the_engines_slime_starts(cluster, prompts, real_stack, tmp_path):
    """The README's flags and examples/.../configs/copris.yaml, slime starting its own SGLang
    engine and router: three rollouts, partials aborted at one target and resumed at the next,
    auto dispatch choosing direct (regular workers)."""
    job, trained = run_job(cluster, tmp_path, "copris", MODE="copris", HF_CHECKPOINT=real_stack.model_path,
                           PROMPT_DATA=prompts, NUM_ROLLOUT=3, ROLLOUT_MAX_RESPONSE_LEN=LONG_BUDGET)
    assert_succeeded(job, job.wait())
    perf = job.perf()
    assert sorted(perf) == [0, 1, 2], job.tail()
    assert all(p["april/policy_version"] == 0 for p in perf.values())
    assert perf[0]["april/aborted_tokens"] > 0, perf[0]
    assert resumed_in_a_later_rollout(perf) > 0, perf
    assert "april_slime: direct dispatch" in job.log
    check_batches(debug_samples(trained), range(3))


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
