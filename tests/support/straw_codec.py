"""slime 0.4.0's durable ``Sample`` codec rules, re-implemented to check what the plugin hands over.

slime 0.4.0's ``--rollout-data-transport straw`` stores every rollout group through
``SampleCodec`` (THUDM/slime ``slime/data/codec.py``, ``SampleCodec.prepare`` and ``load``): a
tagged JSON tree plus typed tensor records, with no pickle and no class named by the payload. It
accepts, by these rules (restated here, not copied):

* ``None``, and values whose type is exactly ``str``, ``bool`` or ``int`` (a subclass, e.g. a
  ``str`` enum, is refused); exactly ``float`` (inf and nan tagged);
* ``torch.Tensor`` (stored with its shape and dtype), ``numpy.ndarray`` (as a tensor, read back as
  an array), numpy scalars (as their Python value), ``bytes`` / ``bytearray`` (base64, read back as
  ``bytes``), ``Sample.Status`` by value;
* ``Sample`` (every attribute in ``vars()``, declared or not; read back as declared fields plus
  set attributes), its ``SpecInfo`` / ``PrefixCacheInfo``, slime's ``DynamicFilterOutput``;
* any ``dict`` (keys and values by these rules, read back as a plain ``dict``), any ``list`` or
  ``tuple`` (read back as ``list`` / ``tuple``), PIL images (as PNG);
* and refuses anything else, and any cycle, with ``TypeError`` ("Unsupported durable Sample field
  type"). The per-token captures (``rollout_routed_experts``, ``rollout_topk_*``,
  ``rollout_top_p_*``) are stored as tensors whatever container holds them.

``round_trip(value)`` encodes ``value`` by these rules and decodes it again, in memory (the tensor
records are kept as tensors, the tree goes through ``json``); ``differences(a, b)`` names every
place where a value did not come back equal, with its type. ``check_samples`` walks samples
through both and raises ``AssertionError`` naming each attribute that is refused or altered.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from typing import Any

CAPTURE_FIELDS = frozenset({"rollout_routed_experts", "rollout_topk_token_ids", "rollout_topk_log_probs",
                            "rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_top_p_log_probs"})


class Encoded:
    """A tagged JSON tree and the tensors its ``tensor`` nodes point at."""

    def __init__(self) -> None:
        self.tensors: list[Any] = []

    def tensor(self, value: Any) -> list:
        import torch

        self.tensors.append(torch.as_tensor(value).detach().clone())
        return ["tensor", len(self.tensors) - 1]


def encode(value: Any) -> tuple[str, list[Any]]:
    """``value`` -> (JSON text of the tagged tree, tensor records); ``TypeError`` where slime 0.4.0's
    codec refuses a value, naming the path to it."""
    out = Encoded()
    tree = _visit(value, out, set(), "value")
    return json.dumps({"version": 1, "tree": tree}, allow_nan=False), out.tensors


def _visit(value: Any, out: Encoded, active: set[int], path: str) -> Any:  # noqa: C901 (one rule per branch)
    import numpy as np
    import torch
    from slime.utils.types import Sample

    if value is None or type(value) in (str, bool, int):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else ["float", repr(value)]
    if isinstance(value, torch.Tensor):
        return out.tensor(value)
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise TypeError(f"{path}: an object ndarray is not a tensor")
        return ["ndarray", out.tensor(np.array(value, copy=True))]
    if isinstance(value, np.generic):
        return _visit(value.item(), out, active, path)
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", base64.b64encode(value).decode("ascii")]
    if isinstance(value, Sample.Status):
        return ["status", value.value]
    if id(value) in active:
        raise TypeError(f"{path}: a cycle (unsupported by the durable Sample codec)")
    active.add(id(value))
    try:
        if isinstance(value, Sample):
            fields = []
            for key, child in vars(value).items():
                node = (out.tensor(np.asarray(child)) if child is not None and key in CAPTURE_FIELDS
                        else _visit(child, out, active, f"{path}.{key}"))
                fields.append([key, node])
            return ["sample", fields]
        for tag, cls in (("spec-info", Sample.SpecInfo), ("prefix-cache-info", Sample.PrefixCacheInfo)):
            if isinstance(value, cls):
                return [tag, _visit(vars(value), out, active, path)]
        if isinstance(value, dict):
            return ["dict", [[_visit(k, out, active, f"{path} key {k!r}"), _visit(v, out, active, f"{path}[{k!r}]")]
                             for k, v in value.items()]]
        if isinstance(value, (list, tuple)):
            return ["tuple" if isinstance(value, tuple) else "list",
                    [_visit(v, out, active, f"{path}[{i}]") for i, v in enumerate(value)]]
        raise TypeError(f"{path}: unsupported durable Sample field type "
                        f"{type(value).__module__}.{type(value).__qualname__}")
    finally:
        active.discard(id(value))


def decode(text: str, tensors: list[Any]) -> Any:
    from slime.utils.types import Sample

    def visit(node: Any) -> Any:
        if not isinstance(node, list):
            return node
        tag, body = node[0], node[1]
        if tag == "dict":
            return {visit(k): visit(v) for k, v in body}
        if tag in ("list", "tuple"):
            items = [visit(v) for v in body]
            return tuple(items) if tag == "tuple" else items
        if tag == "sample":
            values = {key: visit(v) for key, v in body}
            declared = {f.name for f in dataclasses.fields(Sample)}
            s = Sample(**{k: v for k, v in values.items() if k in declared})
            for k, v in values.items():
                if k not in declared:
                    setattr(s, k, v)
            return s
        if tag == "spec-info":
            return Sample.SpecInfo(**visit(body))
        if tag == "prefix-cache-info":
            return Sample.PrefixCacheInfo(**visit(body))
        if tag == "status":
            return Sample.Status(body)
        if tag == "float":
            return float(body)
        if tag == "bytes":
            return base64.b64decode(body, validate=True)
        if tag == "tensor":
            return tensors[body].clone()
        if tag == "ndarray":
            return visit(body).numpy()
        raise ValueError(f"unknown tag {tag!r}")

    return visit(json.loads(text)["tree"])


def round_trip(value: Any) -> Any:
    return decode(*encode(value))


def differences(a: Any, b: Any, path: str = "value") -> list[str]:
    """Every place where ``b`` (what came back) is not ``a`` (what was stored): value, type, dtype."""
    import numpy as np
    import torch

    if isinstance(a, (torch.Tensor, np.ndarray)):
        ta, tb = torch.as_tensor(a), torch.as_tensor(b) if isinstance(b, (torch.Tensor, np.ndarray)) else None
        if tb is None or ta.dtype != tb.dtype or ta.shape != tb.shape or not torch.equal(ta, tb):
            return [f"{path}: {type(a).__name__} {getattr(a, 'dtype', '')} came back as {type(b).__name__} "
                    f"{getattr(b, 'dtype', '')}"]
        return []
    if type(a) is not type(b):
        return [f"{path}: {type(a).__qualname__} came back as {type(b).__qualname__}"]
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, a))} came back as {sorted(map(str, b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items came back as {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return differences(vars(a), vars(b), path)
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{path}: {a!r} came back as {b!r}"]


def check_samples(samples: list[Any]) -> int:
    """Every sample (or list of samples) through slime 0.4.0's codec rules; returns how many were
    checked, and raises ``AssertionError`` naming each refused or altered attribute."""
    problems, count = [], 0
    for i, entry in enumerate(samples):
        for j, s in enumerate(entry if isinstance(entry, list) else [entry]):
            count += 1
            try:
                back = round_trip(s)
            except TypeError as e:
                problems.append(f"sample {i}.{j}: {e}")
                continue
            problems += [f"sample {i}.{j}: {d}" for d in differences(s, back, "sample")]
    assert not problems, "not durable under slime 0.4.0's straw codec:\n" + "\n".join(problems)
    return count
