"""One request's record in an emulated engine, and the SGLang reply it turns into.

Tokens are never materialised while running: a request records its generated count and the
positions where its weight version changed, and its tokens are computed (vectorised) from
``SyntheticLM`` when it replies. The reply holds them as arrays (``LogprobArrays``); the transport
that carries it turns them into SGLang's lists unless its client takes the arrays.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from april_slime.core.sglang_protocol import LogprobArrays

from .model import SampleProfile, SyntheticLM

_WAITING, _PREFILL, _RUNNING, _DONE = "waiting", "prefill", "running", "done"


class _Request:
    __slots__ = ("rid", "input_len", "key", "sampling_seed", "max_new_tokens", "profile",
                 "return_logprob", "generated", "version_starts", "version_values", "end_pos",
                 "state", "future", "arrival_t", "retracted")

    def __init__(self, rid: str, input_len: int, key: int, sampling_seed: int, max_new_tokens: int,
                 profile: SampleProfile, return_logprob: bool, future: asyncio.Future, now: float):
        self.rid = rid
        self.input_len = input_len
        self.key = key
        self.sampling_seed = sampling_seed
        self.max_new_tokens = max_new_tokens
        self.profile = profile
        self.return_logprob = return_logprob
        self.generated = 0
        # Weight version of generated tokens, as runs: tokens from absolute position
        # version_starts[i] on were generated under version_values[i].
        self.version_starts: list[int] = []
        self.version_values: list[int] = []
        self.end_pos: int | None = None  # absolute position of the EOS under the current version
        self.state = _WAITING
        self.future = future
        self.arrival_t = now
        self.retracted = False

    @property
    def kv_tokens(self) -> int:
        return self.input_len + self.generated

    @property
    def next_pos(self) -> int:
        return self.input_len + self.generated

    def steps_left(self) -> int:
        """Decode steps until this request finishes (stop or length)."""
        by_length = self.max_new_tokens - self.generated
        if self.end_pos is None:
            return by_length
        return min(by_length, self.end_pos - self.next_pos + 1)

    def reply(self, model: SyntheticLM, reason: str, now: float, weight_version: int) -> dict:
        """The SGLang /generate reply of this request, finished for ``reason`` at emulated ``now``."""
        n = self.generated
        positions = np.arange(self.input_len, self.input_len + n)
        if n:
            idx = np.searchsorted(np.asarray(self.version_starts), positions, side="right") - 1
            versions = np.asarray(self.version_values, dtype=np.int64)[idx]
        else:
            versions = np.zeros(0, dtype=np.int64)
        ids, lps = model.tokens(self.key, self.sampling_seed, positions, versions)
        if reason == "stop":
            ids[-1] = model.eos_token_id
            finish = {"type": "stop", "matched": model.eos_token_id}
        elif reason == "length":
            finish = {"type": "length", "length": n}
        else:
            finish = {"type": "abort", "message": "Abort request."}
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": finish,
            "prompt_tokens": self.input_len,
            "completion_tokens": n,
            "cached_tokens": 0,
            "weight_version": str(weight_version),
            "e2e_latency": now - self.arrival_t,
            # Not part of SGLang's reply: per-token versions as [first output index, version] runs,
            # so tests can check a reply against the reference stream exactly.
            "emulator_version_runs": _runs_from_versions(versions),
        }
        output_ids: Any = ids.tolist()
        if self.return_logprob:
            # the tokens stay arrays until a transport needs the wire form (``server.wire_form``)
            output_ids = ids
            meta["output_token_logprobs"] = LogprobArrays(lps, ids)
        return {"text": "", "output_ids": output_ids, "meta_info": meta}


def _runs_from_versions(versions: np.ndarray) -> list[list[int]]:
    if versions.size == 0:
        return []
    change = np.flatnonzero(np.diff(versions)) + 1
    starts = np.concatenate(([0], change))
    return [[int(s), int(versions[s])] for s in starts]
