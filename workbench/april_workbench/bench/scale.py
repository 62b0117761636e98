"""``april-slime bench scale``: the plugin's own cost at production size, which the virtual clock
of the policy benchmark cannot see (it does not move while Python computes).

Five measurements, the first three each against the limit that bounds it:

* **Scheduler CPU per request** (copris, N' = 64 ... 4096, unbounded and at a staleness bound):
  the plugin's CPU in each step's ``run_step`` (the thread's CPU minus what the emulated engines
  and their in-process handlers computed, ``emulator.cputime``), per engine call, step by step;
  the gen-2 collections of the step; and steps/h with that CPU charged to the virtual clock
  (serially: the upper bound of what it costs a real job's rollout).
* **The same run over HTTP** (``--parts http``; N' = 1024 and 4096): the engines in a child
  process, so that this one holds and computes what a job's rollout process does (the plugin, its
  HTTP client, the replies' JSON); its CPU per call and the share of it gen-2 collections take.
* **Memory per buffered token** and the **full-collection pause** with the buffer alive, for a
  buffer built through ``Trajectory.append`` as replies build it.
* **Checkpoint** of that buffer (with routed-experts rows or without): file size against the raw
  bytes, save and load time against a plain ``numpy.save`` / ``numpy.load`` of the same number of
  bytes on the same disk (with an fsync, as the checkpoint does), the snapshot's stall of the
  event loop, the save's peak memory, and the memory held by two snapshots after the buffer
  moved on (the checkpoint keeps the two latest).

* **Objects per call in flight** (``--parts objects``): the tracked objects generate calls in
  flight add to the client process, over HTTP to an emulated engine in another process (what a
  job holds) and in process (what the virtual mode holds): gen-2 time per step follows them.

Every figure is this machine's; ratios within one run are what carries over.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from april_slime.core.buffer import PartialBuffer
from april_slime.core.checkpoint import Checkpoints
from april_slime.core.columns import token_column
from april_slime.core.engine import EngineClient
from april_slime.core.replay import SegmentReplay
from april_slime.core.transport import HttpTransport
from april_slime.core.types import Group, Trajectory, TrajectoryStatus
from april_workbench.emulator import run_virtual
from april_workbench.emulator.testing import start_cluster

from .runner import run_policy
from .spec import ENGINE_PRESETS
from .tables import md_table
from .workloads import Workload

PRESET = "h100-qwen3-4b"
REQUESTS_PER_ENGINE = 256  # engines of the emulated cluster: N' / this (SGLang's running-request scale)


# ============================================================================ scheduler CPU
class _GcClock:
    """CPU seconds of this thread spent in collections of each generation while installed (CPU,
    not wall time: on a shared machine a pause's wall time includes other processes' turns)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.seconds[info["generation"]] += time.thread_time() - self._start
            self.count[info["generation"]] += 1

    @contextlib.contextmanager
    def installed(self):
        gc.callbacks.append(self)
        try:
            yield self
        finally:
            gc.callbacks.remove(self)


@dataclass
class StepCost:
    plugin_cpu_s: float
    emulator_cpu_s: float
    engine_calls: int
    gc2_s: float
    gc2_count: int
    rollout_s: float  # virtual seconds
    train_s: float  # virtual seconds
    generated_tokens: int = 0  # what the calls of the step brought back (a bound changes calls' sizes)


