"""Scheduler tests: first against an in-process fake engine client (exact control over latency,
aborts and failures), then against the SGLang-protocol emulator over real HTTP on loopback."""

import asyncio
import collections
import functools
import hashlib
import math
import random

import numpy as np
import pytest

from april_slime.core.buffer import PartialBuffer
from april_slime.core.config import AprilConfig
from april_slime.core.engine import EngineClient
from april_slime.core.groups import StepGroups
from april_slime.core.pacing import StalenessPacing
from april_slime.core.scheduler import PromptsExhausted, RolloutScheduler, RolloutStepError
from april_slime.core.sglang_protocol import EngineLoad, EngineUnavailable, GenerateResult, RequestRejected
from april_slime.core.transport import HttpTransport
from april_slime.core.types import Group, Trajectory, TrajectoryStatus
from april_workbench.emulator.testing import start_cluster
from april_workbench.emulator.vclock import run_virtual
from tests.support.numbered_prompts import numbered_prompt

PROMPT_LEN = 4


# ====================================================================== fake engine client
def _h(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


class FakeClient:
    """Implements EngineClient's methods. Response length, tokens and log-probs are pure functions
    of (prompt key, seed, position, version); a request of k tokens takes k * token_time seconds
    and returns the tokens produced so far when aborted."""

    def __init__(self, n_engines=2, token_time=0.002, short=(2, 10), long=(25, 60), long_frac=0.25):
        self.engine_urls = [f"http://fake-{i}" for i in range(n_engines)]
        self.token_time = token_time
        self.short, self.long, self.long_frac = short, long, long_frac
        self.version = 0
        self.running: dict[str, tuple[str, asyncio.Event]] = {}
        self.rids: set[str] = set()
        self.calls: list[tuple[str, str, list[int], int]] = []
        self.abort_calls: list[tuple[str, str | None, bool]] = []
        self.fail = lambda url, rid: False  # -> raise EngineUnavailable for this call
        self.max_running_seen = 0
        self.delivered: dict[str, int] = {}  # trajectory uid -> tokens returned over all its calls
        self.probes: list[str] = []
        self.probe_fails = lambda url: False
        self.wedged: set[str] = set()  # engines that accept requests and never answer anything
        self.hang = lambda url, rid: False  # -> this call never answers (its engine answers the rest)
        self.abort_hangs: set[str] = set()  # engines whose /abort_request never answers
        self.reject = lambda url, rid: False  # -> HTTP 400 for this call
        self.eos_on_abort = None  # token id an aborted reply ends with (abort racing a stop)
        self.split_versions = False  # weights change half-way through every call
        self.abort_at_budget = False  # an aborted reply holds every token its request allowed
        self.budget_aborts = 0  # replies "abort" that filled their request's budget
        self.transit_s = 0.0  # a generate reaches its engine (an abort can find it) this long after it is sent

    def natural_length(self, key, seed) -> int:
        rng = random.Random(_h("len", key, seed))
        lo, hi = self.long if rng.random() < self.long_frac else self.short
        return rng.randint(lo, hi)

    @staticmethod
    def token(key, seed, pos, version) -> tuple[int, float]:
        v = _h("tok", key, seed, pos, version)
        return v % 1000 + 5, -((v >> 20) % 1000) / 250.0

    async def generate(self, engine_url, input_ids, *, max_new_tokens, rid, sampling_params,
                       sampling_seed, replay_rows=0) -> GenerateResult:
        assert rid not in self.rids, f"rid {rid} reused"
        assert max_new_tokens > 0
        self.rids.add(rid)
        self.calls.append((engine_url, rid, list(input_ids), max_new_tokens))
        if self.fail(engine_url, rid):
            await asyncio.sleep(self.token_time)
            raise EngineUnavailable(f"{engine_url}: injected failure for {rid}")
        if self.reject(engine_url, rid):
            raise RequestRejected(f"{engine_url} rejected {rid} with HTTP 400", 400)
        if engine_url in self.wedged or self.hang(engine_url, rid):
            await asyncio.Event().wait()
        if self.transit_s:
            await asyncio.sleep(self.transit_s)
        key = tuple(map(int, input_ids[:PROMPT_LEN]))  # a list or an int32 array: the same key
        start = len(input_ids) - PROMPT_LEN
        natural_left = self.natural_length(key, sampling_seed) - start
        n = min(max(natural_left, 1), max_new_tokens)
        finish = "stop" if natural_left <= max_new_tokens else "length"
        abort = asyncio.Event()
        self.running[rid] = (engine_url, abort)
        self.max_running_seen = max(self.max_running_seen, len(self.running))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            await asyncio.wait_for(abort.wait(), n * self.token_time)
            n = max_new_tokens if self.abort_at_budget else min(n, int((loop.time() - t0) / self.token_time))
            finish = "abort"
            self.budget_aborts += n == max_new_tokens
        except TimeoutError:
            pass
        finally:
            del self.running[rid]
        version = self.version
        uid = rid.split("#")[0]
        self.delivered[uid] = self.delivered.get(uid, 0) + n
        versions = [version] * n
        if self.split_versions:  # the first half came from the previous weights
            versions[: n // 2] = [version - 1] * (n // 2)
        toks = [self.token(key, sampling_seed, start + i, v) for i, v in enumerate(versions)]
        ids = [t for t, _ in toks]
        if finish == "abort" and n and self.eos_on_abort is not None:
            ids[-1] = self.eos_on_abort
        runs = [[v, versions.count(v)] for v in sorted(set(versions))]
        return GenerateResult(output_ids=np.array(ids, dtype=np.int64),
                              logprobs=np.array([lp for _, lp in toks], dtype=np.float64),
                              finish_reason=finish, weight_version=version, prompt_tokens=len(input_ids),
                              completion_tokens=n, engine_url=engine_url, version_runs=runs)

    async def abort(self, engine_url, rid=None, abort_all=False, *, timeout_s=None, max_retries=None):
        self.abort_calls.append((engine_url, rid, abort_all))
        if engine_url in self.abort_hangs or engine_url in self.wedged:
            if timeout_s is None:
                await asyncio.Event().wait()
            await asyncio.sleep(timeout_s)
            raise EngineUnavailable(f"{engine_url} /abort_request: no reply within {timeout_s} s")
        for r, (url, event) in list(self.running.items()):
            if url == engine_url and (abort_all or r == rid):
                event.set()

    async def probe(self, engine_url, timeout_s):
        self.probes.append(engine_url)
        if self.probe_fails(engine_url) or engine_url in self.wedged:
            await asyncio.sleep(timeout_s)
            raise EngineUnavailable(f"{engine_url}: probe got no reply within {timeout_s} s")

    async def loads(self):
        return [EngineLoad(url=u, num_running=sum(1 for x, _ in self.running.values() if x == u),
                           num_waiting=0, used_tokens=0, capacity_tokens=1000, retractions=0)
                for u in self.engine_urls]

    def expected(self, t: Trajectory) -> tuple[list[int], list[float]]:
        assert self.eos_on_abort is None
        toks = [self.token(tuple(t.prompt_ids[:PROMPT_LEN]), t.sampling_seed, p, v)
                for p, v in enumerate(t.token_versions())]
        return [x for x, _ in toks], [lp for _, lp in toks]


class Prompts:
    def __init__(self, n_samples, max_new_tokens=40, limit=None):
        self.n, self.max_new, self.limit = n_samples, max_new_tokens, limit
        self.made: list[str] = []

    def next_groups(self, k, current_version):
        if self.limit is not None:
            k = min(k, self.limit - len(self.made))
        out = []
        for _ in range(k):
            i = len(self.made)
            uid = f"p{i}"
            prompt = [i * 7 + 1, i * 7 + 2, i * 7 + 3, i * 7 + 4]
            trajs = [Trajectory(uid=f"{uid}/{j}", group_uid=uid, index_in_group=j, prompt_ids=prompt,
                                max_new_tokens=self.max_new, sampling_seed=1000 + j) for j in range(self.n)]
            out.append(Group(uid=uid, prompt_ids=prompt, trajectories=trajs, created_version=current_version))
            self.made.append(uid)
        return out


def virtual_clock(test):
    """Run an async test on the emulator's virtual clock: the fake engines' latencies are timers,
    so the test is deterministic and takes no wall time, whatever the machine's load."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return run_virtual(test(*args, **kwargs))

    return run


def make(policy="copris", *, client=None, batch=4, n=3, buffer=None, **kw):
    cfg_keys = {k: kw.pop(k) for k in list(kw) if k in AprilConfig.__dataclass_fields__}
    if policy != "copris":
        cfg_keys.pop("concurrency", None)  # only copris reads it (and the settings refuse it otherwise)
    config = AprilConfig.from_dict({"policy": policy, **cfg_keys})
    client = client or FakeClient()
    buffer = buffer if buffer is not None else PartialBuffer.from_config(config)
    sched = RolloutScheduler(config, client, buffer, rollout_batch_size=batch, n_samples_per_prompt=n,
                             sampling_params={"temperature": 1.0}, **kw)
    return sched, client, buffer


def check_aligned(t: Trajectory):
    assert len(t.response_ids) == len(t.logprobs) == sum(c for _, c in t.version_runs)
    assert t.status is not TrajectoryStatus.RUNNING


def check_tokens_delivered(client, groups):
    """Every token the engine returned sits in its trajectory: none lost, none invented."""
    for g in groups:
        for t in g.trajectories:
            assert t.response_length == client.delivered.get(t.uid, 0), t.uid


def check_conservation(prompts, returned_uids, buffer, discarded=0):
    """Every group ever made is returned exactly once, in the buffer, or counted as discarded."""
    assert len(returned_uids) == len(set(returned_uids)), "a group was returned twice"
    buffered = [g.uid for g in buffer.groups()]
    assert not set(buffered) & set(returned_uids)
    assert len(returned_uids) + len(buffered) + discarded == len(prompts.made)
    for g in buffer.groups():
        for t in g.trajectories:
            check_aligned(t)


# ====================================================================== fake-client tests
@pytest.mark.parametrize("policy", ["sync", "april", "copris"])
@virtual_clock
async def test_each_policy_returns_exact_batch_and_never_repeats(policy):
    sched, client, buffer = make(policy, batch=4, n=3, concurrency=6)
    prompts = Prompts(3)
    returned = []
    for step in range(4):
        res = await sched.run_step(prompts, current_version=step)
        assert len(res.groups) == 4
        for g in res.groups:
            assert g.complete and len(g.trajectories) == 3
            for t in g.trajectories:
                check_aligned(t)
                assert client.expected(t) == (t.response_ids, t.logprobs)
        returned += [g.uid for g in res.groups]
        check_conservation(prompts, returned, buffer)
        check_tokens_delivered(client, [*res.groups, *buffer.groups()])
        m = res.metrics
        assert all(k.startswith("april/") for k in m)
        assert m["april/returned_groups"] == 4
        assert m["april/buffer_groups"] == len(buffer)
        client.version += 1
    if policy == "sync":
        assert client.abort_calls == [] and len(buffer) == 0
        assert len(client.calls) == 4 * 4 * 3
    else:
        assert client.abort_calls  # aborted at target
    rids = [c[1] for c in client.calls]
    assert len(rids) == len(set(rids))


@virtual_clock
async def test_copris_keeps_exactly_n_prime_in_flight_and_resumes_partials():
    sched, client, buffer = make("copris", batch=3, n=2, concurrency=5, refill_batch=1)
    prompts = Prompts(2, max_new_tokens=50)
    returned, saw_resume = [], False
    for step in range(4):
        res = await sched.run_step(prompts, current_version=step)
        timeline = sched.last_timeline
        assert timeline and all(p.in_flight <= 5 and p.limit == 5 for p in timeline)
        working = [p for p in timeline if p.work_remaining]
        assert working and all(p.in_flight == 5 for p in working)
        assert timeline[-1].in_flight == 0
        assert res.metrics["april/inflight_min_while_work"] == 5
        assert res.metrics["april/inflight_max"] == 5
        assert 0 < res.metrics["april/inflight_mean"] <= 5
        assert client.max_running_seen <= 5
        returned += [g.uid for g in res.groups]
        check_conservation(prompts, returned, buffer)
        check_tokens_delivered(client, [*res.groups, *buffer.groups()])
        assert res.metrics["april/aborted_tokens"] > 0
        # what the abort left behind is in the buffer with its tokens
        assert res.metrics["april/buffer_partial_trajectories"] == buffer.num_partial_trajectories()
        for g in res.groups:
            for t in g.trajectories:
                assert client.expected(t) == (t.response_ids, t.logprobs)
                if len(t.version_runs) > 1:
                    saw_resume = True
        if step:
            assert res.metrics["april/resumed_groups"] >= 1
        client.version += 1
    assert saw_resume, "no returned sample spanned two policy versions"


@virtual_clock
async def test_copris_refills_in_batches_of_refill_batch():
    # A refill waits until refill_batch of the N' slots are free, so the engines prefill several new
    # requests in one step instead of one per completion; conservation and the tokens are unchanged.
    sched, client, buffer = make("copris", batch=3, n=2, concurrency=6, refill_batch=3)
    sent_at: list[float] = []
    generate = client.generate

    async def timed_generate(*args, **kwargs):
        sent_at.append(asyncio.get_running_loop().time())
        return await generate(*args, **kwargs)

    client.generate = timed_generate
    prompts = Prompts(2, max_new_tokens=50)
    returned, batched = [], 0
    for step in range(4):
        sent_at.clear()
        res = await sched.run_step(prompts, current_version=step)
        working = [p for p in sched.last_timeline if p.work_remaining]
        # between two refills at most refill_batch - 1 slots stand empty
        assert working and all(4 <= p.in_flight <= 6 for p in working)
        batched += sum(p.in_flight < 6 for p in working)
        bursts = sorted(collections.Counter(sent_at).items())
        assert all(n >= 3 for _, n in bursts[1:]), bursts  # after the first fill: never fewer than 3 at once
        returned += [g.uid for g in res.groups]
        check_conservation(prompts, returned, buffer)
        check_tokens_delivered(client, [*res.groups, *buffer.groups()])
        client.version += 1
    assert batched, "no refill ever waited for a batch"


def test_copris_refill_batch_never_waits_with_nothing_in_flight():
    from april_slime.core.policies import CoprisPolicy

    class View:
        def __init__(self, in_flight, queued):
            self.calls_in_flight, self.calls_queued = in_flight, queued
            self.target, self.accepted_groups, self.episodes_live, self.groups_to_resume = 4, 0, 0, 0

    policy = CoprisPolicy(8, 2, refill_batch=4)
    assert policy.calls_to_submit(View(0, 2)) == 8  # nothing runs: whatever is queued goes
    assert policy.calls_to_submit(View(5, 9)) == 0  # 3 free < 4: wait for one more completion
    assert policy.calls_to_submit(View(4, 9)) == 4
    assert CoprisPolicy(3, 2, refill_batch=8).calls_to_submit(View(0, 9)) == 3  # a batch above N' is N'
    assert CoprisPolicy(3, 2, refill_batch=8).calls_to_submit(View(1, 9)) == 0
    assert CoprisPolicy(8, 2).calls_to_submit(View(7, 9)) == 1  # refill_batch 1: CoPRIS as published


@virtual_clock
async def test_partial_resubmission_sends_prompt_plus_partial_with_reduced_budget():
    client = FakeClient(token_time=0.003, short=(4, 8), long=(40, 40), long_frac=0.5)
    sched, _, buffer = make("copris", client=client, batch=1, n=2, concurrency=8)
    prompts = Prompts(2, max_new_tokens=40)
    await sched.run_step(prompts, current_version=0)
    partials = {t.uid: t.response_length for g in buffer.groups() for t in g.trajectories
                if t.response_length and not t.status.finished}
    assert partials
    client.calls.clear()
    await sched.run_step(prompts, current_version=1)
    sent = {rid.split("#")[0]: (ids, budget) for _, rid, ids, budget in client.calls}
    for uid, had in partials.items():
        ids, budget = sent[uid]
        assert len(ids) == PROMPT_LEN + had and budget == 40 - had


@virtual_clock
async def test_trajectory_without_budget_is_truncated_without_a_call():
    sched, client, buffer = make("copris", batch=1, n=2)
    prompts = Prompts(2, max_new_tokens=5)
    g = prompts.next_groups(1, 0)[0]
    t = g.trajectories[0]
    t.append([7] * 5, [-1.0] * 5, 0)
    t.status = TrajectoryStatus.ABORTED
    buffer.put(g)
    res = await sched.run_step(prompts, current_version=0)
    assert res.groups[0].uid == g.uid
    assert t.status is TrajectoryStatus.TRUNCATED and t.response_length == 5
    assert not any(rid.startswith(t.uid) for _, rid, _, _ in client.calls)
    assert res.metrics["april/truncated_without_call"] == 1


@pytest.mark.parametrize("action", ["restart", "drop"])
@virtual_clock
async def test_staleness_fallback_restarts_or_drops_what_pacing_cannot_prevent(action):
    """Versions that jump past the bound between two steps (what pacing cannot foresee): the
    buffered partials are restarted or dropped, counted, and nothing older is trained."""
    sched, client, buffer = make("april", batch=3, n=2, max_staleness=1, stale_action=action,
                                 over_sampling_factor=3.0)
    prompts = Prompts(2, max_new_tokens=50)
    returned = []
    for step, version in enumerate((0, 3, 4)):
        client.version = version
        res = await sched.run_step(prompts, current_version=version)
        for g in res.groups:
            for t in g.trajectories:
                assert t.staleness(version) <= 1
        assert res.metrics["april/token_staleness_max"] <= 1
        returned += [g.uid for g in res.groups]
        check_conservation(prompts, returned, buffer, discarded=buffer.dropped_groups)
        if step == 1:
            fallback = res.metrics["april/stale_fallback_groups"]
            assert fallback > 0 and res.metrics["april/stale_discarded_tokens"] > 0
    if action == "restart":
        assert buffer.restarted_groups > 0 and buffer.dropped_groups == 0
        assert buffer.restarted_tokens > 0
    else:
        assert buffer.dropped_groups > 0 and buffer.restarted_groups == 0


def long_tail_client():
    """A quarter of the responses are long (25-60 tokens) against short ones (2-10): a step meets its
    target long before the long ones finish, so partial rollouts carry them over many steps."""
    return FakeClient(token_time=0.002, short=(2, 10), long=(25, 60), long_frac=0.25)


@pytest.mark.parametrize("policy,bound", [("copris", 0), ("copris", 1), ("copris", 2), ("april", 0),
                                          ("april", 1), ("sync", 0)])
@virtual_clock
async def test_pacing_keeps_the_bound_without_throwing_work_away(policy, bound):
    """With max_staleness k no trained token lags more than k versions, and pacing, not the
    restart fallback, keeps it so: no group is restarted or dropped, no token thrown away."""
    sched, client, buffer = make(policy, client=long_tail_client(), batch=3, n=2, concurrency=8,
                                 max_staleness=bound, over_sampling_factor=2.0)
    prompts = Prompts(2, max_new_tokens=60)
    returned, lags, carried = [], set(), 0
    for step in range(10):
        res = await sched.run_step(prompts, current_version=step)
        assert len(res.groups) == 3
        for g in res.groups:
            for t in g.trajectories:
                check_aligned(t)
                assert client.expected(t) == (t.response_ids, t.logprobs)
                lags |= {step - v for v, _ in t.version_runs}
        m = res.metrics
        assert m["april/token_staleness_max"] <= bound and m["april/staleness_max"] <= bound
        assert m["april/stale_fallback_groups"] == 0 and m["april/stale_discarded_tokens"] == 0
        assert m["april/pacing_forced_accepts"] == 0
        returned += [g.uid for g in res.groups]
        check_conservation(prompts, returned, buffer)
        check_tokens_delivered(client, [*res.groups, *buffer.groups()])
        carried += m["april/resumed_trajectories"]
        client.version += 1
    assert max(lags) <= bound
    assert buffer.restarted_groups == buffer.dropped_groups == buffer.discarded_tokens == 0
    if policy != "sync" and bound:
        assert carried > 0, "no partial was carried over: the test shows nothing"
        assert max(lags) == bound, "the bound was never used: the test shows nothing"


@pytest.mark.parametrize("policy", ["copris", "april"])
@virtual_clock
async def test_pacing_sees_a_reply_from_older_weights_at_once(policy):
    """A reply whose tokens come partly from the previous weights makes a group opened with slack 1
    due in the middle of the step. The pacing keeps each live group's slack instead of recomputing
    it per check (``StalenessPacing.track``), so the reply must update it: every decision of this
    run is also recomputed from the groups (``cross_check``, on for every test) and must agree."""
    assert StalenessPacing.cross_check
    client = long_tail_client()
    client.split_versions = True  # half of every reply's tokens are of the previous version
    sched, client, buffer = make(policy, client=client, batch=3, n=2, concurrency=8, max_staleness=1,
                                 over_sampling_factor=2.0)
    prompts = Prompts(2, max_new_tokens=60)
    due_by_a_reply = 0
    for step in range(6):
        client.version = step
        res = await sched.run_step(prompts, current_version=step)
        assert len(res.groups) == 3
        due_by_a_reply += sum(1 for g in res.groups if g.created_version == step
                              and g.staleness(step) == 1)
    assert due_by_a_reply > 0, "no group opened in a step was made due by a reply: the test shows nothing"


def test_pacing_work_per_call_does_not_grow_with_the_step(monkeypatch):
    """The pacing's cost, counted in slack computations (its only per-group work; a check reads
    counts per slack): per engine call the same at 16 and at 256 groups a step, where recomputing
    every live group's slack per check grew with the number of live groups."""
    monkeypatch.setattr(StalenessPacing, "cross_check", False)  # it recomputes on purpose
    computed = collections.Counter()
    compute = StalenessPacing._compute_slack

    def counting(self, group):
        computed["slack"] += 1
        return compute(self, group)

    monkeypatch.setattr(StalenessPacing, "_compute_slack", counting)

    def per_call(batch: int) -> float:
        computed.clear()

        async def main():
            sched, client, _ = make("copris", client=long_tail_client(), batch=batch, n=2, concurrency=4 * batch,
                                    max_staleness=2)
            prompts = Prompts(2, max_new_tokens=60)
            for step in range(4):
                client.version = step
                res = await sched.run_step(prompts, current_version=step)
                assert res.metrics["april/pacing_deferred_groups"] + res.metrics["april/pacing_held_opens"] > 0 \
                    or step == 0
            return len(client.calls)

        calls = run_virtual(main())
        return computed["slack"] / calls

    small, large = per_call(16), per_call(256)
    assert large <= 1.3 * small and large < 8, (small, large)


def test_a_reply_reads_the_versions_of_its_own_member_only(monkeypatch):
    """What a reply costs the pacing, counted in members whose versions it reads: one, the member
    the reply went to (``StalenessPacing.tokens_added``), whatever the group size; reading the
    group's slack afresh read all of them (8 here)."""
    monkeypatch.setattr(StalenessPacing, "cross_check", False)  # it recomputes on purpose
    counts = collections.Counter()
    oldest, changed = Trajectory.oldest_version, StepGroups.tokens_changed
    inside = [False]

    def counting_oldest(self):
        counts["reads"] += inside[0]
        return oldest(self)

    def counting_changed(self, uid, item=None):
        counts["replies"] += 1
        inside[0] = True
        try:
            return changed(self, uid, item)
        finally:
            inside[0] = False

    monkeypatch.setattr(Trajectory, "oldest_version", counting_oldest)
    monkeypatch.setattr(StepGroups, "tokens_changed", counting_changed)

    async def main():
        sched, client, _ = make("copris", client=long_tail_client(), batch=16, n=8, concurrency=64,
                                max_staleness=2)
        prompts = Prompts(8, max_new_tokens=60)
        for step in range(3):
            client.version = step
            await sched.run_step(prompts, current_version=step)

    run_virtual(main())
    assert counts["replies"] > 100 and 0 < counts["reads"] <= counts["replies"], counts


@pytest.mark.parametrize("policy,bound", [("copris", 1), ("april", 0)])
def test_without_pacing_the_same_runs_throw_work_away(policy, bound, monkeypatch):
    """The counterpart of the test above: the same runs with the bound applied only after the
    fact (pacing switched off, the buffer's fallback alone) restart groups, so the test above
    measures pacing and not a workload that never needed it."""
    monkeypatch.setattr(StalenessPacing, "active", property(lambda self: False))

    async def main():
        sched, client, buffer = make(policy, client=long_tail_client(), batch=3, n=2, concurrency=8,
                                     max_staleness=bound, over_sampling_factor=2.0)
        prompts = Prompts(2, max_new_tokens=60)
        for step in range(10):
            await sched.run_step(prompts, current_version=step)
            client.version += 1
        assert buffer.restarted_groups > 0 and buffer.restarted_tokens > 0

    run_virtual(main())


def starving_client():
    """One response in ten is 400 tokens long against 2-8 for the rest: a step meets its target
    within a few dozen token times, so without protection a long one is aborted at step after step."""
    return FakeClient(token_time=0.002, short=(2, 8), long=(400, 400), long_frac=0.1)


async def run_protection(max_interruptions, steps=8):
    # every completion refilled at once (refill_batch 1): the refills that starve the long responses
    sched, client, buffer = make("copris", client=starving_client(), batch=3, n=2, concurrency=8,
                                 max_interruptions=max_interruptions, refill_batch=1)
    prompts = Prompts(2, max_new_tokens=400)
    returned, longest, protected, metrics = [], 0, 0, []
    for step in range(steps):
        res = await sched.run_step(prompts, current_version=step)
        assert len(res.groups) == 3
        returned += [g.uid for g in res.groups]
        check_conservation(prompts, returned, buffer)
        check_tokens_delivered(client, [*res.groups, *buffer.groups()])
        longest = max([longest, *(t.response_length for g in res.groups for t in g.trajectories)])
        protected += res.metrics["april/protected_groups"]
        metrics.append(res.metrics)
        client.version += 1
    return longest, protected, metrics, buffer


@virtual_clock
async def test_protection_lets_a_long_response_finish_instead_of_starving():
    """max_interruptions 2: a group suspended twice is resumed first at the next step and runs to
    completion there, so no trained sample was interrupted more than twice and the 400-token
    responses are trained; without protection the same run trains none of them in 8 steps."""
    longest, protected, metrics, _ = await run_protection(max_interruptions=2)
    assert protected > 0 and longest == 400
    assert all(m["april/interruptions_max"] <= 2 for m in metrics)
    assert all(m["april/stale_fallback_groups"] == 0 for m in metrics)
    unprotected_longest, none, unprotected, buffer = await run_protection(max_interruptions=None)
    assert none == 0 and unprotected_longest < 400
    assert max(g.interruptions for g in buffer.groups()) > 2, "nothing starved: the test shows nothing"


@virtual_clock
async def test_staleness_metrics_without_bound():
    sched, client, buffer = make("copris", batch=2, n=2, concurrency=6)
    prompts = Prompts(2, max_new_tokens=60)
    hist_seen = set()
    for step in range(4):
        res = await sched.run_step(prompts, current_version=step)
        ts = [t for g in res.groups for t in g.trajectories]
        lag = [t.staleness(step) for t in ts]
        assert res.metrics["april/staleness_max"] == max(lag)
        assert res.metrics["april/staleness_mean"] == pytest.approx(sum(lag) / len(lag))
        assert sum(v for k, v in res.metrics.items() if k.startswith("april/staleness_hist/")) == len(ts)
        tokens = sum(t.response_length for t in ts)
        off = sum(t.offpolicy_tokens(step) for t in ts)
        assert res.metrics["april/offpolicy_token_fraction"] == pytest.approx(off / tokens)
        hist_seen |= {k for k in res.metrics if k.startswith("april/staleness_hist/")}
        client.version += 1
    assert len(hist_seen) > 1


@virtual_clock
async def test_filter_rejections_and_surplus_recycling():
    async def slow_reward(group):
        await asyncio.sleep(0.03)  # groups keep completing while earlier ones are being rewarded
        for t in group.trajectories:
            t.reward = float(t.response_length % 2)

    rejected = set()

    def keep(group):
        ok = int(group.uid[1:]) % 3 != 1
        if not ok:
            rejected.add(group.uid)
        return ok

    client = FakeClient(token_time=0.002, long_frac=0.0)
    sched, _, buffer = make("april", client=client, batch=3, n=2, reward_fn=slow_reward, group_filter=keep,
                            over_sampling_factor=3.0)
    prompts = Prompts(2)
    res = await sched.run_step(prompts, current_version=0)
    assert len(res.groups) == 3 and all(keep(g) for g in res.groups)
    assert all(t.reward is not None for g in res.groups for t in g.trajectories)
    m = res.metrics
    assert m["april/filtered_groups"] == len(rejected) > 0
    assert m["april/discarded_tokens"] > 0
    surplus = [g for g in buffer.groups() if g.complete]
    assert m["april/surplus_groups"] == len(surplus) > 0
    check_conservation(prompts, [g.uid for g in res.groups], buffer, discarded=len(rejected))
    # surplus groups are used first next step, without regenerating or re-rewarding them
    calls_before = len(client.calls)
    res2 = await sched.run_step(prompts, current_version=0)
    returned2 = {g.uid for g in res2.groups}
    assert {g.uid for g in surplus[:3]} <= returned2
    if len(surplus) >= 3:
        assert len(client.calls) == calls_before
    check_conservation(prompts, [g.uid for g in res.groups + res2.groups], buffer, discarded=len(rejected))


@virtual_clock
async def test_surplus_discarded_when_not_returned():
    async def slow_reward(group):
        await asyncio.sleep(0.03)

    client = FakeClient(long_frac=0.0)
    sched, _, buffer = make("april", client=client, batch=2, n=2, reward_fn=slow_reward,
                            return_surplus=False, over_sampling_factor=4.0)
    prompts = Prompts(2)
    res = await sched.run_step(prompts, current_version=0)
    m = res.metrics
    assert m["april/surplus_groups"] == m["april/surplus_discarded_groups"] > 0
    assert not any(g.complete for g in buffer.groups())
    check_conservation(prompts, [g.uid for g in res.groups], buffer,
                       discarded=int(m["april/surplus_discarded_groups"]))


@virtual_clock
async def test_engine_failures_are_retried_without_loss():
    client = FakeClient()
    client.fail = lambda url, rid: url.endswith("-0") and rid.endswith("#0")  # first calls on e0 fail
    sched, _, buffer = make("copris", client=client, batch=4, n=2, concurrency=6)
    prompts = Prompts(2)
    returned = []
    for step in range(2):
        res = await sched.run_step(prompts, current_version=step)
        assert len(res.groups) == 4
        returned += [g.uid for g in res.groups]
        check_conservation(prompts, returned, buffer)
        if step == 0:
            assert res.metrics["april/engine_errors"] > 0
        for g in res.groups:
            for t in g.trajectories:
                assert client.expected(t) == (t.response_ids, t.logprobs)
        client.version += 1


@virtual_clock
async def test_persistent_engine_failure_raises_and_keeps_everything():
    client = FakeClient(token_time=0.002)
    sched, _, buffer = make("copris", client=client, batch=3, n=2, concurrency=4,
                            max_failures_per_trajectory=2)
    prompts = Prompts(2)
    await sched.run_step(prompts, current_version=0)
    snapshot = {g.uid: g.to_dict() for g in buffer.groups()}
    client.fail = lambda url, rid: True
    with pytest.raises(RolloutStepError, match="failed 3 engine calls"):
        await sched.run_step(prompts, current_version=1)
    check_conservation(prompts, [], buffer, discarded=3)  # 3 returned by the first step
    for g in buffer.groups():
        if g.uid in snapshot:  # failed calls appended nothing
            before = snapshot[g.uid]["trajectories"]
            assert [t.response_ids for t in g.trajectories] == [t["response_ids"] for t in before]
    assert not client.running
    client.fail = lambda url, rid: False
    res = await sched.run_step(prompts, current_version=1)
    assert len(res.groups) == 3


@virtual_clock
async def test_reward_error_puts_everything_back():
    async def bad_reward(group):
        raise RuntimeError("judge down")

    sched, client, buffer = make("copris", batch=2, n=2, concurrency=4, reward_fn=bad_reward)
    prompts = Prompts(2)
    with pytest.raises(RolloutStepError, match="judge down"):
        await sched.run_step(prompts, current_version=0)
    check_conservation(prompts, [], buffer)
    assert any(g.complete for g in buffer.groups())
    assert not client.running


@virtual_clock
async def test_exhausted_prompt_source_raises_and_buffers():
    sched, client, buffer = make("copris", batch=4, n=2, concurrency=4)
    prompts = Prompts(2, limit=3)
    with pytest.raises(PromptsExhausted):
        await sched.run_step(prompts, current_version=0)
    check_conservation(prompts, [], buffer)
    assert len(buffer) == 3 and all(g.complete for g in buffer.groups())


@virtual_clock
async def test_adaptive_controller_changes_concurrency():
    class Controller:
        def __init__(self):
            self.targets = iter([8, 8, 3, 3])
            self.seen = []

        def initial(self):
            return 4

        def observe(self, loads, now):
            self.seen.append(sum(load.num_running for load in loads))
            return next(self.targets, 3)

    ctrl = Controller()
    client = FakeClient(token_time=0.004, long_frac=0.5)
    sched, _, buffer = make("copris", client=client, batch=6, n=2, controller=ctrl,
                            load_poll_interval_s=0.02, refill_batch=1)
    res = await sched.run_step(Prompts(2), current_version=0)
    limits = [p.limit for p in sched.last_timeline]
    assert limits[0] == 4 and 8 in limits and limits[-1] == 3
    assert max(p.in_flight for p in sched.last_timeline) == 8
    for p in sched.last_timeline:  # growth fills at once; shrink only stops refilling
        if p.work_remaining and p.limit == 8:
            assert p.in_flight == 8
    assert ctrl.seen and res.metrics["april/concurrency_limit"] == 3


# ====================================================================== faults (issue 7)
def bounded(sched, prompts, version):
    """run_step under the virtual clock, failing instead of hanging if a step never ends."""
    return asyncio.wait_for(sched.run_step(prompts, version), 3600)


def check_settled(client, buffer):
    assert not any(t.status is TrajectoryStatus.RUNNING for g in buffer.groups() for t in g.trajectories)


def test_cancelled_step_with_requests_in_flight_puts_every_group_back():
    """Cancelling run_step while requests are in flight (one engine ignoring aborts) must put
    every group back and let the CancelledError through; nothing else may be raised."""

    async def main():
        client = FakeClient(token_time=0.05)
        client.abort_hangs = {client.engine_urls[1]}
        sched, _, buffer = make("copris", client=client, batch=4, n=2, concurrency=6)
        prompts = Prompts(2)
        for cancel_at in (0.01, 0.2, 0.6, 1.5):
            task = asyncio.get_running_loop().create_task(sched.run_step(prompts, current_version=0))
            await asyncio.sleep(cancel_at)
            assert client.running, "the step must have requests in flight when it is cancelled"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            check_conservation(prompts, [], buffer)
            check_settled(client, buffer)
            assert sched.last_dropped == {}
        await asyncio.sleep(10)  # the detached best-effort aborts end on their own
        res = await bounded(sched, prompts, 0)  # and the scheduler still works
        check_conservation(prompts, [g.uid for g in res.groups], buffer)

    run_virtual(main())


@pytest.mark.parametrize("start_time, left", [
    (0.0, lambda now: 4e-10),  # below asyncio's clock resolution (1 ns)
    # the case seen under fault injection: a clock far from 0 (a float's step at 100 s is 1.4e-14 s)
    # and the deadline one step of the float past it, about 1e-14 s left
    (100.0, lambda now: math.nextafter(now, math.inf) - now),
])
def test_the_drain_ends_when_less_than_the_clock_resolution_is_left(start_time, left):
    """asyncio runs a timer within its clock resolution (1 ns) as due, so a wait for the last
    sliver of the drain deadline returns without the clock moving; on the benchmark's virtual clock
    nothing else moves it, and the drain used to spin there (1.3 M iterations in one step, seen
    under fault injection, ~1e-14 s before the deadline). A drain that reaches such a sliver with a
    call the engine never answers must end, cancel that call and buffer its group. A drain that
    spins fails the test after 1000 waits (``pytest.fail`` is no ``Exception``: the recovery's own
    catch-all cannot swallow it and spin on)."""
    from april_slime.core import scheduler as scheduler_module

    waits = 0
    slivers: list[float] = []
    next_events = scheduler_module._Step._next_events
    drain = scheduler_module._Step._drain

    async def counted(self, timeout=None):
        nonlocal waits
        waits += 1
        if waits >= 1000:
            pytest.fail(f"the drain spins without the clock moving ({waits} waits at {self.ctx.loop.time()!r})")
        return await next_events(self, timeout)

    async def positioned(self, deadline):
        # the deadline placed so that what is left of it when the drain starts is the sliver
        now = self.ctx.loop.time()
        slivers.append(left(now))
        return await drain(self, now + slivers[-1])

    async def main():
        client = FakeClient(token_time=0.01, short=(5, 5), long=(300, 300), long_frac=0.5)
        client.abort_hangs = set(client.engine_urls)  # the engines never answer an abort
        sched, _, buffer = make("april", client=client, batch=1, n=2, over_sampling_factor=4.0)
        scheduler_module._Step._next_events = counted
        scheduler_module._Step._drain = positioned
        try:
            result = await sched.run_step(Prompts(2, max_new_tokens=300), current_version=0)
        finally:
            scheduler_module._Step._next_events = next_events
            scheduler_module._Step._drain = drain
        assert slivers and 0 < slivers[0] < 1e-9, slivers  # the condition was reached
        assert result.metrics["april/drain_cancelled_calls"] >= 1  # cut at the deadline, not lost
        check_settled(client, buffer)

    run_virtual(main(), start_time=start_time)


def test_a_due_groups_hung_request_is_cut_at_the_step_deadline_and_its_group_released():
    """A single-turn group carried with tokens of version 0 is due at version 1 (max_staleness 1);
    one of its requests never answers on an engine that answers everything else. At
    april_step_deadline_s the call is cancelled (its trajectory keeps its tokens) and counted as a
    failed call, and the group no longer holds the step: the step meets its target
    with other groups, the group goes back to the buffer and the next step's staleness fallback
    restarts it. Nothing is lost or duplicated."""

    async def main():
        client = FakeClient(token_time=0.01)
        client.hang = lambda url, rid: rid.startswith("d0/0#")
        sched, _, buffer = make("copris", client=client, batch=2, n=2, concurrency=4, max_staleness=1,
                                step_deadline_s=600.0)
        prompt = [901, 902, 903, 904]
        due = Group(uid="d0", prompt_ids=prompt, created_version=0, trajectories=[
            Trajectory(uid=f"d0/{j}", group_uid="d0", index_in_group=j, prompt_ids=prompt, max_new_tokens=40,
                       sampling_seed=7 + j) for j in range(2)])
        for t in due.trajectories:
            t.append([11, 12], [-0.5, -0.5], 0)
            t.status = TrajectoryStatus.ABORTED
        buffer.put(due)
        prompts = Prompts(2)
        client.version = 1
        res = await bounded(sched, prompts, 1)
        m = res.metrics
        assert m["april/deadline_failed_samples"] == 1 and m["april/deadline_released_groups"] == 1
        assert 600.0 - 1e-3 <= m["april/time_to_target_s"] <= 601.0, m["april/time_to_target_s"]
        assert m["april/engine_errors"] == 0  # a cut call is a failure of its sample, not of its engine
        assert "d0" in buffer and "d0" not in {g.uid for g in res.groups}
        hung = next(g for g in buffer.groups() if g.uid == "d0").trajectories[0]
        assert hung.response_ids[:2] == [11, 12] and hung.status is not TrajectoryStatus.RUNNING
        returned = [g.uid for g in res.groups]
        client.version = 2
        res2 = await bounded(sched, prompts, 2)
        assert res2.metrics["april/stale_restarted_groups"] == 1  # d0, past its bound
        returned += [g.uid for g in res2.groups]
        buffered = [g.uid for g in buffer.groups()]
        assert len(returned) == len(set(returned)) and not set(returned) & set(buffered)
        assert set(returned) | set(buffered) == set(prompts.made) | {"d0"}

    run_virtual(main())


@pytest.mark.parametrize("policy", ["sync", "april", "copris"])
def test_reward_failure_while_an_engine_is_wedged_raises_step_error_and_keeps_everything(policy):
    """Default settings: a reward function fails while one engine no longer answers anything.
    The caller sees RolloutStepError (not TypeError), every group is back in the buffer, and the
    recovery ends at the drain deadline, not at the hour-long request timeout."""

    async def main():
        client = FakeClient(token_time=0.05)
        client.wedged = {client.engine_urls[1]}
        calls = 0

        async def flaky_reward(group):
            nonlocal calls
            calls += 1
            if calls == 2:
                raise RuntimeError("judge down")
            for t in group.trajectories:
                t.reward = 1.0

        sched, _, buffer = make(policy, client=client, batch=4, n=2, concurrency=6, reward_fn=flaky_reward)
        prompts = Prompts(2)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(RolloutStepError, match="judge down"):
            await bounded(sched, prompts, 0)
        assert loop.time() - start <= sched.stall_probe_after_s + sched.probe_timeout_s + sched.drain_timeout_s + 5
        check_conservation(prompts, [], buffer)
        check_settled(client, buffer)

    run_virtual(main())


def _step_times(policy, wedged: bool, steps=4, **kw):
    async def main():
        client = FakeClient(token_time=0.05)
        if wedged:
            client.wedged = {client.engine_urls[1]}
        sched, _, buffer = make(policy, client=client, batch=4, n=2, concurrency=8, **kw)
        prompts = Prompts(2)
        loop = asyncio.get_running_loop()
        times, returned, wedged_calls = [], [], []
        for step in range(steps):
            before = sum(1 for url, *_ in client.calls if url == client.engine_urls[1])
            start = loop.time()
            res = await bounded(sched, prompts, step)
            times.append(loop.time() - start)
            wedged_calls.append(sum(1 for url, *_ in client.calls if url == client.engine_urls[1]) - before)
            returned += [g.uid for g in res.groups]
            check_conservation(prompts, returned, buffer)
            check_settled(client, buffer)
        return times, wedged_calls, sched, client

    return run_virtual(main())


@pytest.mark.parametrize("policy", ["sync", "april", "copris"])
def test_one_wedged_engine_under_default_settings(policy):
    """An engine that accepts requests and never answers (not even aborts or probes): no step may
    take longer than twice a healthy step plus the documented deadline, and from the second step
    on the engine gets no requests until it answers a probe."""
    healthy, _, _, _ = _step_times(policy, wedged=False)
    times, wedged_calls, sched, client = _step_times(policy, wedged=True)
    # the documented deadline: a stalled engine is probed after stall_probe_after_s and given up
    # after probe_timeout_s more; a drain never outlasts drain_timeout_s (shorter)
    deadline = max(sched.stall_probe_after_s + sched.probe_timeout_s, sched.drain_timeout_s)
    assert deadline == 90.0
    assert max(times) <= 2 * max(healthy) + deadline, (times, healthy)
    assert wedged_calls[0] > 0 and wedged_calls[1:] == [0] * (len(times) - 1)
    assert max(times[1:]) <= 2 * max(healthy)
    assert client.probes.count(client.engine_urls[1]) >= len(times) - 1  # probed every step
    assert client.engine_urls[1] in sched.health.excluded


def test_excluded_engine_returns_once_it_answers_a_probe():
    async def main():
        client = FakeClient(token_time=0.05)
        sched, _, buffer = make("copris", client=client, batch=4, n=2, concurrency=8)
        prompts = Prompts(2)
        bad = client.engine_urls[1]
        client.wedged = {bad}
        await bounded(sched, prompts, 0)
        assert bad in sched.health.excluded
        client.wedged = set()
        n_before = len(client.calls)
        res = await bounded(sched, prompts, 1)
        assert bad not in sched.health.excluded
        assert any(url == bad for url, *_ in client.calls[n_before:])
        assert res.metrics["april/engines_excluded"] == 0

    run_virtual(main())


@pytest.mark.parametrize("policy", ["sync", "april"])
def test_an_engine_restarted_at_its_address_takes_its_share_of_the_next_steps_first_calls(policy):
    """An engine whose calls failed (its process died) and that a launcher restarted at the same
    address before the next steps (slime's fault tolerance reuses a free port, often its own): the
    router's list reads the same, so the scheduler and its health stay, with the engine out of
    dispatch. The next step submits every call in its first fill, before a probe running alongside
    could answer: the engine must be back for that fill."""

    async def main():
        client = FakeClient(token_time=0.05)
        sched, _, buffer = make(policy, client=client, batch=2, n=2, concurrency=4, over_sampling_factor=1.0)
        prompts = Prompts(2)
        restarted = client.engine_urls[1]
        client.fail = lambda url, rid: url == restarted  # dead: its calls fail, so do its probes
        client.probe_fails = lambda url: url == restarted
        await bounded(sched, prompts, 0)
        assert restarted in sched.health.excluded
        client.fail = lambda url, rid: False  # restarted, at the same address
        client.probe_fails = lambda url: False
        n_before = len(client.calls)
        res = await bounded(sched, prompts, 1)
        assert restarted not in sched.health.excluded and res.metrics["april/engines_excluded"] == 0
        engines = collections.Counter(url for url, *_ in client.calls[n_before:])
        assert set(engines) == set(client.engine_urls), f"the next step's calls went to {dict(engines)}"

    run_virtual(main())


def test_hung_abort_does_not_hold_up_replies_that_arrived():
    """One engine's /abort_request hangs (its requests still finish on their own): the drain must
    handle the replies as they come, not wait on that abort first."""

    async def main():
        client = FakeClient(token_time=0.05, long=(25, 30))
        client.abort_hangs = {client.engine_urls[0]}
        sched, _, buffer = make("copris", client=client, batch=2, n=2, concurrency=8,
                                abort_timeout_s=120.0)
        prompts = Prompts(2)
        res = await asyncio.wait_for(sched.run_step(prompts, current_version=0), 1000)
        # the longest request takes 30 tokens * 0.05 s; nothing waits on the 120 s abort
        assert res.metrics["april/step_time_s"] <= 30 * 0.05 + 0.5
        check_conservation(prompts, [g.uid for g in res.groups], buffer)

    run_virtual(main())


def test_a_call_the_drains_abort_overtook_is_aborted_again_by_one_abort_per_engine():
    """Calls refilled just before the drain are still in transit when its abort reaches their
    engine; a long one would run on to its natural end (a minute here). When nothing comes back for
    an interval the drain aborts again: once per engine still holding calls, not once per call (at
    N' = 4096 that would be thousands of requests, each on a connection of its own)."""

    async def main():
        client = FakeClient(token_time=0.05, short=(2, 10), long=(1000, 1200), long_frac=0.5)
        client.transit_s = 5.0
        sched, _, buffer = make("copris", client=client, batch=4, n=2, concurrency=16, refill_batch=1,
                                abort_retry_interval_s=1.0, drain_timeout_s=600.0)
        prompts = Prompts(2, max_new_tokens=2000)
        res = await bounded(sched, prompts, 0)
        check_conservation(prompts, [g.uid for g in res.groups], buffer)
        drain_s = res.metrics["april/step_time_s"] - res.metrics["april/time_to_target_s"]
        # the calls in transit were caught within an interval of reaching their engine, not run to their end
        assert drain_s <= client.transit_s + 2.0, f"calls in transit ran on: a drain of {drain_s:.1f} s"
        assert res.metrics["april/drain_cancelled_calls"] == 0
        first = len(client.engine_urls)  # the drain's first abort, one per engine
        again = client.abort_calls[first:]
        assert again, "no call was in transit at the drain's abort: nothing tested"
        assert all(rid is None and abort_all for _, rid, abort_all in client.abort_calls), client.abort_calls
        assert len(again) <= len(client.engine_urls) * (client.transit_s + 1), again  # per engine and interval

    run_virtual(main())


def test_trajectory_rejected_by_every_engine_is_dropped_and_counted():
    client = FakeClient()
    client.reject = lambda url, rid: rid.startswith("p1/1#")

    async def main():
        sched, _, buffer = make("copris", client=client, batch=3, n=2, concurrency=6)
        prompts = Prompts(2)
        returned, dropped = [], {}
        for step in range(3):
            res = await bounded(sched, prompts, step)
            assert len(res.groups) == 3
            returned += [g.uid for g in res.groups]
            dropped.update(res.dropped)
            if step == 0:
                assert res.dropped == {"p1": "rejected_by_engine"}
                assert res.metrics["april/rejected_groups"] == 1
                assert res.metrics["april/rejected_calls"] == 2
            check_conservation(prompts, returned, buffer, discarded=len(dropped))
        assert "p1" not in returned

    run_virtual(main())


def test_a_step_whose_every_call_is_refused_stops_instead_of_dropping_the_dataset():
    """Every request refused (a job whose requests no engine takes): past max(16, 4 * target)
    groups dropped with none accepted, the step ends with the engine's message, and the groups it
    still held go back to the buffer."""
    client = FakeClient()
    client.reject = lambda url, rid: True

    async def main():
        sched, _, buffer = make("copris", client=client, batch=2, n=2, concurrency=4)
        prompts = Prompts(2)
        with pytest.raises(RolloutStepError, match="refused by the engines and none accepted.*HTTP 400"):
            await bounded(sched, prompts, 0)
        dropped = {uid for uid, why in sched.last_dropped.items() if why == "rejected_by_engine"}
        # one past the bound, and the few refused while the step drained its calls in flight
        assert 16 < len(dropped) <= 16 + 1 + 4
        buffered = {g.uid for g in buffer.groups()}
        assert set(prompts.made) == dropped | buffered and not dropped & buffered  # nothing lost
        check_settled(client, buffer)

    run_virtual(main())


def test_rejections_are_remembered_across_steps():
    """A partial rejected once, buffered, and rejected again in the next step is dropped then:
    the count lives with the trajectory (and is saved with the buffer)."""

    async def main():
        client = FakeClient(token_time=0.05)
        sched, _, buffer = make("copris", client=client, batch=1, n=2, concurrency=2)
        prompts = Prompts(2)
        g = prompts.next_groups(1, 0)[0]
        g.trajectories[0].rejected_calls = 1  # rejected in an earlier step (or job)
        buffer.put(g)
        client.reject = lambda url, rid: rid.startswith(f"{g.uid}/0#")
        res = await bounded(sched, prompts, 0)
        assert res.dropped == {g.uid: "rejected_by_engine"}
        assert res.metrics["april/rejected_calls"] == 1

    run_virtual(main())


def test_weights_changed_mid_call_give_exact_per_token_versions():
    async def main():
        client = FakeClient(token_time=0.01)
        client.version = 1
        client.split_versions = True
        sched, _, buffer = make("sync", client=client, batch=2, n=2)
        res = await bounded(sched, Prompts(2), 1)
        for g in res.groups:
            for t in g.trajectories:
                n = t.response_length
                assert t.token_versions() == [0] * (n // 2) + [1] * (n - n // 2)
                assert t.call_versions == [1]
                assert client.expected(t) == (t.response_ids, t.logprobs)

    run_virtual(main())


def test_abort_racing_a_stop_token_is_finished():
    """SGLang may answer "abort" for a request whose last token is EOS: that sample is complete
    and must never be resumed past its stop."""

    async def main():
        client = FakeClient(token_time=0.02)
        client.eos_on_abort = 2
        sched, _, buffer = make("copris", client=client, batch=2, n=2, concurrency=8, eos_token_id=2)
        prompts = Prompts(2)
        res = await bounded(sched, prompts, 0)
        assert res.metrics["april/stop_token_finishes"] > 0
        for g in [*res.groups, *buffer.groups()]:
            for t in g.trajectories:
                if t.response_ids and t.response_ids[-1] == 2:
                    assert t.status is TrajectoryStatus.COMPLETED and t.finish_reason == "stop"
        # a buffered sample that already ends in a stop id is not resubmitted
        client.calls.clear()
        await bounded(sched, prompts, 1)
        ended = {t.uid for g in buffer.groups() for t in g.trajectories if t.response_ids[-1:] == [2]}
        assert not any(rid.split("#")[0] in ended for _, rid, _, _ in client.calls)

    run_virtual(main())


@pytest.mark.parametrize("policy", ["april", "copris"])
def test_abort_racing_the_budget_is_a_truncation(policy):
    """SGLang answers "abort" for a request aborted after its last allowed token: the response is
    as long as it may be. It is TRUNCATED with finish_reason "length" (a generate function reads
    that reason in the reply the plugin builds, and must never read an abort the plugin caused)."""

    async def main():
        client = FakeClient(token_time=0.02)
        client.abort_at_budget = True
        sched, _, buffer = make(policy, client=client, batch=2, n=2, concurrency=8)
        res = await bounded(sched, Prompts(2, max_new_tokens=40), 0)
        assert client.budget_aborts > 0  # the race happened
        every = [t for g in [*res.groups, *buffer.groups()] for t in g.trajectories]
        raced = [t for t in every if t.response_length == 40 and t.finish_reason != "stop"]
        assert len(raced) >= client.budget_aborts
        for t in raced:
            assert t.status is TrajectoryStatus.TRUNCATED and t.finish_reason == "length", t.uid
        assert not any(t.finish_reason == "abort" for t in every if t.status.finished)

    run_virtual(main())


@pytest.mark.parametrize("stop", [2, 7])  # the EOS id, a stop_token_ids entry
def test_a_buffered_partial_ending_in_a_stop_id_is_finished_without_a_call(stop):
    """A buffered partial whose response already ends in EOS or a stop id (buffered by a version
    that did not finish it, or under other stop ids) is complete: the step finishes it without a
    model call, never resumes it past its stop."""

    async def main():
        client = FakeClient()
        buffer = PartialBuffer()
        prompts = Prompts(2)
        group = prompts.next_groups(1, 0)[0]
        ended, partial = group.trajectories
        for t, last in ((ended, stop), (partial, 11)):
            t.append([9, 10, last], [-0.5, -0.25, -0.125], 0)
            t.status, t.finish_reason = TrajectoryStatus.ABORTED, "abort"
        buffer.put(group)
        sched = RolloutScheduler(AprilConfig.from_dict({"policy": "sync"}), client, buffer, rollout_batch_size=1,
                                 n_samples_per_prompt=2, eos_token_id=2, sampling_params={"stop_token_ids": [7]})
        res = await bounded(sched, prompts, 1)
        assert [g.uid for g in res.groups] == [group.uid]
        called = {rid.split("#")[0] for _, rid, _, _ in client.calls}
        assert ended.uid not in called and partial.uid in called  # the other one is resumed
        assert ended.status is TrajectoryStatus.COMPLETED and ended.finish_reason == "stop"
        assert ended.response_ids == [9, 10, stop]
        assert res.metrics["april/stop_token_finishes"] == 1

    run_virtual(main())


def test_stop_ids_come_from_sampling_params_and_eos_unless_ignored():
    client = FakeClient()
    config = AprilConfig.from_dict({"policy": "sync"})
    kw = dict(rollout_batch_size=1, n_samples_per_prompt=1)
    sched = RolloutScheduler(config, client, PartialBuffer(), sampling_params={"stop_token_ids": [7, 8]},
                             eos_token_id=2, **kw)
    assert sched.stop_token_ids == {2, 7, 8}
    sched = RolloutScheduler(config, client, PartialBuffer(), eos_token_id=2,
                             sampling_params={"ignore_eos": True}, **kw)
    assert sched.stop_token_ids == set()


def test_out_of_vocabulary_prompt_never_reaches_the_engine():
    """The engine client checks every id against the vocabulary before sending (on SGLang one
    such id kills the engine); the group is dropped and counted, the step completes."""

    async def main():
        async with start_cluster(num_engines=2, seed=3, time_scale=1.0, http=False, length="short") as running:
            vocab = running.cluster.model.vocab_size
            client = EngineClient(running.engine_urls, transport=running.transport, vocab_size=vocab)
            sent = []
            original = running.transport.request

            async def spy(method, url, path, payload, timeout_s):
                if path == "/generate":
                    sent.append(list(payload["input_ids"]))
                return await original(method, url, path, payload, timeout_s)

            running.transport.request = spy
            sched, _, buffer = make("copris", client=client, batch=3, n=2, concurrency=6)
            prompts = EmuPrompts(2, max_new_tokens=32)
            bad = prompts.next_groups(1, 0)[0]
            for t in bad.trajectories:
                t.prompt_ids = t.prompt_ids[:-1] + [vocab]
            buffer.put(bad)
            res = await bounded(sched, prompts, 0)
            assert res.dropped == {bad.uid: "rejected_by_engine"}
            assert all(max(ids) < vocab for ids in sent)
            check_conservation(prompts, [g.uid for g in res.groups], buffer, discarded=1)

    run_virtual(main())


# ====================================================================== emulator over HTTP

EMU_SEED = 11
TIME_SCALE = 10.0


class EmuPrompts(Prompts):
    """Six-token prompts (the emulator keys a prompt on its first four tokens)."""

    def next_groups(self, k, current_version):
        groups = super().next_groups(k, current_version)
        for g in groups:
            i = int(g.uid[1:])
            g.prompt_ids = numbered_prompt(i, (5, 6))
            for t in g.trajectories:
                t.prompt_ids = list(g.prompt_ids)
        return groups


class FlakyTransport(HttpTransport):
    """Real HTTP, except that generate calls to the engines in ``broken`` cannot connect."""

    def __init__(self):
        super().__init__()
        self.broken: set[str] = set()

    async def request(self, method, url, path, payload, timeout_s):
        if path == "/generate" and url in self.broken:
            raise ConnectionError(f"{url} refused the connection")
        return await super().request(method, url, path, payload, timeout_s)


@pytest.fixture
async def emulator():
    async with start_cluster(num_engines=2, seed=EMU_SEED, time_scale=TIME_SCALE, length="short") as running:
        transport = FlakyTransport()
        client = await EngineClient.from_router(running.router_url, transport=transport, timeout_s=60.0,
                                                max_retries=1, retry_backoff_s=0.01)
        try:
            yield running, client, transport
        finally:
            await client.close()
            await transport.close()


def check_reference(model, t: Trajectory):
    ids, lps = model.reference(t.prompt_ids, t.sampling_seed, len(t.prompt_ids), t.token_versions())
    assert t.response_ids == ids
    assert t.logprobs == pytest.approx(lps, abs=0, rel=1e-12)


@pytest.mark.parametrize("policy", ["sync", "april", "copris"])
@virtual_clock
async def test_emulator_policies_exact_batches_and_reference_streams(policy):
    """On the virtual clock, so which requests the abort catches mid-way is the same on any
    machine: partials and resumes across weight updates are there to check, not left to timing."""
    async with start_cluster(num_engines=2, seed=EMU_SEED, time_scale=1.0, http=False, length="short") as running:
        client = await EngineClient.from_router(running.router_url, transport=running.transport, timeout_s=60.0,
                                                max_retries=1, retry_backoff_s=0.01)
        try:
            await _policies_exact_batches_and_reference_streams(running, client, policy)
        finally:
            await client.close()


async def _policies_exact_batches_and_reference_streams(running, client, policy):
    model = running.cluster.model
    refill = {"refill_batch": 1} if policy == "copris" else {}  # N' exactly, every completion refilled
    sched, _, buffer = make(policy, client=client, batch=4, n=2, concurrency=6, **refill)
    prompts = EmuPrompts(2, max_new_tokens=96)
    returned, multi_version, partials = [], 0, 0
    for step in range(3):
        res = await sched.run_step(prompts, current_version=step)
        assert len(res.groups) == 4 and all(g.complete for g in res.groups)
        returned += [g.uid for g in res.groups]
        check_conservation(prompts, returned, buffer)
        # count the partials the aborts left over every step
        partials += sum(1 for g in buffer.groups() for t in g.trajectories
                        if t.response_length and not t.status.finished)
        for g in [*res.groups, *buffer.groups()]:
            for t in g.trajectories:
                check_reference(model, t)
                multi_version += len(t.version_runs) > 1
        if policy == "copris":
            tl = sched.last_timeline
            assert all(p.in_flight <= 6 for p in tl)
            assert all(p.in_flight == 6 for p in tl if p.work_remaining)
        assert running.cluster.bump_weight_version() == step + 1
    if policy != "sync":
        assert partials > 0
        assert multi_version > 0, "no sample was resumed across a weight update"
    else:
        assert len(buffer) == 0


async def test_emulator_staleness_bound_and_filter(emulator):
    running, client, _ = emulator
    rejected = []

    def keep(group):
        ok = sum(t.response_length for t in group.trajectories) % 4 != 0
        if not ok:
            rejected.append(group.uid)
        return ok

    sched, _, buffer = make("copris", client=client, batch=3, n=2, concurrency=10, max_staleness=1,
                            group_filter=keep)
    prompts = EmuPrompts(2, max_new_tokens=128)
    returned = []
    for step in range(4):
        res = await sched.run_step(prompts, current_version=step)
        assert len(res.groups) == 3 and all(keep(g) for g in res.groups)
        for g in res.groups:
            for t in g.trajectories:
                assert t.staleness(step) <= 1
                check_reference(running.cluster.model, t)
        # pacing, not the restart fallback, kept the bound (a healthy emulator never needs it)
        assert res.metrics["april/stale_fallback_groups"] == 0
        assert res.metrics["april/token_staleness_max"] <= 1
        returned += [g.uid for g in res.groups]
        check_conservation(prompts, returned, buffer, discarded=len(set(rejected)))
        running.cluster.bump_weight_version()
    assert buffer.restarted_groups == buffer.dropped_groups == 0


async def test_emulator_engine_failure_mid_step(emulator):
    running, client, transport = emulator
    sched, _, buffer = make("copris", client=client, batch=4, n=2, concurrency=6,
                            max_failures_per_trajectory=2)
    prompts = EmuPrompts(2, max_new_tokens=96)
    await sched.run_step(prompts, current_version=0)
    transport.broken = {client.engine_urls[0]}
    running.cluster.bump_weight_version()
    res = await sched.run_step(prompts, current_version=1)  # engine 1 carries the step alone
    assert len(res.groups) == 4
    assert res.metrics["april/engine_errors"] >= 1
    returned = [g.uid for g in res.groups]
    check_conservation(prompts, returned, buffer, discarded=4)
    for g in [*res.groups, *buffer.groups()]:
        for t in g.trajectories:
            check_reference(running.cluster.model, t)
    # every engine down: a clear error, and every group is still somewhere, unchanged
    transport.broken = set(client.engine_urls)
    before = {g.uid: [t.response_ids for t in g.trajectories] for g in buffer.groups()}
    with pytest.raises(RolloutStepError, match="failed 3 engine calls"):
        await sched.run_step(prompts, current_version=1)
    check_conservation(prompts, returned, buffer, discarded=4)
    for g in buffer.groups():
        if g.uid in before:
            assert [t.response_ids for t in g.trajectories] == before[g.uid]
    transport.broken = set()
    res = await sched.run_step(prompts, current_version=1)
    assert len(res.groups) == 4


# ====================================================================== wiring from slime's rollout
def test_vocabulary_size_from_the_tokenizer_when_no_model_config():
    from april_slime.model_files import vocab_size

    class Tok:
        def __len__(self):
            return 321

    assert vocab_size("/nonexistent", Tok()) == 321
    assert vocab_size("/nonexistent", object()) is None


def test_eos_ids_from_the_tokenizer_and_generation_config(tmp_path):
    from april_slime.model_files import eos_token_ids

    class Tok:
        eos_token_id = 5

    sched = RolloutScheduler(AprilConfig.from_dict({"policy": "sync"}), FakeClient(), PartialBuffer(),
                             rollout_batch_size=1, n_samples_per_prompt=1, sampling_params={},
                             eos_token_id=[5, 7])
    assert sched.stop_token_ids == {5, 7}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 5]}')
    try:
        import transformers  # noqa: F401
    except ImportError:  # the fast tier: the tokenizer's id only
        assert eos_token_ids(str(tmp_path), Tok()) == [5]
    else:
        assert eos_token_ids(str(tmp_path), Tok()) == [5, 7]


def test_groups_completing_during_the_drain_are_rewarded_and_judged_as_surplus():
    """Requests on an engine that ignores the abort finish on their own during the drain: their
    groups are surplus like any other (rewarded, judged), not buffered unrewarded."""

    async def main():
        async def reward(group):
            await asyncio.sleep(0.01)
            for t in group.trajectories:
                t.reward = 1.0

        client = FakeClient(token_time=0.02, long_frac=0.5)
        client.abort_hangs = {client.engine_urls[0]}
        sched, _, buffer = make("copris", client=client, batch=2, n=2, concurrency=12, reward_fn=reward)
        res = await bounded(sched, Prompts(2), 0)
        complete = [g for g in buffer.groups() if g.complete]
        assert complete and res.metrics["april/surplus_groups"] == len(complete)
        assert all(t.reward == 1.0 for g in complete for t in g.trajectories)

    run_virtual(main())
