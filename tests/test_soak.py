"""Fault-injection soak of the rollout side, with a ledger kept outside the scheduler.

Part 1 (virtual clock, in-process emulator): ``SOAK_STEPS`` rollout steps of the production
scheduler on ``AprilDataSource`` (slime's data source: the stand-in here, or real slime), every
step with faults armed from every class below, and checkpoints whose saves are killed at every
save point in turn, each followed by a restart from the last complete checkpoint, under slime's
``train.py`` and ``train_async.py`` orders alternately. Fault classes:

  http_5xx, hang (a generate that never answers), engine_kill (an engine drops every connection
  and restarts after a while), wedged_engine (accepts requests, answers nothing, for a while),
  malformed (no meta_info, NaN log-prob, count mismatch), wrong (positive log-prob, another rid's
  reply, an out-of-vocabulary output token, version spans that do not cover the output, more
  tokens than asked), abort_fail (HTTP 500), abort_hang, reject_4xx, oov_prompt (a prompt with an
  id outside the vocabulary: must never reach an engine), cancel (run_step cancelled mid-way),
  reward_fail, plus a group filter that rejects some groups.

After every step (successful, failed, cancelled or restarted) the ledger checks that every group
handed out by the prompt source is in exactly one place: delivered once (trained), in the buffer,
or dropped with a reason the scheduler reported and counted. Every delivered and buffered token
is checked against the emulator's reference stream (so no malformed reply ever reached a sample).

Part 2 (real HTTP, real processes): two emulator engine processes; one is SIGKILLed during a
step and restarted on the same port, the ledger checked after every step.

Part 3 (episodes, real time): a slime job whose samples come from a multi-turn generate function
(``tests.support.agent_functions.multi_turn``: its calls go through the episode front over HTTP,
so it cannot run on part 1's virtual clock) runs ``EPISODE_STEPS`` steps of ``generate_rollout``
(``APRIL_SOAK_EPISODE_STEPS``, default 16)
with engine faults armed per step from the classes a real-time step gets over quickly (no hang or
wedge: those wait out deadlines of tens of seconds), function faults armed on the next prompts
(a function raises, hangs in its tool past ``april_episode_tool_timeout_s``, or alters a token
of its calls: re-run, or given up with its group), and one checkpoint, death and restore in the
middle. The same ledger is checked after every step, every model token of every trained or
buffered finished episode is checked against the emulator's reference stream, and the restore
restarts exactly its unfinished episodes (``restarted``).

The figures of a run (steps, faults injected per class, step times) are printed with ``-s``;
``APRIL_SOAK_STEPS`` changes the number of steps (CI default: 1000).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from april_slime import rollout
from april_slime.core import checkpoint
from april_slime.core.buffer import PartialBuffer
from april_slime.core.config import AprilConfig
from april_slime.core.engine import EngineClient
from april_slime.core.jsonfile import StateFileError
from april_slime.core.keys import TOKEN_VERSIONS_KEY
from april_slime.core.ledger import DROP_EPISODE_FAILED
from april_slime.core.scheduler import RolloutScheduler, RolloutStepError
from april_slime.core.sglang_protocol import EngineError
from april_slime.core.transport import HttpTransport, TransportHTTPError
from april_slime.core.types import Group, TrajectoryStatus
from april_slime.samples import sampling_seed
from april_workbench.emulator.model import LengthModel, SyntheticLM
from april_workbench.emulator.testing import start_cluster
from april_workbench.emulator.vclock import run_virtual
from tests.support import agent_functions as af
from tests.support.agent_functions import check_sample, expand
from tests.support.engine_kill import GroupLedger
from tests.support.numbered_prompts import NumberedPrompts
from tests.support.slime_jobs import Cluster, loop_run, make_args, point_at

SOAK_STEPS = int(os.environ.get("APRIL_SOAK_STEPS", "1000"))
SEED = 20261123
N_SAMPLES, BATCH, MAX_LEN = 2, 3, 48
CHECKPOINT_EVERY = 6
LENGTH = LengthModel(median_tokens=14.0, prompt_sigma=0.5, truncation_fraction=0.1)

FAULTS = ("http_5xx", "hang", "engine_kill", "wedged_engine", "malformed", "wrong", "abort_fail",
          "abort_hang", "reject_4xx", "oov_prompt", "cancel", "reward_fail")


class Killed(BaseException):
    """A kill at a save point: derives from BaseException only, so nothing cleans up after it
    (the disk is left exactly as a SIGKILL there leaves it, see april_slime.core.checkpoint)."""


# ====================================================================== the faulty engines
class FaultyTransport:
    """The emulator's in-process transport with faults injected per request, as armed per step."""

    def __init__(self, running, rng: random.Random, vocab: int):
        self.inner = running.transport
        self.cluster = running.cluster
        self.urls = list(running.engine_urls)
        self.rng = rng
        self.vocab = vocab
        self.armed: set[str] = set()
        self.down_until: dict[str, float] = {}
        self.wedged_until: dict[str, float] = {}
        self.epoch = Counter()  # url -> kills so far (a request across a kill loses its connection)
        self.injected: Counter[str] = Counter()
        self.oov_sent = 0

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def _fire(self, fault: str, p: float) -> bool:
        if fault in self.armed and self.rng.random() < p:
            self.injected[fault] += 1
            return True
        return False

    def kill(self, url: str, for_s: float) -> None:
        self.down_until[url] = self.now() + for_s
        self.epoch[url] += 1
        self.cluster.engines[self.urls.index(url)].abort(abort_all=True)  # its state dies with it

    async def request(self, method, url, path, payload, timeout_s):
        url = url.rstrip("/")
        if path == "/generate" and payload and max(payload["input_ids"]) >= self.vocab:
            self.oov_sent += 1
        if self.now() < self.down_until.get(url, -1.0):
            raise ConnectionRefusedError(f"{url} is down")
        if self.now() < self.wedged_until.get(url, -1.0):
            await asyncio.Event().wait()  # accepted, never answered
        epoch = self.epoch[url]
        if path == "/abort_request":
            if self._fire("abort_fail", 0.3):
                raise TransportHTTPError(500, {"error": "abort failed"})
            if self._fire("abort_hang", 0.3):
                await asyncio.Event().wait()
            await self.inner.request(method, url, path, payload, timeout_s)
            return None  # SGLang answers an abort with an empty body
        if path != "/generate" or payload.get("rid", "").startswith("april-probe-"):
            return await self.inner.request(method, url, path, payload, timeout_s)
        if self._fire("engine_kill", 0.02):
            self.kill(url, self.rng.uniform(2.0, 40.0))
            raise ConnectionResetError(f"{url} was killed")
        if self._fire("http_5xx", 0.05):
            raise TransportHTTPError(503, {"error": "overloaded"})
        if self._fire("reject_4xx", 0.01):
            raise TransportHTTPError(400, {"error": "invalid request"})
        if self._fire("hang", 0.01):
            await asyncio.Event().wait()
        reply = await self.inner.request(method, url, path, payload, timeout_s)
        if self.epoch[url] != epoch:
            raise ConnectionResetError(f"{url} was killed during the request")
        if self._fire("malformed", 0.03):
            reply = self._malformed(reply)
        elif self._fire("wrong", 0.03):
            reply = self._wrong(reply, payload)
        return reply

    def _malformed(self, reply: dict) -> dict:
        kind = self.rng.choice(["no_meta", "nan", "count"])
        if kind == "no_meta":
            return {"text": "", "output_ids": reply["output_ids"]}
        triples = reply["meta_info"]["output_token_logprobs"]
        if kind == "nan" and triples:
            triples[0][0] = float("nan")
        else:
            reply["output_ids"] = reply["output_ids"] + [7]
        return reply

    def _wrong(self, reply: dict, payload: dict) -> dict:
        meta = reply["meta_info"]
        triples = meta["output_token_logprobs"]
        kind = self.rng.choice(["positive_logprob", "other_rid", "oov_token", "spans", "too_many"])
        if kind == "positive_logprob" and triples:
            triples[-1][0] = 0.5
        elif kind == "oov_token" and triples:
            triples[-1][1] = reply["output_ids"][-1] = self.vocab + 3
        elif kind == "spans":
            n = len(reply["output_ids"])
            meta["weight_versions"] = [{"version": meta["weight_version"], "start": 0, "end": n + 1}]
        elif kind == "too_many":
            extra = payload["sampling_params"]["max_new_tokens"] + 1 - len(reply["output_ids"])
            reply["output_ids"] = reply["output_ids"] + [11] * extra
            triples.extend([[-1.0, 11, None]] * extra)
            meta["completion_tokens"] = len(reply["output_ids"])
        else:
            meta["id"] = payload["rid"] + "x"
        return reply

    async def close(self):
        pass


