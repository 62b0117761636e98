"""A slime job's arguments as slime's own parser builds them, for the start-time checks.

``job_args`` writes the plugin's settings to a ``--custom-config-path`` YAML, adds the README's flags
(the plugin's rollout, data source and custom loss), parses the command line with slime's parser and
validation (``april_workbench.rollout_manager.slime_args``: slime's groups and SGLang's), and sets
the few Megatron arguments the plugin reads, which Megatron's own parser would add (its
``--pipeline-model-parallel-size`` and the like are not slime's). No engine, no Ray, no model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

# the README's command line ("Use it in a slime job")
PLUGIN_ARGV = [
    "--rollout-function-path", "april_slime.rollout.generate_rollout",
    "--data-source-path", "april_slime.rollout.AprilDataSource",
    "--loss-type", "custom_loss", "--custom-loss-function-path", "april_slime.loss.policy_loss",
]
# one optimizer step per rollout unless a test asks for more (a later --global-batch-size wins)
BATCH_ARGV = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
              "--num-rollout", "3", "--rollout-max-response-len", "64"]
# Megatron's arguments the plugin reads, at Megatron's defaults
MEGATRON_DEFAULTS = {"pipeline_model_parallel_size": 1, "context_parallel_size": 1, "tensor_model_parallel_size": 1,
                     "overlap_grad_reduce": False, "num_layers": None, "moe_router_topk": None}


def job_args(tmp_path: Path, settings: dict[str, Any] | None = None, *argv: str, plugin: bool = True,
             **megatron: Any) -> Any:
    """slime's ``args`` for ``argv`` (after the README's flags when ``plugin``) with ``settings`` as
    the custom YAML's ``april_*`` keys and ``megatron`` over Megatron's defaults."""
    from april_workbench.rollout_manager import slime_args

    config = Path(tmp_path) / "april.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump({f"april_{k}": v for k, v in (settings or {}).items()}), encoding="utf-8")
    full = [*(PLUGIN_ARGV if plugin else []), *BATCH_ARGV, "--custom-config-path", str(config), *argv]
    unknown = set(megatron) - set(MEGATRON_DEFAULTS)
    if unknown:
        raise ValueError(f"not one of the Megatron arguments the plugin reads: {sorted(unknown)}")
    return slime_args(full, **{**MEGATRON_DEFAULTS, **megatron})
