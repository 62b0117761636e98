"""A real SGLang engine SIGKILLed mid-rollout: two SGLang 0.5.23 CPU engines of this module's own
behind the router, the plugin inside slime's rollout path (copris and april), weights pushed
before every step. One engine is killed (its process group, by the PID this module started) while
requests of a step generate on it, and, for april, once more while the abort at the target is on
its way to it. After every step the ledger holds: every group handed out is delivered once,
buffered, or dropped with a counted reason. Every call the dead engine held is counted
(``april/engine_fault_lost_calls``) with an estimate of its lost tokens, and sent again to the live
engine, continuing exactly the tokens its sample had; the partials buffered by earlier steps keep
their tokens and are resumed; the engine restarted on its port takes requests again.

Events are placed, not timed: the mid-generation kill waits until the engine's loads show
requests running with tokens generated; the kill at the abort is made inside the client's abort
request, and only when the engine holds requests of the step then. A step where the placement
missed (the requests ended first) is made again, with the engine restarted if it was killed.

These engines are this module's, not the session's ``real_stack`` (which other tests share and a
kill would break)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from april_slime import rollout
from april_slime.core import engine as engine_module
from april_slime.core.transport import HttpTransport
from april_workbench.localstack import LocalEngine
from tests.support.engine_kill import CallLog, GroupLedger, RecordingTransport
from tests.support.real_tier import (
    LocalStack,
    Placement,
    RealStack,
    SlimeRolloutManager,
    build_tiny_qwen3,
    engine_loads,
    local_stack,
    plugin_args,
    post_ok,
    prompt_token_bound,
)

BATCH, N = 4, 2
# EOS about once in 100 tokens and a budget of 192: requests generate for a few seconds on these
# engines, so a step's requests are still running when the kill (or the target) comes
MAX_LEN, EOS_RATE = 192, 1 / 100
MAX_RUNNING, MAX_TOTAL_TOKENS = 16, 32768
ATTEMPTS = 3  # steps a kill may be tried in before the test gives up
M = "april/"


@dataclass
class KillStack:
    """Two engines and the router, with the weights they serve, and the engine that gets killed."""

    stack: LocalStack
    weights: list[Path]  # A, B
    logs: Path
    version: int = 0
    serving: Path | None = None
    kills: list[float] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)

    @property
    def real(self) -> RealStack:
        return RealStack(self.stack, self.weights[0], self.weights[1])

    @property
    def victim(self) -> LocalEngine:
        return self.stack.engines[0]

    @property
    def victim_url(self) -> str:
        return self.stack.engine_urls[0]

    def alive_at(self, url: str, t: float) -> bool:
        """Whether ``url`` served at time ``t`` (the victim: not between a kill and its restart)."""
        if url != self.victim_url:
            return True
        down = max((k for k in self.kills if k <= t), default=None)
        return down is None or any(down < r <= t for r in self.restarts)

    def alive(self) -> list[str]:
        return [url for e, url in zip(self.stack.engines, self.stack.engine_urls) if e.pid is not None]

    def kill(self) -> float:
        """SIGKILL the victim's whole process group (its HTTP server, scheduler and detokenizer
        at once, as when its node dies) by the PID this module started; returns when."""
        pid = self.victim.pid
        assert pid is not None, "the victim is not running"
        at = time.monotonic()
        os.killpg(pid, signal.SIGKILL)
        self.victim.stop()  # reaps it
        self.kills.append(at)
        return at

    def restart(self) -> None:
        """The victim back on its port (the router still lists that URL), serving what the other
        engine serves, under the same version."""
        if self.victim.pid is not None:
            return
        engine = LocalEngine(self.serving or self.weights[0], port=self.victim.port, weight_version=self.version,
                             max_running_requests=MAX_RUNNING, max_total_tokens=MAX_TOTAL_TOKENS,
                             log_path=self.logs / f"victim-{len(self.kills)}.log")
        self.stack.engines[0] = engine.start()
        self.restarts.append(time.monotonic())

    def push(self) -> int:
        """What slime's weight update does before a step: once the live engines are idle, each loads
        the other weights under the next version."""
        urls = self.alive()
        deadline = time.monotonic() + 120
        while sum(load["num_running_reqs"] + load["num_waiting_reqs"] for load in engine_loads(urls)):
            assert time.monotonic() < deadline, "engines still busy before the weight push"
            time.sleep(0.1)
        self.version += 1
        self.serving = self.weights[self.version % 2]
        for url in urls:
            reply = post_ok(f"{url}/update_weights_from_disk", {"model_path": str(self.serving),
                                                               "weight_version": str(self.version)})
            assert reply["success"], reply
        return self.version


@pytest.fixture(scope="module")
def kill_stack(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("engine-kill")
    a = build_tiny_qwen3(root / "a", eos_rate=EOS_RATE, seed=0)
    b = build_tiny_qwen3(root / "b", tokenizer=AutoTokenizer.from_pretrained(a), eos_rate=EOS_RATE, seed=1)
    with local_stack(a, n_engines=2, max_running_requests=MAX_RUNNING, max_total_tokens=MAX_TOTAL_TOKENS,
                     log_dir=root / "logs") as stack:
        yield KillStack(stack, [a, b], root / "logs")


@dataclass
class Job:
    """The plugin's job in slime's rollout path, and what the test keeps outside it."""

    m: SlimeRolloutManager
    log: CallLog
    ledger: GroupLedger
    aborts: list[tuple[float, str]]  # (when, engine) of every abort-all the client sent
    transports: list[RecordingTransport]  # one per engine client the plugin built
    steps: list[dict] = field(default_factory=list)


def start_job(kill_stack: KillStack, tmp_path: Path, monkeypatch, settings: dict) -> Job:
    log, aborts = CallLog(), []
    transports: list[RecordingTransport] = []

    def recording_transport() -> RecordingTransport:
        t = RecordingTransport(HttpTransport(), log, clock=time.monotonic)  # the kills' clock
        t.on_request = lambda method, url, path, payload: (
            aborts.append((time.monotonic(), url)) if path == "/abort_request" and (payload or {}).get("abort_all")
            else None)
        transports.append(t)
        return t

    # the client the plugin builds (``EngineClient.from_router``) sends through this transport
    monkeypatch.setattr(engine_module, "HttpTransport", recording_transport)
    m = SlimeRolloutManager(plugin_args(kill_stack.real, tmp_path, settings=settings, batch=BATCH, n=N,
                                        max_len=MAX_LEN, prompts=256))
    ledger = GroupLedger()
    source = m.data_source
    hand_out = source.next_groups

    def next_groups(n, current_version):
        groups = hand_out(n, current_version)
        ledger.handed_out.update(g.uid for g in groups)
        return groups

    source.next_groups = next_groups
    return Job(m, log, ledger, aborts, transports)


def sample_partials(data_source) -> dict[int, tuple[list[int], list[float]]]:
    """Buffered trajectories holding tokens, by slime sample index: (response ids, log-probs)."""
    return {g.payload["indices"][t.index_in_group]: (list(t.response_ids), list(t.logprobs))
            for g in data_source.buffer.groups() for t in g.trajectories if t.response_ids}


def run_step(kill_stack: KillStack, job: Job, place=None) -> dict:
    """One rollout step after a weight push, with the ledger and the buffered partials checked;
    ``place()``: a ``Placement`` started once the engines are idle and updated."""
    version = kill_stack.push()
    placement = place() if place is not None else None
    before = sample_partials(job.m.data_source)
    start = time.monotonic()
    try:
        samples, metrics, _ = job.m.generate(len(job.steps))
    finally:
        placed = placement.finish() if placement is not None else False
    end = time.monotonic()
    assert metrics[M + "policy_version"] == version
    source = job.m.data_source
    job.ledger.delivered += sorted({str(s.group_index) for s in samples})
    job.ledger.dropped.update(rollout._RUNTIME.scheduler.last_dropped)
    buffered = {g.uid for g in source.buffer.groups()}
    job.ledger.check(buffered, f"step {len(job.steps)}")
    # every partial buffered before the step starts with the same tokens now, trained or buffered
    now = {s.index: (list(s.tokens[len(s.tokens) - s.response_length:]), list(s.rollout_log_probs))
           for s in samples}
    now.update(sample_partials(source))
    resumed = 0
    for index, (ids, lps) in before.items():
        if index in now:
            got_ids, got_lps = now[index]
            assert got_ids[:len(ids)] == ids and got_lps[:len(lps)] == lps, f"sample {index} lost its buffered tokens"
            resumed += len(got_ids) > len(ids)
    step = {"start": start, "end": end, "metrics": metrics, "placed": placed, "resumed": resumed,
            "buffered_partials": len(before), "samples": len(samples)}
    job.steps.append(step)
    return step


def check_kill(kill_stack: KillStack, job: Job, killed_at: float, kill_step: dict, where: str) -> dict:
    """What every kill must show in its step: the calls it took (its requests running at the kill,
    and any sent before the engine was out of dispatch), each counted, and an estimate of their
    tokens; returns its numbers (``failed``: rid -> last attempt, checked by ``check_resent``)."""
    failed = job.log.failed_calls(kill_stack.victim_url, killed_at, kill_step["end"])
    running = job.log.running_at(kill_stack.victim_url, killed_at) & set(failed)
    assert running, f"{where}: no call was running on the engine when it was killed"
    metrics = kill_step["metrics"]
    assert metrics[M + "engine_fault_lost_calls"] == len(failed), (where, len(failed), metrics)
    # what the engine had generated for them is gone; the step says how much, as an estimate
    est, most = metrics[M + "engine_fault_lost_tokens_est"], metrics[M + "engine_fault_lost_tokens_max"]
    assert 0 < est <= most, (where, est, most)
    assert metrics[M + "engine_fault_lost_call_s"] > 0
    return {"where": where, "killed_at": killed_at, "failed": failed, "running_at_kill": len(running),
            "lost_calls": len(failed), "tokens_est": round(est), "tokens_max": round(most),
            "engine_s": round(metrics[M + "engine_fault_lost_call_s"], 2)}


def unsent(job: Job, kill: dict) -> list[str]:
    return [rid for rid in kill["failed"] if job.log.next_call(rid) is None]


def check_resent(kill_stack: KillStack, job: Job, kill: dict) -> None:
    """Every call the kill took was sent again, to an engine alive then (the other one, or the
    victim once restarted), continuing exactly the tokens its sample had: a call's input is its
    prompt and partial response, so the same length (the lost call added nothing, and nothing was
    dropped)."""
    where, killed_at = kill["where"], kill["killed_at"]
    delays = []
    for rid, attempt in kill["failed"].items():
        again = job.log.next_call(rid)
        assert again is not None, f"{where}: {rid}, lost with the engine, was never sent again"
        assert again.sent >= killed_at and kill_stack.alive_at(again.url, again.sent), (where, rid, again)
        assert again.input_len == attempt.input_len, f"{where}: {rid} did not continue its own tokens"
        delays.append(again.sent - killed_at)
    # the lost calls that continued a partial response (from an earlier call or step): its tokens
    # were kept and sent again
    kept = [a.input_len - job.log.first_call(rid).input_len for rid, a in kill["failed"].items()]
    kill["lost_calls_continuing_a_partial"] = sum(k > 0 for k in kept)
    kill["partial_tokens_kept"] = sum(kept)
    kill["resent_to_live"] = len(delays)
    kill["resent_after_s"] = (round(min(delays), 1), round(max(delays), 1))


def kill_mid_generation(kill_stack: KillStack, job: Job, prompt_tokens: int) -> dict:
    """A step in which the victim is killed while it generates for the step's calls, before the
    step's abort at the target reaches it: once its loads show two requests running with 8 tokens
    generated each (on average). Made again (the engine restarted first where it was killed) when
    the kill missed: the poll never saw such a moment, no call of the step was running on the
    engine at the kill, or the step's abort had reached it first."""
    victim = kill_stack.victim_url

    def aborted_since(t0: float, t: float) -> bool:
        return any(t0 <= when <= t and url == victim for when, url in job.aborts)

    for _ in range(ATTEMPTS):
        kill_stack.restart()
        seen: dict = {}

        def kill(seen: dict = seen) -> None:
            if aborted_since(seen["t0"], time.monotonic()):
                return  # the target came first: not a kill mid-generation
            seen["loads"] = engine_loads([victim])[0]
            seen["at"] = kill_stack.kill()

        def place(seen: dict = seen, kill=kill) -> Placement:
            seen["t0"] = time.monotonic()  # the step starts: the engines are idle and updated
            return Placement([victim], kill, running=2, tokens_each=8, prompt_tokens=prompt_tokens)

        step = run_step(kill_stack, job, place)
        if "at" not in seen or aborted_since(seen["t0"], seen["at"]):
            continue
        failed = job.log.failed_calls(victim, seen["at"], step["end"])
        if job.log.running_at(victim, seen["at"]) & set(failed):
            out = check_kill(kill_stack, job, seen["at"], step, "mid-generation")
            out["kv_tokens_in_use_at_kill"] = seen["loads"]["num_used_tokens"]
            return out
    raise AssertionError(f"in {ATTEMPTS} steps no kill landed while a call generated on the engine before "
                         "the target")


