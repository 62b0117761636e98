"""Start an emulated cluster inside the running event loop, for tests and benchmarks."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from .cluster import EmulatorCluster, LocalTransport
from .config import EngineConfig
from .model import LengthModel, SyntheticLM


@dataclass
class RunningCluster:
    router_url: str
    engine_urls: list[str]
    cluster: EmulatorCluster
    transport: LocalTransport  # in-process access to the same handlers (also works over HTTP URLs)


def build_cluster(num_engines: int = 2, seed: int = 0, *, length: LengthModel | str | None = None,
                  engine_config: EngineConfig | None = None, vocab_size: int | None = None,
                  eos_token_id: int | None = None, **engine_overrides: Any) -> EmulatorCluster:
    """An unstarted cluster; ``engine_overrides`` are ``EngineConfig`` fields (``time_scale``,
    ``kv_capacity_tokens``, ``max_running_requests``, ``time=TimeModel(...)``, ...)."""
    if isinstance(length, str):
        length = LengthModel.parse(length)
    model_kw: dict[str, Any] = {"seed": seed}
    if length is not None:
        model_kw["length"] = length
    if vocab_size is not None:
        model_kw["vocab_size"] = vocab_size
    if eos_token_id is not None:
        model_kw["eos_token_id"] = eos_token_id
    config = replace(engine_config or EngineConfig(), **engine_overrides)
    return EmulatorCluster(num_engines, model=SyntheticLM(**model_kw), engine_config=config)


@contextlib.asynccontextmanager
async def start_cluster(num_engines: int = 2, seed: int = 0, *, time_scale: float = 50.0,
                        http: bool = True, host: str = "127.0.0.1",
                        **kw: Any) -> AsyncIterator[RunningCluster]:
    """Router + engines in the current loop; over HTTP on free loopback ports unless ``http`` is
    False (then the URLs are in-process names for ``transport``, e.g. under ``run_virtual``, where
    ``time_scale`` should be 1). Other keywords as for ``build_cluster``. Tears down on exit."""
    cluster = build_cluster(num_engines, seed, time_scale=time_scale, **kw)
    await cluster.start()
    try:
        if http:
            await cluster.serve_http(host)
        yield RunningCluster(cluster.router_url, list(cluster.engine_urls), cluster, cluster.transport())
    finally:
        await cluster.close()


# ================================================================== golden replies
# The same scenarios run against a real SGLang 0.5.23 engine (recorded once into
# tests/data/sglang-0.5.23-golden.json by scripts/real-stack/record_golden.py, and re-checked live by
# the real test tier) and against the emulator (tests/test_emulator.py): their replies must have
# the same shape, field by field (``reply_shape``).

GOLDEN_PROMPT = [11, 12, 13, 14, 15, 16]


async def golden_replies(engine_url: str, *, max_running_requests: int, new_weights_path: str,
                         weight_version: int) -> dict[str, dict]:
    """Run the protocol scenarios against one engine (no router) and return, per scenario, the
    request(s) made and the replies: ``{"status": int, "body": parsed JSON | None, "raw": str}``.

    ``max_running_requests`` is the engine's setting (to queue requests behind it);
    ``new_weights_path`` is what ``/update_weights_from_disk`` loads (a real engine needs weights
    of the served shape; the emulator accepts any path); ``weight_version`` is the engine's version
    now (the scenarios move it to ``weight_version + 1``)."""
    import asyncio
    import json

    import aiohttp

    out: dict[str, dict] = {}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def call(method: str, path: str, body: Any = None) -> dict:
            async with session.request(method, engine_url + path, json=body) as r:
                raw = await r.text()
            try:
                parsed = json.loads(raw) if raw.strip() else None
            except json.JSONDecodeError:
                parsed = None
            return {"status": r.status, "body": parsed, "raw": raw if parsed is None else ""}

        def gen(rid: str, max_new: int, **sampling: Any) -> dict:
            return {"input_ids": GOLDEN_PROMPT, "rid": rid, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0, **sampling}}

        async def wait_load(pred) -> None:
            for _ in range(600):
                loads = (await call("GET", "/v1/loads"))["body"]["loads"]
                if pred(sum(e["num_running_reqs"] for e in loads), sum(e["num_waiting_reqs"] for e in loads)):
                    return
                await asyncio.sleep(0.05)
            raise TimeoutError("engine load never reached the expected state")

        out["generate_length"] = {"request": gen("golden-length", 6, ignore_eos=True)}
        out["generate_length"]["reply"] = await call("POST", "/generate", out["generate_length"]["request"])
        greedy = gen("golden-greedy", 6, temperature=0.0, top_k=1, ignore_eos=True)
        out["generate_greedy"] = {"request": greedy, "reply": await call("POST", "/generate", greedy)}
        third = out["generate_greedy"]["reply"]["body"]["output_ids"][2]
        # the greedy continuation again, told to stop at its third token (a 400 from the emulator)
        stop = gen("golden-stop", 6, temperature=0.0, top_k=1, stop_token_ids=[third])
        out["generate_stop_token"] = {"request": stop, "reply": await call("POST", "/generate", stop)}
        out["generate_zero_tokens"] = {"request": gen("golden-zero", 0)}
        out["generate_zero_tokens"]["reply"] = await call("POST", "/generate", out["generate_zero_tokens"]["request"])

        # abort of a running request, by rid: the generate returns its partial output
        long = gen("golden-abort", 3000, ignore_eos=True)
        pending = asyncio.create_task(call("POST", "/generate", long))
        await wait_load(lambda running, waiting: running >= 1)
        await asyncio.sleep(0.3)
        abort = await call("POST", "/abort_request", {"rid": "golden-abort"})
        out["abort_running"] = {"request": long, "abort_reply": abort, "reply": await pending}

        # abort_all with requests queued behind max_running_requests
        reqs = [gen(f"golden-queued-{i}", 3000, ignore_eos=True) for i in range(max_running_requests + 2)]
        tasks = [asyncio.create_task(call("POST", "/generate", r)) for r in reqs]
        await wait_load(lambda running, waiting: waiting >= 1)
        abort = await call("POST", "/abort_request", {"abort_all": True})
        replies = await asyncio.gather(*tasks)
        queued = [r for r in replies if "prompt_tokens" not in r["body"]["meta_info"]]
        running = [r for r in replies if r["body"]["meta_info"].get("completion_tokens", 0) > 0]
        out["abort_all"] = {"abort_reply": abort, "running_reply": running[0] if running else None,
                            "queued_reply": queued[0] if queued else None}
        out["abort_unknown_rid"] = {"abort_reply": await call("POST", "/abort_request", {"rid": "no-such-rid"})}
        out["abort_empty_body"] = {"abort_reply": await call("POST", "/abort_request", {})}

        out["loads"] = {"reply": await call("GET", "/v1/loads")}
        out["model_info"] = {"reply": await call("GET", "/model_info")}
        out["workers_on_engine"] = {"reply": await call("GET", "/workers")}
        out["get_weight_version"] = {"reply": await call("GET", "/get_weight_version")}

        new_version = weight_version + 1
        update = {"model_path": new_weights_path, "weight_version": str(new_version)}
        out["update_weights_from_disk"] = {"request": update,
                                           "reply": await call("POST", "/update_weights_from_disk", update)}
        out["model_info_after_update"] = {"reply": await call("GET", "/model_info")}
        out["generate_after_update"] = {"request": gen("golden-after-update", 4, ignore_eos=True)}
        out["generate_after_update"]["reply"] = await call("POST", "/generate",
                                                           out["generate_after_update"]["request"])

        # malformed requests
        bad = {
            "temperature_negative": {"input_ids": GOLDEN_PROMPT, "sampling_params": {"max_new_tokens": 4,
                                                                                      "temperature": -1}},
            "temperature_string": {"input_ids": GOLDEN_PROMPT, "sampling_params": {"max_new_tokens": 4,
                                                                                    "temperature": "hot"}},
            "max_new_tokens_negative": {"input_ids": GOLDEN_PROMPT, "sampling_params": {"max_new_tokens": -1}},
            "input_ids_empty": {"input_ids": [], "sampling_params": {"max_new_tokens": 4}},
            "no_input": {"sampling_params": {"max_new_tokens": 4}},
            "unknown_sampling_param": {"input_ids": GOLDEN_PROMPT, "sampling_params": {"max_new_tokens": 4,
                                                                                        "tempreature": 1}},
        }
        for name, body in bad.items():
            out[f"bad_{name}"] = {"request": body, "reply": await call("POST", "/generate", body)}
        dup = gen("golden-dup", 3000, ignore_eos=True)
        first_call = asyncio.create_task(call("POST", "/generate", dup))
        await wait_load(lambda running, waiting: running >= 1)
        out["bad_duplicate_rid"] = {"request": dup, "reply": await call("POST", "/generate", dup)}
        await call("POST", "/abort_request", {"rid": "golden-dup"})
        await first_call
    return out


# Fields whose value (not just type) carries protocol meaning.
_PINNED = ("finish_reason.type", "success", "status")
# Present as null or as an object depending on prefix-cache hits.
_NULLABLE = ("cached_tokens_details",)
# Scenarios whose replies carry many engine internals: the compared side may send a subset.
SUBSET_SCENARIOS = ("model_info", "model_info_after_update", "loads")
# Keys the emulator adds on purpose (not SGLang's): its per-token version runs, for its own tests,
# and cumulative retractions in /v1/loads, for the adaptive concurrency controller.
EMULATOR_EXTENSIONS = ("emulator_version_runs", "num_retractions")


def reply_shape(value: Any, path: str = "") -> Any:
    """The structure of a reply: dict keys (recursively), list element shapes, scalar types;
    values only for the fields that carry protocol meaning (``_PINNED``)."""
    if isinstance(value, dict):
        return {k: reply_shape(v, f"{path}.{k}".lstrip(".")) for k, v in sorted(value.items())}
    if isinstance(value, list):
        shapes = []
        for item in value:
            s = reply_shape(item, path + "[]")
            if s not in shapes:
                shapes.append(s)
        return shapes
    if any(path == p or path.endswith("." + p) for p in _PINNED):
        return value
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def shape_differences(got: Any, want: Any, *, subset: bool = False, path: str = "") -> list[str]:
    """Where reply ``got`` differs in shape from ``want`` (both raw replies), one line each.
    ``subset``: ``got`` may omit keys of ``want`` (but sends none it does not have)."""
    return _diff(reply_shape(got), reply_shape(want), subset, path)


def _diff(got: Any, want: Any, subset: bool, path: str) -> list[str]:
    if isinstance(got, dict) and isinstance(want, dict):
        out = []
        for key in sorted(set(got) | set(want)):
            where = f"{path}.{key}".lstrip(".")
            if key not in want:
                if key not in EMULATOR_EXTENSIONS:
                    out.append(f"{where}: sent, but SGLang does not send it")
            elif key not in got:
                if not subset:
                    out.append(f"{where}: missing (SGLang sends {want[key]!r})")
            elif key in _NULLABLE and "NoneType" in (got[key], want[key]):
                continue
            else:
                out += _diff(got[key], want[key], subset, where)
        return out
    if isinstance(got, list) and isinstance(want, list):
        if not want or not got:
            return []
        return [line for g in got for line in
                (_diff(g, want[0], subset, path + "[]") if len(want) == 1 else
                 ([] if g in want else [f"{path}[]: element {g!r} not among {want!r}"]))]
    return [] if got == want else [f"{path}: {got!r} where SGLang has {want!r}"]


def golden_differences(got: dict[str, dict], want: dict[str, dict], *, skip: tuple[str, ...] = ()) -> list[str]:
    """Compare two ``golden_replies`` results reply by reply (``request`` entries are inputs)."""
    out = []
    for name, scenario in want.items():
        if name in skip:
            continue
        if name not in got:
            out.append(f"{name}: not run")
            continue
        for part, reply in scenario.items():
            if part == "request" or reply is None:
                continue
            mine = got[name].get(part)
            if mine is None:
                out.append(f"{name}.{part}: no reply")
                continue
            mine = {k: v for k, v in mine.items() if k != "raw"}
            theirs = {k: v for k, v in reply.items() if k != "raw"}
            out += [f"{name}.{part}: {line}" for line in
                    shape_differences(mine, theirs, subset=name in SUBSET_SCENARIOS)]
    return out
