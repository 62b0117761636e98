"""A real, local rollout stack: a tiny model, SGLang CPU engines, and the sglang-router in front.

What slime jobs run (SGLang engines behind ``sglang-router``), shrunk to one machine without a GPU
and without network: the real test tier, ``april-slime demo`` and the calibration tests build on it.

    build_tiny_qwen3(dir)                     # tiny_qwen3: random Qwen3 + a locally trained tokenizer
    with local_stack(dir, n_engines=2) as s:  # engines + router on free loopback ports
        s.router_url, s.engine_urls

From a shell (for people; stops everything on Ctrl-C)::

    python -m april_workbench.localstack --tiny /tmp/tiny --engines 2

Engines run SGLang 0.5.23 on CPU (``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu --attention-backend
torch_native --sampling-backend pytorch --disable-cuda-graph --dtype float32``), which needs the
environment ``scripts/real-stack/setup.sh`` builds; ``real_stack_missing()`` says what is absent.
Every server binds a port chosen at run time and runs in its own process group, which ``stop()``
(or leaving the ``with`` block) kills whole. slime's rollout side on top of it is
``rollout_manager``'s.

Only the standard library is imported at module level (``tiny_qwen3`` imports torch and
transformers when it builds a model).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from april_workbench.tiny_qwen3 import build_tiny_qwen3

__all__ = [
    "LocalEngine",
    "LocalRouter",
    "LocalStack",
    "ServerStartError",
    "local_stack",
    "real_stack_missing",
]

# The flags that make SGLang 0.5.23 serve on CPU from PyPI wheels (see scripts/real-stack/README.md).
# --sleep-on-idle: an idle scheduler otherwise busy-polls, about half a core per engine on a CPU
# (measured: 0.1 s of CPU per 10 s idle with it), which the other engines and tests then lack
CPU_ENGINE_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                    "--disable-cuda-graph", "--dtype", "float32", "--sleep-on-idle")
# The runtime workarounds that must run inside SGLang's own processes (its spawned scheduler too), as a
# sitecustomize first on the engines' PYTHONPATH: --enable-return-routed-experts on a CPU torch.
CPU_SITE = Path(__file__).resolve().parents[2] / "scripts" / "real-stack" / "sglang_cpu_site"


# ====================================================================== environment check
def real_stack_missing() -> str | None:
    """None when SGLang, the router and the CPU workarounds are in this environment, else one line
    saying what is missing and how to get it."""
    fix = "run `bash scripts/real-stack/setup.sh` and use its .venv"
    for module, what in (("sglang", "SGLang"), ("sglang_router", "sglang-router"),
                         ("transformers", "transformers"), ("torch", "torch")):
        if importlib.util.find_spec(module) is None:
            return f"{what} is not installed ({module} not importable); {fix}"
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None:
        return f"sgl_kernel is missing (SGLang imports CPU helpers from it); {fix}"
    if "assign_req_to_token_pool_cpu" not in Path(spec.origin).read_text(encoding="utf-8", errors="replace"):
        return f"{spec.origin} lacks the CPU helpers SGLang needs (assign_req_to_token_pool_cpu); {fix}"
    tv = importlib.util.find_spec("torchvision")
    if tv is not None and tv.submodule_search_locations:
        meta = Path(list(tv.submodule_search_locations)[0]) / "_meta_registrations.py"
        if meta.exists() and '@torch.library.register_fake("torchvision::nms")\n' in meta.read_text(encoding="utf-8"):
            return f"torchvision's nms fake registration is unguarded ({meta}), so SGLang cannot import; {fix}"
    return None


# ====================================================================== servers
class ServerStartError(RuntimeError):
    """A server process died or did not answer in time; the message carries its log's tail."""


def free_port(host: str = "127.0.0.1", *, below: int | None = None) -> int:
    """A port nothing listens on now. ``below`` bounds it: the kernel's ephemeral range reaches 60999,
    and some servers derive further ports from theirs (SGLang 0.5.15 refuses to start when its
    --port + 10000, the gRPC port it derives, passes 65535)."""
    if below is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    top = min(below, 32768)  # below the ephemeral range too, so no outgoing connection takes the port
    for _ in range(200):
        candidate = random.randrange(20000, top)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, candidate))
            except OSError:
                continue
            return candidate
    raise OSError(f"no free port on {host} in 20000-{top - 1} after 200 tries")


def _get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read() or b"null")


def _tail(path: Path | None, n: int = 40) -> str:
    if path is None or not path.exists():
        return ""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n:])


