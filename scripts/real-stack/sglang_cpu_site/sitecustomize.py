"""Runtime workarounds that SGLang and slime need on a CPU-only machine; no SGLang or slime file is
changed. Put this folder first on ``PYTHONPATH`` (``LocalEngine`` does so for every engine it
starts; the CPU launcher ``examples/qwen3-4B-dapo-math/run-cpu.sh`` for slime's whole job, Ray's
workers included): Python imports ``sitecustomize`` at start-up in every process, the processes
SGLang spawns included, and ``PYTHONPATH`` comes before the ``sitecustomize`` some distributions ship
in the standard library's folder. Each workaround runs right after its module has been imported,
so a process that never imports it pays nothing, and each one does nothing on a machine with a GPU.

1. ``sglang.srt.mem_cache.pool_host.common`` (SGLang 0.5.23, ``--enable-return-routed-experts``):
   SGLang allocates the routed-experts host cache (``sglang.srt.state_capturer.base.BaseHostCache``)
   through ``ALLOC_MEMORY_FUNCS[device]``, whose ``"cpu"`` entry pins the buffer with
   ``torch.cuda.cudart().cudaHostRegister``: a CPU build of torch has no CUDA runtime, and the
   engine fails at start. The ``"cpu"`` entry is replaced by a plain zero-filled tensor (nothing to
   pin without a GPU). Every module that imported the table holds the same dict, so they all see it.
2. ``slime.utils.accelerator`` (slime's launcher, ``train.py``): slime picks its accelerator from the
   hardware and stops with "No usable accelerator was detected" on a CPU. slime's own extension
   point, ``register_accelerator``, gets a CPU backend (gloo for its process groups) at the lowest
   priority, so that CUDA or MUSA still win wherever they are present.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cpu_alloc(dims, dtype, device, pin_memory=False, allocator=None, registration_granularity_bytes=None):
    import torch

    return torch.zeros(dims, dtype=dtype, device=device)


def _patch_host_alloc(module) -> None:
    if not _cuda_available():
        module.ALLOC_MEMORY_FUNCS["cpu"] = _cpu_alloc


def cpu_accelerator_class():
    """The host as slime's accelerator (a subclass of slime's ``Accelerator``): one device, no
    streams, no device memory, gloo for process groups. Also what the training tier's tests install
    with slime's ``set_accelerator`` (``tests/support/training/slime_cpu.py``)."""
    import torch
    from slime.utils.accelerator.base import Accelerator

    class CpuAccelerator(Accelerator):
        name = "cpu"
        device_type = "cpu"
        communication_backend_name = "gloo"

        def is_available(self) -> bool:
            return True

        def device(self, index=None) -> torch.device:
            return torch.device("cpu")

        def device_name(self, index=None) -> str:
            return "cpu"

        def set_device(self, index) -> None:
            pass

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def synchronize(self, device=None) -> None:
            pass

        def current_stream(self, device=None):
            return None

        def empty_cache(self) -> None:
            pass

        def mem_get_info(self, device=None) -> tuple[int, int]:
            return 0, 0

        def memory_allocated(self, device=None) -> int:
            return 0

        def memory_reserved(self, device=None) -> int:
            return 0

    return CpuAccelerator


def _register_cpu_accelerator(module) -> None:
    # no communication_backends: gloo is no device backend (slime destroys and rebuilds the WORLD
    # group across sleep / wake only for those)
    module.register_accelerator("cpu", cpu_accelerator_class(), lambda: not _cuda_available(), priority=-100)


AFTER_IMPORT = {
    "sglang.srt.mem_cache.pool_host.common": _patch_host_alloc,
    "slime.utils.accelerator": _register_cpu_accelerator,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds a module of ``AFTER_IMPORT`` as the normal finders would, and runs its workaround once
    the module has executed."""

    def find_spec(self, name, path, target=None):
        patch = AFTER_IMPORT.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


# only as the interpreter's own sitecustomize: a test that loads this file for its accelerator
# class must not install the import hooks a second time
if __name__ == "sitecustomize" and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterImport())
