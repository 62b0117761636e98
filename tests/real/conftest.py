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

The helpers the tier's tests share (``RealStack``, ``plugin_args``, ``Placement``, ...) are in
``tests.support.real_tier``; this file holds the tier's gate, its hooks and its fixtures.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.real_tier import (
    EOS_RATE,
    MAX_RUNNING_REQUESTS,
    MAX_TOTAL_TOKENS,
    REQUIRED,
    SGLANG_0515,
    WHY_SKIPPED,
    LocalStack,
    RealStack,
    build_tiny_qwen3,
    http_json,
    load_hf_models,
    local_stack,
    sglang_0515_python,
)

HERE = Path(__file__).resolve().parent
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
        report.longrepr = (f"the real tier must run in CI, but {collector.path.name} skipped: "
                           f"{_skip_reason(report.longrepr)}")


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
@pytest.fixture(scope="session")
def real_stack(tmp_path_factory) -> RealStack:
    from transformers import AutoTokenizer

    reuse = os.environ.get("APRIL_REAL_REUSE")
    if reuse:
        # development: `python -m april_workbench.localstack --tiny DIR` already serves DIR; DIR-b holds
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


@pytest.fixture(scope="session")
def old_stack(real_stack, tmp_path_factory) -> RealStack:
    """Two SGLang 0.5.15.post1 engines (the SGLang of slime's images at the pin) behind their router,
    serving the stack's weights, shared by tests/real/test_sglang_0515.py and slime's launcher
    tests (which use them as external engines: a job runs more than one engine)."""
    python = sglang_0515_python()
    logs = tmp_path_factory.mktemp("sglang-0515-logs")
    with local_stack(real_stack.model_path, n_engines=2, max_running_requests=MAX_RUNNING_REQUESTS,
                     max_total_tokens=MAX_TOTAL_TOKENS, log_dir=logs, python=python) as stack:
        status, loads = http_json("GET", f"{stack.engine_urls[0]}/v1/loads")
        assert status == 200 and loads["version"] == SGLANG_0515, loads
        yield RealStack(stack, real_stack.model_path, real_stack.other_model_path)


@pytest.fixture(scope="session")
def hf_models(real_stack) -> dict:
    """The stack's weights A and B in transformers (``load_hf_models``), for log-prob checks."""
    return load_hf_models(real_stack)


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
