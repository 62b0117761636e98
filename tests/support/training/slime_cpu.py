"""slime's real training data path and loss_function on CPU, gloo world size 1 (test helper).

What runs is slime's own code at the pinned commit with the repository's patches: the rollout
side's ``RolloutManager._convert_samples_to_train_data`` and ``_split_train_data_by_dp``, the
trainer's ``process_rollout_data``, ``compute_advantages_and_returns``, ``get_batch`` and
``loss_function``, driven by Megatron's ``forward_backward_no_pipelining``. Four test-only
adaptations, each as narrow as it can be:

* slime picks its accelerator from the hardware; a CPU one is installed with slime's own
  ``set_accelerator``.
* ``ray.put`` / ``ray.get`` around the rollout->trainer hand-off are the identity (one process).
* Megatron's ``forward_backward_no_pipelining`` allocates its token counter with
  ``torch.zeros(..., device="cuda")``; inside that module only, ``torch.zeros`` maps a CUDA device
  to the CPU. Nothing else in Megatron is touched.

* slime's ``torch.compile``d PPO helpers run eagerly (``torch._dynamo`` disabled while the world
  is up): with inductor's FX-graph / AOTAutograd caches on, the compiled ``compute_policy_loss``
  can clip with the eps values of an earlier call (the upstream note in docs/loss.md), and
  compiling costs tens of seconds on two cores. The math is slime's either way.

The model is token-wise (embedding -> linear -> logits) so that no attention kernel is needed for
slime's packed ``thd`` micro-batches; the loss path does not depend on what produced the logits.

``train_one_step`` below runs slime's own ``train_one_step`` (model.py) with Megatron's DDP and
optimizer (see ``megatron_cpu.ddp_and_optimizer_on_cpu``). slime's model.py imports Megatron-LM's
``megatron.training`` package, which the megatron-core distribution does not contain; where it is
missing, empty stand-ins are installed for that import alone, and ``get_args`` (the only part
``train_one_step`` calls) answers the test's args.
"""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import sys
import types
from argparse import Namespace
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer.transformer_config import TransformerConfig
from slime.backends.megatron_utils import data as slime_data
from slime.backends.megatron_utils import loss as slime_loss
from slime.ray import rollout as slime_rollout
from slime.utils import accelerator as slime_accelerator
from slime.utils import data as slime_utils_data
from slime.utils.types import Sample
from torch import nn

from tests.support import ROOT

VOCAB = 29

BATCH_KEYS = ["tokens", "multimodal_train_inputs", "packed_seq_params", "total_lengths", "response_lengths",
              "loss_masks", "log_probs", "ref_log_probs", "values", "advantages", "returns", "rollout_log_probs",
              "teacher_log_probs", "rollout_mask_sums", "metadata"]


def _cpu_accelerator_class():
    """slime's CPU accelerator as the launcher's ``sitecustomize`` registers it (one home for it)."""
    path = ROOT / "scripts" / "real-stack" / "sglang_cpu_site" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("april_cpu_site", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cpu_accelerator_class()


CpuAccelerator = _cpu_accelerator_class()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_world(tp: int = 1, rank: int = 0, world_size: int = 1, port: int | None = None):
    """A gloo job with Megatron's model-parallel groups and slime on the CPU (one process unless
    ``world_size`` says otherwise; the remaining ranks are data parallel)."""
    port = free_port() if port is None else port
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world_size)
    parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=1)
    slime_accelerator.set_accelerator(CpuAccelerator())
    dynamo_disabled = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    try:
        yield
    finally:
        torch._dynamo.config.disable = dynamo_disabled
        slime_accelerator.reset_accelerator()
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


