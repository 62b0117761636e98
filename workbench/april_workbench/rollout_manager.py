"""slime's rollout side on the local real stack: slime's argument parsing, and its ``RolloutManager``
methods run without Ray against engines that ``localstack`` started.

Only the standard library is imported at module level; slime is imported when these run.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

__all__ = ["SlimeRolloutManager", "slime_args"]


def slime_args(argv: list[str], **overrides: Any) -> argparse.Namespace:
    """Arguments as slime's own parser builds them (its rollout + SGLang/router groups; the
    Megatron training groups are not needed on the rollout side), then ``overrides``, then slime's
    own validation (derived defaults: eval function, over-sampling size, ``--custom-config-path``)."""
    from slime.backends.sglang_utils.arguments import add_sglang_arguments
    from slime.utils.arguments import get_slime_extra_args_provider, slime_validate_args

    parser = argparse.ArgumentParser(allow_abbrev=False)
    get_slime_extra_args_provider()(parser)
    add_sglang_arguments(parser)
    # the mode flags slime's parse_args reads in a pre-pass
    parser.add_argument("--train-backend", default="megatron")
    parser.add_argument("--debug-rollout-only", action="store_true")
    parser.add_argument("--debug-train-only", action="store_true")
    parser.add_argument("--load-debug-rollout-data", default=None)
    args = parser.parse_args(argv)
    for key, value in overrides.items():
        setattr(args, key, value)
    slime_validate_args(args)  # slime's own derived defaults (eval path, over-sampling, custom config)
    return args


class SlimeRolloutManager:
    """slime's own ``RolloutManager`` methods (unwrapped from the Ray actor class) on an instance
    built like its ``__init__`` minus Ray and engine start-up: the engines are ``real_stack``'s.

    ``generate`` does what ``RolloutManager.generate`` does up to the DP split (which needs Ray):
    ``call_rollout_fn`` on ``--rollout-function-path`` with the data source of
    ``--data-source-path``, slime's rollout logging, and the conversion to train data (which
    checks the sample contract: loss-mask lengths, rewards, rollout log-probs)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from slime.ray.rollout import RolloutManager
        from slime.rollout.sglang_rollout import GenerateState
        from slime.utils.http_utils import init_http_client
        from slime.utils.misc import load_function

        init_http_client(args)  # slime's HTTP client to the router, as RolloutManager.__init__ makes it
        # slime builds its rollout state (tokenizer, sampling parameters, semaphore) once per
        # process, from the first job's arguments. A manager here stands for a job process of its
        # own, so it must not inherit another job's: another model's tokenizer, say.
        GenerateState._instances.pop(GenerateState, None)
        raw = RolloutManager.__ray_metadata__.modified_class.__mro__[1]
        assert raw.__name__ == "RolloutManager", raw
        self.cls = raw
        self.manager = m = object.__new__(raw)
        m.pg, m.args, m.servers = None, args, {}
        m.data_source = load_function(args.data_source_path)(args)
        m.generate_rollout = load_function(args.rollout_function_path)
        m.eval_generate_rollout = load_function(args.eval_function_path)
        m.custom_reward_post_process_func = None
        m.custom_convert_samples_to_train_data_func = None
        m.rollout_id = -1
        m._health_monitors = []

    @property
    def data_source(self) -> Any:
        return self.manager.data_source

    def generate(self, rollout_id: int) -> tuple[list[Any], dict, dict]:
        """(flattened samples, rollout metrics, train data) of one rollout step."""
        from slime.observability.rollout_metrics import log_rollout_data

        m = self.manager
        start = time.time()
        m.rollout_id = rollout_id
        samples, metrics = self.cls._get_rollout_data(m, rollout_id=rollout_id)
        log_rollout_data(rollout_id, m.args, samples, metrics, time.time() - start)
        train = self.cls._convert_samples_to_train_data(m, samples)
        return samples, metrics or {}, train

    def eval(self, rollout_id: int) -> None:
        self.cls.eval(self.manager, rollout_id)

    def save(self, rollout_id: int) -> None:
        self.cls.save(self.manager, rollout_id)

    def load(self, rollout_id: int | None = None) -> None:
        self.cls.load(self.manager, rollout_id)