@dataclass
class _Process:
    """One server command in its own process group, logging to a file."""

    name: str
    log_path: Path | None
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    _own_log: bool = False

    def launch(self, cmd: list[str]) -> None:
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"april-{self.name}-", suffix=".log")
            os.close(fd)
            self.log_path, self._own_log = Path(name), True
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env}, start_new_session=True)

    def wait_ready(self, probe, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is None:
                raise ServerStartError(f"{self.name}: not launched")
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(f"{self.name} exited with code {code} before {what}; log "
                                       f"{self.log_path}:\n{_tail(self.log_path)}")
            try:
                if probe():
                    return
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"{self.name}: no {what} within {timeout_s:.0f} s; log "
                                       f"{self.log_path}:\n{_tail(self.log_path)}")
            time.sleep(0.5)

    def address_in_use(self) -> bool:
        text = _tail(self.log_path, 200)
        return "address already in use" in text.lower() or "errno 98" in text.lower()

    def stop(self, grace_s: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                # the leader is gone; children of the group may linger a moment longer
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if self._own_log and self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()


# SGLang derives ports from --port (+10000 for gRPC in 0.5.15, +233 for DP attention); an engine's
# own port stays low enough that all of them are valid.
ENGINE_PORT_LIMIT = 65535 - 10000


class LocalEngine:
    """One SGLang 0.5.23 CPU engine serving ``model_path`` in a subprocess.

    ``port=None`` picks a free port at start (and another one if it was taken meanwhile).
    ``threads`` sets OMP_NUM_THREADS for the engine (1 by default: the machines it is meant for
    are small and shared). ``extra_args`` go to ``sglang.launch_server`` as they are. ``python`` is
    the interpreter that serves (default: this one); another SGLang build lives in another venv.
    """

    def __init__(self, model_path: str | os.PathLike, *, port: int | None = None, host: str = "127.0.0.1",
                 max_total_tokens: int = 32768, max_running_requests: int = 64, weight_version: int | str = 0,
                 extra_args: Sequence[str] = (), log_path: str | os.PathLike | None = None, threads: int = 1,
                 env: dict[str, str] | None = None, python: str | None = None) -> None:
        self.model_path = str(model_path)
        self.python = python or sys.executable
        self.host = host
        self._fixed_port = port
        self.port = port
        self.max_total_tokens = max_total_tokens
        self.max_running_requests = max_running_requests
        self.weight_version = str(weight_version)
        self.extra_args = list(extra_args)
        env = dict(env or {})
        if CPU_SITE.is_dir():
            inherited = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SITE), inherited) if p)
        elif "--enable-return-routed-experts" in self.extra_args:
            raise ServerStartError(f"--enable-return-routed-experts on CPU needs the workaround in {CPU_SITE}, "
                                   "which is missing (it ships with the repository's scripts/real-stack)")
        self._process = _Process("sglang-engine", Path(log_path) if log_path else None,
                                 env={"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": str(threads),
                                      "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", **env})

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("engine not started: no port yet")
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path | None:
        return self._process.log_path

    @property
    def pid(self) -> int | None:
        return self._process.proc.pid if self._process.proc else None

    def command(self) -> list[str]:
        return [self.python, "-m", "sglang.launch_server", "--model-path", self.model_path,
                "--host", self.host, "--port", str(self.port), *CPU_ENGINE_FLAGS,
                "--max-total-tokens", str(self.max_total_tokens),
                "--max-running-requests", str(self.max_running_requests),
                "--weight-version", self.weight_version, "--skip-server-warmup", *self.extra_args]

    def launch(self) -> LocalEngine:
        """Start the process without waiting (``wait_ready`` waits); lets several engines boot at once."""
        if self.port is None or self._fixed_port is None:
            self.port = free_port(self.host, below=ENGINE_PORT_LIMIT)
        self._process.launch(self.command())
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> LocalEngine:
        for attempt in range(3):
            try:
                self._process.wait_ready(lambda: _get_json(f"{self.url}/model_info") is not None, timeout_s,
                                         "reply on /model_info")
                return self
            except ServerStartError:
                if self._fixed_port is not None or attempt == 2 or not self._process.address_in_use():
                    raise
                self._process.stop()
                self.launch()
        return self

    def start(self, timeout_s: float = 600.0) -> LocalEngine:
        return self.launch().wait_ready(timeout_s)

    def stop(self) -> None:
        self._process.stop()

    def __enter__(self) -> LocalEngine:
        return self.start() if self._process.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class LocalRouter:
    """sglang-router (the Rust router slime launches) in front of ``worker_urls``, with the settings
    slime gives it: no circuit breaker, no health checks of its own."""

    def __init__(self, worker_urls: Sequence[str], *, port: int | None = None, host: str = "127.0.0.1",
                 policy: str | None = None, extra_args: Sequence[str] = (),
                 log_path: str | os.PathLike | None = None) -> None:
        self.worker_urls = list(worker_urls)
        self.host = host
        self._fixed_port = port
        self.port = port
        self.policy = policy
        self.extra_args = list(extra_args)
        self.prometheus_port: int | None = None
        self._process = _Process("sglang-router", Path(log_path) if log_path else None)

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("router not started: no port yet")
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path | None:
        return self._process.log_path

    @property
    def metrics_url(self) -> str:
        """The router's Prometheus metrics (``smg_worker_cb_outcomes_total{worker=...}`` counts the
        requests each engine answered through it, circuit breaker off or not)."""
        if self.prometheus_port is None:
            raise RuntimeError("router not started: no metrics port yet")
        return f"http://{self.host}:{self.prometheus_port}/metrics"

    def command(self) -> list[str]:
        # no worker URLs: engines are registered later with POST /workers, as slime registers them
        workers = ["--worker-urls", *self.worker_urls] if self.worker_urls else []
        self.prometheus_port = free_port(self.host)
        cmd = [sys.executable, "-m", "sglang_router.launch_router", *workers,
               "--host", self.host, "--port", str(self.port), "--prometheus-host", self.host,
               "--prometheus-port", str(self.prometheus_port), "--disable-circuit-breaker",
               "--disable-health-check"]
        if self.policy:
            cmd += ["--policy", self.policy]
        return cmd + self.extra_args

    def _serves_all_workers(self) -> bool:
        listed = {w.get("url") for w in _get_json(f"{self.url}/workers").get("workers", [])}
        return set(self.worker_urls) <= listed

    def start(self, timeout_s: float = 600.0) -> LocalRouter:
        # The deadline only guards against a hang, like the engines': on a starved machine the
        # router's start-up alone (a Python launcher, then the Rust server) has taken over 120 s.
        for attempt in range(3):
            if self.port is None or self._fixed_port is None:
                self.port = free_port(self.host)
            self._process.launch(self.command())
            try:
                self._process.wait_ready(self._serves_all_workers, timeout_s, "list of its workers on /workers")
                return self
            except ServerStartError:
                if self._fixed_port is not None or attempt == 2 or not self._process.address_in_use():
                    raise
                self._process.stop()
        return self

    def stop(self) -> None:
        self._process.stop()

    def __enter__(self) -> LocalRouter:
        return self.start() if self._process.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@dataclass
