"""A minimal stand-in for the parts of slime that ``april_slime.rollout`` touches.

Written from slime's contract at the pinned commit (THUDM/slime 624b824a8), not from its code:

* ``slime.utils.types.Sample``: a dataclass; ``Sample.Status`` enum (pending, completed, truncated,
  aborted, failed); ``to_dict()`` gives the instance fields with ``status`` as its string value;
  ``Sample.from_dict(d)`` is the inverse and keeps unknown keys as attributes;
  ``get_reward_value(args)`` reads ``reward[args.reward_key]`` when a reward key is set.
* ``slime.rollout.base_types``: ``RolloutFnTrainOutput(samples, metrics=None)``,
  ``RolloutFnEvalOutput(data, metrics=None)``.
* ``slime.rollout.data_source.RolloutDataSource(args)``: prompts from ``args.prompt_data`` (jsonl,
  ``args.input_key`` / ``args.label_key``); ``get_samples(n)`` returns ``n`` groups of
  ``args.n_samples_per_prompt`` copies of a prompt sample with consecutive ``group_index`` and
  ``index``, wrapping into the next epoch; ``save(rollout_id)`` writes its counters to
  ``<args.save>/rollout/global_dataset_state_dict_<rollout_id>.pt``, ``load(rollout_id)`` reads
  them from ``<args.load>/...`` when that file exists.
* ``slime.rollout.rm_hub``: ``async_rm(args, sample)`` calls ``args.custom_rm_path`` when set;
  ``batched_async_rm(args, samples)`` calls the custom function once with all samples, else
  ``async_rm`` per sample.
* ``slime.rollout.filter_hub.base_types``: ``DynamicFilterOutput(keep, reason=None,
  keep_when_insufficient=False)``; ``call_dynamic_filter(fn, args, samples)`` wraps a plain bool.
* ``slime.rollout.sample_hooks.apply_rollout_sample_hooks(args, value, **kw)``: applies the hooks of
  ``args.rollout_sample_hook_path``.
* ``slime.utils.async_utils.run(coro)``: runs the coroutine on one persistent background loop.
* ``slime.utils.misc.load_function("pkg.mod.attr")``; ``slime.utils.processing_utils.load_tokenizer``.

The tests use it only when the real slime cannot be imported (``install`` is a no-op then).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import inspect
import json
import os
import sys
import threading
import types
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


def real_slime_importable() -> bool:
    try:
        importlib.import_module("slime.utils.types")
        importlib.import_module("slime.rollout.data_source")
    except ImportError:
        return False
    return True


class ToyTokenizer:
    """Characters to ids and back; every id decodes (engines emit ids the prompt never used)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [4 + (ord(c) % 250) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **kwargs) -> str:
        return " ".join(str(i) for i in ids)

    def __call__(self, text: str, **kwargs) -> dict:
        return {"input_ids": self.encode(text)}


# ---------------------------------------------------------------------------- slime.utils.types
@dataclass
class Sample:
    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: Any = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict | None = None
    multimodal_train_inputs: dict | None = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: Any = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None

    def to_dict(self) -> dict:
        out = dict(self.__dict__)
        out["status"] = self.status.value
        return out

    @staticmethod
    def from_dict(data: dict) -> Sample:
        data = dict(data)
        data["status"] = Sample.Status(data["status"])
        known = set(Sample.__dataclass_fields__)
        sample = Sample(**{k: v for k, v in data.items() if k in known})
        for k, v in data.items():
            if k not in known:
                setattr(sample, k, v)
        return sample

    def get_reward_value(self, args) -> Any:
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key else self.reward


# ---------------------------------------------------------------------------- slime.utils.*
def load_function(path: str):
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


class _Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()


_LOOP: _Loop | None = None


def run(coro):
    global _LOOP
    if _LOOP is None:
        _LOOP = _Loop()
    return asyncio.run_coroutine_threadsafe(coro, _LOOP.loop).result()


def load_tokenizer(name_or_path: str, **kwargs) -> ToyTokenizer:
    return ToyTokenizer()


# ---------------------------------------------------------------------------- slime.rollout.*
@dataclass
class RolloutFnTrainOutput:
    samples: list
    metrics: dict | None = None


@dataclass
class RolloutFnEvalOutput:
    data: dict
    metrics: dict | None = None


