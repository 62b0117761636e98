"""Megatron's real tensor-parallel layers on CPU over gloo (test helper).

Megatron-core allocates its communication buffers with ``torch.cuda.current_device()``
(``GlobalMemoryBuffer.get_tensor``, ``tensor_parallel.mappings`` and ``tensor_parallel.layers``).
Inside those two modules only, ``torch.cuda.current_device()`` answers ``"cpu"``, and the global
buffer allocates plain CPU tensors; the layers, their autograd functions and collectives are
Megatron's own.
"""

from __future__ import annotations

import contextlib
import operator
import types
from functools import reduce

import torch

import megatron.core.utils as megatron_utils
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
