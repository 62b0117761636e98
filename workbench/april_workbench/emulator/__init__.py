"""An SGLang-protocol engine emulator.

This is a stand-in for SGLang used by the tests and the benchmarks. It models the protocol
(``/generate`` with log-probs and request ids, ``/abort_request`` returning partial output,
``/v1/loads``, weight versions, a router front) and the scheduling and memory behaviour of a
serving engine (continuous batching, a KV-token budget with retraction and recompute, per-step
time costs), not a language model: tokens and log-probs are a deterministic hash of
(seed, prompt key, sampling seed, position, weight version), and response lengths follow a
configurable long-tailed distribution.

Entry points: ``python -m april_workbench.emulator`` (HTTP on loopback),
``testing.start_cluster`` (in the current event loop), ``EmulatorCluster`` + ``LocalTransport``
(in-process) and ``vclock.run_virtual`` (emulated time without waiting).
"""

from .batching import AdmissionRefused, EmulatedEngine
from .clocked import EngineStopped
from .cluster import EmulatorCluster, LocalTransport
from .config import EngineConfig, TimeModel
from .model import LENGTH_PRESETS, LengthModel, SyntheticLM, prompt_key, reference_tokens
from .server import EngineHandler, RouterHandler
from .testing import RunningCluster, build_cluster, start_cluster
from .vclock import VirtualEventLoop, run_virtual

__all__ = [
    "AdmissionRefused", "EmulatedEngine", "EngineConfig", "EngineStopped", "TimeModel",
    "EmulatorCluster", "LocalTransport",
    "LENGTH_PRESETS", "LengthModel", "SyntheticLM", "prompt_key", "reference_tokens",
    "EngineHandler", "RouterHandler",
    "RunningCluster", "build_cluster", "start_cluster",
    "VirtualEventLoop", "run_virtual",
]
