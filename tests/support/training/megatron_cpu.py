"""Megatron's real tensor-parallel layers, DDP and optimizer on CPU over gloo (test helper).

Megatron-core allocates its communication buffers with ``torch.cuda.current_device()``
(``GlobalMemoryBuffer.get_tensor``, ``tensor_parallel.mappings`` and ``tensor_parallel.layers``).
Inside those two modules only, ``torch.cuda.current_device()`` answers ``"cpu"``, and the global
buffer allocates plain CPU tensors; the layers, their autograd functions and collectives are
Megatron's own.

``ddp_and_optimizer_on_cpu`` does the same for Megatron's ``DistributedDataParallel`` (its
contiguous gradient buffer), the optimizer built by ``get_megatron_optimizer`` (``FP32Optimizer``
in a ``ChainedOptimizer``), gradient clipping / norms and ``finalize_model_grads``: inside
those modules a tensor created on ``"cuda"`` (``torch.tensor``, ``zeros``, ``empty``) is
created on the CPU instead. Megatron's ``DistributedOptimizer`` cannot be had this way: it
checks every parameter's type string for ``torch.cuda.*Tensor`` and refuses CPU tensors.
"""

from __future__ import annotations

import contextlib
import importlib
import operator
import types
from functools import reduce

import megatron.core.utils as megatron_utils
import torch
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel import mappings as tp_mappings


class _Cuda(types.ModuleType):
    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return "cpu"


class _Torch(types.ModuleType):
    cuda = _Cuda("cuda")

    def __getattr__(self, name):
        return getattr(torch, name)


def _cpu_buffer(self, tensor_shape, dtype, name, mem_alloc_context=None):
    return torch.empty(reduce(operator.mul, tensor_shape, 1), dtype=dtype).view(*tensor_shape)


@contextlib.contextmanager
def megatron_on_cpu():
    saved = tp_layers.torch, tp_mappings.torch, megatron_utils.GlobalMemoryBuffer.get_tensor
    tp_layers.torch = tp_mappings.torch = _Torch("torch")
    megatron_utils.GlobalMemoryBuffer.get_tensor = _cpu_buffer
    try:
        yield
    finally:
        tp_layers.torch, tp_mappings.torch, megatron_utils.GlobalMemoryBuffer.get_tensor = saved


def _on_cpu(device):
    if isinstance(device, int):  # a CUDA ordinal
        return "cpu"
    if device is not None and torch.device(device).type == "cuda":
        return "cpu"
    return device


class _CpuFactoryTorch(_Torch):
    """``torch`` whose tensor factories put a tensor meant for a CUDA device on the CPU."""

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, device=_on_cpu(device), **kwargs)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device=_on_cpu(device), **kwargs)

    @staticmethod
    def empty(*args, device=None, **kwargs):
        return torch.empty(*args, device=_on_cpu(device), **kwargs)


# by module path: megatron.core.distributed re-exports a function under its module's name
_DDP_AND_OPTIMIZER_MODULES = tuple(importlib.import_module(f"megatron.core.{name}") for name in (
    "distributed.param_and_grad_buffer", "distributed.distributed_data_parallel",
    "distributed.finalize_model_grads", "optimizer.optimizer", "optimizer.clip_grads", "utils"))


@contextlib.contextmanager
def ddp_and_optimizer_on_cpu():
    saved = [module.torch for module in _DDP_AND_OPTIMIZER_MODULES]
    for module in _DDP_AND_OPTIMIZER_MODULES:
        module.torch = _CpuFactoryTorch("torch")
    try:
        yield
    finally:
        for module, original in zip(_DDP_AND_OPTIMIZER_MODULES, saved):
            module.torch = original
