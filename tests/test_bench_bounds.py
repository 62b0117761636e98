"""The bench at the staleness bounds users set, and tools as they run.

Every partial-rollout policy runs at each bound of ``staleness_bounds`` (``copris@s2``); a bounded
run trains no token older than its bound and, on the healthy emulator, pacing keeps it there (the
restart / drop fallback throws nothing away); the band reports the share of the unbounded gain a
bound keeps, within each variant. Tools share a bounded pool of workers (a call waits for a free
one) and fail by timing out, then are retried. No timing is asserted.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest

from april_workbench.bench import ENGINE_PRESETS, Workload
from april_workbench.bench.band import Variant, gain_retained
from april_workbench.bench.multiturn import EpisodeDriver, OldestFirstPool, plan_episode
from april_workbench.bench.multiturn_report import run_pair_band
from april_workbench.bench.runner import plan, run_benchmark, run_policy
from april_workbench.bench.workloads import parse_bounds, split_label
from april_workbench.emulator import SyntheticLM, run_virtual

SPEC = replace(ENGINE_PRESETS["h100-qwen3-4b"], num_engines=2, kv_capacity_tokens=12_000, train_fixed_s=0.5,
               train_s_per_token=0.0, decode_t0=0.03, prefill_t0=0.001)


def tiny(**kw) -> Workload:
    args = dict(name="tiny-bounds", length="short:median_tokens=60,truncation_fraction=0.05",
                max_response_len=200, prompt_len=16, rollout_batch_size=4, n_samples_per_prompt=4, steps=6,
                warmup_steps=1, policies=("sync", "copris"), timeline_interval_s=0.25,
                load_poll_interval_s=1.0, turns_min=2, turns_max=4, tool_median_s=1.5, tool_sigma=0.8,
                tool_tokens=8, tool_workers=None, tool_failure_rate=0.0)
    args.update(kw)
    return Workload(**args)


def test_each_partial_rollout_policy_runs_at_each_bound():
    w = tiny(policies=("sync", "april", "copris"), staleness_bounds=(None, 4, 1))
    points = {p.label: p for p in plan(w)}
    assert list(points) == ["sync", "april", "april@s4", "april@s1", "copris", "copris@s4", "copris@s1"]
    assert points["copris@s1"].policy == "copris" and points["copris@s1"].max_staleness == 1
    assert points["copris"].max_staleness is None  # unbounded, whatever the workload's own bound
    assert split_label("copris@s1") == ("copris", 1) and split_label("april") == ("april", None)
    with pytest.raises(ValueError, match="staleness_bounds"):
        tiny(staleness_bounds=(2, 2))


def test_a_bounded_run_trains_no_older_token_and_pacing_discards_nothing():
    w = tiny(staleness_bounds=(None, 1), steps=8)
    result = run_benchmark(w, SPEC)
    free, bound = result.summaries["copris"], result.summaries["copris@s1"]
    assert free["bound"] is None and bound["bound"] == 1
    assert free["token_staleness_max"] > 1, "the unbounded run never lagged past 1: the bound was not tested"
    assert bound["token_staleness_max"] <= 1
    # every step of the run, warm-up included, held the bound, and by pacing: nothing restarted
    run = next(r for r in result.runs if r.label == "copris@s1")
    assert max(s.metrics["april/token_staleness_max"] for s in run.steps) <= 1
    assert bound["stale_discarded_tokens"] == 0 and bound["stale_fallback_groups"] == 0
    assert sum(bound["token_staleness_hist"].values()) == pytest.approx(1.0)
    assert bound["token_staleness_mean"] == pytest.approx(
        sum(int(k) * v for k, v in bound["token_staleness_hist"].items()))


def test_gain_retained_is_measured_within_each_variant():
    variants = [Variant("a"), Variant("b", 1)]
    runs = {"a": {"sync": {"steps_per_hour": 10.0}, "copris": {"steps_per_hour": 30.0},
                  "copris@s2": {"steps_per_hour": 26.0}},
            "b": {"sync": {"steps_per_hour": 20.0}, "copris": {"steps_per_hour": 40.0},
                  "copris@s2": {"steps_per_hour": 30.0}}}
    g = gain_retained(runs, variants, ["sync", "copris", "copris@s2"])["copris@s2"]
    assert g["nominal"] == pytest.approx(0.8) and g["min"] == pytest.approx(0.5) and g["max"] == pytest.approx(0.8)


def test_the_pair_band_reports_bounds_on_both_workloads():
    w = tiny(steps=3, staleness_bounds=(None, 2))
    band = run_pair_band(w, SPEC, [Variant("seed 0 (nominal)", 0)])
    for side in ("multi_turn", "single_turn"):
        policies = band[side]["policies"]
        assert set(policies) == {"sync", "copris", "copris@s2"}
        assert policies["copris@s2"]["token_staleness_max"] <= 2
        runs = band[side]["runs"]["seed 0 (nominal)"]
        ratio = {k: runs[k]["steps_per_hour"] / runs["sync"]["steps_per_hour"] for k in runs}
        kept = band[side]["gain_retained"]["copris@s2"]["nominal"]
        assert kept == pytest.approx((ratio["copris@s2"] - 1) / (ratio["copris"] - 1)) or math.isnan(kept)
    assert set(band["comparison"]) == {"copris", "copris@s2"}


def test_parse_bounds():
    assert parse_bounds("none,4,2,1") == (None, 4, 2, 1)
    assert parse_bounds("-") == ()
    with pytest.raises(ValueError, match="bounds"):
        parse_bounds("2,x")


# ============================================================================ tools as they run
def test_tool_failures_time_out_and_are_retried():
    w = tiny(tool_failure_rate=0.4, tool_timeout_s=7.0, tool_max_retries=2)
    clean = replace(w, tool_failure_rate=0.0)
    model = SyntheticLM(seed=w.seed, length=w.length_model())
    prompt = list(range(1, 17))
    pairs = [(plan_episode(w, model, prompt, i, j, 200), plan_episode(clean, model, prompt, i, j, 200))
             for i in range(30) for j in range(4)]
    phases = [(a, b) for p, q in pairs for a, b in zip(p.tool_attempts, q.tool_attempts)]
    assert all(len(b) == 1 for _, b in phases)  # no failure, one attempt
    for a, b in phases:
        assert 1 <= len(a) <= 3
        assert all(x == 7.0 for x in a[:-1])  # each failed attempt held its worker until the timeout
        assert a[-1] in (b[0], 7.0)  # then the same call succeeds, or the last retry timed out too
    retried = [a for a, _ in phases if len(a) > 1]
    assert retried and 0.2 < len(retried) / len(phases) < 0.6  # about 40% of the phases failed at least once
    assert sum(p.tool_failures for p, _ in pairs) == sum(len(a) - 1 for a, _ in phases)


@pytest.mark.parametrize("workers, order", [(2, "fifo"), (None, "fifo"), (2, "oldest")])
def test_tool_calls_share_a_bounded_pool_of_workers(workers, order):
    w = tiny(steps=3, tool_workers=workers, tool_pool_order=order)

    async def go():
        model = SyntheticLM(seed=w.seed, length=w.length_model())
        driver = EpisodeDriver(w, model, w.max_response_len)
        result = await run_policy("copris", "copris", w, SPEC, driver=driver)
        return result, driver

    result, driver = run_virtual(go())
    waited = sum(s.tool_wait_s for s in result.steps)
    if workers is None:
        assert driver.agent.tool_busy_max == 0 and waited == 0.0
    else:
        assert driver.agent.tool_busy_max == workers, "the pool never filled: its bound was not tested"
        assert waited > 0 and result.settings["tool_busy_max"] == workers


async def _until_waiting(pool: OldestFirstPool, n: int) -> None:
    """Let the other tasks run until ``n`` calls wait on ``pool`` (no clock involved)."""
    while len(pool.waiting) < n:
        await asyncio.sleep(0)


def test_the_oldest_first_pool_hands_a_freed_worker_to_the_oldest_episode():
    """A young episode's call that came first waits behind an older episode's that came later;
    a cancelled waiter neither takes nor loses a worker."""
    async def go():
        pool, order, held, free_it = OldestFirstPool(1), [], asyncio.Event(), asyncio.Event()

        async def holder():
            async with pool.slot(0.0):
                held.set()
                await free_it.wait()

        async def call(name, started):
            async with pool.slot(started):
                order.append(name)

        tasks = [asyncio.create_task(holder())]
        await held.wait()
        tasks.append(asyncio.create_task(call("young, first come", 5.0)))
        await _until_waiting(pool, 1)
        gone = asyncio.create_task(call("cancelled", 0.5))
        tasks.append(asyncio.create_task(call("old, come later", 1.0)))
        await _until_waiting(pool, 3)
        gone.cancel()
        free_it.set()
        await asyncio.gather(*tasks)
        assert gone.cancelled() and order == ["old, come later", "young, first come"]
        assert pool.free == 1 and not pool.waiting

        # a waiter cancelled just after it was handed a worker passes the worker on
        await pool._acquire(0.0)  # a call holds the one worker
        late = asyncio.create_task(call("late", 2.0))
        await _until_waiting(pool, 1)
        pool._release()  # the holder is done: the worker goes to ``late``'s waiter ...
        late.cancel()  # ... which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await late
        assert pool.free == 1 and not pool.waiting and "late" not in order

    asyncio.run(go())
    with pytest.raises(ValueError, match="tool_pool_order"):
        tiny(tool_pool_order="lifo")