# ====================================================================== the ledger
class Ledger(GroupLedger):
    """Where every group handed out is, kept from what the test sees (never from the scheduler's
    own books, except the reason of a drop, which it must report); with the state at each save."""

    def __init__(self):
        super().__init__()
        self.checkpoints: dict[int, tuple] = {}

    def check(self, buffer, where: str) -> None:
        super().check({g.uid for g in buffer.groups()}, where)

    def save(self, k: int) -> None:
        self.checkpoints[k] = (set(self.handed_out), list(self.delivered), dict(self.dropped))

    def restore(self, k: int) -> None:
        handed, delivered, dropped = self.checkpoints[k]
        self.handed_out, self.delivered, self.dropped = set(handed), list(delivered), dict(dropped)


class LedgerPrompts:
    """The data source as the scheduler's prompt source, recording every group it hands out
    (and, when armed, corrupting a prompt with an out-of-vocabulary id)."""

    def __init__(self, source, ledger: Ledger, soak: Soak):
        self.source, self.ledger, self.soak = source, ledger, soak

    def next_groups(self, n, current_version):
        groups = self.source.next_groups(n, current_version)
        for g in groups:
            self.ledger.handed_out.add(g.uid)
            if self.soak.transport._fire("oov_prompt", 0.05):
                bad = g.prompt_ids[:-1] + [self.soak.vocab + 1]
                g.prompt_ids = bad
                for t in g.trajectories:
                    t.prompt_ids = list(bad)
        return groups


