"""An emulated cluster served over HTTP from a child process.

The process that drives it then holds what a job's rollout process holds: the plugin, its HTTP
client and the replies' decoding, and none of the engines' objects or CPU. ``bench scale`` measures
the plugin's garbage-collection share that way (the in-process cluster's objects are walked by the
same collections as the plugin's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pickle
import subprocess
import sys

from .cluster import EmulatorCluster
from .config import EngineConfig
from .model import SyntheticLM

START_TIMEOUT_S = 120.0


def _serve() -> None:
    """The child: the cluster's arguments come pickled on stdin, its URLs go out as one JSON line on
    stdout, and it serves until its stdin closes (the parent stopped it, or is gone)."""
    num_engines, model, engine_config = pickle.load(sys.stdin.buffer)

    async def main() -> None:
        cluster = EmulatorCluster(num_engines, model=model, engine_config=engine_config)
        await cluster.start()
        await cluster.serve_http()
        print(json.dumps([list(cluster.engine_urls), cluster.router_url]), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)  # until EOF
        await cluster.close()

    asyncio.run(main())


class ChildCluster:
    """What ``bench.runner.run_policy`` uses of an ``EmulatorCluster`` over HTTP (URLs, the model
    the prompts come from, the emulated clock, close), with the engines in a child process: a
    fresh interpreter, so nothing of this process is copied into it."""

    def __init__(self, num_engines: int, *, model: SyntheticLM, engine_config: EngineConfig) -> None:
        self.model = model
        self.engine_config = engine_config
        self.engines: list = []  # none in this process
        self.engine_urls: list[str] = []
        self.router_url = ""
        self._num_engines = num_engines
        self._process: subprocess.Popen | None = None
        self._t0 = 0.0

    async def start(self) -> None:
        self._process = process = subprocess.Popen(
            [sys.executable, "-c", "from april_workbench.emulator.child import _serve; _serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        process.stdin.write(pickle.dumps((self._num_engines, self.model, self.engine_config)))
        process.stdin.flush()
        loop = asyncio.get_running_loop()
        try:
            line = await asyncio.wait_for(loop.run_in_executor(None, process.stdout.readline), START_TIMEOUT_S)
            self.engine_urls, self.router_url = json.loads(line)
        except (TimeoutError, ValueError) as exc:
            await self.close()
            raise RuntimeError(f"the emulated engines did not start within {START_TIMEOUT_S:g} s "
                               f"(child exit code {process.poll()})") from exc
        self._t0 = loop.time()

    async def serve_http(self) -> None:
        """Already serving (the child serves from its start)."""

    def now(self) -> float:
        """Emulated seconds since start (the child's clock runs at the same scale from about then)."""
        return (asyncio.get_running_loop().time() - self._t0) * self.engine_config.time_scale

    async def close(self) -> None:
        if self._process is None:
            return
        process, self._process = self._process, None
        with contextlib.suppress(OSError):  # the child is gone already
            process.stdin.close()  # its signal to stop
        try:
            await asyncio.get_running_loop().run_in_executor(None, process.wait, 30.0)
        except subprocess.TimeoutExpired:
            process.kill()  # the child this object started, by its handle
            process.wait()
        process.stdout.close()
