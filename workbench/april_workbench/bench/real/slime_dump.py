"""A job's lengths, the way a user has them: a slime rollout dump (``--save-debug-rollout-data``)
of a real rollout, made on the engines a comparison runs on.

``slime_rollout_dump`` runs rollout steps of a slime job on the engines (slime's argument parser,
data source and ``RolloutManager`` methods, the plugin's ``generate_rollout`` at policy sync; the
model's own stop tokens decide every length) and saves each step with slime's own writer,
``slime.observability.rollout_data_utils.save_debug_rollout_data``, which is what
``--save-debug-rollout-data`` calls. ``april-slime bench real --slime-dump`` then predicts and
measures the policies on those lengths. Needs slime (the real stack's environment).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import yaml


def write_prompts(path: Path, n: int) -> Path:
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            f.write(json.dumps({"prompt": f"Question: what is {a} + {b}? Answer:", "label": str(a + b)}) + "\n")
    return path


async def zero_reward(args, sample, **kwargs) -> float:
    return 0.0


def slime_rollout_dump(router_url: str, model: Path, folder: Path, *, batch: int, n: int, max_len: int,
                       engines: int, rollouts: int = 1) -> list[Path]:
    """``rollouts`` rollout steps of a slime job on the engines behind ``router_url``, each saved by
    slime's ``save_debug_rollout_data`` under ``folder``; returns the files."""
    from slime.observability.rollout_data_utils import save_debug_rollout_data

    from april_workbench.rollout_manager import SlimeRolloutManager, slime_args

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "april.yaml").write_text(yaml.safe_dump({"april_policy": "sync", "april_dispatch": "direct"}))
    host, port = router_url.removeprefix("http://").rsplit(":", 1)
    template = str(folder / "rollout_data" / "{rollout_id}.pt")
    argv = ["--rollout-function-path", "april_slime.rollout.generate_rollout",
            "--data-source-path", "april_slime.rollout.AprilDataSource",
            "--custom-config-path", str(folder / "april.yaml"), "--hf-checkpoint", str(model),
            "--prompt-data", str(write_prompts(folder / "prompts.jsonl", batch * (rollouts + 1))),
            "--input-key", "prompt", "--label-key", "label",
            "--rollout-batch-size", str(batch), "--n-samples-per-prompt", str(n),
            "--rollout-max-response-len", str(max_len), "--rollout-temperature", "1.0",
            "--num-rollout", str(rollouts), "--custom-rm-path", f"{__name__}.zero_reward",
            "--sglang-router-ip", host, "--sglang-router-port", port, "--save", str(folder / "ckpt"),
            "--rollout-num-gpus", str(engines), "--rollout-num-gpus-per-engine", "1",
            "--save-debug-rollout-data", template]
    manager = SlimeRolloutManager(slime_args(argv))
    files = []
    for rollout_id in range(rollouts):
        samples, _, _ = manager.generate(rollout_id)
        save_debug_rollout_data(template, samples, rollout_id=rollout_id, evaluation=False)
        files.append(Path(template.format(rollout_id=rollout_id)))
    from april_slime import rollout

    rollout.shutdown()
    return files