# ====================================================================== the soak
class Soak:
    def __init__(self, running, tmp_path: Path, prompts_path: str):
        self.running = running
        self.model = running.cluster.model
        self.vocab = self.model.vocab_size
        self.rng = random.Random(SEED)
        self.transport = FaultyTransport(running, random.Random(SEED + 1), self.vocab)
        self.client = EngineClient(running.engine_urls, transport=self.transport, vocab_size=self.vocab,
                                   max_retries=2, retry_backoff_s=0.5)  # default 3600 s timeout
        self.ckpt = str(tmp_path / "ckpt")
        self.prompts_path = prompts_path
        self.ledger = Ledger()
        self.figures: Counter[str] = Counter()
        self.step_times: list[float] = []
        self.save_points = [(order, point) for order in ("train", "train_async")
                            for point in checkpoint.SAVE_POINTS]
        self.kills_done: Counter[tuple[str, str]] = Counter()
        self.restarts = 0

    # ------------------------------------------------------------ one process life of the trainer
    def start(self, load: int | None):
        args = SimpleNamespace(
            prompt_data=self.prompts_path, input_key="prompt", label_key=None, rollout_global_dataset=True,
            # the rest of what real slime's RolloutDataSource reads, at slime's defaults
            metadata_key="metadata", tool_key=None, multimodal_keys=None, apply_chat_template=False,
            apply_chat_template_kwargs={}, rollout_max_prompt_len=None, dump_details=None,
            buffer_filter_path=None,
            hf_checkpoint="toy", rollout_seed=1, rollout_shuffle=False, n_samples_per_prompt=N_SAMPLES,
            rollout_batch_size=BATCH, over_sampling_batch_size=BATCH, rollout_max_response_len=MAX_LEN,
            rollout_top_p=1.0, save=self.ckpt, load=self.ckpt if load is not None else None,
            april_policy="copris")
        self.source = rollout.AprilDataSource(args)
        if load is not None:
            try:
                self.source.load(load)
            except StateFileError:
                self.figures["refused_loads"] += 1
                complete = [c for c in checkpoint.complete_checkpoints(Path(self.ckpt) / "rollout") if c < load]
                load = max(complete) if complete else None
                if load is not None:
                    self.source = rollout.AprilDataSource(args)
                    self.source.load(load)
            if load is None:  # nothing complete yet: a fresh start
                args.load = None
                self.source = rollout.AprilDataSource(args)
                self.ledger = Ledger()
            else:
                self.ledger.restore(load)
        self.loaded = load
        self.policy = ["sync", "april", "copris"][self.restarts % 3]
        self.order = "train" if (self.restarts // 3) % 2 == 0 else "train_async"
        config = AprilConfig.from_dict({"policy": self.policy, "over_sampling_factor": 2.0})
        self.sched = RolloutScheduler(
            config, self.client, self.source.buffer, rollout_batch_size=BATCH,
            n_samples_per_prompt=N_SAMPLES, sampling_params={"temperature": 1.0},
            reward_fn=self.reward, group_filter=self.keep, eos_token_id=self.model.eos_token_id)
        self.prompts = LedgerPrompts(self.source, self.ledger, self)
        self.ledger.check(self.source.buffer, f"restart from {load}")

    async def reward(self, group: Group) -> None:
        await asyncio.sleep(0.01)
        if self.transport._fire("reward_fail", 0.02):
            raise RuntimeError("reward model unreachable")
        for t in group.trajectories:
            t.reward = float(t.response_length % 2)

    def keep(self, group: Group) -> bool:
        return int(group.uid) % 10 != 7  # a fixed tenth of the prompts fails the filter

    # ------------------------------------------------------------ one rollout step
    async def step(self, k: int) -> None:
        loop = asyncio.get_running_loop()
        t = self.transport
        t.armed = set(self.rng.sample(FAULTS, self.rng.randint(2, 5)))
        if "wedged_engine" in t.armed and self.rng.random() < 0.2:
            url = self.rng.choice(t.urls)
            t.wedged_until[url] = loop.time() + self.rng.uniform(30.0, 400.0)
            t.injected["wedged_engine"] += 1
        version = self.running.cluster.engines[0].weight_version
        self.source.policy_version = version
        start = loop.time()
        task = loop.create_task(self.sched.run_step(self.prompts, version))
        if t._fire("cancel", 0.3):
            await asyncio.sleep(self.rng.uniform(0.0, 3.0))
            task.cancel()  # a no-op when the step is already done
        try:
            result = await task
        except asyncio.CancelledError:
            self.figures["cancelled_steps"] += 1
            result = None
        except RolloutStepError:
            self.figures["failed_steps"] += 1
            result = None
        self.step_times.append(loop.time() - start)
        self.ledger.dropped.update(self.sched.last_dropped)
        if result is not None:
            self.figures["delivered_steps"] += 1
            assert len(result.groups) == BATCH
            self.ledger.delivered += [g.uid for g in result.groups]
            for g in result.groups:
                assert g.complete and all(tr.reward is not None for tr in g.trajectories)
                self.check_tokens(g)
        for g in self.source.buffer.groups():
            self.check_tokens(g)
        self.ledger.check(self.source.buffer, f"step {k}")
        self.figures["steps"] += 1
        self.figures["faulted_steps"] += bool(t.armed)
        self.running.cluster.bump_weight_version()
        self.source.snapshot(k)
        self.ledger.save(k)

    def check_tokens(self, g: Group) -> None:
        for tr in g.trajectories:
            assert tr.status is not TrajectoryStatus.RUNNING
            if not tr.response_ids:
                continue
            ids, lps = self.model.reference(tr.prompt_ids, tr.sampling_seed, len(tr.prompt_ids),
                                            tr.token_versions())
            assert tr.response_ids == ids and tr.logprobs == lps, f"{tr.uid}: tokens differ from the engine's"

    # ------------------------------------------------------------ checkpoints
    def save(self, k: int) -> bool:
        """Save checkpoint k, killed at the next save point not yet covered (until all are).
        Returns False when the process was killed."""
        plan = [p for p in self.save_points if p[0] == self.order and self.kills_done[p] == 0]
        kill_at = plan[0][1] if plan and self.rng.random() < 0.5 else None

        def hook(point):
            if point == kill_at:
                raise Killed(point)

        checkpoint.SAVE_POINT_HOOK = hook
        try:
            self.source.save(k)
        except Killed:
            self.kills_done[(self.order, kill_at)] += 1
            return False
        finally:
            checkpoint.SAVE_POINT_HOOK = None
        return True

    async def run(self, steps: int) -> None:
        self.start(None)
        k = 0
        while k < steps:
            alive, checkpointed = True, None
            await self.step(k)
            if k % CHECKPOINT_EVERY == CHECKPOINT_EVERY - 1:
                checkpointed = k
                if self.order == "train_async":  # generate k+1 runs before save k
                    k += 1
                    await self.step(k)
                alive = self.save(checkpointed)
            k += 1
            if not alive:
                self.restart(checkpointed)
            elif checkpointed is not None and (checkpointed // CHECKPOINT_EVERY) % 4 == 3:
                self.restart(checkpointed)  # a planned restart: also rotates the policy and the loop

    def restart(self, model_checkpoint: int) -> None:
        """The trainer comes back from its model checkpoint; the data source loads the same one,
        or (its save was killed before the commit) is refused by name and the job restarts from
        the latest complete one, as the message says."""
        self.restarts += 1
        self.start(model_checkpoint)


@pytest.fixture
def quiet():
    """Thousands of injected faults each log a warning; formatting them costs more than the soak."""
    logger = logging.getLogger("april_slime")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.fixture
def slime(slime_mode):
    """``slime_mode``, with the save-point hook the soak's kills arm taken off again."""
    yield slime_mode
    checkpoint.SAVE_POINT_HOOK = None


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i:04d} solve"}) + "\n" for i in range(600)))
    return str(path)


def test_soak_virtual_clock_every_fault_class(slime, quiet, tmp_path, prompts_file):
    async def main():
        async with start_cluster(num_engines=3, seed=SEED % 1000, time_scale=1.0, http=False,
                                 length=LENGTH) as running:
            soak = Soak(running, tmp_path, prompts_file)
            await soak.run(SOAK_STEPS)
            return soak

    wall = time.monotonic()
    soak = run_virtual(main())
    wall = time.monotonic() - wall
    f, t = soak.figures, soak.transport
    times = sorted(soak.step_times)
    report = {
        "steps": f["steps"], "faulted_steps": f["faulted_steps"], "delivered_steps": f["delivered_steps"],
        "failed_steps": f["failed_steps"], "cancelled_steps": f["cancelled_steps"],
        "restarts": soak.restarts, "refused_loads": f["refused_loads"],
        "killed_saves": {f"{o}/{p}": n for (o, p), n in sorted(soak.kills_done.items())},
        "faults_injected": dict(sorted(t.injected.items())), "groups_handed_out": len(soak.ledger.handed_out),
        "groups_delivered": len(soak.ledger.delivered), "groups_buffered": len(soak.source.buffer),
        "groups_dropped": dict(Counter(soak.ledger.dropped.values())), "lost": 0, "duplicated": 0,
        "step_time_median_s": times[len(times) // 2], "step_time_p99_s": times[int(0.99 * (len(times) - 1))],
        "step_time_max_s": times[-1], "wall_s": round(wall, 1),
    }
    print("\nsoak:", json.dumps(report, indent=1))
    assert f["steps"] >= SOAK_STEPS and f["faulted_steps"] == f["steps"]
    assert set(t.injected) == set(FAULTS), f"fault classes never injected: {set(FAULTS) - set(t.injected)}"
    assert t.oov_sent == 0, "an out-of-vocabulary id reached an engine"
    assert set(soak.kills_done) == set(soak.save_points), "a save point was never killed"
    assert f["delivered_steps"] > SOAK_STEPS // 2


@pytest.mark.parametrize("policy", ["sync", "april", "copris"])
def test_one_wedged_engine_bounds_every_step(quiet, policy):
    """Default settings, emulated engines: after some healthy steps one engine accepts requests
    and never answers again (not even probes or aborts). No step takes longer than twice the
    longest healthy step plus the documented deadline (stall_probe_after_s + probe_timeout_s,
    90 s), and the steps after the first are no slower than twice a healthy one."""

    async def main():
        async with start_cluster(num_engines=2, seed=9, time_scale=1.0, http=False, length=LENGTH) as running:
            transport = FaultyTransport(running, random.Random(1), running.cluster.model.vocab_size)
            client = EngineClient(running.engine_urls, transport=transport)  # every default
            config = AprilConfig.from_dict({"policy": policy})
            sched = RolloutScheduler(config, client, PartialBuffer(), rollout_batch_size=4,
                                     n_samples_per_prompt=N_SAMPLES, sampling_params={"temperature": 1.0})

            prompts = NumberedPrompts("w", N_SAMPLES, MAX_LEN)
            loop = asyncio.get_running_loop()
            times = []
            for step in range(10):
                if step == 5:
                    transport.wedged_until[running.engine_urls[1]] = float("inf")
                start = loop.time()
                res = await asyncio.wait_for(sched.run_step(prompts, step), 3 * 3600)
                assert len(res.groups) == 4
                times.append(loop.time() - start)
            return times, sched

    times, sched = run_virtual(main())
    healthy, wedged = times[:5], times[5:]
    deadline = sched.stall_probe_after_s + sched.probe_timeout_s
    assert max(wedged) <= 2 * max(healthy) + deadline, (healthy, wedged)
    assert max(wedged[1:]) <= 2 * max(healthy), (healthy, wedged)
    print(f"\n{policy}: healthy steps {[round(t, 1) for t in healthy]} s, "
          f"one engine wedged {[round(t, 1) for t in wedged]} s (virtual)")


# ====================================================================== part 2: real processes
EMU_SEED = 5


def _free_port_pair() -> int:
    """A port P with P and P+1 free (an emulator process puts its router on P, its engine on P+1)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


class EngineProcess:
    """One emulated SGLang engine in its own process, restartable on the same port."""

    def __init__(self, port: int):
        self.port = port
        self.url = f"http://127.0.0.1:{port + 1}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "april_workbench.emulator", "--port", str(self.port), "--engines", "1",
             "--seed", str(EMU_SEED), "--length-dist", "short", "--time-scale", "4"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2):  # "router URL" then "engine URL" once it serves
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"emulator did not start: {self.proc.stderr.read()}")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


@pytest.fixture
def engine_processes():
    engines = [EngineProcess(_free_port_pair()) for _ in range(2)]
    try:
        for e in engines:
            e.start()
        yield engines
    finally:
        for e in engines:
            e.stop()


def test_http_engine_killed_mid_step_and_restarted(quiet, engine_processes):
    """SIGKILL of a real engine process while a step has requests on it, a restart on the same
    port, and a second kill that lasts two steps: no step loses or repeats a group, every token is
    the engine's, and the restarted engine comes back into dispatch.

    Nothing here rests on how long a step takes in wall time, which a loaded machine changes:
    the kill waits for the step's first request to the victim, a step with the victim dead must
    send it nothing at all, and a restarted victim is waited for step by step (it is probed at
    the start of every step and takes requests once the probe answers, which may be a step or
    two later) with a generous bound. The scheduler's deadlines are far above what a healthy
    call takes, so only a dead engine ever reaches them."""
    model = SyntheticLM(seed=EMU_SEED, length=LengthModel.parse("short"))
    victim, other = engine_processes

    ledger = Ledger()
    back_within = 10  # steps a restarted engine may take to get requests again

    async def main():
        transport = HttpTransport()
        client = EngineClient([victim.url, other.url], transport=transport, timeout_s=60.0, max_retries=2,
                              retry_backoff_s=0.1, vocab_size=model.vocab_size)
        buffer = PartialBuffer()
        sched = RolloutScheduler(AprilConfig.from_dict({"policy": "copris", "concurrency": 8}), client, buffer,
                                 rollout_batch_size=BATCH, n_samples_per_prompt=N_SAMPLES,
                                 sampling_params={"temperature": 1.0}, drain_timeout_s=30.0,
                                 probe_timeout_s=10.0, probe_interval_s=0.2)
        prompts = NumberedPrompts("h", N_SAMPLES, 64, first_seed=100, tail=(5, 6), handed_out=ledger.handed_out)
        loop = asyncio.get_running_loop()
        victim_calls: list[int] = []  # generate calls the victim got, per step
        failed_steps: list[int] = []
        kill_steps: list[int] = []

        async def step(kill: bool = False) -> int:
            """One step (killing the victim once it has a request of the step); the victim's calls."""
            n = len(victim_calls)
            before = client.stats[victim.url].calls
            task = loop.create_task(sched.run_step(prompts, 0))
            if kill:
                # The counter moves when a request to the victim starts: kill it with that
                # request in flight (an event, not a guess at how long the step takes). A step
                # may also end without any call (the buffer can hold enough finished groups).
                while client.stats[victim.url].calls == before and not task.done():
                    await asyncio.sleep(0.002)
                if client.stats[victim.url].calls > before:
                    victim.kill()
                    kill_steps.append(n)
            try:
                result = await task
                ledger.delivered += [g.uid for g in result.groups]
                for g in result.groups:
                    check_against(model, g)
            except RolloutStepError:
                failed_steps.append(n)
            ledger.dropped.update(sched.last_dropped)
            for g in buffer.groups():
                check_against(model, g)
            ledger.check(buffer, f"http step {n}")
            victim_calls.append(client.stats[victim.url].calls - before)
            return victim_calls[-1]

        async def kill_mid_step() -> None:
            for _ in range(5):
                await step(kill=True)
                if kill_steps and kill_steps[-1] == len(victim_calls) - 1:
                    return
            raise AssertionError(f"no step in 5 sent a request to the victim: {victim_calls}")

        async def restart_and_wait_until_back() -> None:
            await loop.run_in_executor(None, victim.start)
            for _ in range(back_within):
                if await step() > 0:
                    return
            raise AssertionError(f"the restarted engine got no request in {back_within} steps: {victim_calls}")

        try:
            await step()
            await step()
            await kill_mid_step()
            assert await step() == 0, "a killed engine kept getting requests"
            await restart_and_wait_until_back()
            await step()
            await kill_mid_step()
            for _ in range(2):  # the second kill lasts two steps
                assert await step() == 0, "a killed engine kept getting requests"
            await restart_and_wait_until_back()
            await step()
        finally:
            await client.close()
            await transport.close()
        return victim_calls, failed_steps, kill_steps, sched

    victim_calls, failed_steps, kill_steps, sched = asyncio.run(main())
    print(f"\nvictim calls per step {victim_calls}, killed in steps {kill_steps}, failed steps {failed_steps}")
    assert victim.url not in sched.health.excluded
    # Only a step that had the victim killed under it may fail (a trajectory there can exhaust
    # its retries); every other step delivers its batch.
    assert set(failed_steps) <= set(kill_steps), (failed_steps, kill_steps, victim_calls)
    assert len(ledger.delivered) == (len(victim_calls) - len(failed_steps)) * BATCH


def check_against(model, g: Group) -> None:
    for tr in g.trajectories:
        assert tr.status is not TrajectoryStatus.RUNNING
        ids, lps = model.reference(tr.prompt_ids, tr.sampling_seed, len(tr.prompt_ids), tr.token_versions())
        assert tr.response_ids == ids and tr.logprobs == lps, tr.uid


# ====================================================================== part 3: episodes
EPISODE_STEPS = int(os.environ.get("APRIL_SOAK_EPISODE_STEPS", "16"))
EPISODE_ENGINE_FAULTS = ("http_5xx", "engine_kill", "malformed", "wrong", "abort_fail", "reject_4xx")
FUNCTION_FAULTS = ("raise", "hang", "corrupt")  # agent_functions.CONTROL, armed once (re-run) or twice (given up)
EPISODE_FUNCTION = "tests.support.agent_functions.multi_turn"


class RealTimeFaults(FaultyTransport):
    """Part 1's faults on a real-time cluster emulated 20x faster than real time: kills as long in
    emulated time as part 1's, and refusals three times as often (a few hundred calls here, not tens
    of thousands), so that every class is injected."""

    def kill(self, url: str, for_s: float) -> None:
        super().kill(url, for_s / 20)

    def _fire(self, fault: str, p: float) -> bool:
        return super()._fire(fault, 3 * p if fault == "reject_4xx" else p)

    def down_for(self) -> float:
        """Seconds until every killed engine is back (on the loop)."""
        return max([0.0, *(until - self.now() for until in self.down_until.values())])


@pytest.fixture
def three_engines(slime_mode):
    c = Cluster(num_engines=3)  # as many as part 1: one killed engine leaves two
    c.bump(1)
    yield c
    rollout.shutdown()
    c.stop()


def check_episode_tokens(model, tokens, response_length, logprobs, mask, version_runs, seed, where) -> None:
    """Every model token of an episode's response is the engine's at its position and version: each
    run of trainable tokens (one model call, resumed or not) against the emulator's reference."""
    start = len(tokens) - response_length
    prompt, response, versions = tokens[:start], tokens[start:], expand(version_runs)
    k = 0
    while k < response_length:
        end = k
        while end < response_length and mask[end]:
            end += 1
        if end > k:
            ids, lps = model.reference(prompt, seed, start + k, versions[k:end])
            assert response[k:end] == ids and logprobs[k:end] == lps, f"{where}: tokens differ from the engine's"
        k = end + 1


async def _on_loop(fn):
    return fn()


def on_loop(fn):
    """``fn()`` on the job's loop: episodes go on there between steps, filling their members."""
    return loop_run(_on_loop(fn))


@pytest.mark.parametrize("mask", [False, True], ids=["drop", "mask"])
def test_soak_episodes_under_engine_and_function_faults(three_engines, quiet, tmp_path, monkeypatch, mask):
    """Part 3 (module docstring): every step with every engine fault class of ``EPISODE_ENGINE_FAULTS``
    armed and each function fault armed on one of the next prompts' samples; with ``mask``
    (``april_mask_failed_samples``) a given-up sample is masked and its group goes on."""
    cluster = three_engines
    rng = random.Random(SEED + 3)
    emulator, model = cluster.emulator, cluster.emulator.model
    running = SimpleNamespace(transport=emulator.transport(), cluster=emulator, engine_urls=emulator.engine_urls)
    transport = RealTimeFaults(running, random.Random(SEED + 4), model.vocab_size)
    transport.armed = set(EPISODE_ENGINE_FAULTS)
    from_router = EngineClient.from_router.__func__

    async def faulty_from_router(cls, router_url, **kw):
        """The job's engine client, on the faulty transport, knowing the vocabulary as a real
        checkpoint's config tells it (the toy tokenizer has no size): out-of-vocabulary replies fail."""
        return await from_router(cls, router_url, transport=transport, **{**kw, "vocab_size": model.vocab_size})

    monkeypatch.setattr(EngineClient, "from_router", classmethod(faulty_from_router))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i:03d}", "label": str(i)}) + "\n"
                               for i in range(600)))
    # one re-run per episode, a short tool deadline, short retry delays (all in real time)
    settings = dict(custom_generate_function_path=EPISODE_FUNCTION, april_policy="copris", april_concurrency=12,
                    april_max_episode_failures=1, april_episode_tool_timeout_s=0.5, april_retry_backoff_s=0.02,
                    april_mask_failed_samples=mask)
    args = point_at(make_args(tmp_path, prompts, **settings), cluster)
    source = rollout.AprilDataSource(args)
    ledger, figures, runners = Ledger(), Counter(), []
    restored = None  # unfinished members the restore found

    def check_buffer(where: str) -> None:
        ledger.handed_out = {str(i) for i in range(source._prompts.sample_group_index)}
        ledger.check(source.buffer, where)
        for g in source.buffer.groups():
            for t in g.finished():
                if t.status is TrajectoryStatus.FAILED:  # masked: no tokens
                    assert mask and not t.response_ids and t.episode_sample is None
                    continue
                sample = t.episode_sample
                check_episode_tokens(model, sample["tokens"], sample["response_length"], t.logprobs, t.loss_mask,
                                     t.version_runs, t.sampling_seed, f"{where}: buffered {t.uid}")

    af.reset()
    try:
        for k in range(EPISODE_STEPS):
            ahead = source._prompts.sample_index  # the first sample of the prompts this step may take
            for fault in FUNCTION_FAULTS:
                af.CONTROL[fault][ahead + rng.randrange(4 * args.rollout_batch_size)] += rng.choice((1, 2))
            cluster.bump(k + 1)
            try:
                out = rollout.generate_rollout(args, k, source)
            except (RolloutStepError, EngineError) as e:
                # slime's job would stop here; the soak goes on, as the job restarted would, once
                # the killed engines are back (a restart takes longer than a kill here)
                figures[f"failed_steps_{type(e).__name__}"] += 1
                out = None
                time.sleep(on_loop(transport.down_for))
            if rollout._RUNTIME.scheduler is not None:
                ledger.dropped.update(rollout._RUNTIME.scheduler.last_dropped)
            if out is not None:
                figures["delivered_steps"] += 1
                figures["masked_metric"] += out.metrics["april/masked_samples"]
                assert len(out.samples) == args.rollout_batch_size
                for group in out.samples:
                    assert len(group) == args.n_samples_per_prompt
                    ledger.delivered.append(str(group[0].group_index))
                    for i, s in enumerate(group):
                        if s.status.value == "failed":  # masked out of its group
                            assert mask and s.remove_sample and not any(s.loss_mask)
                            figures["masked_trained"] += 1
                            continue
                        check_sample(s, version_floor=1)
                        check_episode_tokens(model, s.tokens, s.response_length, s.rollout_log_probs, s.loss_mask,
                                             s.train_metadata[TOKEN_VERSIONS_KEY],
                                             sampling_seed(args.rollout_seed, str(s.group_index), i),
                                             f"step {k}: trained {s.index}")
            on_loop(lambda k=k: check_buffer(f"episode step {k}"))
            if restored is None and out is not None and k >= EPISODE_STEPS // 2:
                source.save(k)  # train.py: generate k, train k, save k; then the job dies
                runners.append(rollout._RUNTIME.episodes)
                rollout.shutdown()
                args = point_at(make_args(tmp_path, prompts, load=args.save, **settings), cluster)
                source = rollout.AprilDataSource(args)
                source.load(k)
                restored = len(source.restored_episodes)
                on_loop(lambda k=k: check_buffer(f"restore of {k}"))
        runners.append(rollout._RUNTIME.episodes)
    finally:
        af.reset()
    episodes = Counter()
    for runner in runners:
        episodes.update(runner.counters.as_dict())
    dropped = Counter(ledger.dropped.values())
    print("\nepisode soak:", json.dumps({
        **figures, "faults_injected": dict(sorted(transport.injected.items())), "episodes": dict(episodes),
        "groups_handed_out": len(ledger.handed_out), "groups_delivered": len(ledger.delivered),
        "groups_buffered": len(source.buffer), "groups_dropped": dict(dropped), "restored_unfinished": restored}))
    assert figures["delivered_steps"] >= EPISODE_STEPS // 2
    assert set(transport.injected) == set(EPISODE_ENGINE_FAULTS), "an engine fault class was never injected"
    assert episodes["failures"] > 0 and episodes["timeouts"] > 0 and episodes["given_up"] > 0
    if mask:  # every given-up sample masked; a group dropped only when fewer than two were left
        assert episodes["masked"] == episodes["given_up"] and figures["masked_trained"] > 0
        assert figures["masked_trained"] == figures["masked_metric"]
        assert dropped[DROP_EPISODE_FAILED] <= episodes["given_up"] // 2
    else:
        assert 0 < dropped[DROP_EPISODE_FAILED] <= episodes["given_up"] and not episodes["masked"]
    # the restore restarts exactly the unfinished episodes it found, each once (no staleness bound here)
    last = runners[-1]
    assert restored and last.counters.restarted == restored - len(last.restored)