class _CpuZerosTorch(types.ModuleType):
    """``torch`` as seen by megatron.core.pipeline_parallel.schedules, with ``zeros`` on the CPU."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)


@contextlib.contextmanager
def cpu_token_counter():
    saved = schedules.torch
    schedules.torch = _CpuZerosTorch()
    try:
        yield
    finally:
        schedules.torch = saved


class TokenwiseLM(nn.Module):
    """Embedding -> ``depth`` tanh linear layers of width ``dim`` -> head, token by token."""

    def __init__(self, seed: int = 0, dim: int = 16, depth: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, dim)
        self.hidden = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.head = nn.Linear(dim, VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.7 if p.dim() < 2 or p.shape[0] == VOCAB
                                                             or p.shape[1] == VOCAB else 1.0 / dim ** 0.5))
        self.config = TransformerConfig(num_layers=1, hidden_size=dim, num_attention_heads=1,
                                        use_cpu_initialization=True)
        self.model_type = None

    def set_input_tensor(self, tensor) -> None:  # Megatron's pipeline interface; one stage here
        pass

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.embed(tokens))
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.head(x)


def make_args(**overrides) -> Namespace:
    values = dict(
        # rollout -> trainer data path
        micro_batch_size=2, use_dynamic_batch_size=False, max_tokens_per_gpu=None, balance_data=False,
        balance_by_flops=False, global_batch_size=6, rollout_data_transport="object-store",
        n_samples_per_prompt=3, rollout_batch_size=2, rewards_normalization=True, grpo_std_normalization=True,
        rollout_top_p=1.0, data_pad_size_multiplier=8, allgather_cp=False, reward_key=None,
        # advantages
        advantage_estimator="grpo", normalize_advantages=False, kl_coef=0.0, kl_loss_type="low_var_kl",
        custom_advantage_function_path=None, use_opd=False, gamma=1.0, lambd=1.0,
        # loss
        loss_type="policy_loss", custom_loss_function_path=None, eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None,
        entropy_coef=0.0, use_kl_loss=False, kl_loss_coef=0.0, use_unbiased_kl=False, calculate_per_token_loss=False,
        use_rollout_logprobs=False, use_tis=False, get_mismatch_metrics=False, custom_tis_function_path=None,
        tis_clip=2.0, tis_clip_low=0.0, custom_pg_loss_reducer_function_path=None, use_opsm=False,
        recompute_loss_function=False, rollout_temperature=1.0, log_probs_chunk_size=-1,
        save_debug_train_data=None,
        # slime's train_one_step and rollout-data logging (one pipeline stage, no MTP, no trackers)
        custom_megatron_before_train_step_hook_path=None, seq_length=1, decoder_seq_length=None,
        check_for_nan_in_loss_and_grad=True, ci_test=False, enable_mtp_training=False, use_wandb=False,
        use_tensorboard=False, wandb_always_use_train_step=False, log_multi_turn=False, log_passrate=False,
        log_correct_samples=False,
    )
    values.update(overrides)
    return Namespace(**values)


def make_samples(seed: int = 0, num_prompts: int = 2, per_prompt: int = 3, spread: float = 0.3,
                 model: nn.Module | None = None, temperature: float = 1.0, max_response: int = 8) -> list[Sample]:
    """Groups of samples with rewards, partial loss masks, rollout log-probs near the model's and
    per-token policy versions in train_metadata (as the rollout side writes them)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for p in range(num_prompts):
        prompt = torch.randint(VOCAB, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        for k in range(per_prompt):
            n = int(torch.randint(3, max_response + 1, (1,), generator=g))
            response = torch.randint(VOCAB, (n,), generator=g).tolist()
            mask = (torch.rand(n, generator=g) > 0.2).int().tolist()
            mask[0] = 1
            tokens = prompt + response
            if model is not None:
                with torch.no_grad():
                    logits = model(torch.tensor(tokens)) / temperature
                    lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(
                        -1, torch.tensor(response)[:, None])[:, 0]
            else:
                lp = -torch.rand(n, generator=g) * 3
            rollout_lp = (lp + spread * torch.randn(n, generator=g)).tolist()
            s = Sample(index=p * per_prompt + k, prompt="", tokens=tokens, response_length=n,
                       reward=float(torch.rand(1, generator=g) > 0.5), loss_mask=mask, rollout_log_probs=rollout_lp,
                       status=Sample.Status.COMPLETED)
            s.group_index = p
            s.train_metadata = {"april_token_versions_rle": [[3, n - 2], [4, 2]], "april_policy_version": 4}
            samples.append(s)
    return samples


def make_stale_samples(model: nn.Module, seed: int = 0, num_prompts: int = 2, per_prompt: int = 3,
                       policy_version: int = 5, drift: float = 0.25, noise: float = 0.05,
                       max_response: int = 8) -> list[Sample]:
    """Groups as partial rollouts leave them: each response was generated by up to three
    consecutive policy versions (the oldest 0-3 versions behind ``policy_version``, the version the
    step trains), written to train_metadata as run-length pairs, and each token's rollout
    log-prob is the model's plus noise of ``noise + drift * staleness`` nats: the older the
    policy that sampled a token, the further its log-prob is from the current policy's.
    ``train_metadata["sample"]`` is the sample's index (to check what reaches the loss)."""
    samples = make_samples(seed=seed, num_prompts=num_prompts, per_prompt=per_prompt, spread=0.0, model=model,
                           max_response=max_response)
    for s in samples:
        g = torch.Generator().manual_seed(10_000 * seed + s.index)
        n = s.response_length
        oldest = s.index % 4
        runs = min(n, 1 + s.index % 3)
        cuts = [round(j * n / runs) for j in range(runs + 1)]
        rle = [[policy_version - max(0, oldest - j), cuts[j + 1] - cuts[j]] for j in range(runs)]
        staleness = torch.cat([torch.full((count,), float(policy_version - v)) for v, count in rle])
        lp = torch.tensor(s.rollout_log_probs)
        s.rollout_log_probs = (lp + (noise + drift * staleness) * torch.randn(n, generator=g)).tolist()
        s.train_metadata = {"april_token_versions_rle": rle, "april_policy_version": policy_version,
                            "sample": s.index}
    return samples


def _rollout_manager_cls():
    cls = slime_rollout.RolloutManager
    meta = getattr(cls, "__ray_metadata__", None)
    return meta.modified_class if meta is not None else cls


def rollout_to_trainer(args: Namespace, samples: list[Sample], dp_size: int = 1, dp_rank: int = 0,
                       reward_post_process=None) -> dict:
    """The rollout side's conversion and DP split, then the trainer's process_rollout_data;
    ``reward_post_process``: the function --custom-reward-post-process-path names (None: slime's)."""
    cls = _rollout_manager_cls()
    # the methods only read these attributes; __init__ would start engines
    manager = object.__new__(cls)
    manager.args = args
    manager.custom_convert_samples_to_train_data_func = None
    manager.custom_reward_post_process_func = reward_post_process
    manager.train_parallel_config = {"dp_size": dp_size, "cp_size": 1, "vpp_size": 1,
                                     "microbatch_group_size_per_vp_stage": 1}
    identity = types.SimpleNamespace(put=lambda x, **_: x, get=lambda x: x)
    saved = slime_rollout.ray, slime_utils_data.ray
    slime_rollout.ray = slime_utils_data.ray = identity
    try:
        train_data = cls._convert_samples_to_train_data(manager, samples)
        refs = cls._split_train_data_by_dp(manager, train_data)
        rollout_data = slime_utils_data.process_rollout_data(args, refs, dp_rank, dp_size)
    finally:
        slime_rollout.ray, slime_utils_data.ray = saved
    # what MegatronTrainRayActor._get_rollout_data does next (no CP: the slices are whole)
    rollout_data["tokens"] = [t.to(dtype=torch.long) for t in rollout_data["tokens"]]
    rollout_data["loss_masks"] = [t.to(dtype=torch.int) for t in rollout_data["loss_masks"]]
    rollout_data["rollout_mask_sums"] = rollout_data["rollout_mask_sums"].to(dtype=torch.float32)
    rollout_data["rollout_log_probs"] = [t.to(torch.float32) for t in rollout_data["rollout_log_probs"]]
    return rollout_data


def _microbatch_log_probs(args, model, batch, with_entropy=False):
    logits = model(batch["tokens"])
    _, out = slime_loss.get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"], with_entropy=with_entropy)
    return out["log_probs"]


def recompute_log_probs(args, model, rollout_data, store_prefix="", perturb: float = 0.0, seed: int = 0):
    """The trainer's log-prob forward before the step (slime's compute_log_prob, without grad).
    ``perturb`` shifts them, standing in for a proximal policy one optimizer step behind."""
    g = torch.Generator().manual_seed(seed)
    iterator = slime_data.get_data_iterator(rollout_data)[0]
    by_index = {}
    with torch.no_grad():
        for indices in rollout_data["micro_batch_indices"]:
            batch = slime_data.get_batch(iterator, ["tokens", "total_lengths", "response_lengths", "loss_masks"],
                                         args.data_pad_size_multiplier)
            for i, lp in zip(indices, _microbatch_log_probs(args, model, batch)):
                by_index[i] = lp + perturb * torch.randn(lp.shape, generator=g)
    rollout_data[f"{store_prefix}log_probs"] = [by_index[i] for i in range(len(by_index))]


def train_step(args, model, rollout_data, step: int = 0, dp_group=None):
    """slime's train_one_step without the optimizer: forward_backward over the step's micro-batches
    with slime's get_batch and loss_function. Returns (reduced metrics, {param name: grad}); the
    gradients are this rank's, before any data-parallel reduction. With ``dp_group`` the metrics
    are reduced over it by slime's own ``reduce_train_step_metrics``, as train_one_step does."""
    slime_loss.compute_advantages_and_returns(args, rollout_data)
    iterator = slime_data.get_data_iterator(rollout_data)
    num_microbatches = rollout_data["num_microbatches"][step]
    step_global_batch_size = rollout_data["global_batch_sizes"][step]
    model.zero_grad(set_to_none=True)
    model.config.calculate_per_token_loss = args.calculate_per_token_loss

    def forward_step(data_iterator, model):
        batch = slime_data.get_batch(data_iterator, BATCH_KEYS, args.data_pad_size_multiplier, args.allgather_cp)
        logits = model(batch["tokens"])
        return logits, partial(slime_loss.loss_function, args, batch, num_microbatches, step_global_batch_size)

    with cpu_token_counter():
        losses = schedules.forward_backward_no_pipelining(
            forward_step_func=forward_step, data_iterator=iterator, model=[model],
            num_microbatches=num_microbatches, seq_length=1, micro_batch_size=1, forward_only=False)
    if dp_group is not None:
        from slime.observability import train_metric_utils

        metrics = train_metric_utils.reduce_train_step_metrics(
            losses, calculate_per_token_loss=args.calculate_per_token_loss,
            step_global_batch_size=step_global_batch_size, cp_size=1, dp_with_cp_group=dp_group)
    else:
        keys = losses[0]["keys"]
        values = sum(item["values"] for item in losses)
        divisor = values[0] if args.calculate_per_token_loss else step_global_batch_size
        metrics = {k: float(v) / float(divisor) for k, v in zip(keys, values[1:])}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return metrics, grads


# ---------------------------------------------------------------------- slime's train_one_step
class GPTLikeLM(TokenwiseLM):
    """TokenwiseLM with the keyword interface train_one_step calls Megatron's GPTModel with."""

    def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None, packed_seq_params=None,
                loss_mask=None):
        return super().forward(input_ids)


