"""A slime job's rollout side in a process of its own, on the real tier's engines, to be SIGKILLed.

Run by ``test_sigkill_on_real_engines_then_restart_loses_and_repeats_nothing``
(``tests/real/test_checkpoint_real.py``) as ``python -m tests.support.restart_worker CONFIG_JSON``
from the repository root. It drives slime's own ``RolloutManager`` methods (as
``SlimeRolloutManager`` does) in ``train_async.py``'s order: generate rollout 0, then for each k
generate rollout k + 1 before saving checkpoint k. The process is killed with SIGKILL where the
config says:

- ``kill: "save"``: at the data-source save point ``point`` of checkpoint ``kill_save``
  (``APRIL_SLIME_SAVE_KILL_AT``, see ``april_slime.core.checkpoint``);
- ``kill: "step"``: in the middle of rollout ``kill_save + 1``, from inside slime's reward path at
  the first reward of that rollout, while the rest of its requests are still on the engines (or,
  where that rollout needs no new reward, as it returns, before anything reaches the trainer).

Each line of stdout is one JSON event: ``step`` (the prompt groups a rollout delivered to the
trainer, the buffered ones, the data-source state as of its end), ``finished`` when nothing was
killed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from april_slime.core import checkpoint
from tests.support import real_tier

KILL_IN_REWARD = False


async def reward(args, sample, **kwargs) -> float:
    """The real tier's reward; SIGKILLs the process when the test asked for a kill mid-rollout."""
    if KILL_IN_REWARD:
        os.kill(os.getpid(), signal.SIGKILL)
    return float(sample.response_length % 2)


def emit(kind: str, **values) -> None:
    print(json.dumps({"kind": kind, **values}), flush=True)


def delivered(samples) -> list[int]:
    return sorted({s.group_index for s in samples})


def buffered(data_source) -> list[int]:
    return sorted(g.payload["group_index"] for g in data_source.buffer.groups())


def main() -> None:
    global KILL_IN_REWARD
    cfg = json.loads(sys.argv[1])
    stack = real_tier.RealStack(real_tier.LocalStack(cfg["router_url"], cfg["engine_urls"], [], None),
                                Path(cfg["model_path"]), Path(cfg["model_path"]))
    args = real_tier.plugin_args(stack, Path(cfg["job_dir"]), **cfg["plugin_args"])
    m = real_tier.SlimeRolloutManager(args)

    def step(rollout_id: int) -> None:
        samples, _, _ = m.generate(rollout_id)
        emit("step", step=rollout_id, trained=delivered(samples), buffered=buffered(m.data_source),
             buffer=m.data_source.buffer.state_dict())

    step(0)
    for k in range(cfg["kill_save"] + 1):
        if cfg["kill"] == "step" and k == cfg["kill_save"]:
            KILL_IN_REWARD = True
            m.generate(k + 1)
            # No reward was asked for: every group this rollout delivered came finished (and
            # rewarded) from the buffer, which a slow machine makes likely. The kill still lands
            # inside the rollout, before it reaches the trainer or a checkpoint.
            os.kill(os.getpid(), signal.SIGKILL)
        step(k + 1)
        if cfg["kill"] == "save" and k == cfg["kill_save"]:
            os.environ[checkpoint.KILL_AT_ENV] = cfg["point"]
        m.save(k)
    emit("finished")


if __name__ == "__main__":
    main()