def scale_workload(n_prime: int, bound: int | None, steps: int, max_response_len: int) -> Workload:
    """copris at N' requests in flight, a step of N'/2 samples (CoPRIS' ratio), groups of 8."""
    return Workload(name=f"scale-{n_prime}", preset=PRESET, max_response_len=max_response_len,
                    rollout_batch_size=max(1, n_prime // 16), n_samples_per_prompt=8, steps=steps,
                    warmup_steps=1, policies=("copris",), concurrency=n_prime, max_staleness=bound)


def scheduler_cost(n_prime: int, bound: int | None, steps: int, max_response_len: int = 16384) -> dict[str, Any]:
    """One copris run on the emulated cluster in virtual mode; the plugin's cost of every step."""
    workload = scale_workload(n_prime, bound, steps, max_response_len)
    spec = replace(ENGINE_PRESETS[PRESET], num_engines=max(2, n_prime // REQUESTS_PER_ENGINE))
    meters: list[Any] = []
    costs: list[StepCost] = []

    def emulator_cpu() -> float:
        return sum(m.seconds for m in meters)

    def hook(cluster) -> None:
        meters.extend(engine.cpu for engine in cluster.engines)
        original = cluster.transport

        def transport(**kw):
            made = original(**kw)
            meters.append(made.cpu)
            return made

        cluster.transport = transport

    @contextlib.contextmanager
    def probe(index: int):
        gc_clock = _GcClock()
        cpu0, emu0 = time.thread_time(), emulator_cpu()
        with gc_clock.installed():
            yield
        total, emulated = time.thread_time() - cpu0, emulator_cpu() - emu0
        costs.append(StepCost(total - emulated, emulated, 0, gc_clock.seconds[2], gc_clock.count[2], 0.0, 0.0))

    def on_step(record) -> None:
        cost = costs[-1]
        cost.engine_calls = int(record.metrics.get("april/engine_calls", 0))
        cost.generated_tokens = int(record.metrics.get("april/generated_tokens", 0))
        cost.rollout_s, cost.train_s = record.rollout_s, record.train_s

    async def main():
        return await run_policy(f"copris N'={n_prime}", "copris", workload, spec, step_probe=probe,
                                cluster_hook=hook, on_step=on_step, max_staleness=bound)

    run_virtual(main())
    steady = costs[1:] or costs
    per_request = [c.plugin_cpu_s / max(c.engine_calls, 1) for c in steady]
    virtual = sum(c.rollout_s + c.train_s for c in steady)
    charged = virtual + sum(c.plugin_cpu_s for c in steady)
    return {
        "n_prime": n_prime, "bound": bound, "engines": spec.num_engines,
        "samples_per_step": workload.samples_per_step, "steps": [vars(c) for c in costs],
        "plugin_ms_per_call": 1e3 * statistics.median(per_request),
        "plugin_ms_per_call_by_step": [1e3 * c.plugin_cpu_s / max(c.engine_calls, 1) for c in costs],
        "plugin_cpu_s_per_step": statistics.median(c.plugin_cpu_s for c in steady),
        "plugin_ms_per_1k_tokens": 1e6 * statistics.median(c.plugin_cpu_s / max(c.generated_tokens, 1) for c in steady),
        "gc2_count_per_step": statistics.median(c.gc2_count for c in steady),
        "gc2_share": sum(c.gc2_s for c in steady) / max(sum(c.plugin_cpu_s + c.emulator_cpu_s for c in steady), 1e-9),
        "steps_per_h_virtual": 3600 * len(steady) / virtual,
        "steps_per_h_charged": 3600 * len(steady) / charged,
    }


def http_scheduler_cost(n_prime: int, bound: int | None, steps: int, max_response_len: int = 16384,
                        time_scale: float = 50.0) -> dict[str, Any]:
    """The same copris run as ``scheduler_cost``, in a process that holds what a job's rollout process
    holds: the plugin talks HTTP (``HttpTransport``) to emulated engines in a child process, which
    run ``time_scale`` emulated seconds per wall second. Every CPU second of this thread in a step
    is the plugin's, its HTTP client's and the replies' JSON decoding; the gen-2 share is of that."""
    workload = scale_workload(n_prime, bound, steps, max_response_len)
    spec = replace(ENGINE_PRESETS[PRESET], num_engines=max(2, n_prime // REQUESTS_PER_ENGINE))
    costs: list[StepCost] = []

    @contextlib.contextmanager
    def probe(index: int):
        gc_clock = _GcClock()
        cpu0 = time.thread_time()
        with gc_clock.installed():
            yield
        costs.append(StepCost(time.thread_time() - cpu0, 0.0, 0, gc_clock.seconds[2], gc_clock.count[2], 0.0, 0.0))

    def on_step(record) -> None:
        cost = costs[-1]
        cost.engine_calls = int(record.metrics.get("april/engine_calls", 0))
        cost.generated_tokens = int(record.metrics.get("april/generated_tokens", 0))
        cost.rollout_s, cost.train_s = record.rollout_s, record.train_s

    wall0 = time.perf_counter()
    asyncio.run(run_policy(f"copris N'={n_prime} over HTTP", "copris", workload, spec, mode="http",
                           time_scale=time_scale, step_probe=probe, on_step=on_step, max_staleness=bound,
                           engines_in_child=True))
    steady = costs[1:] or costs
    return {
        "n_prime": n_prime, "bound": bound, "engines": spec.num_engines, "time_scale": time_scale,
        "samples_per_step": workload.samples_per_step, "steps": [vars(c) for c in costs],
        "client_ms_per_call": 1e3 * statistics.median(c.plugin_cpu_s / max(c.engine_calls, 1) for c in steady),
        "client_cpu_s_per_step": statistics.median(c.plugin_cpu_s for c in steady),
        "gc2_count_per_step": statistics.median(c.gc2_count for c in steady),
        "gc2_share": sum(c.gc2_s for c in steady) / max(sum(c.plugin_cpu_s for c in steady), 1e-9),
        "wall_s": time.perf_counter() - wall0,
    }


# ============================================================================ memory and checkpoint
def build_buffer(tokens: int, *, routed: tuple[int, int] | None = None, response_len: int = 8192,
                 n: int = 8, prompt_len: int = 512, experts: int = 128, seed: int = 0) -> PartialBuffer:
    """A buffer of partial groups holding ``tokens`` response tokens, each response made of two
    replies (versions 0 and 1) appended as the scheduler appends them; with ``routed`` =
    (layers, top-k), every position carries its routed experts (ids below ``experts``)."""
    rng = np.random.default_rng(seed)
    buffer = PartialBuffer()
    width = routed[0] * routed[1] if routed else 0
    made, g = 0, 0
    while made < tokens:
        prompt = token_column(rng.integers(0, 150_000, prompt_len))
        members = []
        for j in range(n):
            t = Trajectory(uid=f"s{g}/{j}", group_uid=f"s{g}", index_in_group=j, prompt_ids=prompt,
                           max_new_tokens=2 * response_len, sampling_seed=j)
            length = min(response_len, tokens - made)
            first = length // 2
            for start, count, version in ((0, first, 0), (first, length - first, 1)):
                if not count:
                    continue
                replay = None
                if routed:
                    rows = (prompt_len + start + count - 1) - (prompt_len + start - 1 if start else 0)
                    values = rng.integers(0, experts, rows * width, dtype=np.uint8).astype("<i4")
                    replay = SegmentReplay(routed_start=prompt_len + start - 1 if start else 0,
                                           routed=values.tobytes(), routed_width=width)
                t.append(rng.integers(0, 150_000, count), -rng.random(count), version, replay=replay)
            t.status, t.finish_reason = TrajectoryStatus.ABORTED, "abort"
            made += length
            members.append(t)
            if made >= tokens:
                break
        buffer.put(Group(uid=f"s{g}", prompt_ids=prompt, trajectories=members, payload={"index": g}))
        g += 1
    return buffer


def _held_bytes(buffer: PartialBuffer) -> int:
    """The raw bytes of the buffer's arrays (prompts once per group; routed experts as held: one
    byte per id when every id of a trajectory's rows fits, else four). The file holds the same."""
    total = 0
    for group in buffer.groups():
        total += group.prompt_ids.nbytes
        for t in group.trajectories:
            total += t.response_ids.nbytes + t.logprobs.nbytes
            total += len(t.replay.routed) if t.replay is not None and t.replay.routed is not None else 0
    return total


class _Prompts(SimpleNamespace):
    def save(self, rollout_id: int) -> None:
        pass

    def load(self, rollout_id: int) -> None:
        pass


def _fresh_prompts() -> _Prompts:
    return _Prompts(sample_offset=0, epoch_id=0, sample_group_index=0, sample_index=0, metadata={})


def _timed(fn, repeat: int = 1, setup=None, tries: list[tuple[float, float]] | None = None) -> float:
    """The fastest of ``repeat`` calls of ``fn`` (``setup`` before each, untimed), wall seconds.
    ``tries`` gets each call's (wall, process CPU) seconds: a wall time well above its CPU time
    waited on something else (the disk, another process on the cores)."""
    best = float("inf")
    for _ in range(repeat):
        if setup is not None:
            setup()
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        wall = time.perf_counter() - start
        if tries is not None:
            tries.append((wall, time.process_time() - cpu))
        best = min(best, wall)
    return best


def checkpoint_cost(tokens: int, *, routed: tuple[int, int] | None, folder: Path,
                    repeat: int = 2) -> dict[str, Any]:
    gc.collect()
    gc_pause_without = _timed(gc.collect, 3)  # the process's own objects (modules, the emulator)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    buffer = build_buffer(tokens, routed=routed)
    live = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    held = _held_bytes(buffer)
    response_tokens = sum(t.response_length for g in buffer.groups() for t in g.trajectories)
    gc_pause = _timed(gc.collect, 3)

    where = dict(save_dir=str(folder), load_dir=str(folder), buffer_dir=None, rollout_shuffle=False)
    checkpoints = Checkpoints(_fresh_prompts(), buffer, **where)
    snapshot_s = _timed(lambda: checkpoints.snapshot(0, 1), 3)
    # every save a new checkpoint of the snapshot its rollout took, as in a job (rewriting one file
    # would add freeing the old one). The previous try's file goes before each try, untimed, as
    # numpy's does below: a new file's pages come from the page cache, and on a machine whose page
    # cache is short of free memory, writing while the older files stay costs up to ten times the
    # write that follows a deletion, whoever writes (measured with plain writes of 840 MB here)
    saved = iter(range(1, repeat + 1))
    taken = iter(range(1, repeat + 1))

    def before_save() -> None:
        rollout_id = next(taken)
        with contextlib.suppress(FileNotFoundError):
            (folder / "rollout" / f"april_state_{rollout_id - 1}.bin").unlink()
        checkpoints.snapshot(rollout_id, 1)

    save_s = _timed(lambda: checkpoints.save(next(saved), 1), repeat, setup=before_save)
    size = (folder / "rollout" / f"april_state_{repeat}.bin").stat().st_size
    # a load into a new data source, which keeps what it loaded (the buffer and the snapshot of its
    # rollout), as a restarted job does; the previous try's are freed before the next, untimed
    # (numpy's array below is freed in its timing, which costs it about a millisecond)
    loaded_box: list[tuple[PartialBuffer, Checkpoints]] = []

    def load() -> None:
        fresh = PartialBuffer()
        restored = Checkpoints(_fresh_prompts(), fresh, **where)
        restored.load(repeat)
        loaded_box.append((fresh, restored))

    # one untimed load first: the first touch of a few hundred MB of fresh memory costs this VM
    # anywhere from 0.1 to 1.7 s of CPU, whoever reads (numpy.load too, first in a fresh process),
    # and numpy's load below reuses the memory these loads freed (the cold try is kept, in tries)
    load_tries: list[tuple[float, float]] = []
    _timed(load, 1, tries=load_tries)
    load_s = _timed(load, repeat, setup=loaded_box.clear, tries=load_tries)
    assert loaded_box[0][0].num_partial_trajectories() == buffer.num_partial_trajectories()
    loaded_box.clear()

    # the same number of bytes through numpy, on the same disk, fsynced like the checkpoint
    raw = held  # the file holds the arrays as the buffer holds them
    plain = folder / "plain.npy"
    blocks = [np.ones(raw, dtype=np.uint8)]

    def np_save() -> None:
        with open(plain, "wb") as f:
            np.save(f, blocks[0])
            f.flush()
            os.fsync(f.fileno())

    def no_file() -> None:  # a new file each time, like the saves
        with contextlib.suppress(FileNotFoundError):
            plain.unlink()

    np_save_s = _timed(np_save, repeat, setup=no_file)
    blocks.clear()
    np_load_tries: list[tuple[float, float]] = []
    np_load_s = _timed(lambda: np.load(plain), repeat, tries=np_load_tries)
    plain.unlink()

    # memory: the save's peak, and two snapshots held while every partial moved on by one reply
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    checkpoints.save(repeat, 1)
    save_peak = tracemalloc.get_traced_memory()[1] - base
    checkpoints.snapshot(1, 1)
    rng = np.random.default_rng(1)
    width = routed[0] * routed[1] if routed else 0
    for group in buffer.groups():
        for t in group.trajectories:
            replay = None
            if routed:
                rows = 16
                values = rng.integers(0, 128, rows * width, dtype=np.uint8).astype("<i4")
                replay = SegmentReplay(routed_start=len(t.prompt_ids) + t.response_length - 1,
                                       routed=values.tobytes(), routed_width=width)
            t.append(rng.integers(0, 150_000, 16), -rng.random(16), 2, replay=replay)
    checkpoints.snapshot(2, 2)
    after = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    held_after = _held_bytes(buffer)
    return {
        "response_tokens": response_tokens, "routed": list(routed) if routed else None,
        "live_bytes_per_token": live / response_tokens, "held_bytes": held,
        "full_gc_pause_s": gc_pause, "full_gc_pause_without_buffer_s": gc_pause_without,
        "snapshot_s": snapshot_s,
        "file_bytes": size, "raw_bytes": raw, "file_over_raw": size / raw,
        "save_s": save_s, "load_s": load_s, "numpy_save_s": np_save_s, "numpy_load_s": np_load_s,
        "save_over_numpy": save_s / np_save_s, "load_over_numpy": load_s / np_load_s,
        "load_tries_wall_cpu_s": load_tries, "numpy_load_tries_wall_cpu_s": np_load_tries,
        "disk_write_gb_s": raw / np_save_s / 1e9,
        "save_peak_over_buffer": save_peak / held,
        "resident_with_two_snapshots_over_buffer": (held_after + after) / held_after,
    }


# ============================================================================ objects per call in flight
def objects_in_flight(calls: int) -> dict[str, Any]:
    """Tracked objects the client process holds per generate call in flight, by transport: over
    HTTP (``HttpTransport``, what a job uses) to an emulated engine in another process, and in process (the
    virtual mode's ``LocalTransport``, whose count includes the emulated engine's own objects).

    A full collection runs once the objects promoted to the oldest generation since the last reach
    a quarter of those it kept, and a call in flight outlives the young collections, so gen-2 time
    per step follows these counts times the calls a step makes. Counts, not times: the same on any
    machine for the same library versions."""
    return {"calls": calls, "http": asyncio.run(_http_census(calls)), "in_process": asyncio.run(_local_census(calls))}


async def _http_census(calls: int) -> dict[str, Any]:
    engine = subprocess.Popen(
        [sys.executable, "-m", "april_workbench.cli", "emulator", "--port", "0", "--engines", "1",
         "--length-dist", "max-length", "--max-running-requests", str(2 * calls), "--time-scale", "0.01"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = None
        for line in engine.stdout:  # "router URL", then "engine URL" once it listens
            if line.startswith("engine "):
                url = line.split()[1]
                break
        if url is None:
            raise RuntimeError(f"the emulated engine exited ({engine.wait()}) before it listened")
        transport = HttpTransport()
        try:
            return await _census(EngineClient([url], transport=transport), url, calls)
        finally:
            await transport.close()
    finally:
        engine.terminate()
        engine.wait()


async def _local_census(calls: int) -> dict[str, Any]:
    async with start_cluster(1, time_scale=0.01, http=False, length="max-length",
                             max_running_requests=2 * calls) as cluster:
        return await _census(EngineClient(cluster.engine_urls, transport=cluster.transport), cluster.engine_urls[0],
                             calls)


async def _census(client: EngineClient, url: str, calls: int) -> dict[str, Any]:
    """The tracked objects ``calls`` generate calls in flight on ``url`` add, per call and by type."""
    def counts() -> collections.Counter:
        gc.collect()
        return collections.Counter(_kind(o) for o in gc.get_objects())

    # one call first, so that a session, its connector and the loop's machinery exist before
    await client.generate(url, [1, 2, 3], max_new_tokens=1, rid="first", sampling_params={}, sampling_seed=0)
    before = counts()
    tasks = [asyncio.create_task(client.generate(url, list(range(10, 74)), max_new_tokens=8192, rid=f"r{i}",
                                                 sampling_params={}, sampling_seed=i)) for i in range(calls)]

    def check_in_flight() -> None:
        ended = [t for t in tasks if t.done()]
        if ended:  # the engine ran too fast, or refused: the count would not be of calls in flight
            raise RuntimeError(f"{len(ended)} calls ended before the count: {ended[0].exception()!r}")

    while sum(load.num_running + load.num_waiting for load in await client.loads()) < calls:
        check_in_flight()
        await asyncio.sleep(0.05)  # until every request has reached the engine
    during = counts()
    check_in_flight()
    await client.abort(url, abort_all=True)
    await asyncio.gather(*tasks, return_exceptions=True)
    added = {kind: during[kind] - before[kind] for kind in during if during[kind] > before[kind]}
    top = sorted(added.items(), key=lambda kv: -kv[1])[:12]
    return {"per_call": sum(added.values()) / calls, "top_per_call": {k: n / calls for k, n in top}}


def _kind(obj: Any) -> str:
    kind = type(obj)
    name = f"{kind.__module__}.{kind.__qualname__}"
    return f"{name}:{obj.cr_code.co_qualname}" if kind.__name__ == "coroutine" else name


# ============================================================================ the command
QUICK = {"n_primes": (64, 256), "steps": 3, "tokens": 2_000_000, "routed_tokens": 100_000,
         "max_response_len": 4096, "calls_in_flight": 32, "http_n_primes": (64,), "http_time_scale": 50.0}
FULL = {"n_primes": (64, 256, 1024, 4096), "steps": 4, "tokens": 30_000_000, "routed_tokens": 2_000_000,
        "max_response_len": 16384, "calls_in_flight": 256, "http_n_primes": (1024, 4096), "http_time_scale": 10.0}
ROUTED = (48, 8)  # Qwen3-30B-A3B: 48 MoE layers, top-8 of 128 experts


PARTS = ("scheduler", "http", "checkpoint", "objects")


def run(*, quick: bool, bounds: tuple[int | None, ...] = (None, 2), n_primes: tuple[int, ...] | None = None,
        tokens: int | None = None, routed_tokens: int | None = None, folder: Path | None = None,
        parts: tuple[str, ...] = PARTS, progress=print) -> dict[str, Any]:
    plan = dict(QUICK if quick else FULL)
    http_n_primes = n_primes or plan["http_n_primes"]
    n_primes = n_primes or plan["n_primes"]
    out: dict[str, Any] = {"quick": quick, "scheduler": [], "http": [], "checkpoint": [], "objects": None}
    if "scheduler" in parts:
        for n_prime in n_primes:
            for bound in bounds:
                progress(f"scheduler: copris N'={n_prime}, bound {bound}")
                out["scheduler"].append(scheduler_cost(n_prime, bound, plan["steps"], plan["max_response_len"]))
    if "http" in parts:
        for n_prime in http_n_primes:
            for bound in bounds:
                progress(f"over HTTP, engines in a child process: copris N'={n_prime}, bound {bound}")
                out["http"].append(http_scheduler_cost(n_prime, bound, plan["steps"], plan["max_response_len"],
                                                       time_scale=plan["http_time_scale"]))
    if "objects" in parts:
        progress(f"objects per call in flight: {plan['calls_in_flight']} calls")
        out["objects"] = objects_in_flight(plan["calls_in_flight"])
    if "checkpoint" not in parts:
        return out
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        for count, routed in ((tokens or plan["tokens"], None), (routed_tokens or plan["routed_tokens"], ROUTED)):
            progress(f"checkpoint: {count:,} tokens, routed experts {routed}")
            out["checkpoint"].append(checkpoint_cost(count, routed=routed, folder=Path(tmp)))
            gc.collect()
    return out


def report(result: dict[str, Any]) -> str:
    """The tables of the parts measured."""
    tables = []
    if result["scheduler"]:
        tables.append(md_table(
            ["N'", "bound", "engines", "plugin ms / call (by step)", "plugin CPU s / step", "gen-2 GC share",
             "steps/h virtual", "steps/h, plugin CPU charged"],
            [[str(r["n_prime"]), "none" if r["bound"] is None else str(r["bound"]), str(r["engines"]),
              f"{r['plugin_ms_per_call']:.2f} ({', '.join(f'{x:.2f}' for x in r['plugin_ms_per_call_by_step'])})",
              f"{r['plugin_cpu_s_per_step']:.2f}", f"{100 * r['gc2_share']:.2f}%",
              f"{r['steps_per_h_virtual']:.1f}", f"{r['steps_per_h_charged']:.1f}"] for r in result["scheduler"]]))
    if result.get("http"):
        tables.append(md_table(
            ["N'", "bound", "engines", "client ms / call", "client CPU s / step", "full collections / step",
             "gen-2 GC share"],
            [[str(r["n_prime"]), "none" if r["bound"] is None else str(r["bound"]), str(r["engines"]),
              f"{r['client_ms_per_call']:.2f}", f"{r['client_cpu_s_per_step']:.2f}", f"{r['gc2_count_per_step']:g}",
              f"{100 * r['gc2_share']:.2f}%"] for r in result["http"]]))
    if result["checkpoint"]:
        tables.append(md_table(
            ["tokens", "routed experts", "live B / token", "full GC pause (without the buffer)", "snapshot stall",
             "file / raw", "save (numpy.save)", "load (numpy.load)", "save peak / buffer",
             "2 snapshots: resident / buffer"],
            [[f"{c['response_tokens']:,}", "x".join(map(str, c["routed"])) if c["routed"] else "none",
              f"{c['live_bytes_per_token']:.1f}",
              f"{1e3 * c['full_gc_pause_s']:.1f} ms ({1e3 * c['full_gc_pause_without_buffer_s']:.1f} ms)",
              f"{1e3 * c['snapshot_s']:.1f} ms", f"{c['file_over_raw']:.3f}",
              f"{c['save_s']:.2f} s ({c['numpy_save_s']:.2f} s) = {c['save_over_numpy']:.2f}x",
              f"{c['load_s']:.2f} s ({c['numpy_load_s']:.2f} s) = {c['load_over_numpy']:.2f}x",
              f"{c['save_peak_over_buffer']:.3f}", f"{c['resident_with_two_snapshots_over_buffer']:.3f}"]
             for c in result["checkpoint"]]))
    objects = result.get("objects")
    if objects:
        def most_held(census: dict[str, Any]) -> str:
            top = list(census["top_per_call"].items())[:6]
            return ", ".join(f"{kind.rsplit('.', 1)[-1]} {n:.1f}" for kind, n in top)

        tables.append(md_table(
            ["transport", f"tracked objects per call in flight ({objects['calls']} calls)", "most held"],
            [[name, f"{objects[key]['per_call']:.1f}", most_held(objects[key])]
             for name, key in (("HTTP (the plugin's client), engine in another process", "http"),
                               ("in process (virtual mode), the emulated engine's included", "in_process"))]))
    return "\n\n".join(tables)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="april-slime bench scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: checks that every part runs")
    p.add_argument("--n-prime", default=None, help="comma-separated N' values (default: 64,256,1024,4096)")
    p.add_argument("--bounds", default="none,2", help="staleness bounds, comma-separated ('none': unbounded)")
    p.add_argument("--tokens", type=float, default=None, help="buffered tokens of the checkpoint without routing rows")
    p.add_argument("--routed-tokens", type=float, default=None, help="buffered tokens with 48 x 8 routing rows")
    p.add_argument("--dir", type=Path, default=None, help="folder on the disk to measure (default: the temp folder)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"what to measure, comma-separated (default: {','.join(PARTS)})")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    try:
        bounds = tuple(None if b.strip() == "none" else int(b) for b in args.bounds.split(","))
        n_primes = tuple(int(x) for x in args.n_prime.split(",")) if args.n_prime else None
        parts = tuple(x.strip() for x in args.parts.split(","))
        unknown = [x for x in parts if x not in PARTS]
        if unknown or not parts:
            raise ValueError(f"--parts: {', '.join(unknown) or 'nothing'} is not one of {', '.join(PARTS)}")
    except ValueError as e:
        print(f"april-slime bench scale: {e}", file=sys.stderr)
        return 2
    result = run(quick=args.quick, bounds=bounds, n_primes=n_primes,
                 tokens=int(args.tokens) if args.tokens else None,
                 routed_tokens=int(args.routed_tokens) if args.routed_tokens else None, folder=args.dir,
                 parts=parts, progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(report(result))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
