"""Helpers the tests share, in one home: no test module imports another.

Imported as ``tests.support.<module>``: ``tests/conftest.py`` puts the repository root on
``sys.path`` once, and the worker processes tests start run as ``python -m tests.support.<worker>``
with the repository root as their working directory (``child_process_kwargs``).

* ``slime_standin``: the slime stand-in, for where the real slime cannot be imported;
* ``slime_jobs``: the plugin inside a slime job on emulated engines (arguments, cluster, the
  ``slime_mode`` / ``cluster`` fixtures, which ``tests/conftest.py`` re-exports), and scenarios run on
  both the stand-in and real slime;
* ``save_kill`` and ``save_kill_worker``: SIGKILLs at every point of a data-source save, then a restart;
* ``real_tier``: the real tier's shared stack, job arguments, engine probes, event placement and
  sample contract; ``restart_worker``: a real-tier job's rollout side in a process to be killed;
  ``contract_worker``: slime's plugin-contract checks on a real-tier job;
* ``gloo``: a function run on several gloo ranks (spawned processes), for the data- and
  tensor-parallel tests on CPU.
* ``numbered_prompts``: a prompt source for a scheduler driven by hand, a distinct prompt per group.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def child_process_kwargs(drop_env: tuple[str, ...] = ()) -> dict[str, Any]:
    """``subprocess.run`` keywords for ``python -m tests.support.<worker>``: run from the repository
    root (``-m`` puts the working directory on the child's ``sys.path``), with this environment less
    ``drop_env``."""
    return {"cwd": ROOT, "env": {k: v for k, v in os.environ.items() if k not in drop_env}}
