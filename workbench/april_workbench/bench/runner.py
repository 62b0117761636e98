"""One policy run on a fresh emulated cluster, and whole benchmarks (``run_jobs``: independent runs
in worker processes, also for ``band`` and ``reproduce``). What a run measured is in ``records``;
its warm-up and steady-state summary in ``steady``."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

from april_slime.core.buffer import PartialBuffer
from april_slime.core.config import AprilConfig
from april_slime.core.engine import EngineClient
from april_slime.core.scheduler import assemble_scheduler
from april_slime.core.transport import HttpTransport
from april_slime.core.types import Group
from april_workbench.emulator import EmulatorCluster, SyntheticLM, run_virtual
from april_workbench.emulator.child import ChildCluster

from .dispatch import SplitDispatch
from .multiturn import EpisodeDriver, episode_length_stats
from .records import STAT_KEYS, PolicyRun, StepRecord
from .spec import EngineSpec
from .steady import detect_warmup, summarize
from .workloads import MODES, LengthStats, SyntheticPrompts, Workload, ideal_throughput, length_stats

# ============================================================================ one policy run
WORKLOAD_BOUND = "workload"  # run_policy / RunPoint: the workload's own max_staleness


def _policy_config(policy: str, workload: Workload, concurrency: int | None,
                   over_sampling_factor: float) -> AprilConfig:
    values: dict[str, Any] = {
        "policy": "copris" if policy.startswith("copris") else "sync" if policy == "sync-split" else policy,
        "over_sampling_factor": over_sampling_factor,
        "max_staleness": workload.max_staleness,
        "refill_batch": workload.refill_batch,
    }
    if policy == "sync-oversample":
        # slime's baseline under dynamic sampling (APRIL's DAPO arm): over-sample, abort at the
        # target, and throw the partials away (nothing survives to the next step: run_policy
        # empties the buffer after each step). No staleness bound: a bound of 0 would pace the
        # step, holding every opened group until it finished, which slime's baseline does not do.
        values.update(policy="april", max_staleness=None, return_surplus=False)
    if policy == "copris":
        values["concurrency"] = concurrency or workload.copris_concurrency()
    if policy == "copris-adaptive":
        values.update(adaptive_concurrency=True, min_concurrency=workload.n_samples_per_prompt,
                      max_concurrency=8 * workload.samples_per_step)
        # starts where a fixed-N' run would (CoPRIS' ratio), then steers from the engine loads
        values["concurrency"] = concurrency or workload.copris_concurrency()
    return AprilConfig.from_dict(values)


async def _cluster_counters(transport: Any, router_url: str) -> dict[str, float]:
    reply = await transport.request("GET", router_url, "/emulator/stats", None, 60.0)
    return {k: float(sum(e[k] for e in reply["engines"])) for k in STAT_KEYS}


def _buffer_age(groups: Sequence[Group], next_version: int) -> tuple[int, float]:
    """Response tokens held in the buffer and their token-weighted mean age (versions behind
    ``next_version``), from each trajectory's version runs."""
    tokens = 0
    age_sum = 0.0
    for group in groups:
        for t in group.trajectories:
            for version, count in t.version_runs:  # runs of [version, token count]
                tokens += count
                age_sum += count * (next_version - version)
    return tokens, (age_sum / tokens if tokens else 0.0)


