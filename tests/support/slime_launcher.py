"""slime's own launcher as users run it, for the real tier: ``examples/qwen3-4B-dapo-math/run-cpu.sh``
(common.sh's flag blocks, the CPU hardware block) submitting slime's ``train.py`` with ``ray job
submit`` to a Ray cluster of this machine, in the environment ``scripts/real-stack/setup.sh`` builds
in ``.venv/slime-launcher`` (SGLang 0.5.15.post1, slime with patches/, Megatron-LM's training package).

What a job did is read the way a user reads it: slime's own log lines (``perf <rollout_id>: {...}``,
which carry the plugin's ``april/*`` metrics, and Ray's ``Job ... succeeded``), the samples slime
hands to training (``--save-debug-rollout-data``), and the plugin's checkpoints.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support import ROOT

LAUNCHER_VENV = ROOT / ".venv" / "slime-launcher"
RUN_CPU = ROOT / "examples" / "qwen3-4B-dapo-math" / "run-cpu.sh"
# a job on a loaded 2-core machine: start-up (imports, Ray actors, engine) takes minutes
JOB_TIMEOUT_S = 1200.0
# the engines a job runs (NUM_ENGINES of run-cpu.sh), and the fake GPUs the cluster has for them
ENGINES = 2
_PERF = re.compile(r"rollout_metrics\.py:\d+ - perf (\d+): (\{.*\})\s*$")


def launcher_missing() -> str | None:
    """Why slime's launcher cannot run here, or None."""
    fix = "run `bash scripts/real-stack/setup.sh`, which builds it"
    if not (LAUNCHER_VENV / "bin" / "ray").exists():
        return f"no slime launcher environment ({LAUNCHER_VENV}/bin/ray is missing); {fix}"
    if not (LAUNCHER_VENV / "slime" / "train.py").exists():
        return f"no slime checkout for the launcher ({LAUNCHER_VENV}/slime/train.py is missing); {fix}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(**values: Any) -> dict[str, str]:
    """The environment a user has after ``PATH=.venv/slime-launcher/bin:$PATH``, plus ``values``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "MODE", "ROLLOUT_", "APRIL_CONFIG", "PYTHONPATH", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join([str(LAUNCHER_VENV / "bin"), env.get("PATH", "")])
    env["SLIME_DIR"] = str(LAUNCHER_VENV / "slime")
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in values.items()})
    return env


class RayCluster:
    """A head node of its own (free ports, a short temp dir: Ray's socket paths must stay short), with
    a fake GPU for each of a job's ``ENGINES`` engines and the dashboard that ``ray job submit`` talks
    to; shared by the module's jobs."""

    def __init__(self) -> None:
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        self.dashboard_port = _free_port()
        self.gcs_port = _free_port()
        self.address = f"http://127.0.0.1:{self.dashboard_port}"

    def _ray(self, *argv: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
        # the job's actors at normal priority, as run-cpu.sh starts them: Ray's default (nice 15)
        # starves them behind whatever else keeps the machine's cores busy (a launch then took 11
        # minutes to reach its first rollout beside two busy loops)
        return subprocess.run([str(LAUNCHER_VENV / "bin" / "ray"), *argv], env=launcher_env(RAY_worker_niceness=0),
                              text=True, capture_output=True, timeout=timeout)

    def start(self) -> RayCluster:
        done = self._ray("start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(self.gcs_port),
                         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
                         "--num-gpus", str(ENGINES), "--num-cpus", "8", "--disable-usage-stats",
                         "--temp-dir", str(self.temp_dir))
        if done.returncode != 0:
            raise RuntimeError(f"ray start failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")
        self._wait_for_job_agent()
        return self

    def _wait_for_job_agent(self, timeout: float = JOB_TIMEOUT_S) -> None:
        """Until a job can be submitted: the dashboard answers ``ray job submit`` with "No available
        agent to submit job" until the node's dashboard agent has registered, which on a loaded
        machine comes well after ``ray start`` returns. A trivial job is submitted until one runs."""
        deadline = time.monotonic() + timeout
        while True:
            done = self._ray("job", "submit", "--address", self.address, "--", "python3", "-c", "pass")
            if done.returncode == 0:
                return
            if "No available agent" not in done.stdout + done.stderr or time.monotonic() > deadline:
                raise RuntimeError(f"no job runs on the new Ray cluster: {done.stdout[-2000:]}{done.stderr[-2000:]}")
            time.sleep(2.0)

    def stop(self) -> None:
        self._ray("stop", "--force")
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@dataclass
class Job:
    """One run of the launcher: its process and its log (stdout and stderr of ``ray job submit``,
    which streams the job's own output)."""

    process: subprocess.Popen
    log_path: Path
    save_dir: Path

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            self.process.kill()
            raise AssertionError(f"the launcher did not finish within {timeout:.0f} s; its log:\n{self.tail()}") from e

    @property
    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.splitlines()[-n:])

    def perf(self) -> dict[int, dict[str, Any]]:
        """slime's ``perf <rollout_id>`` log line of each rollout, as the dict it printed."""
        return perf_metrics(self.log)

    def kill_driver(self) -> int:
        """SIGKILL the job's driver (``python3 .../train.py``, started by Ray's job supervisor; not the
        ``ray job submit`` client, whose arguments name train.py too): the job dies at whatever it
        was doing, as on a node failure. Returns the number of processes killed."""
        killed = 0
        for pid in _driver_pids(str(self.save_dir)):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        return killed


def _driver_pids(save_dir: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if (len(argv) > 1 and Path(argv[0]).name.startswith("python") and argv[1].endswith("train.py")
                and save_dir in argv):
            pids.append(int(proc.name))
    return pids


def perf_metrics(log: str) -> dict[int, dict[str, Any]]:
    out = {}
    for line in log.splitlines():
        m = _PERF.search(line)
        if m:
            out[int(m.group(1))] = ast.literal_eval(m.group(2))
    return out


def launch(cluster: RayCluster, log_path: Path, save_dir: Path, *args: str, **env: Any) -> Job:
    """Start ``run-cpu.sh`` (as a user would: env variables, then train.py's extra arguments)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    environment = launcher_env(RAY_ADDRESS=cluster.address, SAVE_DIR=save_dir, **env)
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(["bash", str(RUN_CPU), *args], env=environment, cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    return Job(process, log_path, save_dir)


def debug_samples(folder: Path) -> dict[int, list[dict]]:
    """The samples slime handed to training, per rollout (``--save-debug-rollout-data``)."""
    import torch

    out = {}
    for path in folder.glob("rollout_*.pt"):
        data = torch.load(path, weights_only=False)
        out[int(data["rollout_id"])] = data["samples"]
    return out


def wait_for(path: Path, job: Job, timeout: float = JOB_TIMEOUT_S, poll_s: float = 1.0) -> None:
    """Until ``path`` exists; fails with the job's log if the job ended first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if job.process.poll() is not None:
            raise AssertionError(f"the job ended ({job.process.returncode}) before {path} was written:\n{job.tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} not written within {timeout:.0f} s:\n{job.tail()}")
        time.sleep(poll_s)


def kill_engine(url: str) -> list[int]:
    """SIGKILL the SGLang server serving ``url`` (the process listening on its port) and every process
    it started (its scheduler, its detokenizer), at once, as a node or accelerator fault ends them;
    slime's ``SGLangEngine`` actor, which started it, lives on. Returns the PIDs killed."""
    import psutil

    port = int(url.rstrip("/").rsplit(":", 1)[1])
    listeners = {c.pid for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}
    if len(listeners) != 1:
        raise AssertionError(f"expected one process listening on port {port} ({url}), found {sorted(listeners)}")
    server = psutil.Process(listeners.pop())
    victims = [server, *server.children(recursive=True)]
    for process in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
    return [p.pid for p in victims]
