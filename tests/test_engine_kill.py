"""An engine killed with requests in flight, on emulated engines (virtual clock), for copris and
april with the weights bumped every step: once while its requests generate, once while the abort
at the target is on its way to it. The calls it held are counted as lost
(``april/engine_fault_lost_*``), their tokens estimated, and the estimate compared with the
exact count the emulator knows (a non-streaming client never sees those tokens); every lost call's
work item is sent again, to the live engine, continuing exactly the partial it had; no group is
lost or trained twice; the partials buffered by earlier steps keep their tokens. The same on real
SGLang engines: ``tests/real/test_engine_kill_real.py``."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from april_slime.core.buffer import PartialBuffer
from april_slime.core.config import AprilConfig
from april_slime.core.engine import EngineClient
from april_slime.core.scheduler import RolloutScheduler
from april_slime.core.step_metrics import LostCall, StepCounters, engine_fault_losses
from april_workbench.emulator.model import LengthModel
from april_workbench.emulator.testing import start_cluster
from april_workbench.emulator.vclock import run_virtual
from tests.support.engine_kill import (
    CallLog,
    GroupLedger,
    RecordingTransport,
    buffered_prefixes,
    check_prefixes_kept,
)
from tests.support.numbered_prompts import NumberedPrompts

BATCH, N, MAX_LEN = 4, 2, 256
LENGTH = LengthModel(median_tokens=80.0, prompt_sigma=0.3, truncation_fraction=0.2)
M = "april/"


class KillableEngines:
    """The emulator's in-process transport with engines that can be killed: a killed engine drops
    every connection (its requests in flight end in a connection reset) and refuses new ones until
    it is restarted, empty. What each dropped request had generated is known exactly: the emulated
    engine is aborted at the kill, and the replies of that abort, which the client never sees, are
    counted in ``lost_tokens``. ``kill_at_abort``: kill that engine when an abort-all reaches it."""

    def __init__(self, running):
        self.inner = running.transport
        self.cluster = running.cluster
        self.urls = list(running.engine_urls)
        self.dead: set[str] = set()
        self.epoch: Counter[str] = Counter()
        self.lost_tokens: dict[str, int] = {}  # rid -> tokens its engine had generated at the kill
        self.kill_at_abort: str | None = None
        self.kills = 0
        self.killed_at: float | None = None

    def kill(self, url: str) -> None:
        self.killed_at = asyncio.get_running_loop().time()
        self.dead.add(url)
        self.epoch[url] += 1
        self.kills += 1
        self.cluster.engines[self.urls.index(url)].abort(abort_all=True)

    def restart(self, url: str) -> None:
        self.dead.discard(url)

    async def request(self, method, url, path, payload, timeout_s):
        url = url.rstrip("/")
        if path == "/abort_request" and url == self.kill_at_abort and (payload or {}).get("abort_all"):
            self.kill_at_abort = None
            self.kill(url)
        if url in self.dead:
            raise ConnectionRefusedError(f"{url} is down")
        epoch = self.epoch[url]
        reply = await self.inner.request(method, url, path, payload, timeout_s)
        if self.epoch[url] != epoch:
            if path == "/generate":
                self.lost_tokens[payload["rid"]] = len(reply["output_ids"])
            raise ConnectionResetError(f"{url} was killed during the request")
        return reply

    async def close(self):
        pass


def run_kill_scenario(policy: str) -> dict:
    """Healthy steps, a kill mid-generation, a step with the engine dead, its restart, then a kill
    at the abort; returns what each kill cost and what the test saw."""
    ledger, log = GroupLedger(), CallLog()

    async def main():
        async with start_cluster(num_engines=2, seed=3, time_scale=1.0, http=False, length=LENGTH) as running:
            engines = KillableEngines(running)
            client = EngineClient(running.engine_urls, transport=RecordingTransport(engines, log), max_retries=2,
                                  retry_backoff_s=0.5, vocab_size=running.cluster.model.vocab_size)
            victim, live = running.engine_urls
            buffer = PartialBuffer()
            settings = {"policy": policy, "concurrency": 8} if policy == "copris" else {
                "policy": policy, "over_sampling_factor": 2.0}
            sched = RolloutScheduler(AprilConfig.from_dict(settings), client, buffer, rollout_batch_size=BATCH,
                                     n_samples_per_prompt=N, sampling_params={"temperature": 1.0},
                                     eos_token_id=running.cluster.model.eos_token_id, probe_interval_s=0.5)
            prompts = NumberedPrompts("k", N, MAX_LEN, handed_out=ledger.handed_out)
            loop = asyncio.get_running_loop()
            out: dict = {"kills": []}

            async def step(kill_mid_generation: bool = False):
                version = running.cluster.bump_weight_version()  # weights pushed every step
                before = buffered_prefixes(buffer.groups())
                start = loop.time()
                task = loop.create_task(sched.run_step(prompts, version))
                killed_at = None
                if kill_mid_generation:
                    # placed, not timed: once two calls of the step run on the victim, let them
                    # generate for a while, then kill it
                    while len(log.in_flight(victim)) < 2:
                        assert not task.done(), "the step ended before two calls ran on the victim"
                        await asyncio.sleep(0.001)
                    await asyncio.sleep(0.2)
                    assert not task.done() and log.in_flight(victim), "nothing ran on the victim at the kill"
                    killed_at = loop.time()
                    engines.kill(victim)
                result = await task
                ledger.delivered += [g.uid for g in result.groups]
                ledger.dropped.update(sched.last_dropped)
                buffered = {g.uid for g in buffer.groups()}
                ledger.check(buffered, f"step {len(out.get('steps', []))}")
                trajectories = [t for g in result.groups + buffer.groups() for t in g.trajectories]
                grew = check_prefixes_kept(before, trajectories, "after a step")
                out.setdefault("steps", []).append({"start": start, "killed_at": killed_at,
                                                    "metrics": result.metrics, "resumed": grew})
                return result.metrics

            await step()
            await step()
            lost_before = dict(engines.lost_tokens)
            metrics = await step(kill_mid_generation=True)
            out["kills"].append(("mid-generation", out["steps"][-1]["killed_at"], loop.time(), metrics,
                                 {r: n for r, n in engines.lost_tokens.items() if r not in lost_before}))
            dead = await step()
            assert not [a for a in log.to(victim) if a.sent >= out["steps"][-1]["start"]], (
                "the dead engine was sent calls in the step after the kill")
            assert dead[M + "engine_fault_lost_calls"] == 0 and dead[M + "engine_fault_lost_tokens_est"] == 0
            engines.restart(victim)
            for _ in range(10):  # the restarted engine answers its probe and takes calls again
                start = loop.time()
                await step()
                if [a for a in log.to(victim) if a.sent >= start]:
                    break
            else:
                raise AssertionError("the restarted engine got no call in 10 steps")
            for _ in range(5):  # the abort at the target reaches the victim only if it is busy then
                engines.kill_at_abort = victim
                kills, lost_before = engines.kills, dict(engines.lost_tokens)
                metrics = await step()
                if engines.kills > kills:
                    out["kills"].append(("at the abort", engines.killed_at, loop.time(), metrics,
                                         {r: n for r, n in engines.lost_tokens.items() if r not in lost_before}))
                    break
                engines.kill_at_abort = None
            else:
                raise AssertionError("in 5 steps the abort at the target never went to the victim")
            for _ in range(3):  # every item the kill at the abort took is sent again, to the live engine
                await step()
            engines.restart(victim)
            await client.close()
            out.update(victim=victim, live=live, log=log)
            return out

    return run_virtual(main())


@pytest.mark.parametrize("policy", ["copris", "april"])
def test_engine_killed_mid_generation_and_at_the_abort(policy):
    out = run_kill_scenario(policy)
    log, victim, live = out["log"], out["victim"], out["live"]
    for where, killed_at, ended, metrics, truth in out["kills"]:
        # the event happened: the killed engine held requests that had generated tokens
        exact = sum(truth.values())
        assert truth and exact > 0, f"{where}: the kill found nothing generating"
        # every call the kill took (its requests in flight, and any sent before the engine was
        # out of dispatch) is counted, and its item sent again, to the live engine, continuing
        # exactly the tokens it had (the lost call added nothing, and nothing was dropped)
        failed = log.failed_calls(victim, killed_at, ended)
        assert set(truth) <= set(failed), (where, sorted(truth), sorted(failed))
        assert metrics[M + "engine_fault_lost_calls"] == len(failed), (where, metrics, sorted(failed))
        for rid, attempt in failed.items():
            again = log.next_call(rid)
            assert again is not None, f"{where}: {rid} was never sent again"
            assert again.url == live and again.sent >= killed_at, (where, rid, again)
            assert again.input_len == attempt.input_len, f"{where}: {rid} did not continue its own tokens"
        assert metrics[M + "engine_fault_lost_tokens_max"] >= exact
        est = metrics[M + "engine_fault_lost_tokens_est"]
        print(f"\n{policy}, killed {where}: {len(truth)} requests in flight ({len(failed)} calls lost, all sent "
              f"again to the live engine), {exact} tokens lost (the emulator's count), estimate {est:.0f}, at "
              f"most {metrics[M + 'engine_fault_lost_tokens_max']:.0f}, engine seconds "
              f"{metrics[M + 'engine_fault_lost_call_s']:.2f}")
        assert 0.5 * exact <= est <= 2 * exact, (where, est, exact)
    assert [where for where, *_ in out["kills"]] == ["mid-generation", "at the abort"]
    kill_step = next(s for s in out["steps"] if s["killed_at"] is not None)
    assert kill_step["killed_at"] - kill_step["start"] < kill_step["metrics"][M + "time_to_target_s"], (
        "the mid-generation kill came after the target")
    assert sum(s["resumed"] for s in out["steps"]) > 0, "no buffered partial was resumed"


def test_lost_token_estimate_from_the_steps_rate():
    """The estimate: each lost call's engine seconds times the step's tokens per call-second of its
    answered calls, at most the call's budget; an unusable reply's tokens as they were."""
    c = StepCounters(generated_tokens=300, answered_call_s=3.0)  # 100 tokens per call-second
    c.lost_to_faults += [LostCall(0.5, 200), LostCall(4.0, 64), LostCall(0.0, 32), LostCall(1.0, 128, seen=7)]
    m = engine_fault_losses(c)
    assert m == {"engine_fault_lost_calls": 4, "engine_fault_lost_call_s": 5.5,
                 "engine_fault_lost_tokens_max": 200 + 64 + 32 + 7, "engine_fault_lost_tokens_est": 50 + 64 + 0 + 7}
    assert engine_fault_losses(StepCounters())["engine_fault_lost_tokens_est"] == 0