def _group_filter(workload: Workload):
    """DAPO's dynamic sampling, emulated: a group passes (mixed rewards) with probability
    ``filter_keep_fraction``, decided by a hash of its uid so every policy sees the same groups."""
    keep = workload.filter_keep_fraction
    if keep >= 1.0:
        return None

    def passes(group: Group) -> bool:
        digest = hashlib.blake2b(f"{workload.seed}:{group.uid}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2.0 ** 64 < keep

    return passes


async def run_policy(label: str, policy: str, workload: Workload, spec: EngineSpec, *,
                     mode: str = "virtual", time_scale: float = 1.0,
                     concurrency: int | None = None, over_sampling_factor: float | None = None,
                     max_response_len: int | None = None, on_step=None,
                     driver: EpisodeDriver | None = None, token_arrays: bool = True,
                     max_staleness: int | None | str = WORKLOAD_BOUND,
                     step_probe: Callable[[int], contextlib.AbstractContextManager] | None = None,
                     cluster_hook: Callable[[EmulatorCluster], None] | None = None,
                     engines_in_child: bool = False) -> PolicyRun:
    """Run one policy for ``workload.steps`` rollout + training steps on a fresh emulated cluster,
    inside the running event loop (virtual: the caller runs this under ``run_virtual``). A
    multi-turn workload runs through an ``EpisodeDriver`` (made here unless given).
    ``token_arrays=False`` (virtual mode) hands the client SGLang's lists instead of the engines'
    token arrays: the same run, slower (the reference the arrays are tested against).
    ``max_staleness``: the bound of this run (None: unbounded); by default the workload's.
    ``step_probe(index)``: a context entered around each step's ``run_step`` alone (what
    ``bench scale`` measures); ``cluster_hook(cluster)``: called once the cluster has started.
    ``engines_in_child`` (HTTP only): the engines run in a child process, so this one holds and
    computes only what a job's rollout process does."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if engines_in_child and mode != "http":
        raise ValueError(f"engines_in_child needs mode 'http', got {mode!r}")
    scale = 1.0 if mode == "virtual" else float(time_scale)
    budget = max_response_len or workload.max_response_len
    factor = over_sampling_factor if over_sampling_factor is not None else workload.over_sampling_factor
    if max_staleness != WORKLOAD_BOUND:
        workload = replace(workload, max_staleness=max_staleness)
    config = _policy_config(policy, workload, concurrency, factor)
    wall0 = time.perf_counter()
    cluster = (ChildCluster if engines_in_child else EmulatorCluster)(
        spec.num_engines, model=SyntheticLM(seed=workload.seed, length=workload.length_model()),
        engine_config=spec.engine_config(time_scale=scale))
    await cluster.start()
    if cluster_hook is not None:
        cluster_hook(cluster)
    if driver is None and workload.turns_max:
        driver = EpisodeDriver(workload, cluster.model, budget, time_scale=scale)
    transport: Any = None
    client = None
    sampler = None
    try:
        if mode == "http":
            await cluster.serve_http()
            transport = HttpTransport()
        else:
            # Replies are built afresh per call, so the JSON round trip that guards against
            # aliasing buys nothing here and would dominate the run time; the replies' tokens stay
            # arrays (the same values as the wire form, without a Python object per token).
            transport = cluster.transport(token_arrays=token_arrays, transit_s=spec.transit_s)
        if policy == "sync-split":
            transport = SplitDispatch(transport, cluster.engine_urls, workload.rollout_batch_size)
        # Virtual time: an emulated hour passes in a moment, so the client timeout must not be
        # what ends a long step; over HTTP keep SGLang-like limits (in wall seconds).
        client = EngineClient(cluster.engine_urls, transport=transport,
                              timeout_s=1e9 if mode == "virtual" else config.request_timeout_s,
                              max_retries=config.max_retries, retry_backoff_s=0.1)
        buffer = PartialBuffer.from_config(config)
        scheduler = assemble_scheduler(
            config, client, buffer, rollout_batch_size=workload.rollout_batch_size,
            n_samples_per_prompt=workload.n_samples_per_prompt,
            sampling_params=driver.sampling_params if driver else {"temperature": 1.0, "top_p": 1.0},
            controller_overrides={"cooldown_s": 10.0 / scale, "settle_s": 20.0 / scale},
            group_filter=_group_filter(workload), episodes=driver.episodes if driver else None,
            load_poll_interval_s=workload.load_poll_interval_s / scale,
            abort_retry_interval_s=1.0 / scale)
        prompts = driver.prompts if driver else SyntheticPrompts(
            workload.prompt_len, workload.n_samples_per_prompt, budget, cluster.model.vocab_size, workload.seed)
        timeline: dict[str, list[float]] = {"t": [], "running": [], "waiting": [], "kv_used": []}

        async def sample_loads() -> None:
            while True:
                loads = await client.loads()
                timeline["t"].append(cluster.now())
                timeline["running"].append(sum(x.num_running for x in loads))
                timeline["waiting"].append(sum(x.num_waiting for x in loads))
                timeline["kv_used"].append(sum(x.used_tokens for x in loads))
                await asyncio.sleep(workload.timeline_interval_s / scale)

        sampler = asyncio.get_running_loop().create_task(sample_loads())
        records: list[StepRecord] = []
        counters: list[dict[str, float]] = []
        version = 0
        for index in range(workload.steps):
            counters.append(await _cluster_counters(transport, cluster.router_url))
            start = cluster.now()
            wait0 = driver.agent.tool_wait_s if driver and driver.agent else 0.0
            if driver:
                held_before = driver.snapshot(buffer.groups())
            else:
                before = {t.uid: t.response_length for g in buffer.groups() for t in g.trajectories}
            with step_probe(index) if step_probe is not None else contextlib.nullcontext():
                result = await scheduler.run_step(prompts, version)
            rollout_s = cluster.now() - start
            if policy == "sync-oversample":  # slime's baseline discards what its abort left
                buffer.take(len(buffer), version + 1)
            if driver:
                tracked, context_sum, held, age = driver.step_done(held_before, result.groups, buffer.groups(),
                                                                   version + 1)
            else:
                tracked, context_sum = _decoded_positions(before, [*result.groups, *buffer.groups()])
                held, age = _buffer_age(buffer.groups(), version + 1)
            trained = sum(len(t.prompt_ids) + t.response_length
                          for g in result.groups for t in g.trajectories)
            parts = spec.train_parts(trained, held)
            train_s = sum(parts.values())
            records.append(StepRecord(index, version, start, rollout_s, train_s, result.metrics,
                                      tracked, context_sum, held, age, parts["buffered"], trained,
                                      _carried_tokens(result.groups),
                                      (driver.agent.tool_wait_s - wait0) if driver and driver.agent else 0.0))
            if index == workload.steps - 1:
                counters.append(await _cluster_counters(transport, cluster.router_url))
            if on_step is not None:
                on_step(records[-1])
            # Colocated training: engines hold their state and idle, then get the new weights.
            await asyncio.sleep(train_s / scale)
            version += 1  # noqa: SIM113  (the policy version, which the weight push moves, not a counter)
            await transport.request("POST", cluster.router_url, "/update_weight_version",
                                    {"new_version": str(version)}, 60.0)
        warmup, stationary = detect_warmup(records, workload.warmup_steps)
        return PolicyRun(
            label=label, policy=policy,
            settings={"max_response_len": budget, "over_sampling_factor": factor,
                      "concurrency": (config.resolved_concurrency(workload.rollout_batch_size,
                                                                  workload.n_samples_per_prompt)
                                      if policy.startswith("copris") else None),
                      "mode": mode, "time_scale": scale, "max_staleness": config.max_staleness,
                      "tool_busy_max": driver.agent.tool_busy_max if driver and driver.agent else None},
            steps=records, timeline=timeline, capacity_tokens=spec.kv_capacity() * spec.num_engines,
            num_engines=spec.num_engines, counters=counters, warmup_steps=warmup,
            stationary=stationary,
            concurrency_history=list(scheduler.controller.history) if scheduler.controller is not None else [],
            wall_s=time.perf_counter() - wall0)
    finally:
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sampler
        if driver is not None:
            await driver.close()  # its episodes' coroutines, before the engines they call go
        if client is not None:
            await client.close()
        if transport is not None:
            await transport.close()
        await cluster.close()


def _carried_tokens(groups: Sequence[Group]) -> int:
    """Response tokens generated before the last resume of every trajectory resumed at least once
    (its tokens span several policy versions, one per step it ran in)."""
    return sum(sum(count for _, count in t.version_runs.runs()[:-1])
               for g in groups for t in g.trajectories if len(t.version_runs) > 1)


def _decoded_positions(before: dict[str, int], groups: Sequence[Group]) -> tuple[int, float]:
    """Tokens generated in a step and the sum of the context lengths they were decoded at, from
    each trajectory's length before and after the step (a trajectory restarted for staleness is
    skipped: its old tokens are gone)."""
    tokens = 0
    context_sum = 0.0
    for group in groups:
        for t in group.trajectories:
            prev, new = before.get(t.uid, 0), t.response_length
            if new > prev:
                d = new - prev
                tokens += d
                context_sum += d * len(t.prompt_ids) + (prev + new - 1) * d / 2.0
    return tokens, context_sum


# ============================================================================ benchmark plans
@dataclass(frozen=True)
class RunPoint:
    """One (policy, setting) run of a benchmark."""

    label: str
    policy: str
    concurrency: int | None = None
    over_sampling_factor: float | None = None
    max_response_len: int | None = None
    max_staleness: int | None | str = WORKLOAD_BOUND


def plan(workload: Workload) -> list[RunPoint]:
    if workload.sweep == "none":
        return [RunPoint(label, p, max_staleness=bound if workload.staleness_bounds else WORKLOAD_BOUND)
                for label, p, bound in workload.run_labels()]
    points: list[RunPoint] = []
    if workload.sweep == "context":
        for value in workload.sweep_values:
            budget = int(value)
            for p in workload.policies:
                points.append(RunPoint(f"{p}@{budget // 1024}k", p, max_response_len=budget))
    elif workload.sweep == "concurrency":
        for value in workload.sweep_values:
            if "copris" in workload.policies:
                points.append(RunPoint(f"copris@N={int(value)}", "copris", concurrency=int(value)))
        if "copris-adaptive" in workload.policies:
            points.append(RunPoint("copris-adaptive", "copris-adaptive"))
        for p in workload.policies:
            if p not in ("copris", "copris-adaptive"):
                points.append(RunPoint(p, p))
    elif workload.sweep == "oversampling":
        for value in workload.sweep_values:
            points.append(RunPoint(f"april@x{value:g}", "april", over_sampling_factor=float(value)))
        for p in workload.policies:
            if p != "april":
                points.append(RunPoint(p, p))
    return points


@dataclass
class BenchResult:
    workload: Workload
    spec: EngineSpec
    mode: str
    time_scale: float
    runs: list[PolicyRun]
    points: list[RunPoint]
    ideal: dict[int, dict[str, float]]  # by response budget
    lengths: dict[int, LengthStats]
    summaries: dict[str, dict[str, Any]]
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        """``{"workload": {...}, "results": {label: {...}}}``."""
        w = asdict(self.workload)
        w.update(mode=self.mode, time_scale=self.time_scale, engine=self.spec.describe(),
                 ideal={str(k): v for k, v in self.ideal.items()},
                 response_lengths={str(k): dict(asdict(v), kv_per_slot=v.kv_per_slot)
                                   for k, v in self.lengths.items()},
                 wall_s=self.wall_s)
        return {"workload": w, "results": self.summaries}


class Progress:
    """What a long run reports as it goes (the CLI draws a tqdm bar from it); no-ops here."""

    def step(self, label: str, record: StepRecord) -> None:
        pass

    def run_done(self, run: PolicyRun) -> None:
        pass


async def _run_all(workload: Workload, spec: EngineSpec, mode: str, time_scale: float,
                   points: list[RunPoint], progress: Progress) -> list[PolicyRun]:
    runs = []
    for point in points:
        run = await run_policy(point.label, point.policy, workload, spec, mode=mode,
                               time_scale=time_scale, concurrency=point.concurrency,
                               over_sampling_factor=point.over_sampling_factor,
                               max_response_len=point.max_response_len, max_staleness=point.max_staleness,
                               on_step=lambda record, label=point.label: progress.step(label, record))
        runs.append(run)
        progress.run_done(run)
    return runs


def run_jobs(function, jobs: list, processes: int) -> list:
    """``function`` over ``jobs``, in ``processes`` worker processes (1: in this process)."""
    if processes <= 1 or len(jobs) <= 1:
        return [function(j) for j in jobs]
    with ProcessPoolExecutor(max_workers=min(processes, len(jobs))) as pool:
        return list(pool.map(function, jobs))


def _run_point(job: tuple[Workload, EngineSpec, RunPoint]) -> PolicyRun:
    workload, spec, point = job
    return run_virtual(_run_all(workload, spec, "virtual", 1.0, [point], Progress()))[0]


def run_benchmark(workload: Workload, spec: EngineSpec, *, mode: str = "virtual",
                  time_scale: float = 1.0, progress: Progress | None = None,
                  jobs: int = 1) -> BenchResult:
    """Run every point of the workload (each on a fresh cluster; virtual mode: in ``jobs``
    processes) and summarise."""
    progress = progress or Progress()
    wall0 = time.perf_counter()
    points = plan(workload)
    budgets = sorted({p.max_response_len or workload.max_response_len for p in points})
    lengths = {b: (episode_length_stats if workload.turns_max else length_stats)(workload, b) for b in budgets}
    ideal = {b: ideal_throughput(spec, replace(workload, max_response_len=b), lengths[b])
             for b in budgets}
    if mode == "virtual" and jobs > 1 and len(points) > 1:
        runs = run_jobs(_run_point, [(workload, spec, p) for p in points], jobs)
        for run in runs:
            progress.run_done(run)
    elif mode == "virtual":
        runs = run_virtual(_run_all(workload, spec, mode, 1.0, points, progress))
    elif mode == "http":
        runs = asyncio.run(_run_all(workload, spec, mode, time_scale, points, progress))
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    summaries = {}
    for point, run in zip(points, runs):
        budget = point.max_response_len or workload.max_response_len
        summaries[point.label] = summarize(run, ideal[budget]["tokens_per_s"], spec)
    return BenchResult(workload, spec, mode, time_scale if mode == "http" else 1.0, runs, points,
                       ideal, lengths, summaries, time.perf_counter() - wall0)


