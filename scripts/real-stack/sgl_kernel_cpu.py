"""CPU stand-ins for the two ``sgl_kernel`` functions SGLang 0.5.23 imports on CPU.

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang runs ``from sgl_kernel import assign_req_to_token_pool_cpu``
(``sglang/srt/mem_cache/allocation.py``) and ``from sgl_kernel import copy_all_layer_kv_cache_cpu``
(``sglang/kernels/ops/kvcache/cache_move.py``) at import time: plain module attributes, not
``torch.ops``. PyPI has no CPU build of ``sgl_kernel``, so ``cpu_workarounds.py install`` copies this
file into the real-stack environment as ``sgl_kernel/__init__.py``.

Both are index copies, written here in plain torch with the semantics of SGLang's triton kernels of
the same names (``assign_req_to_token_pool`` and ``copy_all_layer_kv_cache_tiled``).

SGLang's speculative-decoding modules import seven more CPU helpers at import time, also on servers
that never decode speculatively. Those names exist here so the imports succeed; calling one raises
``NotImplementedError`` (run without ``--speculative-algorithm``).

Deliberately absent: every ``torch.ops.sgl_kernel`` operator. SGLang switches to its Intel AMX
kernels when ``torch.ops.sgl_kernel.convert_weight_packed`` exists, and those are not provided here;
without it SGLang keeps its plain torch paths (``--attention-backend torch_native``).
"""

from __future__ import annotations

import ctypes

import torch

# Lets an environment check tell this module from a real sgl_kernel build.
APRIL_SLIME_CPU_HELPERS = 1

# Imported at module level by sglang/kernels/ops/speculative/{spec_tree,cache_locs,eagle,
# multi_layer_eagle}.py when SGLANG_USE_CPU_ENGINE=1; only called by speculative decoding.
_SPECULATIVE = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
)

__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu", *_SPECULATIVE]


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For request ``i`` of the batch, write its newly allocated KV slots into its row of the
    request-to-token table: ``req_to_token[req_pool_indices[i], start[i]:end[i]] =
    out_cache_loc[o_i : o_i + end[i] - start[i]]`` where ``o_i`` is the number of slots of the
    requests before ``i`` (``out_cache_loc`` holds the batch's slots back to back)."""
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"pool_len {pool_len} != req_to_token row length {req_to_token.shape[1]}")
    start = start_offset.to(torch.int64)
    lengths = end_offset.to(torch.int64) - start
    total = int(lengths.sum())
    if total == 0:
        return
    if int(lengths.min()) < 0:
        raise ValueError("end_offset < start_offset")
    first_out = torch.cumsum(lengths, 0) - lengths  # o_i
    rows = req_pool_indices.to(torch.int64).repeat_interleave(lengths)
    within = torch.arange(total, dtype=torch.int64) - first_out.repeat_interleave(lengths)
    cols = start.repeat_interleave(lengths) + within
    req_to_token[rows, cols] = out_cache_loc[:total].to(req_to_token.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For every KV buffer ``b`` (its address ``data_ptrs[b]``, its row size ``strides[b]`` in
    bytes), copy rows ``src_loc`` onto rows ``tgt_loc``. All source rows are read before any
    target row is written, so overlapping moves are safe (as in the tiled triton kernel)."""
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"tgt_loc has {tgt_loc.numel()} entries, src_loc {src_loc.numel()}")
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(address))
        view = torch.frombuffer(raw, dtype=torch.uint8).view(rows, int(stride))
        view[tgt] = view[src].clone()


def _speculative_only(name: str):
    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: speculative decoding has no CPU helper in this "
                                  "environment; run SGLang without --speculative-algorithm")

    unavailable.__name__ = unavailable.__qualname__ = name
    return unavailable


for _name in _SPECULATIVE:
    globals()[_name] = _speculative_only(_name)
del _name
