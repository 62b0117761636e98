"""Inside a slime job, for the fault-tolerance test of slime's launcher (``tests/real/test_slime_launcher.py``):
the plugin's rollout function as slime loads it (``--rollout-function-path
tests.support.slime_faults.generate_rollout``), with what the test must see and do from inside
slime's ``RolloutManager`` actor.

* **What each engine served.** Every ``/generate`` the plugin sends (health probes aside) is
  recorded with its engine, when it was sent and how it ended (a reply, and its tokens, or the
  error), in ``<faults_dir>/rollout_<id>.json`` once the rollout has returned.
* **When to kill.** In rollout ``faults_kill_rollout``, as soon as ``faults_kill_at`` of the
  plugin's requests are in flight on the engine of the lowest port, ``<faults_dir>/in_flight.json``
  names it (slime restarts a dead engine on the first free port from its base, so the engine comes
  back at its own address and the router's list reads as before: the harder case for the plugin,
  which must notice the engine answers again without a new address to tell it): the test
  waits for that file and SIGKILLs the engine's processes, so the kill lands while they run, not
  before they start (slime's ``--ci-test`` injection crashes its engine at the top of a rollout).
* **Recovery.** slime restarts the engines its ``RolloutHealthMonitor`` killed in
  ``RolloutManager.recover_updatable_engines``, which the trainer calls from ``update_weights``;
  under ``--debug-rollout-only`` (no trainer on a CPU) ``update_weights`` returns before it
  (slime/backends/megatron_utils/actor.py), so nothing recovers. At the top of rollout
  ``faults_recover_before`` this module calls that same method of the running ``RolloutManager``
  where ``update_weights`` would have, after waiting until the monitor has marked the engine dead
  (slime's own event: the engine's slot set to ``None``), and resumes the monitor as ``generate``
  does. A trainer then connects the new engine to its weight-update group and pushes the weights,
  which takes a while; here the wait is for the router to list the new engine, which the plugin
  reads at the start of the rollout. ``<faults_dir>/recovered.json`` says what was recovered.

The settings come from the job's ``--custom-config-path`` YAML (slime sets every key on ``args``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from april_slime import rollout
from april_slime.core.transport import HttpTransport
from tests.support.engine_spans import reply_token_count

# how long the recovery waits for slime's health monitor to mark the killed engine dead, and for
# the router to list the engine slime started in its place (a loaded 2-core machine is slow)
WAIT_S = 600.0


def _write(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1), encoding="utf-8")
    os.replace(tmp, path)


class _Recorder:
    """The plugin's generate calls of the current rollout, recorded at the transport."""

    def __init__(self, args: Any) -> None:
        self.folder = Path(args.faults_dir)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.kill_rollout = int(args.faults_kill_rollout)
        self.kill_at = int(args.faults_kill_at)
        self.rollout_id: int | None = None
        self.calls: list[dict] = []
        self.in_flight: Counter[str] = Counter()
        self.signalled = False
        self.kill_target: str | None = None  # the engine to kill, in the rollout of the kill
        original = HttpTransport.request
        recorder = self

        async def recording(transport, method, url, path, payload, timeout_s):
            if path != "/generate" or str((payload or {}).get("rid", "")).startswith("april-probe-"):
                return await original(transport, method, url, path, payload, timeout_s)
            return await recorder.generate(original, transport, method, url, path, payload, timeout_s)

        HttpTransport.request = recording

    async def generate(self, original, transport, method, url, path, payload, timeout_s):
        url = url.rstrip("/")
        call = {"url": url, "rid": payload.get("rid"), "sent": time.time()}
        self.in_flight[url] += 1
        self._signal_if_due(url)
        try:
            reply = await original(transport, method, url, path, payload, timeout_s)
        except BaseException as e:
            call["error"] = f"{type(e).__name__}: {e}"[:300]
            raise
        else:
            call["tokens"] = reply_token_count(reply)
            return reply
        finally:
            call["ended"] = time.time()
            self.in_flight[url] -= 1
            self.calls.append(call)

    def _signal_if_due(self, url: str) -> None:
        if (self.signalled or self.rollout_id != self.kill_rollout or self.in_flight[url] < self.kill_at
                or _port(url) != _port(self.kill_target)):
            return
        self.signalled = True
        _write(self.folder / "in_flight.json", {"url": url, "rollout": self.rollout_id,
                                                "in_flight": self.in_flight[url], "time": time.time()})

    def begin(self, rollout_id: int, engines: list[str]) -> None:
        self.rollout_id, self.calls = rollout_id, []
        if rollout_id == self.kill_rollout:
            self.kill_target = min(engines, key=_port)

    def end(self) -> None:
        _write(self.folder / f"rollout_{self.rollout_id}.json", self.calls)


_RECORDER: _Recorder | None = None


def _rollout_manager() -> Any:
    """slime's ``RolloutManager`` instance whose ``generate`` called this rollout function (its frame
    is below this one on the stack: ``generate`` -> ``_get_rollout_data`` -> ``call_rollout_fn``)."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and type(owner).__name__ == "RolloutManager":
            return owner
        frame = frame.f_back
    raise RuntimeError("no slime RolloutManager on the stack: this function must be slime's rollout function")


def _router_lists(args: Any) -> list[str]:
    with urllib.request.urlopen(f"http://{args.sglang_router_ip}:{args.sglang_router_port}/workers",
                                timeout=30) as reply:
        return sorted(w["url"].rstrip("/") for w in json.loads(reply.read())["workers"])


def _port(url: str | None) -> int | None:
    return None if url is None else urlsplit(url).port


def _wait(condition, what: str) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > WAIT_S:
            raise RuntimeError(f"waited {WAIT_S:.0f} s for {what}")
        time.sleep(0.5)
    return time.monotonic() - started


def _recover_as_the_weight_update_would(args: Any, folder: Path) -> None:
    import ray

    manager = _rollout_manager()
    server = manager._get_updatable_server()
    waited_for_monitor = _wait(lambda: any(e is None for e in server.all_engines),
                               "slime's health monitor to mark the killed engine dead")
    listed_before = _router_lists(args)
    manager.recover_updatable_engines()
    manager.health_monitoring_resume()
    urls = sorted(u.rstrip("/") for u in ray.get([e.get_url.remote() for e in server.engines]))
    listed_at_once = _router_lists(args)
    waited_for_router = _wait(lambda: set(urls) <= set(_router_lists(args)), "the router to list the recovered engine")
    _write(folder / "recovered.json", {"engines": urls, "listed_before": listed_before,
                                       "listed_at_once": listed_at_once,
                                       "waited_for_monitor_s": waited_for_monitor,
                                       "waited_for_router_s": waited_for_router})


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False):
    """The plugin's ``april_slime.rollout.generate_rollout``, recorded (see the module docstring)."""
    global _RECORDER
    if evaluation:
        return rollout.generate_rollout(args, rollout_id, data_source, evaluation=True)
    if _RECORDER is None:
        _RECORDER = _Recorder(args)
    if rollout_id == int(args.faults_recover_before):
        _recover_as_the_weight_update_would(args, _RECORDER.folder)
    # the router may list no worker yet when the first rollout starts (slime adds its engines as they come up)
    _wait(lambda: _router_lists(args), "the router to list the engines")
    _RECORDER.begin(rollout_id, _router_lists(args))
    try:
        return rollout.generate_rollout(args, rollout_id, data_source)
    finally:
        _RECORDER.end()
