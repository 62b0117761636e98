"""What an emulated engine replays for training: MoE routed experts and top-p kept token ids.

An ``EmulatedReplay`` on an engine's handler makes it answer like SGLang started with
``--enable-return-routed-experts`` (``return_routed_experts``, ``routed_experts_start_len``), and,
with ``top_p_ids``, like SGLang with slime's top-p patch (``custom_params.return_top_p_token_ids``
with ``top_p`` < 1). Both are pure functions of ``(seed, weight version, position, token)``:

* the routed experts of position ``i`` come from the version of the forward pass that computed
  ``i``: the version of token ``i + 1`` for positions whose next token the call generated, and the
  version the call started under for the positions it prefilled. A resume after a weight update
  therefore gets *different* rows for the old positions than the aborted call sent, as a real
  engine does once the update flushed its prefix cache;
* the top-p kept ids of output token ``j``: the token itself and up to three more ids, under the
  version that sampled it.

``routing_row`` / ``top_p_kept_ids`` are what tests compare a trained sample's data against.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from april_slime.core.replay import int32_bytes

from .model import _mix_scalar

_SALT_ROUTING = 0x726F7574696E6721
_SALT_TOP_P = 0x746F705F705F6964


@dataclass(frozen=True)
class EmulatedReplay:
    layers: int = 2
    topk: int = 2
    num_experts: int = 8
    top_p_ids: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.layers >= 1 and 1 <= self.topk <= self.num_experts):
            raise ValueError(f"EmulatedReplay: need layers >= 1 and 1 <= topk <= num_experts, got {self}")

    def routing_row(self, version: int, position: int, token: int) -> list[int]:
        """The experts of one position, ``layers x topk`` flattened (distinct within a layer)."""
        row = []
        for layer in range(self.layers):
            h = _mix_scalar(self.seed, _SALT_ROUTING, version, position, token, layer)
            picked: list[int] = []
            while len(picked) < self.topk:
                expert = h % self.num_experts
                if expert not in picked:
                    picked.append(expert)
                h = _mix_scalar(h, len(picked))
            row += picked
        return row

    def top_p_kept_ids(self, version: int, position: int, token: int, vocab_size: int) -> list[int]:
        h = _mix_scalar(self.seed, _SALT_TOP_P, version, position, token)
        extra = [(h >> (16 * k)) % vocab_size for k in range(h % 4)]
        return [token] + [t for t in dict.fromkeys(extra) if t != token]

    def annotate(self, meta: dict, payload: Any, output_ids: Sequence[int], vocab_size: int) -> None:
        """Add what ``payload`` asked for to a reply's ``meta_info`` (no tokens: nothing, as SGLang)."""
        output_ids = [int(t) for t in output_ids]  # a list, or the engine's numpy array
        if not isinstance(payload, dict) or not output_ids:
            return
        input_ids = [int(t) for t in payload.get("input_ids", ())]  # a list, or the client's int32 array
        runs = meta.get("emulator_version_runs") or [[0, int(meta.get("weight_version", 0))]]
        versions = _token_versions(runs, len(output_ids))
        tokens = input_ids + list(output_ids)
        if payload.get("return_routed_experts"):
            start = int(payload.get("routed_experts_start_len") or 0)
            rows = []
            for i in range(start, len(tokens) - 1):
                version = versions[i + 1 - len(input_ids)] if i + 1 >= len(input_ids) else versions[0]
                rows += self.routing_row(version, i, tokens[i])
            meta["routed_experts"] = _b64_int32(rows)
        params = payload.get("sampling_params") or {}
        custom = params.get("custom_params") or {}
        if self.top_p_ids and custom.get("return_top_p_token_ids") and params.get("top_p", 1.0) < 1.0:
            ids, offsets = [], [0]
            for j, token in enumerate(output_ids):
                ids += self.top_p_kept_ids(versions[j], len(input_ids) + j, token, vocab_size)
                offsets.append(len(ids))
            meta["top_p_token_ids"], meta["top_p_token_offsets"] = _b64_int32(ids), _b64_int32(offsets)


def _token_versions(runs: list, n: int) -> list[int]:
    """The emulator's ``[[start, version], ...]`` runs -> one version per output token."""
    versions = []
    for k, (start, version) in enumerate(runs):
        end = runs[k + 1][0] if k + 1 < len(runs) else n
        versions += [int(version)] * (end - start)
    return versions


def _b64_int32(values: list[int]) -> str:
    """As SGLang sends int32 arrays: base64 of little-endian int32 (``core.replay`` reads them)."""
    return base64.b64encode(int32_bytes(values)).decode("ascii")