class RolloutDataSource:
    def __init__(self, args) -> None:
        self.args = args
        self.epoch_id = 0
        self.sample_group_index = 0
        self.sample_index = 0
        self.sample_offset = 0
        self.prompts: list[Sample] = []
        with open(args.prompt_data, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                self.prompts.append(Sample(prompt=row[args.input_key],
                                           label=row.get(args.label_key) if args.label_key else None,
                                           metadata=row.get("metadata") or {}))

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        picked = []
        for _ in range(num_samples):
            if self.sample_offset == len(self.prompts):
                self.sample_offset = 0
                self.epoch_id += 1
            picked.append(self.prompts[self.sample_offset])
            self.sample_offset += 1
        groups = []
        for prompt in picked:
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                s = copy.deepcopy(prompt)
                s.group_index, s.index = self.sample_group_index, self.sample_index
                self.sample_index += 1
                group.append(s)
            self.sample_group_index += 1
            groups.append(group)
        return groups

    def _state(self) -> dict:
        return {"sample_offset": self.sample_offset, "epoch_id": self.epoch_id,
                "sample_group_index": self.sample_group_index, "sample_index": self.sample_index}

    def save(self, rollout_id) -> None:
        path = os.path.join(self.args.save, f"rollout/global_dataset_state_dict_{rollout_id}.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self._state(), f)

    def load(self, rollout_id=None) -> None:
        if self.args.load is None:
            return
        path = os.path.join(self.args.load, f"rollout/global_dataset_state_dict_{rollout_id}.pt")
        if not os.path.exists(path):
            return
        with open(path) as f:
            for k, v in json.load(f).items():
                setattr(self, k, v)

    def __len__(self) -> int:
        return len(self.prompts)


async def async_rm(args, sample, **kwargs):
    path = sample.custom_rm_path or args.custom_rm_path
    if path is None:
        raise NotImplementedError("the stand-in only has the custom reward path")
    return await load_function(path)(args, sample, **kwargs)


async def batched_async_rm(args, samples, **kwargs):
    if args.custom_rm_path is not None:
        return await load_function(args.custom_rm_path)(args, samples, **kwargs)
    return await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples))


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def call_dynamic_filter(fn, *args, **kwargs) -> DynamicFilterOutput:
    if fn is None:
        return DynamicFilterOutput(keep=True)
    out = fn(*args, **kwargs)
    return out if isinstance(out, DynamicFilterOutput) else DynamicFilterOutput(keep=out)


async def apply_rollout_sample_hooks(args, value, **kwargs):
    for path in getattr(args, "rollout_sample_hook_path", None) or []:
        hook = load_function(path)
        accepted = {k: v for k, v in kwargs.items() if k in inspect.signature(hook).parameters}
        result = hook(args, value, **accepted)
        if inspect.isawaitable(result):
            result = await result
        value = result if result is not None else value
    return value


def sglang_generate_rollout(args, rollout_id, data_source, evaluation=False):
    raise NotImplementedError("the stand-in has no SGLang rollout; tests replace this function")


# ---------------------------------------------------------------------------- installation
_MODULES = {
    "slime": {},
    "slime.utils": {},
    "slime.utils.types": {"Sample": Sample},
    "slime.utils.misc": {"load_function": load_function},
    "slime.utils.async_utils": {"run": run},
    "slime.utils.processing_utils": {"load_tokenizer": load_tokenizer},
    "slime.rollout": {},
    "slime.rollout.base_types": {"RolloutFnTrainOutput": RolloutFnTrainOutput,
                                 "RolloutFnEvalOutput": RolloutFnEvalOutput},
    "slime.rollout.data_source": {"RolloutDataSource": RolloutDataSource},
    "slime.rollout.rm_hub": {"async_rm": async_rm, "batched_async_rm": batched_async_rm},
    "slime.rollout.filter_hub": {},
    "slime.rollout.filter_hub.base_types": {"DynamicFilterOutput": DynamicFilterOutput,
                                            "call_dynamic_filter": call_dynamic_filter},
    "slime.rollout.sample_hooks": {"apply_rollout_sample_hooks": apply_rollout_sample_hooks},
    "slime.rollout.sglang_rollout": {"generate_rollout": sglang_generate_rollout},
}


def install(monkeypatch, force: bool = False) -> str:
    """Put the stand-in into ``sys.modules`` (undone by ``monkeypatch``) unless real slime imports
    (or always, with ``force``). Returns ``"real"`` or ``"standin"``."""
    if not force and real_slime_importable():
        return "real"
    for name, attrs in _MODULES.items():
        module = types.ModuleType(name)
        module.__path__ = []  # every stand-in module may act as a package
        for key, value in attrs.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, name, module)
    return "standin"


def patch_real_tokenizer(monkeypatch) -> None:
    """With real slime, replace the HF tokenizer / processor loading by the toy tokenizer, so the
    same tests run without a model checkpoint on disk."""
    processing = importlib.import_module("slime.utils.processing_utils")
    data_source = importlib.import_module("slime.rollout.data_source")
    modules = [processing, data_source]
    # Modules that bind ``load_tokenizer`` by name at import: imported first, so that the binding
    # is the real loader, then patched here too (and restored). Imported for the first time while
    # the patch is on, one would keep the toy loader for the rest of the process.
    for name in ("slime.rollout.sglang_rollout",):
        with contextlib.suppress(ImportError):
            modules.append(importlib.import_module(name))
    for module in modules:
        monkeypatch.setattr(module, "load_tokenizer", load_tokenizer, raising=False)
        monkeypatch.setattr(module, "load_processor", lambda *a, **k: None, raising=False)