def kill_at_the_abort(kill_stack: KillStack, job: Job) -> dict:
    """A step in which the victim is killed when the client's abort-all at the target is about to
    reach it, provided requests of the step run on it then (its loads and the client agree)."""
    for _ in range(ATTEMPTS):
        kill_stack.restart()
        seen: dict = {}
        victim = kill_stack.victim_url

        def at_abort(method, url, path, payload, seen: dict = seen, victim: str = victim) -> None:
            if path == "/abort_request" and (payload or {}).get("abort_all"):
                job.aborts.append((time.monotonic(), url))
                if url == victim and not seen and job.log.in_flight(victim):
                    load = engine_loads([victim])[0]
                    if load["num_running_reqs"] > 0:
                        seen["loads"], seen["at"] = load, kill_stack.kill()

        for t in job.transports:
            t.on_request = at_abort
        step = run_step(kill_stack, job)
        if seen:
            out = check_kill(kill_stack, job, seen["at"], step, "at the abort")
            out["running_reqs_at_kill"] = seen["loads"]["num_running_reqs"]
            return out
    raise AssertionError(f"in {ATTEMPTS} steps the abort at the target never reached the engine while it ran a call")


@pytest.mark.parametrize("policy", ["copris", "april"])
def test_engine_killed_mid_rollout(kill_stack, tmp_path, monkeypatch, policy):
    settings = ({"april_policy": "copris", "april_concurrency": 8} if policy == "copris"
                else {"april_policy": "april", "april_over_sampling_factor": 2.0})
    kill_stack.restart()  # a previous test's kill
    job = start_job(kill_stack, tmp_path, monkeypatch, settings)
    report = []
    try:
        prompt_tokens = prompt_token_bound(kill_stack.real, job.m.manager.args.prompt_data)
        run_step(kill_stack, job)
        report.append(kill_mid_generation(kill_stack, job, prompt_tokens))
        # the engine stays dead for a step: nothing is sent to it, the partials resume on the other
        dead = run_step(kill_stack, job)
        assert not [a for a in job.log.to(kill_stack.victim_url) if a.sent >= dead["start"]]
        assert dead["metrics"][M + "engine_fault_lost_calls"] == 0
        kill_stack.restart()
        # back in dispatch once its health probe answers (at the start of the next step); april
        # places a step's calls at its start, so they may all go to the other engine first
        for _ in range(3):
            back = run_step(kill_stack, job)
            if [a for a in job.log.to(kill_stack.victim_url) if a.sent >= back["start"]]:
                break
        else:
            raise AssertionError("the restarted engine took no request in 3 steps")
        if policy == "april":
            report.append(kill_at_the_abort(kill_stack, job))
        # a call the kill took during a drain waits in the buffer with its group, and a buffered
        # group is opened when the policy has room: a few steps at most
        for _ in range(3):
            if not any(unsent(job, kill) for kill in report):
                break
            run_step(kill_stack, job)
        for kill in report:
            check_resent(kill_stack, job, kill)
    finally:
        rollout.shutdown()
        kill_stack.restart()
    resumed = sum(s["resumed"] for s in job.steps)
    assert resumed > 0, "no buffered partial was resumed"
    buffered = {g.uid for g in job.m.data_source.buffer.groups()}
    print(f"\n{policy}: {len(job.steps)} steps; {job.ledger.summary(buffered)}; {resumed} buffered partials "
          f"resumed with their tokens")
    for r in report:
        shown = {k: v for k, v in r.items() if k not in ("where", "failed", "killed_at")}
        print(f"{policy}, killed {r['where']}: {shown}")
