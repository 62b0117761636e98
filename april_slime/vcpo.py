"""VCPO: effective-sample-size learning-rate scaling and the off-policy optimal baseline.

Two independent controls of the variance of an importance-weighted policy gradient
(Huang et al., "Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs"):

* ``EssLrScaler`` -- the learning rate of one optimizer step is multiplied by
  ``clamp(sqrt(ESS_ratio / rho_on), min, max)``, where ``ESS_ratio = (sum w)^2 / (N sum w^2)`` of the
  unclipped sequence-level importance weights ``w_i = pi_theta(y_i|x_i) / mu(y_i|x_i)`` of exactly the
  batch that produced the step's gradient (paper eq. 4-5).
* ``PerSampleGradNorms`` + ``opob_policy_loss`` -- the off-policy optimal baseline
  ``b = sum_i w_i^2 R_i ||g_i||^2 / sum_i w_i^2 ||g_i||^2`` with ``g_i = grad log pi(y_i|x_i)`` (the score
  of the whole sequence: token log-probs summed), paper eq. 7 / 13. The exact per-sample gradient
  norms come from layer hooks during the one ordinary backward pass, and the baselined gradient
  is formed by linearity (eq. 8): autograd accumulates ``P = sum_i w_i grad(-log pi_i)`` into the
  parameters' gradients while the hooks accumulate ``Q = sum_i R_i w_i grad(-log pi_i)`` in a side
  buffer; after the last micro-batch ``grad = Q - b P``. No second backward pass is run.

The importance-weight and ESS formulas themselves belong to ``april_slime.training.offpolicy``
(``EssStats``, ``sequence_log_weights``, ``correct_log_weights``, ``Packing``); this module applies
them.

slime entry points (see docs/vcpo.md for the exact call order inside slime's Megatron loop):
``before_train_step`` (``--custom-megatron-before-train-step-hook-path``), ``opob_advantages``
(``--custom-advantage-function-path``); ``april_slime.loss.policy_loss`` (the custom loss) feeds
``runtime().lr_scaler`` and calls ``opob_policy_loss``.

torch is imported at module level: this module is only used on the training side.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from april_slime.training import offpolicy
from april_slime import settings
from april_slime.core.config import AprilConfig, AprilConfigError

__all__ = [
    "EssLrScaler",
    "PerSampleGradNorms",
    "OpobResult",
    "opob_policy_loss",
    "finish_opob_step",
    "opob_baseline",
    "reduce_per_sample_sq_norms",
    "VcpoRuntime",
    "runtime",
    "reset_runtime",
    "check_settings",
    "before_train_step",
    "opob_advantages",
]


def _default_group_active(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


# ============================================================================ ESS
class EssLrScaler:
    """Owns the ESS learning-rate rule: rho_on, the statistics of the current step, the last scale.

    Call order per optimizer step: ``begin_step()`` -> ``observe(seq_log_weights)`` for every
    micro-batch of the step -> the optimizer step runs inside ``scaled_lr(optimizer)`` (which
    reduces the statistics across ranks, multiplies every param group's ``lr`` by the factor and
    puts the exact previous values back afterwards, whatever the step does). ``wrap_optimizer``
    installs that context around ``optimizer.step`` once.

    rho_on: given, or the ESS ratio of the first step at which any weight was observed (the
    paper estimates it from one on-policy step; the first step of a run is the on-policy one).
    That step's factor is therefore 1.
    """

    def __init__(self, rho_on: float | None = None, scale_min: float = 0.0, scale_max: float = 1.0,
                 group=None) -> None:
        if rho_on is not None and not (0.0 < rho_on <= 1.0):
            raise ValueError(f"rho_on must be in (0, 1], got {rho_on}")
        if not (0.0 <= scale_min <= scale_max):
            raise ValueError(f"need 0 <= scale_min <= scale_max, got {scale_min}, {scale_max}")
        self.rho_on = rho_on
        self.rho_on_from_first_step = rho_on is None
        self.scale_min = scale_min
        self.scale_max = scale_max
        self.group = group
        self._stats = offpolicy.EssStats()
        self._device: torch.device | str = "cpu"
        self.last_ess_ratio: float = float("nan")
        self.last_scale: float = 1.0
        self.steps_scaled = 0

    # -- per step --------------------------------------------------------------------------
    def begin_step(self) -> None:
        self._stats = offpolicy.EssStats()

    def observe(self, seq_log_weights: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Unclipped sequence log importance weights ``log pi_theta(y|x) - log mu(y|x)`` [N] of
        samples of the current step (any number of calls per step; whole sequences, not CP chunks;
        ``valid`` excludes samples). Local only: the cross-rank reduction waits for the optimizer
        step, because data-parallel ranks may run different numbers of micro-batches."""
        self._device = seq_log_weights.device
        self._stats.add(seq_log_weights, valid)

    def compute_scale(self) -> float:
        """Collective over ``group``: every rank must call it once per step."""
        stats = self._stats.reduce(self.group, device=self._device)
        if stats.num_samples == 0:
            # Nothing was measured anywhere (e.g. a loss that does not feed the scaler): leave
            # the step unscaled.
            self.last_ess_ratio, self.last_scale = float("nan"), 1.0
            return 1.0
        ratio = stats.ess_ratio
        if self.rho_on is None:
            self.rho_on = ratio
        self.last_ess_ratio = ratio
        self.last_scale = min(self.scale_max, max(self.scale_min, math.sqrt(ratio / self.rho_on)))
        return self.last_scale

    @contextlib.contextmanager
    def scaled_lr(self, optimizer) -> Iterator[float]:
        scale = self.compute_scale()
        groups = list(optimizer.param_groups)
        saved = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = group["lr"] * scale
        self.steps_scaled += 1
        try:
            yield scale
        finally:
            # Restore the exact values: a scheduler that overwrites lr after the step makes this
            # redundant, but a skipped step (inf/nan grads: no scheduler step) must not keep it.
            for group, lr in zip(groups, saved):
                group["lr"] = lr
            self._stats = offpolicy.EssStats()

    def wrap_optimizer(self, optimizer) -> None:
        """Make ``optimizer.step()`` run inside ``scaled_lr`` (idempotent, instance-level)."""
        current = optimizer.step
        if getattr(current, "_vcpo_scaler", None) is self:
            return
        original = getattr(current, "_vcpo_original", current)

        def step(*args, **kwargs):
            with self.scaled_lr(optimizer):
                return original(*args, **kwargs)

        step._vcpo_scaler = self  # type: ignore[attr-defined]
        step._vcpo_original = original  # type: ignore[attr-defined]
        optimizer.step = step

    # -- persistence -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"rho_on": self.rho_on, "last_ess_ratio": self.last_ess_ratio,
                "last_scale": self.last_scale, "steps_scaled": self.steps_scaled}

    def load_state_dict(self, state: dict) -> None:
        self.rho_on = state["rho_on"]
        self.last_ess_ratio = state["last_ess_ratio"]
        self.last_scale = state["last_scale"]
        self.steps_scaled = state["steps_scaled"]

    def metrics(self) -> dict[str, float]:
        return {"vcpo/ess_ratio": self.last_ess_ratio, "vcpo/lr_scale": self.last_scale,
                "vcpo/rho_on": float("nan") if self.rho_on is None else self.rho_on}