_MEGATRON_TRAINING_STANDINS = {
    "megatron.training": {},
    "megatron.training.global_vars": {"get_args": None, "set_args": None, "_build_tokenizer": None},
    "megatron.training.training": {"get_model": None},
    "megatron.training.checkpointing": {"load_checkpoint": None, "save_checkpoint": None},
    "megatron.training.arguments": {"core_transformer_config_from_args": None},
}


def slime_model_module():
    """slime.backends.megatron_utils.model (where train_one_step lives)."""
    return slime_module("slime.backends.megatron_utils.model")


def slime_module(name: str):
    """A slime module that imports Megatron-LM's ``megatron.training`` (model.py, actor.py), imported
    with the stand-ins of that package where it is missing."""
    if name in sys.modules:
        return sys.modules[name]
    installed = []
    if importlib.util.find_spec("megatron.training") is None:
        for module_name, attrs in _MEGATRON_TRAINING_STANDINS.items():
            module = types.ModuleType(module_name)
            module.__path__ = []
            for attr in attrs:
                setattr(module, attr, _not_available(module_name, attr))
            sys.modules[module_name] = module
            installed.append(module_name)
    try:
        return importlib.import_module(name)
    finally:
        for module_name in installed:  # nothing else may mistake the stand-ins for Megatron-LM
            sys.modules.pop(module_name, None)


