"""The real tier: the plugin inside real slime against real SGLang CPU engines behind the real
sglang-router (``pytest -m real``; ``bash scripts/real-stack/setup.sh`` builds the environment).

Where SGLang, the router, megatron-core, the CPU workarounds or slime cannot be had, nothing here is
collected but ``test_the_real_tier_can_run``, which skips with one line saying why. In CI
(``CI=true``, or ``APRIL_REQUIRE_REAL=1``, which ``.ci/run`` sets) the tier must run: that test
fails with the same line instead, and any other skip under ``tests/real`` (a module that cannot
import what it needs, a test that skips itself) is turned into a failure that names its reason. So
the tier cannot drop out of a green CI run unnoticed.

``real_stack`` (session scope) is the one set of engines every real-tier test shares, other people's
included: a tiny Qwen3 built here, ``APRIL_REAL_ENGINES`` engines (default 2) and the router. It is
shared state, so a test that changes it puts it back: weights pushed to the engines are restored
with ``real_stack.restore_weights()`` (the weight *version* only grows: never assume a number,
read ``real_stack.weight_version()``), and no test leaves requests running.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from april_slime.workbench.localstack import (  # noqa: F401  (SlimeRolloutManager: for the tests)
    LocalStack, SlimeRolloutManager, build_tiny_qwen3, local_stack, real_stack_missing, slime_args,
)

HERE = Path(__file__).resolve().parent

# Every conftest.py of the suite is imported under the module name "conftest", the last one
# imported taking sys.modules["conftest"]; the tier's tests and slime's --custom-rm-path import
# from this one under a name of its own.
MODULE = "real_tier"
sys.modules[MODULE] = sys.modules[__name__]

# The tiny model's shape: long-tailed lengths at temperature 1 (EOS with probability ~1/24 per
# token), so budgets of a few dozen tokens mix finished and truncated samples.
EOS_RATE = 1 / 24
MAX_RUNNING_REQUESTS = 16
MAX_TOTAL_TOKENS = 32768


def why_skipped() -> str | None:
    missing = real_stack_missing()
    if missing:
        return missing
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return "megatron-core is not installed; run `bash scripts/real-stack/setup.sh` and use its .venv"
    if importlib.util.find_spec("slime") is None:
        return ("slime is not installed: put THUDM/slime@624b824a8 in SLIME_DIR (or its tarball in "
                "../shared/third_party/) and rerun `bash scripts/real-stack/setup.sh`")
    return None


def real_tier_required() -> bool:
    """True in CI, where a real tier that cannot run is a failure rather than a skip."""
    return (os.environ.get("APRIL_REQUIRE_REAL", "") == "1"
            or os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"))


WHY_SKIPPED = why_skipped()
REQUIRED = real_tier_required()
AVAILABILITY_TEST = "test_real_tier_available.py"
if WHY_SKIPPED:
    # Only the availability test is collected: it skips (or, in CI, fails) with the reason.
    collect_ignore_glob = [str(p.relative_to(HERE)) for p in HERE.rglob("test_*.py") if p.name != AVAILABILITY_TEST]


def _under_this_tier(path) -> bool:
    path = Path(str(path))
    return path == HERE or HERE in path.parents


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _under_this_tier(item.fspath):
            item.add_marker(pytest.mark.real)


def _skip_reason(longrepr) -> str:
    # a skip's longrepr is (path, line, "Skipped: reason")
    return str(longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """In CI a module of this tier that skips at import (``pytest.skip(allow_module_level=True)``)
    fails instead, with its reason."""
    outcome = yield
    report = outcome.get_result()
    if REQUIRED and report.skipped and _under_this_tier(collector.path):
        report.outcome = "failed"
        report.longrepr = f"the real tier must run in CI, but {collector.path.name} skipped: {_skip_reason(report.longrepr)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI a test of this tier that skips fails instead, with its reason (xfail is left alone)."""
    outcome = yield
    report = outcome.get_result()
    if REQUIRED and report.skipped and not hasattr(report, "wasxfail") and _under_this_tier(item.path):
        report.outcome = "failed"
        report.longrepr = f"the real tier must run in CI, but this test skipped: {_skip_reason(report.longrepr)}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if WHY_SKIPPED:
        verdict = "FAILED (CI requires it)" if REQUIRED else "skipped"
        terminalreporter.write_line(f"tests/real {verdict}: {WHY_SKIPPED}")


