"""Exact per-sample gradient norms from layer hooks during the one ordinary backward pass.

``PerSampleGradNorms`` covers every trainable parameter of a model with a per-sample rule
(``april_slime.training.layer_grads``), hooks the layers, and keeps per micro-batch the squared
norms ``||g_i||^2`` of each sample's score and, for VCPO's off-policy optimal baseline, the second
gradient buffer ``Q = sum_i c_i g_i`` (``april_slime.training.baseline`` turns them into the baselined
gradient). A micro-batch of a single sample is left to the caller: its gradient is the whole
gradient buffer, so the hooks only pass its backward through.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from april_slime.training.layer_grads import LayerRules, MicrobatchSegments, module_kind, parameter_names

__all__ = ["PerSampleGradNorms", "SectionClock", "group_active", "reduce_per_sample_sq_norms"]


def group_active(group) -> bool:
    """True when ``group`` spans more than one rank, so a reduction over it is needed."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


class SectionClock:
    """Time spent in sections of one step: host time on the CPU, CUDA events on a GPU (recorded
    without a sync; ``seconds()`` waits for the last one), so asynchronous kernels are counted
    where they run."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._host = 0.0
        self._events: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def section(self, device: torch.device | str | None = None) -> Iterator[None]:
        if device is not None and torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._host += time.perf_counter() - t0

    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
        return self._host + sum(s.elapsed_time(e) for s, e in self._events) / 1000.0


def _main_output(output: Any) -> torch.Tensor | None:
    # Megatron's parallel linears return (output, output_bias).
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


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
    micro-batch) into ``weighted_grads`` -- the second buffer of the linearity trick.

    A micro-batch with one sample is skipped (its norm and ``Q`` come from the gradient buffer,
    ``baseline.OpobAccumulator``); ``clock`` times what the hooks do.

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
        self._rules = LayerRules(weighted=weighted, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group,
                                 gram_tile=gram_tile)
        self._handles: list[Any] = []
        self._inputs: dict[nn.Module, tuple[torch.Tensor, ...]] = {}
        self._modules: list[tuple[nn.Module, str, str]] = []
        self._mb: MicrobatchSegments | None = None
        self.microbatches = 0
        self.clock = SectionClock()

        covered: dict[int, str] = {}
        all_params: dict[int, str] = {}
        for chunk in chunks:
            for pname, p in chunk.named_parameters():
                if p.requires_grad:
                    all_params.setdefault(id(p), pname)
            for mname, module in chunk.named_modules():
                kind = module_kind(module)
                if kind is None:
                    continue
                own = [p for p in (getattr(module, n, None) for n in parameter_names(kind))
                       if isinstance(p, torch.Tensor) and p.requires_grad and p.numel()]
                for p in own:
                    if id(p) in covered:
                        raise ValueError(
                            f"parameter of {mname} is shared with {covered[id(p)]} "
                            "(tied weights); exact per-sample norms of shared parameters are not "
                            "supported -- untie the embedding and output layer")
                    covered[id(p)] = mname
                extra = [n for n, p in module.named_parameters(recurse=False)
                         if p.requires_grad and id(p) not in covered]
                if extra:
                    raise ValueError(
                        f"{mname} ({type(module).__name__}) has parameters "
                        f"{extra} that no per-sample rule covers (fused layers such as "
                        "LayerNormLinear are not supported; use unfused layers)")
                self._modules.append((module, mname, kind))
        missing = [name for pid, name in all_params.items() if pid not in covered]
        if missing:
            raise ValueError(
                f"no per-sample gradient rule for parameters {missing[:8]}"
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
        """Start a new optimizer step: clear the weighted buffers."""
        self._rules.weighted_grads = {}
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
        self._mb = MicrobatchSegments(segment_ids, num_samples, coeffs)
        self.microbatches += 1

    @property
    def weighted_grads(self) -> dict[nn.Parameter, torch.Tensor]:
        """The second buffer ``Q`` of the current step, per covered parameter."""
        return self._rules.weighted_grads

    @property
    def last_sq_norms(self) -> torch.Tensor | None:
        """Per-sample squared norms of the latest micro-batch (this rank's shards only)."""
        return None if self._mb is None else self._mb.sq_norms

    def counts_in_norm(self, p: torch.Tensor) -> str:
        """How this rank's gradient of ``p`` enters a sample's squared norm: ``counted`` (a shard,
        or a replicated parameter on TP rank 0), ``tp_partial`` (a replicated parameter whose
        gradient is summed over the TP group by Megatron: sequence parallelism) or ``skip``."""
        if self.tp_size > 1 and getattr(p, "sequence_parallel", False):
            return "tp_partial"
        return "counted" if self._rules.counts(p) else "skip"

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

    def _on_output_grad(self, module: nn.Module, kind: str, grad: torch.Tensor) -> None:
        mb = self._mb
        if mb is None:
            raise RuntimeError("backward through a hooked layer before set_microbatch(): the loss must "
                               "describe its micro-batch (opob_policy_loss does)")
        (inp,) = self._inputs.pop(module)
        if mb.num_samples == 1:
            return
        with self.clock.section(grad.device):
            sq = self._rules.sq_norms(module, kind, inp, grad, mb)
            if mb.sq_norms is None:
                mb.sq_norms = torch.zeros_like(sq)
            mb.sq_norms += sq


def reduce_per_sample_sq_norms(sq_norms: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Sum the partial per-sample squared norms of the tensor-parallel shards (in place)."""
    if group_active(tp_group):
        dist.all_reduce(sq_norms, op=dist.ReduceOp.SUM, group=tp_group)
    return sq_norms
