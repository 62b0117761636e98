"""What the plugin reads of slime's ``args``: the one module that reads its attributes.

``SlimeArgs`` is every slime (and Megatron) argument the plugin reads, under slime's own name, with
the value it takes where the attribute is absent; what slime derives from them (optimizer steps per
rollout, sampling parameters, the engines its launcher starts) are its properties. Beside it: the
``april_*`` attributes slime set from the custom YAML, and the copy of ``args`` that users' generate
functions get. ``april_slime.job`` builds the job's description from these, once per job; the rest of
the plugin takes that description or plain values (``tests/test_structure.py`` holds every read of
``args`` to this module).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

from april_slime.core.dispatch import DeploymentHints

# arguments of slime 0.4.0 that the pinned slime does not define (april_slime.slime_compat): absent, they
# take their default here
LATER_SLIME_ARGUMENTS = frozenset({"buffer_sort_by_staleness", "flush_cache_interval", "use_score_centering",
                                   "score_centering_top_k"})


@dataclass(frozen=True)
class SlimeArgs:
    """Every slime and Megatron argument the plugin reads, under slime's name, with the value it
    takes where the attribute is absent (slime's parser default, or None where the plugin checks)."""

    # -- the rollout
    rollout_batch_size: int | None = None
    n_samples_per_prompt: int | None = None
    rollout_max_response_len: int | None = None
    over_sampling_batch_size: int | None = None
    rollout_seed: int = 42
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    rollout_top_k: int = -1
    rollout_stop: Any = None
    rollout_stop_token_ids: Any = None
    rollout_skip_special_tokens: bool = False
    rollout_shuffle: bool = False
    hf_checkpoint: str | None = None
    mask_offpolicy_in_partial_rollout: bool = False
    custom_generate_function_path: str | None = None
    dynamic_sampling_filter_path: str | None = None
    # -- rewards
    group_rm: bool = False
    reward_key: str | None = None
    advantage_estimator: str | None = None
    rewards_normalization: bool = False
    grpo_std_normalization: bool = False
    custom_reward_post_process_path: str | None = None
    # -- the engines and slime's router
    sglang_router_ip: str | None = None
    sglang_router_port: int | None = None
    sglang_config: Any = None
    rollout_external: bool = False
    prefill_num_servers: int | None = None
    router_pd_disaggregation: bool = False
    router_dp_aware: bool = False
    router_policy: str | None = None
    rollout_num_gpus: int | None = None
    rollout_num_gpus_per_engine: int | None = None
    rollout_data_transport: str | None = None
    buffer_sort_by_staleness: bool = False
    flush_cache_interval: int | None = None
    # -- what training replays
    use_rollout_routing_replay: bool = False
    use_routing_replay: bool = False
    num_layers: int | None = None
    moe_router_topk: int | None = None
    use_score_centering: bool = False
    score_centering_top_k: int | None = None
    # -- the trainer's step and loss
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    use_dynamic_batch_size: bool = False
    balance_data: bool = False
    loss_type: str | None = None
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    entropy_coef: float | None = 0.0
    use_kl_loss: bool = False
    use_unbiased_kl: bool = False
    kl_loss_type: str | None = None
    kl_loss_coef: float = 0.0
    kl_coef: float | None = 0.0
    calculate_per_token_loss: bool = False
    use_tis: bool = False
    get_mismatch_metrics: bool = False
    use_rollout_logprobs: bool = False
    use_opsm: bool = False
    use_critic: bool = False
    keep_old_actor: bool = False
    use_opd: bool = False
    recompute_loss_function: bool = False
    pipeline_model_parallel_size: int | None = 1
    context_parallel_size: int | None = 1
    overlap_grad_reduce: bool = False
    # -- the hooks a job names
    custom_loss_function_path: str | None = None
    custom_tis_function_path: str | None = None
    custom_megatron_before_train_step_hook_path: str | None = None
    custom_advantage_function_path: str | None = None
    # -- save and load
    save: str | None = None
    load: str | None = None
    custom_config_path: str | None = None

    @classmethod
    def read(cls, args: Any) -> SlimeArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    # ------------------------------------------------------------ what slime derives from them
    @property
    def steps_per_rollout(self) -> int:
        """slime's optimizer steps per rollout: rollout_batch_size * n_samples_per_prompt // global_batch_size."""
        try:
            return max(1, int(self.rollout_batch_size) * int(self.n_samples_per_prompt) // int(self.global_batch_size))
        except (TypeError, ValueError, ZeroDivisionError):
            return 1

    @property
    def recomputes_log_probs_anyway(self) -> bool:
        """Whether something of slime's step besides the loss reads its recomputed log-probs, so slime
        runs its log-prob forward whatever the loss answers (slime's ``can_reuse_log_probs_in_loss``)."""
        return bool(self.kl_coef or self.use_critic or self.keep_old_actor or self.use_opd
                    or (self.use_routing_replay and not self.use_rollout_routing_replay))

    @property
    def explicit_over_sampling(self) -> int | None:
        """slime fills --over-sampling-batch-size with rollout_batch_size when unset, so only a larger
        value is the user's explicit choice; it then wins over april_over_sampling_factor."""
        over = self.over_sampling_batch_size
        return over if over is not None and over > self.rollout_batch_size else None

    @property
    def router_url(self) -> str:
        return f"http://{self.sglang_router_ip}:{self.sglang_router_port}"

    @property
    def deployment_hints(self) -> DeploymentHints:
        """What slime's arguments say about its router: PD disaggregation (``--prefill-num-servers``,
        the router's ``--router-pd-disaggregation``), a DP-aware router, the router's policy."""
        return DeploymentHints(
            pd_disaggregation=self.prefill_num_servers is not None or bool(self.router_pd_disaggregation),
            dp_aware_router=bool(self.router_dp_aware), router_policy=self.router_policy)

    @property
    def engines_started(self) -> int | None:
        """How many engines slime's launcher registers with its router: one per
        ``--rollout-num-gpus-per-engine`` GPUs of ``--rollout-num-gpus`` (an engine spanning nodes
        registers once). None where the layout comes from elsewhere (``--sglang-config``, PD
        disaggregation, external engines): then the first list that stays the same is taken."""
        if self.sglang_config is not None or self.rollout_external or self.prefill_num_servers is not None:
            return None
        gpus, per_engine = self.rollout_num_gpus, self.rollout_num_gpus_per_engine
        if not (isinstance(gpus, int) and isinstance(per_engine, int) and gpus >= per_engine >= 1):
            return None
        return gpus // per_engine

    def sampling_params(self) -> dict[str, Any]:
        """slime's rollout sampling parameters (as its ``GenerateState`` builds them), without
        ``max_new_tokens``: the scheduler sends each call the trajectory's remaining budget."""
        params = {
            "temperature": self.rollout_temperature,
            "top_p": self.rollout_top_p,
            "top_k": self.rollout_top_k,
            "stop": self.rollout_stop,
            "stop_token_ids": self.rollout_stop_token_ids,
            "skip_special_tokens": self.rollout_skip_special_tokens,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        }
        if params["top_p"] != 1.0:  # slime's top-p token replay (its SGLang patch reads this)
            params["custom_params"] = {"return_top_p_token_ids": True}
        return {k: v for k, v in params.items() if v is not None}


def prefixed_attributes(args: Any, looks_prefixed: Callable[[str], bool], settings: Iterable[str]) -> dict[str, Any]:
    """Every attribute of ``args`` whose name ``looks_prefixed`` (what looks meant to be a setting),
    and every one of ``settings`` that ``args`` has (also where an object serves it from its class),
    by name."""
    try:
        names = set(vars(args))
    except TypeError:  # an args object without __dict__
        names = {k for k in dir(args) if not k.startswith("__")}
    names = {k for k in names if looks_prefixed(k)} | {k for k in settings if hasattr(args, k)}
    return {k: getattr(args, k) for k in sorted(names)}


def args_for_functions(args: Any, host: str, port: int) -> Any:
    """slime's arguments as a job's generate functions get them: a copy whose router address is the
    plugin's front (``core.front``), and without slime's own partial rollout."""
    view = argparse.Namespace(**vars(args)) if isinstance(args, argparse.Namespace) else copy.copy(args)
    view.sglang_router_ip, view.sglang_router_port = host, port
    view.partial_rollout = False
    return view