def _not_available(module_name, attr):
    def call(*args, **kwargs):
        raise RuntimeError(f"{module_name}.{attr} is a stand-in: Megatron-LM is not installed")
    return call


def megatron_trainer(model: nn.Module, optimizer: str = "sgd", lr: float = 0.1):
    """``model`` in Megatron's DistributedDataParallel, Megatron's optimizer from
    ``get_megatron_optimizer`` (fp32 parameters, no distributed optimizer: an FP32Optimizer in a
    ChainedOptimizer, as slime builds it without --use-distributed-optimizer) over torch's
    SGD (no momentum) or AdamW, a constant-lr OptimizerParamScheduler, and the model config as
    slime's train() sets it before its steps. Call inside megatron_cpu.ddp_and_optimizer_on_cpu()."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.utils import get_model_config

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    megatron_optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer=optimizer, lr=lr, min_lr=lr, weight_decay=0.0, sgd_momentum=0.0,
                        params_dtype=torch.float32, clip_grad=0.0), [ddp])
    scheduler = OptimizerParamScheduler(
        megatron_optimizer, init_lr=lr, max_lr=lr, min_lr=lr, lr_warmup_steps=0, lr_decay_steps=1000,
        lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=1000, wd_incr_style="constant")
    config = get_model_config(ddp)
    config.grad_scale_func = megatron_optimizer.scale_loss
    config.timers = None
    config.finalize_model_grads_func = finalize_model_grads
    return ddp, megatron_optimizer, scheduler


def train_one_step(args, ddp, optimizer, scheduler, rollout_data, rollout_id: int = 0, step: int = 0):
    """slime's train_one_step on ``rollout_data`` (advantages first, as the trainer computes them
    before its steps): the before-train-step hook, forward/backward with slime's get_batch and
    loss_function, Megatron's gradient finalisation, optimizer and scheduler steps. Returns
    (slime's reduced metrics, grad norm)."""
    module = slime_model_module()
    slime_loss.compute_advantages_and_returns(args, rollout_data)
    iterator = slime_data.get_data_iterator(rollout_data)
    saved = module.get_args
    module.get_args = lambda: args
    try:
        with cpu_token_counter():
            return module.train_one_step(args, rollout_id, step, iterator, [ddp], optimizer, scheduler,
                                         rollout_data["num_microbatches"][step],
                                         rollout_data["global_batch_sizes"][step])
    finally:
        module.get_args = saved


# ------------------------------------------------------------------- slime's trainer actor
# The model's size as slime's perf log reads it (log_perf_data -> calculate_fwd_flops), for the
# token-wise model; no multi-latent attention, no experts.
PERF_ARGS = dict(hidden_size=16, num_attention_heads=1, num_query_groups=1, vocab_size=VOCAB, ffn_hidden_size=16,
                 num_experts=None, num_layers=1, kv_channels=16, multi_latent_attention=False, q_lora_rank=None,
                 kv_lora_rank=None)
# what slime's MegatronTrainRayActor.train_actor and model.train read on top of make_args
ACTOR_ARGS = dict(use_rollout_routing_replay=False, use_routing_replay=False, compute_advantages_and_returns=True,
                  keep_old_actor=False, use_critic=False, use_opd=False, ref_update_interval=None,
                  use_rollout_entropy=False, custom_megatron_before_log_prob_hook_path=None,
                  reset_optimizer_states=False, manual_gc=False, overlap_grad_reduce=False, align_grad_reduce=False,
                  overlap_param_gather=False, align_param_gather=False, use_distributed_optimizer=False,
                  ci_save_grad_norm=None, ci_load_grad_norm=None, **PERF_ARGS)


class _Nothing:
    """The trainer actor's parts that have no work in a one-model CPU job: the weight backups (only the
    actor's own weights, nothing to swap), the profiler, the weight updater (no engines)."""

    backup_tags = ("actor",)

    def restore(self, tag):
        pass

    def backup(self, tag):
        pass

    def step(self, rollout_id=None):
        pass

    def pop_metrics(self):
        return {}


def train_actor(args, ddp, optimizer, scheduler, rollout_data, rollout_id: int = 0) -> list[dict]:
    """slime's own ``MegatronTrainRayActor.train_actor`` (slime/backends/megatron_utils/actor.py) on
    ``rollout_data``: its decision to recompute the log-probs (``compute_log_prob``, the real
    forward-only pass), the advantages, the rollout log line, every optimizer step of the rollout
    (model.train) and the perf log line. Returns what reached slime's logger (``logging_utils.log``),
    one dict per call."""
    from slime.observability import logging_utils
    from slime.observability.timer import Timer

    slime_actor = slime_module("slime.backends.megatron_utils.actor")
    module = slime_model_module()
    actor = object.__new__(slime_actor.MegatronTrainRayActor)
    actor.args = args
    actor.model, actor.optimizer, actor.opt_param_scheduler = [ddp], optimizer, scheduler
    actor.weights_backuper = actor.prof = actor.weight_updater = _Nothing()
    actor._active_model_tag = "actor"
    actor.rollout_data_postprocess = None
    logged = []
    real_log = logging_utils.log

    def log(log_args, metrics, step_key):
        logged.append(dict(metrics))
        return real_log(log_args, metrics, step_key)

    saved = module.get_args, logging_utils.log
    module.get_args, logging_utils.log = (lambda: args), log
    try:
        timer = Timer()
        if "train_wait" not in timer.start_time:  # the actor's init starts it (the wait for the first rollout)
            timer.start("train_wait")
        with cpu_token_counter():
            actor.train_actor(rollout_id, rollout_data)
    finally:
        module.get_args, logging_utils.log = saved
    return logged