# ============================================================================ per-sample norms
_KIND_LINEAR, _KIND_EMBEDDING, _KIND_LAYERNORM, _KIND_RMSNORM = "linear", "embedding", "layernorm", "rmsnorm"
# Transformer Engine's fused LayerNormLinear (Megatron's TELayerNormColumnParallelLinear): a norm
# with parameters layer_norm_weight (/ layer_norm_bias) feeding a linear (weight / bias) in one
# module; attributes normalization ("LayerNorm" | "RMSNorm"), eps, zero_centered_gamma.
_KIND_LN_LINEAR = "layernorm_linear"


def _module_kind(module: nn.Module) -> str | None:
    """Duck typing over torch and Megatron layer classes (weight shapes as nn.Linear's [out, in])."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.requires_grad:
        return None
    name = type(module).__name__
    if weight.dim() == 1 and "RMSNorm" in name:
        return _KIND_RMSNORM
    if weight.dim() == 1 and "LayerNorm" in name and "Linear" not in name:
        return _KIND_LAYERNORM
    if weight.dim() == 2 and isinstance(getattr(module, "layer_norm_weight", None), torch.Tensor):
        return _KIND_LN_LINEAR
    if weight.dim() == 2 and (isinstance(module, nn.Embedding) or hasattr(module, "vocab_start_index")
                              or name.endswith("Embedding")):
        return _KIND_EMBEDDING
    if weight.dim() == 2 and (isinstance(module, nn.Linear) or name.endswith("Linear")):
        return _KIND_LINEAR
    return None


def _eps(module: nn.Module, dtype: torch.dtype) -> float:
    eps = getattr(module, "eps", None)
    return torch.finfo(dtype).eps if eps is None else float(eps)


def _normalize(x: torch.Tensor, is_layernorm: bool, eps: float) -> torch.Tensor:
    if is_layernorm:
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, unbiased=False, keepdim=True)
        return (x - mean) * torch.rsqrt(var + eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _main_output(output: Any) -> torch.Tensor | None:
    # Megatron's parallel linears return (output, output_bias).
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


class _Microbatch:
    __slots__ = ("segment_ids", "num_samples", "coeffs", "coeffs_host", "sq_norms", "runs")

    def __init__(self, segment_ids: torch.Tensor, num_samples: int, coeffs: torch.Tensor | None):
        self.segment_ids = segment_ids.reshape(-1).long()
        self.num_samples = num_samples
        self.coeffs = coeffs
        self.coeffs_host = coeffs.tolist() if coeffs is not None else None
        self.sq_norms: torch.Tensor | None = None
        # Each sample's token ranges [start, end) in the activations, found once per micro-batch
        # on the host: the hooks then slice views (no per-layer, per-sample device syncs or
        # gathers). Packed samples are one range each.
        values, counts = torch.unique_consecutive(self.segment_ids.cpu(), return_counts=True)
        runs: list[list[tuple[int, int]]] = [[] for _ in range(num_samples)]
        start = 0
        for v, c in zip(values.tolist(), counts.tolist()):
            if v >= 0:
                runs[v].append((start, start + c))
            start += c
        self.runs = runs


class PerSampleGradNorms:
    """Exact per-sample squared gradient norms (and optionally a per-sample-weighted second
    gradient) from forward/backward hooks, without per-sample gradients for the whole model.

    For every covered layer the forward hook keeps the layer input and a hook on the output
    tensor receives its gradient ``B``; sample i's gradient of the layer's parameters is then
    assembled from its own tokens only (``segment_ids``):

    * linear ``W`` [out, in]: ``G_i = sum_{t in i} b_t a_t^T``. ``||G_i||^2`` either directly
      (``O(T_i d_in d_out)``) or by the Gram identity ``sum_{t,s} (a_t.a_s)(b_t.b_s)``
      (``O(T_i^2 (d_in + d_out))``, tiled), whichever is cheaper; when the weighted buffer is
      requested the direct form is always used, since it yields ``G_i`` for ``Q`` at no extra cost.
      Bias: ``sum_t b_t``.
    * embedding: rows of equal token ids add up, so ``||G_i||^2 = sum_v ||sum_{t in i, x_t = v} b_t||^2``
      (grouped by (sample, token id); vocab-parallel shards keep only their id range).
    * LayerNorm / RMSNorm: ``sum_t xhat_t * b_t`` (elementwise; ``xhat`` recomputed from the input),
      bias ``sum_t b_t``.

    Per-sample squared norms add over parameters, so partial results of tensor-parallel shards add
    up (``reduce_per_sample_sq_norms``). Parameters that Megatron replicates across TP ranks
    (no ``tensor_model_parallel`` attribute) are counted on TP rank 0 only.

    With ``weighted=True`` the hooks also accumulate ``Q[p] = sum_i c_i G_i[p]`` (``c_i`` given per
    micro-batch) into ``weighted_grads`` -- the second buffer of the linearity trick -- and the
    running OPOB sums ``num = sum_i c_i ||G_i||^2``, ``den = sum_i ||G_i||^2``.

    Every trainable parameter of ``model`` must belong to a covered layer, or construction fails
    (a silently partial norm would bias the baseline). One forward and one backward per
    micro-batch, in that order; forwards without grad (log-prob recomputation) are ignored.
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module], *, weighted: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, tp_group=None, gram_tile: int = 1024) -> None:
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.weighted = weighted
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.gram_tile = gram_tile
        self._handles: list[Any] = []
        self._inputs: dict[nn.Module, tuple[torch.Tensor, ...]] = {}
        self._modules: list[tuple[nn.Module, str, str]] = []
        self._mb: _Microbatch | None = None
        self.weighted_grads: dict[nn.Parameter, torch.Tensor] = {}
        self.num = None  # torch scalars once anything was accumulated
        self.den = None
        self.microbatches = 0
        self.last_baseline = float("nan")  # set by finish_opob_step
        self.last_num = self.last_den = float("nan")

        covered: dict[int, str] = {}
        all_params: dict[int, str] = {}
        for chunk in chunks:
            for pname, p in chunk.named_parameters():
                if p.requires_grad:
                    all_params.setdefault(id(p), pname)
            for mname, module in chunk.named_modules():
                kind = _module_kind(module)
                if kind is None:
                    continue
                names = ("weight", "bias") + (("layer_norm_weight", "layer_norm_bias") if kind == _KIND_LN_LINEAR
                                              else ())
                own = [p for p in (getattr(module, n, None) for n in names)
                       if isinstance(p, torch.Tensor) and p.requires_grad and p.numel()]
                for p in own:
                    if id(p) in covered:
                        raise AprilConfigError(
                            f"april_vcpo_baseline: parameter of {mname} is shared with {covered[id(p)]} "
                            "(tied weights); exact per-sample norms of shared parameters are not "
                            "supported -- untie the embedding and output layer")
                    covered[id(p)] = mname
                extra = [n for n, p in module.named_parameters(recurse=False)
                         if p.requires_grad and id(p) not in covered]
                if extra:
                    raise AprilConfigError(
                        f"april_vcpo_baseline: {mname} ({type(module).__name__}) has parameters "
                        f"{extra} that no per-sample rule covers (fused layers such as "
                        "LayerNormLinear are not supported; use unfused layers)")
                self._modules.append((module, mname, kind))
        missing = [name for pid, name in all_params.items() if pid not in covered]
        if missing:
            raise AprilConfigError(
                f"april_vcpo_baseline: no per-sample gradient rule for parameters {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}: supported layers are Linear / "
                "Column- and RowParallelLinear, Embedding / VocabParallelEmbedding, LayerNorm, RMSNorm")
        for module, _, kind in self._modules:
            self._handles.append(module.register_forward_hook(self._make_forward_hook(kind)))

    # -- lifecycle ---------------------------------------------------------------------------
    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._inputs.clear()

    def reset(self) -> None:
        """Start a new optimizer step: clear the weighted buffers and the OPOB sums."""
        self.weighted_grads = {}
        self.num = self.den = None
        self.microbatches = 0
        self._mb = None
        self._inputs.clear()

    def set_microbatch(self, segment_ids: torch.Tensor, num_samples: int,
                       coeffs: torch.Tensor | None = None) -> None:
        """Describe the micro-batch whose backward comes next: which sample each token of the
        layers' activations belongs to (flattened in the activations' order, -1 = none) and, with
        ``weighted=True``, the per-sample coefficient ``c_i`` of the second buffer."""
        if self.weighted and coeffs is None:
            raise ValueError("weighted per-sample norms need one coefficient per sample")
        if coeffs is not None:
            coeffs = coeffs.detach().reshape(-1)
            if coeffs.numel() != num_samples:
                raise ValueError(f"{coeffs.numel()} coefficients for {num_samples} samples")
            if not torch.isfinite(coeffs).all():
                raise ValueError("non-finite per-sample coefficient (reward/advantage)")
        seg = segment_ids.reshape(-1)
        if seg.numel() and int(seg.max()) >= num_samples:
            raise ValueError(f"segment id {int(seg.max())} >= num_samples {num_samples}")
        self._mb = _Microbatch(segment_ids, num_samples, coeffs)
        self.microbatches += 1

    @property
    def last_sq_norms(self) -> torch.Tensor | None:
        """Per-sample squared norms of the latest micro-batch (this rank's shards only)."""
        return None if self._mb is None else self._mb.sq_norms

    # -- hooks -----------------------------------------------------------------------------
    def _make_forward_hook(self, kind: str) -> Callable:
        def hook(module, inputs, output):
            out = _main_output(output)
            if out is None or not torch.is_grad_enabled() or not out.requires_grad:
                return
            if module in self._inputs:
                raise RuntimeError(
                    f"{type(module).__name__} ran forward twice before its backward: per-sample norms "
                    "need one forward and one backward per micro-batch and no module reuse")
            self._inputs[module] = (inputs[0].detach(),)
            out.register_hook(lambda grad, m=module, k=kind: self._on_output_grad(m, k, grad))
        return hook

    def _counts(self, p: torch.Tensor) -> bool:
        return self.tp_size == 1 or getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0

    # -- sequence parallelism ---------------------------------------------------------------
    # With --sequence-parallel the activations outside the tensor-parallel regions hold this TP
    # rank's contiguous slice of the token stream (S / tp tokens), inside them all S tokens. A
    # layer's input or output gradient with S / tp tokens is gathered over the TP group when a
    # per-sample sum must see every token (a sharded weight), and a replicated parameter sums its
    # per-sample rows over the group instead. The hooks run in the same layer order on every TP
    # rank, so these collectives line up.
    def _token_layout(self, n: int, total: int, what: str, module: nn.Module) -> bool:
        """True when a tensor with ``n`` tokens is this rank's sequence-parallel slice."""
        if n == total:
            return False
        if self.tp_size > 1 and n * self.tp_size == total:
            return True
        raise RuntimeError(
            f"{type(module).__name__}: {n} tokens in the {what} but {total} segment ids (tensor-parallel size "
            f"{self.tp_size}; context-parallel layouts are not supported)")

    def _local_slice(self, total: int) -> slice:
        n = total // self.tp_size
        return slice(self.tp_rank * n, (self.tp_rank + 1) * n)

    def _gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts)

    # -- hooks -----------------------------------------------------------------------------
    def _on_output_grad(self, module: nn.Module, kind: str, grad: torch.Tensor) -> None:
        mb = self._mb
        if mb is None:
            raise RuntimeError("backward through a hooked layer before set_microbatch(): the loss must "
                               "describe its micro-batch (opob_policy_loss does)")
        (inp,) = self._inputs.pop(module)
        total = mb.segment_ids.numel()
        acc = torch.promote_types(grad.dtype, torch.float32)
        # GEMM operands stay in the activations' dtype (bf16 on GPU: tensor cores, fp32
        # accumulation); reductions of squares and the second buffer are float32 or wider.
        b = grad.reshape(-1, grad.shape[-1])
        b_split = (self._token_layout(b.shape[0], total, "output gradient", module)
                   if kind not in (_KIND_LAYERNORM, _KIND_RMSNORM) else False)
        if mb.sq_norms is None:
            mb.sq_norms = torch.zeros(mb.num_samples, dtype=acc, device=grad.device)
        weight = module.weight
        bias = getattr(module, "bias", None)
        bias = bias if isinstance(bias, torch.Tensor) and bias.requires_grad else None
        sq = torch.zeros(mb.num_samples, dtype=acc, device=grad.device)

        if kind == _KIND_LINEAR:
            a = inp.reshape(-1, inp.shape[-1])
            a_split = self._token_layout(a.shape[0], total, "input", module)
            if (a_split or b_split) and not getattr(weight, "tensor_model_parallel", False):
                raise RuntimeError(f"{type(module).__name__}: a replicated weight with sequence-parallel "
                                   "activations has no per-sample rule")
            b_local = b
            a = self._gather_tokens(a) if a_split else a
            b = self._gather_tokens(b) if b_split else b
            if a.shape[-1] != weight.shape[1] or b.shape[-1] != weight.shape[0]:
                raise RuntimeError(f"{type(module).__name__}: activations {tuple(a.shape)} / output grads "
                                   f"{tuple(b.shape)} do not match weight {tuple(weight.shape)} "
                                   "(gather_output is not supported)")
            self._linear(weight, a.to(b.dtype), b, mb, sq, self._counts(weight))
            if bias is not None:
                # RowParallelLinear's bias under sequence parallelism is replicated and summed over
                # the TP group by Megatron: its second buffer takes this rank's tokens only
                self._segment_sum_param(bias, b.to(acc), mb, sq, split=False,
                                        local=b_local.to(acc) if b_split else None)
        elif kind == _KIND_EMBEDDING:
            b = self._gather_tokens(b) if b_split else b
            self._embedding(module, inp.reshape(-1), b.to(acc), mb, sq)
        elif kind == _KIND_LN_LINEAR:
            self._layernorm_linear(module, inp, b, b_split, mb, sq, acc, total)
        else:
            d = inp.shape[-1]
            x = inp.reshape(-1, d).to(acc)
            # a norm over heads (Qwen3's q/k layernorm) sees several rows per token
            per_token_rows = max(x.shape[0] // total, 1) if x.shape[0] % total == 0 else 1
            tokens = x.shape[0] // per_token_rows
            split = self._token_layout(tokens, total, "input", module)
            xhat = _normalize(x, kind == _KIND_LAYERNORM, _eps(module, inp.dtype))
            b = grad.reshape(-1, d).to(acc)
            wgrad = (xhat * b).reshape(tokens, per_token_rows, d).sum(1)
            self._segment_sum_param(weight, wgrad, mb, sq, split=split)
            if bias is not None:
                self._segment_sum_param(bias, b.reshape(tokens, per_token_rows, d).sum(1), mb, sq, split=split)

        mb.sq_norms += sq
        if mb.coeffs is not None:
            c = mb.coeffs.to(device=sq.device, dtype=acc)
            num, den = (c * sq).sum(), sq.sum()
            self.num = num if self.num is None else self.num + num
            self.den = den if self.den is None else self.den + den

    def _layernorm_linear(self, module, inp, b, b_split, mb, sq, acc, total) -> None:
        """Transformer Engine's LayerNormLinear: ``y = W norm(x) + c``, norm weight g (bias beta).

        The norm output ``n = xhat * g' + beta`` (``g' = 1 + g`` with zero-centred gamma) is
        recomputed from the input; the linear's per-sample gradient is ``sum_t b_t n_t^T`` and the
        norm's per-token gradients are ``xhat * u`` and ``u`` with ``u = b W`` (the gradient
        reaching ``n``). Column-parallel TP: ``u`` from a weight shard is partial, so the per-sample
        rows are summed over the TP group before squaring; with sequence parallelism the input is
        this rank's slice and ``n`` is gathered (TE gathers it the same way inside the module).
        """
        weight = module.weight
        bias = getattr(module, "bias", None)
        bias = bias if isinstance(bias, torch.Tensor) and bias.requires_grad and bias.numel() else None
        gamma = module.layer_norm_weight
        beta = getattr(module, "layer_norm_bias", None)
        beta = beta if isinstance(beta, torch.Tensor) and beta.requires_grad and beta.numel() else None
        x = inp.reshape(-1, inp.shape[-1]).to(acc)
        x_split = self._token_layout(x.shape[0], total, "input", module)
        is_layernorm = str(getattr(module, "normalization", "LayerNorm")) == "LayerNorm"
        xhat = _normalize(x, is_layernorm, _eps(module, inp.dtype))
        if x_split:
            xhat = self._gather_tokens(xhat)
        g_eff = gamma.detach().to(acc) + (1.0 if getattr(module, "zero_centered_gamma", False) else 0.0)
        n = xhat * g_eff + (beta.detach().to(acc) if beta is not None else 0.0)
        b_full = self._gather_tokens(b) if b_split else b
        self._linear(weight, n.to(b.dtype), b_full, mb, sq, self._counts(weight))
        if bias is not None:
            self._segment_sum_param(bias, b_full.to(acc), mb, sq, split=False,
                                    local=b.to(acc) if b_split else None)
        u = b_full.to(acc) @ weight.detach().to(acc)  # [S, h], this shard's part of d loss / d n
        tp = self.tp_size > 1
        for p, per_token in ((gamma, xhat * u), (beta, u)):
            if p is None:
                continue
            rows = self._rows(per_token, mb)
            full = rows.clone()
            if tp:
                dist.all_reduce(full, group=self.tp_group)
            if self.tp_rank == 0:
                sq += full.pow(2).sum(-1)
            if self.weighted:
                # sequence parallel: Megatron sums these replicated gradients over the group, so
                # each rank keeps its partial rows; otherwise every rank holds the full gradient
                q_rows = rows if x_split else full
                self._add_weighted(p, (mb.coeffs.to(q_rows) @ q_rows).reshape(p.shape))

    def _add_weighted(self, p: torch.Tensor, value: torch.Tensor) -> None:
        buf = self.weighted_grads.get(p)
        if buf is None:
            self.weighted_grads[p] = value.to(torch.promote_types(p.dtype, torch.float32)).clone()
        else:
            buf += value

    def _rows(self, per_token: torch.Tensor, mb: _Microbatch, offset: int = 0) -> torch.Tensor:
        """Per-sample sums [N, d] of a [T, d] tensor whose first token is token ``offset``."""
        rows = torch.zeros(mb.num_samples, per_token.shape[-1], dtype=per_token.dtype, device=per_token.device)
        end = offset + per_token.shape[0]
        for i, runs in enumerate(mb.runs):
            for s, e in runs:
                s, e = max(s, offset), min(e, end)
                if s < e:
                    rows[i] += per_token[s - offset:e - offset].sum(0)
        return rows

    def _segment_sum_param(self, p: torch.Tensor, per_token: torch.Tensor, mb: _Microbatch, sq: torch.Tensor,
                           split: bool, local: torch.Tensor | None = None) -> None:
        """Parameters whose per-sample gradient is a plain sum over the sample's tokens.

        ``split``: ``per_token`` holds this rank's sequence-parallel slice; the per-sample rows are
        summed over the TP group for the norm, while the second buffer keeps the local part
        (Megatron sums these replicated gradients over the group). ``local``: the full tokens
        are given, and this rank's slice of them feeds the second buffer.
        """
        total = mb.segment_ids.numel()
        offset = self._local_slice(total).start if split else 0
        rows = self._rows(per_token, mb, offset)
        if split:
            full = rows.clone()
            dist.all_reduce(full, group=self.tp_group)
        else:
            full = rows
        if self._counts(p) and not (split and self.tp_rank != 0):
            sq += full.pow(2).sum(-1)
        if self.weighted:
            q_rows = rows if local is None else self._rows(local, mb, self._local_slice(total).start)
            self._add_weighted(p, (mb.coeffs.to(q_rows) @ q_rows).reshape(p.shape))

    def _linear(self, weight, a, b, mb, sq, counts: bool) -> None:
        d_out, d_in = b.shape[-1], a.shape[-1]
        q = None
        for i, runs in enumerate(mb.runs):
            t = sum(e - s for s, e in runs)
            if t == 0:
                continue
            if self.weighted or t * (d_in + d_out) >= d_in * d_out:
                g_i = None
                for s, e in runs:
                    part = b[s:e].t() @ a[s:e]  # [out, in], as the weight
                    g_i = part if g_i is None else g_i.add_(part)
                if counts:
                    sq[i] += torch.linalg.vector_norm(g_i, dtype=sq.dtype).square()
                if self.weighted:
                    c_i = mb.coeffs_host[i]
                    if q is None:
                        q = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                                        device=g_i.device)
                    q.add_(g_i, alpha=c_i)
            elif counts:
                idx = [torch.arange(s, e, device=a.device) for s, e in runs]
                idx = idx[0] if len(idx) == 1 else torch.cat(idx)
                sq[i] += self._gram_sq_norm(a.index_select(0, idx).to(sq.dtype), b.index_select(0, idx).to(sq.dtype))
        if self.weighted:
            self._add_weighted(weight, q if q is not None else torch.zeros_like(weight, dtype=torch.float32))

    def _gram_sq_norm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # sum_{t,s} (a_t.a_s)(b_t.b_s), tiled so memory stays O(tile^2); symmetric, so each
        # off-diagonal tile pair is computed once and counted twice.
        t, tile = a.shape[0], self.gram_tile
        total = a.new_zeros(())
        for r0 in range(0, t, tile):
            ar, br = a[r0:r0 + tile], b[r0:r0 + tile]
            for c0 in range(r0, t, tile):
                block = ((ar @ a[c0:c0 + tile].t()) * (br @ b[c0:c0 + tile].t())).sum()
                total = total + (block if c0 == r0 else 2 * block)
        return total

    def _embedding(self, module, ids: torch.Tensor, b: torch.Tensor, mb: _Microbatch, sq: torch.Tensor) -> None:
        weight = module.weight
        seg = mb.segment_ids.to(b.device)
        if ids.numel() != seg.numel():
            raise RuntimeError(f"{type(module).__name__}: {ids.numel()} token ids but {seg.numel()} segment ids")
        start = int(getattr(module, "vocab_start_index", 0))
        n_rows = weight.shape[0]
        local = ids.to(seg.device).long() - start
        keep = (seg >= 0) & (local >= 0) & (local < n_rows)
        if b.shape[-1] != weight.shape[1]:
            raise RuntimeError(f"{type(module).__name__}: output grads {tuple(b.shape)} do not match "
                               f"weight {tuple(weight.shape)}")
        seg_k, row_k, b_k = seg[keep], local[keep], b[keep]
        if self._counts(weight) and seg_k.numel():
            key = seg_k * n_rows + row_k
            uniq, inverse = torch.unique(key, return_inverse=True)
            grouped = torch.zeros(uniq.numel(), b.shape[-1], dtype=b.dtype, device=b.device)
            grouped.index_add_(0, inverse, b_k)
            sq.index_add_(0, uniq // n_rows, grouped.pow(2).sum(-1))
        if self.weighted:
            q = torch.zeros(weight.shape, dtype=b.dtype, device=b.device)
            if seg_k.numel():
                q.index_add_(0, row_k, b_k * mb.coeffs.to(b)[seg_k][:, None])
            self._add_weighted(weight, q)


def reduce_per_sample_sq_norms(sq_norms: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Sum the partial per-sample squared norms of the tensor-parallel shards (in place)."""
    if _default_group_active(tp_group):
        dist.all_reduce(sq_norms, op=dist.ReduceOp.SUM, group=tp_group)
    return sq_norms


def opob_baseline(num: torch.Tensor | float | None, den: torch.Tensor | float | None,
                  group=None, device=None) -> tuple[float, float, float]:
    """``b = num / den`` after summing both over ``group`` (every rank of the training job: data
    parallel ranks add their samples, TP/PP ranks their parameter shards -- the sums are linear
    in the per-sample squared norms). Returns ``(b, num, den)``; ``b = 0`` when ``den == 0`` (every
    weighted gradient is zero, so the baseline has nothing to act on)."""
    device = offpolicy.collective_device(group, device)
    vals = torch.tensor([float(num or 0.0), float(den or 0.0)], dtype=torch.float64, device=device)
    if _default_group_active(group):
        dist.all_reduce(vals, op=dist.ReduceOp.SUM, group=group)
    num_g, den_g = float(vals[0]), float(vals[1])
    if not (math.isfinite(num_g) and math.isfinite(den_g)):
        raise FloatingPointError(f"non-finite OPOB sums num={num_g} den={den_g}")
    return (num_g / den_g if den_g > 0 else 0.0), num_g, den_g


# ============================================================================ loss side
@dataclass
class OpobResult:
    loss: torch.Tensor            # sum_i w_i * (-log pi(y_i|x_i)): what autograd differentiates
    is_weights: torch.Tensor      # [N] w_i used as coefficients (after truncation / masking)
    seq_log_ratios: torch.Tensor  # [N] unclipped log pi_theta(y_i|x_i) - log mu(y_i|x_i), for the ESS
    rewards: torch.Tensor         # [N] R_i
    keep: torch.Tensor            # [N] 0.0 where masking (MIS) removed the sample
    truncated: torch.Tensor       # [N] 1.0 where truncation (TIS) changed the weight
    packing: offpolicy.Packing    # layout of the samples' response tokens


def opob_policy_loss(log_probs: Sequence[torch.Tensor], rollout_log_probs: Sequence[torch.Tensor],
                     loss_masks: Sequence[torch.Tensor], rewards: torch.Tensor | Sequence[float],
                     segment_ids: torch.Tensor, *, grad_norms: PerSampleGradNorms | None = None,
                     correction: str = "truncate", low: float = 0.0, high: float = 2.0) -> OpobResult:
    """Loss side of VCPO for one micro-batch (paper eq. 9 without the baseline term).

    Returns ``loss = sum_i w_i * (-sum_t mask_t log pi_t)`` -- differentiate it once; its gradient
    is the score buffer ``P``. ``w_i`` is the sequence-level importance weight
    ``pi_theta(y_i|x_i) / mu(y_i|x_i)`` corrected by ``offpolicy.correct_log_weights`` (``truncate``
    = TIS, ``mask`` = MIS, ``none``; bounds ``[low, high]``). With ``grad_norms`` (``weighted=True``)
    the micro-batch is registered so that the backward hooks accumulate
    ``Q = sum_i R_i w_i grad(-log pi_i)`` and the OPOB sums; ``finish_opob_step`` then turns the
    gradients into ``Q - b P``, the gradient of ``sum_i w_i (R_i - b)(-log pi_i)``. The unclipped
    sequence log-ratios come back in ``seq_log_ratios`` for the ESS learning-rate scaler.

    ``log_probs`` are the training forward's per-token log-probs of each sample's response (with
    grad); ``rollout_log_probs`` the behaviour log-probs (a resumed sample's concatenation over its
    generation stages, so the ratio is against the policies that actually produced it);
    ``segment_ids`` map every token of the layers' activations to its sample (-1 = none).
    """
    n = len(log_probs)
    if not (len(rollout_log_probs) == n == len(loss_masks)):
        raise ValueError("log_probs, rollout_log_probs and loss_masks must have one entry per sample")
    for i, (lp, rlp, m) in enumerate(zip(log_probs, rollout_log_probs, loss_masks)):
        if lp.shape != rlp.shape or lp.shape != m.shape:
            raise ValueError(f"sample {i}: log_probs {tuple(lp.shape)}, rollout_log_probs "
                             f"{tuple(rlp.shape)} and loss_mask {tuple(m.shape)} differ in length")
    if n == 0:
        raise ValueError("empty micro-batch")
    if isinstance(rewards, (list, tuple)):
        rewards = torch.stack([torch.as_tensor(r, dtype=torch.float64).reshape(()) for r in rewards])
    rewards = torch.as_tensor(rewards).detach().reshape(-1)
    if rewards.numel() != n:
        raise ValueError(f"{rewards.numel()} rewards for {n} samples")
    if not torch.isfinite(rewards).all():
        raise ValueError("non-finite reward")

    current, packing = offpolicy.pack(list(log_probs))
    rollout = torch.cat([r.detach() for r in rollout_log_probs]).to(device=current.device, dtype=torch.float64)
    mask = torch.cat(list(loss_masks)).to(current.device)
    clean = offpolicy.check_finite({"log_probs": current, "rollout_log_probs": rollout}, mask, packing)
    current = clean["log_probs"]
    log_ratio = offpolicy.sequence_log_weights(
        offpolicy.masked_log_ratio(current.detach().to(torch.float64), clean["rollout_log_probs"], mask),
        packing, mask)
    weights = offpolicy.correct_log_weights(log_ratio, correction, low, high)
    if grad_norms is not None:
        grad_norms.set_microbatch(segment_ids, n, rewards.to(torch.float64))
    nll = -packing.sum(current * mask.to(current.dtype))
    loss = (nll * weights.weights.to(current.dtype)).sum()
    return OpobResult(loss, weights.weights, log_ratio, rewards, weights.keep, weights.truncated, packing)


def finish_opob_step(grad_norms: PerSampleGradNorms, params: Iterable[nn.Parameter], group=None
                     ) -> float:
    """After the step's last backward and before any gradient reduction: compute the global ``b``
    and set every covered parameter's gradient to ``Q - b P`` (``main_grad`` when Megatron keeps
    one, else ``.grad``). Collective over ``group``. Returns ``b``."""
    device = None
    if grad_norms.den is not None:
        device = grad_norms.den.device
    b, num, den = opob_baseline(grad_norms.num, grad_norms.den, group=group, device=device)
    for p in params:
        q = grad_norms.weighted_grads.get(p)
        grad = getattr(p, "main_grad", None)
        if grad is None:
            grad = p.grad
        if grad is None:
            if q is not None and q.abs().max() > 0:
                raise RuntimeError("a parameter received a weighted gradient but no autograd gradient")
            continue
        grad.mul_(-b)
        if q is not None:
            grad.add_(q.to(grad.dtype))
    grad_norms.last_baseline, grad_norms.last_num, grad_norms.last_den = b, num, den
    grad_norms.reset()
    return b


# ============================================================================ slime glue
class VcpoRuntime:
    """Everything VCPO keeps for one slime training job (one per training process)."""

    def __init__(self, config: AprilConfig, *, group=None) -> None:
        self.config = config
        self.group = group
        self.lr_scaler: EssLrScaler | None = None
        if config.vcpo_lr_scaling:
            self.lr_scaler = EssLrScaler(config.vcpo_rho_on, config.vcpo_lr_scale_min,
                                         config.vcpo_lr_scale_max, group=group)
        self.grad_norms: PerSampleGradNorms | None = None
        self._params: list[nn.Parameter] = []
        self.last_baseline = float("nan")

    @property
    def is_correction(self) -> tuple[str, float, float]:
        c = self.config
        return c.is_correction, c.is_low, c.is_high

    def attach_model(self, model: Sequence[nn.Module], tp_rank: int = 0, tp_size: int = 1, tp_group=None) -> None:
        if not self.config.vcpo_baseline or self.grad_norms is not None:
            return
        self.grad_norms = PerSampleGradNorms(model, weighted=True, tp_rank=tp_rank, tp_size=tp_size,
                                             tp_group=tp_group)
        self._params = [p for chunk in model for p in chunk.parameters() if p.requires_grad]

    def begin_step(self) -> None:
        if self.lr_scaler is not None:
            self.lr_scaler.begin_step()
        if self.grad_norms is not None:
            self.grad_norms.reset()

    def finish_gradients(self) -> float:
        """Apply the baseline to the accumulated gradients (before the DP reduction)."""
        if self.grad_norms is None:
            return float("nan")
        if self.grad_norms.microbatches == 0:
            raise RuntimeError("april_vcpo_baseline is on but the loss never registered a micro-batch: "
                               "use the VCPO loss (opob_policy_loss)")
        self.last_baseline = finish_opob_step(self.grad_norms, self._params, group=self.group)
        return self.last_baseline

    def wrap_finalize(self, megatron_config) -> None:
        """Run ``finish_gradients`` first inside Megatron's ``finalize_model_grads_func``, which
        forward_backward_func calls once after the last micro-batch and which starts the DP
        gradient reduction. slime's ``train()`` re-installs the original every rollout, so this is
        called every step."""
        current = megatron_config.finalize_model_grads_func
        if current is None or getattr(current, "_vcpo_runtime", None) is self:
            return

        def finalize(*args, **kwargs):
            self.finish_gradients()
            return current(*args, **kwargs)

        finalize._vcpo_runtime = self  # type: ignore[attr-defined]
        megatron_config.finalize_model_grads_func = finalize

    def metrics(self) -> dict[str, float]:
        out = {}
        if self.lr_scaler is not None:
            out.update(self.lr_scaler.metrics())
        if self.grad_norms is not None:
            out["vcpo/opob_baseline"] = self.last_baseline
        return out


_RUNTIME: VcpoRuntime | None = None


def runtime() -> VcpoRuntime | None:
    """The job's VCPO state, created by the first ``before_train_step`` (None before / when off)."""
    return _RUNTIME


def reset_runtime() -> None:
    global _RUNTIME
    _RUNTIME = None


def check_settings(args: Any, config: AprilConfig) -> None:
    """Refuse, in one ``AprilConfigError``, every setup the enabled VCPO controls cannot serve."""
    if not (config.vcpo_lr_scaling or config.vcpo_baseline):
        return
    loss_type = getattr(args, "loss_type", None)
    if loss_type is not None and loss_type != "custom_loss":
        raise AprilConfigError(
            "april_vcpo_lr_scaling / april_vcpo_baseline are fed by the custom loss: set --loss-type custom_loss "
            f"--custom-loss-function-path april_slime.loss.policy_loss (got --loss-type {loss_type})")
    if not config.vcpo_baseline:
        return
    estimator = getattr(args, "advantage_estimator", None)
    checks = [
        (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1,
        (getattr(args, "context_parallel_size", 1) or 1) > 1,
        bool(getattr(args, "overlap_grad_reduce", False)),
        bool(getattr(args, "use_kl_loss", False)),
        float(getattr(args, "entropy_coef", 0.0) or 0.0) != 0.0,
        bool(getattr(args, "recompute_loss_function", False)),
        config.is_mode != "copris",
        config.is_level != "sequence",
        config.loss_level != "token" or estimator in ("gspo", "cispo"),
    ]
    reasons = [
        "pipeline parallelism (only the last stage sees the rewards)",
        "context parallelism (sequences split across ranks)",
        "--overlap-grad-reduce (gradients must stay local until the baseline is applied)",
        "--use-kl-loss (the baseline is defined for the pure policy-gradient loss)",
        "a non-zero --entropy-coef (same reason)",
        "--recompute-loss-function (the loss would register its micro-batch twice)",
        f"april_is_mode={config.is_mode} (the baseline is derived for the importance-weighted REINFORCE "
        "estimator against the rollout log-probs: set april_is_mode: copris; decoupled and on_policy clip "
        "around the recomputed policy, which has no per-trajectory baseline)",
        f"april_is_level={config.is_level} (one weight per trajectory: set april_is_level: sequence)",
        f"april_loss_level={config.loss_level} / --advantage-estimator {estimator} (the baselined loss is "
        "REINFORCE, not a GSPO or CISPO objective)",
    ]
    bad = [r for c, r in zip(checks, reasons) if c]
    if bad:
        raise AprilConfigError("april_vcpo_baseline: not supported with " + "; ".join(bad))


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None:
    """slime ``--custom-megatron-before-train-step-hook-path`` entry point.

    slime calls it in ``train_one_step`` after zeroing the gradients and before the step's
    forward/backward, with the optimizer whose ``step()`` follows the backward and the scheduler
    whose ``step()`` follows that (and overwrites every group's lr).
    """
    global _RUNTIME
    if _RUNTIME is None:
        config = settings.for_job(args)
        check_settings(args, config)
        _RUNTIME = VcpoRuntime(config)
        if config.vcpo_baseline:
            from megatron.core import mpu  # lazy: only inside a Megatron job

            _RUNTIME.attach_model(model, tp_rank=mpu.get_tensor_model_parallel_rank(),
                                  tp_size=mpu.get_tensor_model_parallel_world_size(),
                                  tp_group=mpu.get_tensor_model_parallel_group())
    rt = _RUNTIME
    if rt.lr_scaler is not None:
        rt.lr_scaler.wrap_optimizer(optimizer)
    if rt.grad_norms is not None:
        from megatron.core.utils import get_model_config  # lazy

        rt.wrap_finalize(get_model_config(model[0]))
    rt.begin_step()


def opob_advantages(args, rollout_data: dict) -> None:
    """slime ``--custom-advantage-function-path``: advantages (and returns) are the raw rewards
    broadcast over each response, so the OPOB loss sees ``R_i`` and the baseline replaces the
    group mean."""
    rewards = rollout_data["rewards"]
    shapes = rollout_data.get("kl") or rollout_data.get("log_probs") or rollout_data["rollout_log_probs"]
    if len(rewards) != len(shapes):
        raise ValueError(f"{len(rewards)} rewards for {len(shapes)} samples")
    advantages = []
    for r, like in zip(rewards, shapes):
        r = float(r)
        if not math.isfinite(r):
            raise ValueError(f"non-finite reward {r}")
        advantages.append(torch.full_like(like, r, dtype=torch.float32))
    rollout_data["advantages"] = advantages
    rollout_data["returns"] = [a.clone() for a in advantages]