# ------------------------------------------------------------------ the shared stack
def http_json(method: str, url: str, body: Any = None, timeout: float = 120.0) -> tuple[int, Any]:
    """One blocking HTTP call; the reply parsed as JSON (None for an empty body)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            status, raw = reply.status, reply.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    return status, (json.loads(raw) if raw.strip() else None)


@dataclass
class RealStack:
    """The session's engines and router, with the two models their weights can be."""

    stack: LocalStack
    model_path: Path  # the weights the engines start with
    other_model_path: Path  # same shape and tokenizer, other random weights (seed 1)
    _tokenizer: Any = field(default=None, repr=False)

    @property
    def router_url(self) -> str:
        return self.stack.router_url

    @property
    def engine_urls(self) -> list[str]:
        return list(self.stack.engine_urls)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    def weight_versions(self) -> list[int]:
        return [int(http_json("GET", f"{u}/model_info")[1]["weight_version"]) for u in self.engine_urls]

    def weight_version(self) -> int:
        """The engines' current weight version; they must agree (``restore_weights`` re-aligns
        them after a test that updated one engine only)."""
        versions = self.weight_versions()
        assert len(set(versions)) == 1, f"engines disagree on the weight version: {versions}"
        return versions[0]

    def push_weights(self, model_path: str | os.PathLike, version: int) -> None:
        """What slime's disk-based weight update does: every engine loads ``model_path`` and
        reports ``version`` from then on (SGLang waits for running requests to finish first)."""
        for url in self.engine_urls:
            status, reply = http_json("POST", f"{url}/update_weights_from_disk",
                                      {"model_path": str(model_path), "weight_version": str(version)})
            assert status == 200 and reply["success"], reply

    def restore_weights(self) -> int:
        """Every engine back to the starting weights, under one fresh version; returns it."""
        version = max(self.weight_versions()) + 1
        self.push_weights(self.model_path, version)
        return version

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            loads = [http_json("GET", f"{u}/v1/loads")[1]["loads"] for u in self.engine_urls]
            busy = sum(l["num_running_reqs"] + l["num_waiting_reqs"] for per in loads for l in per)
            if busy == 0:
                return
            assert time.monotonic() < deadline, f"engines still busy after {timeout_s} s: {loads}"
            time.sleep(0.2)


@pytest.fixture(scope="session")
def real_stack(tmp_path_factory) -> RealStack:
    from transformers import AutoTokenizer

    reuse = os.environ.get("APRIL_REAL_REUSE")
    if reuse:
        # development: `python -m april_slime.localstack --tiny DIR` already serves DIR; DIR-b holds
        # the second weights. APRIL_REAL_REUSE=ROUTER_URL,ENGINE_URL[;ENGINE_URL...],DIR
        router_url, engines, folder = reuse.split(",")
        fake = LocalStack(router_url, engines.split(";"), [], None)
        yield RealStack(fake, Path(folder), Path(folder + "-b"))
        return
    root = tmp_path_factory.mktemp("real-stack")
    model = build_tiny_qwen3(root / "tiny-qwen3", eos_rate=EOS_RATE, seed=0)
    other = build_tiny_qwen3(root / "tiny-qwen3-b", tokenizer=AutoTokenizer.from_pretrained(model),
                             eos_rate=EOS_RATE, seed=1)
    n = int(os.environ.get("APRIL_REAL_ENGINES", "2"))
    with local_stack(model, n_engines=n, max_running_requests=MAX_RUNNING_REQUESTS,
                     max_total_tokens=MAX_TOTAL_TOKENS, log_dir=root / "logs") as stack:
        yield RealStack(stack, model, other)