class LocalStack:
    router_url: str
    engine_urls: list[str]
    engines: list[LocalEngine]
    router: LocalRouter


@contextlib.contextmanager
def local_stack(model_path: str | os.PathLike, n_engines: int = 1, *, router_kwargs: dict | None = None,
                start_timeout_s: float = 600.0, log_dir: str | os.PathLike | None = None,
                **engine_kwargs: Any) -> Iterator[LocalStack]:
    """``n_engines`` CPU engines (booted concurrently) behind one router; all stopped on exit.
    ``engine_kwargs`` go to every ``LocalEngine``. With ``log_dir``, the servers log to
    ``engine-<i>.log`` and ``router.log`` there (kept); else to temporary files removed on stop."""
    if n_engines < 1:
        raise ValueError(f"n_engines must be >= 1, got {n_engines}")
    logs = Path(log_dir) if log_dir is not None else None
    engines = [LocalEngine(model_path, log_path=logs / f"engine-{i}.log" if logs else None, **engine_kwargs)
               for i in range(n_engines)]
    router_kwargs = dict(router_kwargs or {})
    if logs:
        router_kwargs.setdefault("log_path", logs / "router.log")
    router = None
    try:
        for engine in engines:
            engine.launch()
        for engine in engines:
            engine.wait_ready(start_timeout_s)
        router = LocalRouter([e.url for e in engines], **router_kwargs).start()
        yield LocalStack(router.url, [e.url for e in engines], engines, router)
    finally:
        if router is not None:
            router.stop()
        for engine in engines:
            engine.stop()


# ====================================================================== command line
def main(argv: Sequence[str] | None = None, prog: str = "python -m april_workbench.localstack") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a model on local SGLang CPU engines behind sglang-router until interrupted.")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a local Hugging Face model folder")
    src.add_argument("--tiny", metavar="DIR", help="build a tiny random Qwen3 in DIR (reused if present) and serve it")
    parser.add_argument("--eos-rate", type=float, default=None,
                        help="with --tiny: per-token EOS probability shaped into the weights")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per engine")
    parser.add_argument("--no-router", action="store_true", help="engines only")
    parser.add_argument("--log-dir", type=Path, default=None)
    ns = parser.parse_args(argv)
    missing = real_stack_missing()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    model = ns.model
    if ns.tiny:
        model = Path(ns.tiny)
        if not (model / "config.json").exists():
            print(f"building a tiny Qwen3 in {model}", file=sys.stderr)
            build_tiny_qwen3(model, eos_rate=ns.eos_rate)
    logs = (lambda name: ns.log_dir / name) if ns.log_dir else (lambda name: None)
    engine_kw = dict(max_total_tokens=ns.max_total_tokens, max_running_requests=ns.max_running_requests,
                     threads=ns.threads)
    stop = {"now": False}

    def on_signal(*_: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    with contextlib.ExitStack() as stack:
        engines = [LocalEngine(model, log_path=logs(f"engine-{i}.log"), **engine_kw) for i in range(ns.engines)]
        for e in engines:
            stack.callback(e.stop)
            e.launch()
        for e in engines:
            e.wait_ready()
            print(f"engine: {e.url}  (log {e.log_path})", flush=True)
        if not ns.no_router:
            router = LocalRouter([e.url for e in engines], log_path=logs("router.log"))
            stack.callback(router.stop)
            router.start()
            print(f"router: {router.url}  (log {router.log_path})", flush=True)
        print("serving; Ctrl-C stops everything", flush=True)
        try:
            while not stop["now"]:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
