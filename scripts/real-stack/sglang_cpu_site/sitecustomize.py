"""A runtime workaround SGLang 0.5.23 needs on CPU for ``--enable-return-routed-experts``; no SGLang
file is changed. Put this folder first on ``PYTHONPATH`` of an engine (``LocalEngine`` does so for
every engine it starts): Python imports ``sitecustomize`` at start-up in every process, the
scheduler processes SGLang spawns included, and ``PYTHONPATH`` comes before the ``sitecustomize``
some distributions ship in the standard library's folder.

Why: SGLang allocates the routed-experts host cache (``sglang.srt.state_capturer.base.BaseHostCache``)
through ``ALLOC_MEMORY_FUNCS[device]``, whose ``"cpu"`` entry pins the buffer with
``torch.cuda.cudart().cudaHostRegister``: a CPU build of torch has no CUDA runtime, and the engine
fails at start. Once ``sglang.srt.mem_cache.pool_host.common`` has run, its ``"cpu"`` entry is
replaced by a plain zero-filled tensor (nothing to pin without a GPU). Every module that imported
the table holds the same dict, so they all see the change.

Inert in a process that never imports that module, and on a machine with a GPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGET = "sglang.srt.mem_cache.pool_host.common"


def _cpu_alloc(dims, dtype, device, pin_memory=False, allocator=None, registration_granularity_bytes=None):
    import torch

    return torch.zeros(dims, dtype=dtype, device=device)


def _patch(module) -> None:
    import torch

    if torch.cuda.is_available():
        return
    module.ALLOC_MEMORY_FUNCS["cpu"] = _cpu_alloc


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``TARGET`` as the normal finders would, and runs ``_patch`` once it has executed."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterImport())