def write_prompts(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` arithmetic prompts in slime's jsonl format (``prompt`` / ``label``)."""
    import random

    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            f.write(json.dumps({"prompt": f"Question: what is {a} + {b}? Answer:", "label": str(a + b)}) + "\n")
    return path


def plugin_args(stack: RealStack, tmp_path: Path, *, settings: dict[str, Any] | None = None,
                batch: int = 4, n: int = 2, max_len: int = 32, prompts: int = 64,
                reward: str = "length_parity_reward", extra_argv: list[str] = (), **overrides: Any):
    """slime arguments of a job using the plugin against ``stack``'s router: real slime parser,
    ``--custom-config-path`` YAML for the ``april_*`` settings, rewards from this module (``real_tier``)."""
    import yaml

    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "april.yaml"
    config.write_text(yaml.safe_dump(settings or {}), encoding="utf-8")
    host, port = stack.router_url.removeprefix("http://").rsplit(":", 1)
    argv = [
        "--rollout-function-path", "april_slime.rollout.generate_rollout",
        "--data-source-path", "april_slime.rollout.AprilDataSource",
        "--custom-config-path", str(config),
        "--hf-checkpoint", str(stack.model_path),
        "--prompt-data", str(write_prompts(tmp_path / "prompts.jsonl", prompts)),
        "--input-key", "prompt", "--label-key", "label",
        "--rollout-batch-size", str(batch), "--n-samples-per-prompt", str(n),
        "--rollout-max-response-len", str(max_len), "--rollout-temperature", "1.0",
        "--num-rollout", "1000", "--custom-rm-path", f"{MODULE}.{reward}",
        "--sglang-router-ip", host, "--sglang-router-port", port,
        "--save", str(tmp_path / "ckpt"),
        # one GPU per engine in slime's accounting: how it counts the engines behind the router
        "--rollout-num-gpus", str(len(stack.engine_urls)), "--rollout-num-gpus-per-engine", "1",
        *extra_argv,
    ]
    return slime_args(argv, **overrides)


async def length_parity_reward(args, sample, **kwargs) -> float:
    """A reward that varies within a group, so GRPO-style normalization has something to do."""
    return float(sample.response_length % 2)


# ------------------------------------------------------------------ events placed inside requests
# Tests that need something to happen *while* requests run (an abort, a weight update) do not sleep
# and hope: they read the engines' progress from ``/v1/loads`` (requests running, KV tokens in
# use) until the requests provably hold tokens and are not finished, act then, and afterwards
# check from the samples' recorded versions that the event did land where it should. Requests are
# made long enough (a large budget, weights that almost never sample EOS) that "not finished yet"
# holds with a wide margin whatever the machine's speed.
PROGRESS_DEADLINE_S = 180.0


def engine_loads(urls: list[str]) -> list[dict]:
    return [http_json("GET", f"{u}/v1/loads")[1]["loads"][0] for u in urls]


def wait_for_progress(urls: list[str], *, running: int, tokens_each: int, prompt_tokens: int,
                      deadline_s: float = PROGRESS_DEADLINE_S, stop: Any = None) -> list[dict]:
    """Poll ``urls`` until at least ``running`` requests are running on them (none waiting) and
    their KV tokens in use show at least ``tokens_each`` generated tokens per request on average,
    counting ``prompt_tokens`` (an upper bound of one prompt's length) for each request's prompt
    even where prompts share a cached prefix: the estimate of generated tokens is low, but for the
    slot SGLang allocates for a request's next token before computing it (a token or two per
    request; callers keep a margin for it). Returns the loads seen.
    Fails naming the last loads at the deadline, or at once when ``stop`` (a ``threading.Event``)
    is set: the caller gave up, and an event placed later would land in the wrong place."""
    deadline = time.monotonic() + deadline_s
    while True:
        assert stop is None or not stop.is_set(), "stopped: the requests being waited for are gone"
        loads = engine_loads(urls)
        n_running = sum(l["num_running_reqs"] for l in loads)
        n_waiting = sum(l["num_waiting_reqs"] for l in loads)
        generated = sum(l["num_used_tokens"] for l in loads) - n_running * prompt_tokens
        if n_running >= running and n_waiting == 0 and generated >= n_running * tokens_each:
            return loads
        assert time.monotonic() < deadline, (
            f"no moment with {running} requests running and {tokens_each} tokens generated each within "
            f"{deadline_s:.0f} s; last loads: running {n_running}, waiting {n_waiting}, about {generated} "
            "generated tokens")
        time.sleep(0.01)


class Placement:
    """``act()`` run in a thread of its own at the first moment ``wait_for_progress(urls,
    **progress)`` sees, while the caller runs the requests; ``finish()`` once they are over says
    whether it acted. A lone tiny-model request decodes hundreds of tokens a second, so on a
    starved machine a poll can miss a step's requests whole: then nothing was done and ``finish()``
    returns False (the caller tries again with new requests, a bounded number of times). Any other
    failure, the deadline included, is raised by ``finish()``."""

    def __init__(self, urls: list[str], act, **progress: Any) -> None:
        import threading

        self.stop, self.placed, self.error = threading.Event(), False, None
        self.thread = threading.Thread(target=self._run, args=(urls, act, progress), daemon=True)
        self.thread.start()

    def _run(self, urls: list[str], act, progress: dict) -> None:
        try:
            wait_for_progress(urls, stop=self.stop, **progress)
        except AssertionError as e:
            if not self.stop.is_set():
                self.error = e
            return
        except BaseException as e:  # noqa: BLE001  (re-raised by finish)
            self.error = e
            return
        try:
            act()
            self.placed = True
        except BaseException as e:  # noqa: BLE001  (re-raised by finish)
            self.error = e

    def finish(self) -> bool:
        self.stop.set()
        self.thread.join()
        if self.error is not None:
            raise AssertionError(f"placing the event inside the requests failed: {self.error!r}") from self.error
        return self.placed


def prompt_token_bound(stack: "RealStack", prompts_jsonl: Path) -> int:
    """The longest prompt of a jsonl prompt file, in tokens."""
    lines = Path(prompts_jsonl).read_text(encoding="utf-8").splitlines()
    return max(len(stack.tokenizer.encode(json.loads(line)["prompt"], add_special_tokens=False))
               for line in lines if line.strip())


def post_ok(url: str, body: Any) -> Any:
    status, reply = http_json("POST", url, body)
    assert status == 200, (url, reply)
    return reply


def pause_in_place(urls: list[str]) -> None:
    """SGLang's in-place pause: running requests stay where they are, no token is computed until
    ``continue_generation``, new requests wait."""
    for url in urls:
        post_ok(f"{url}/pause_generation", {"mode": "in_place"})


def continue_generation(urls: list[str]) -> None:
    for url in urls:
        post_ok(f"{url}/continue_generation", {})


def abort_and_hold(urls: list[str]) -> None:
    """SGLang's abort pause: every running request is aborted (its reply carries the tokens it
    has) and new requests wait until ``continue_generation``; returns once nothing runs."""
    for url in urls:
        post_ok(f"{url}/pause_generation", {"mode": "abort"})


def load_weights(urls: list[str], model_path: str | os.PathLike, version: int, flush_cache: bool = True) -> None:
    """``/update_weights_from_disk`` under ``version``; on a paused engine it applies at once."""
    for url in urls:
        reply = post_ok(f"{url}/update_weights_from_disk", {"model_path": str(model_path),
                                                            "weight_version": str(version),
                                                            "flush_cache": flush_cache})
        assert reply["success"], reply


@pytest.fixture(scope="session")
def long_weights(real_stack, tmp_path_factory) -> tuple[Path, Path]:
    """Two weights of the stack's shape and tokenizer whose logits spread like the stack's (std 2)
    but whose EOS is about 1e-6 likely per token at temperature 1 (about 1 in 10^4 responses of
    100 tokens ends early) and, far below the other logits, never the greedy choice: responses run
    to their budget, so a request is still running a known number of tokens after it started."""
    root = tmp_path_factory.mktemp("long-weights")
    paths = []
    for seed in (3, 4):
        paths.append(build_tiny_qwen3(root / f"long-{seed}", tokenizer=real_stack.tokenizer, eos_rate=1e-6,
                                      seed=seed))
    return paths[0], paths[1]


def version_spans(sample) -> list[tuple[int, int]]:
    """The per-token version runs the plugin recorded for a slime sample."""
    from april_slime import rollout

    return [(int(v), int(c)) for v, c in sample.train_metadata[rollout.TOKEN_VERSIONS_KEY]]
