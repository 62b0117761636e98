"""Per-sample gradient rules of the layers VCPO's norms cover, one layer at a time.

``PerSampleGradNorms`` (``april_slime.training.grad_norms``) hooks the layers and calls
``LayerRules.sq_norms`` with a layer's input and output gradient; this module owns the math that
turns them into every sample's squared gradient norm of the layer's parameters and its share of
the weighted second buffer: linear (direct or Gram form), embedding, LayerNorm / RMSNorm and
Transformer Engine's fused LayerNormLinear, under tensor and sequence parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["LayerRules", "MicrobatchSegments", "module_kind", "parameter_names"]

_KIND_LINEAR, _KIND_EMBEDDING, _KIND_LAYERNORM, _KIND_RMSNORM = "linear", "embedding", "layernorm", "rmsnorm"
# Transformer Engine's fused LayerNormLinear (Megatron's TELayerNormColumnParallelLinear): a norm
# with parameters layer_norm_weight (/ layer_norm_bias) feeding a linear (weight / bias) in one
# module; attributes normalization ("LayerNorm" | "RMSNorm"), eps, zero_centered_gamma.
_KIND_LN_LINEAR = "layernorm_linear"


def module_kind(module: nn.Module) -> str | None:
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


def parameter_names(kind: str) -> tuple[str, ...]:
    """The attributes holding the parameters a layer of ``kind`` has a per-sample rule for."""
    return ("weight", "bias") + (("layer_norm_weight", "layer_norm_bias") if kind == _KIND_LN_LINEAR else ())


class MicrobatchSegments:
    """Which sample each token of one micro-batch's activations belongs to, the per-sample
    coefficients of the second buffer, and the per-sample squared norms accumulated so far."""

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


class LayerRules:
    """Per-sample squared gradient norms of one layer's parameters from its input and output
    gradient, and with ``weighted=True`` the layer's part ``sum_i c_i G_i[p]`` of the second buffer,
    accumulated into ``weighted_grads``.

    ``tp_rank`` / ``tp_size`` / ``tp_group``: this rank's place in the tensor-parallel group whose
    shards the layer holds; ``gram_tile``: the tile of the Gram form of a linear's norm.
    """

    def __init__(self, *, weighted: bool, tp_rank: int, tp_size: int, tp_group, gram_tile: int) -> None:
        self.weighted = weighted
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.gram_tile = gram_tile
        self.weighted_grads: dict[nn.Parameter, torch.Tensor] = {}

    def counts(self, p: torch.Tensor) -> bool:
        """Whether this rank's gradient of ``p`` counts in a sample's norm (replicated: TP rank 0)."""
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

    def sq_norms(self, module: nn.Module, kind: str, inp: torch.Tensor, grad: torch.Tensor,
                 mb: MicrobatchSegments) -> torch.Tensor:
        """Per-sample squared norms [N] of the gradients of ``module``'s parameters (this rank's
        shards) from its input ``inp`` and output gradient ``grad``; with ``weighted=True`` the
        layer's part of the second buffer is added to ``weighted_grads``."""
        total = mb.segment_ids.numel()
        acc = torch.promote_types(grad.dtype, torch.float32)
        # GEMM operands stay in the activations' dtype (bf16 on GPU: tensor cores, fp32
        # accumulation); reductions of squares and the second buffer are float32 or wider.
        b = grad.reshape(-1, grad.shape[-1])
        b_split = (self._token_layout(b.shape[0], total, "output gradient", module)
                   if kind not in (_KIND_LAYERNORM, _KIND_RMSNORM) else False)
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
            self._linear(weight, a.to(b.dtype), b, mb, sq, self.counts(weight))
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
        return sq

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
        self._linear(weight, n.to(b.dtype), b_full, mb, sq, self.counts(weight))
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

    def _rows(self, per_token: torch.Tensor, mb: MicrobatchSegments, offset: int = 0) -> torch.Tensor:
        """Per-sample sums [N, d] of a [T, d] tensor whose first token is token ``offset``."""
        rows = torch.zeros(mb.num_samples, per_token.shape[-1], dtype=per_token.dtype, device=per_token.device)
        end = offset + per_token.shape[0]
        for i, runs in enumerate(mb.runs):
            for s, e in runs:
                s, e = max(s, offset), min(e, end)
                if s < e:
                    rows[i] += per_token[s - offset:e - offset].sum(0)
        return rows

    def _segment_sum_param(self, p: torch.Tensor, per_token: torch.Tensor, mb: MicrobatchSegments,
                           sq: torch.Tensor, split: bool, local: torch.Tensor | None = None) -> None:
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
        if self.counts(p) and not (split and self.tp_rank != 0):
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

    def _embedding(self, module, ids: torch.Tensor, b: torch.Tensor, mb: MicrobatchSegments,
                   sq: torch.Tensor) -> None:
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
        if self.counts(weight) and seg_k.numel():
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
