"""slime entry points: the rollout function and the data source.

Use in a slime job::

    --rollout-function-path april_slime.rollout.generate_rollout
    --data-source-path april_slime.rollout.AprilDataSource
    --custom-config-path april.yaml          # april_* settings

This is the only module that knows slime's ``Sample``: prompts come in as slime samples and leave as
``Group`` records for the scheduler; completed groups come back and leave as slime samples for the
trainer. Everything slime-specific is imported lazily, so the module imports without slime and
fails with a clear ``ImportError`` only on a path that needs it.

Policy versions. slime's trainer counts weight updates (``weight_updater.weight_version``, starting
at ``--update-weight-start-version``, default 0, +1 per ``update_weights``) and pushes the count to
the engines with every update; SGLang reports it as ``meta_info["weight_version"]`` on each reply
and on ``GET /get_weight_version``. That engine-reported number is the policy version used here: it
is what actually generated each token, also under ``train_async.py`` where several rollout ids can
share one version. ``rollout_id`` is not used, because it is not the policy that generated a token.
The trainer's count restarts after a job restart while the saved buffer keeps the old numbers, so
the data source saves the last version with the buffer and the first step after a restore shifts
the engines' numbers by a constant (``_PolicyVersionClient``) to continue the saved numbering.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib
import json
import logging
import math
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from april_slime import settings
from april_slime.core import checkpoint
from april_slime.core.buffer import PartialBuffer
from april_slime.core.config import AprilConfig, AprilConfigError
from april_slime.core.keys import METRIC_PREFIX, POLICY_VERSION_KEY, TOKEN_VERSIONS_KEY
from april_slime.core.jsonfile import StateFileError, read_json, write_text_atomic
from april_slime.core.types import Group, Trajectory, TrajectoryStatus

logger = logging.getLogger(__name__)

__all__ = [
    "AprilDataSource",
    "POLICY_VERSION_KEY",
    "TOKEN_VERSIONS_KEY",
    "generate_rollout",
    "load_config",
    "shutdown",
]


_STATUS_TO_SLIME = {
    TrajectoryStatus.PENDING: "PENDING",
    TrajectoryStatus.RUNNING: "PENDING",
    TrajectoryStatus.COMPLETED: "COMPLETED",
    TrajectoryStatus.TRUNCATED: "TRUNCATED",
    TrajectoryStatus.ABORTED: "ABORTED",
    TrajectoryStatus.FAILED: "FAILED",
}


# ====================================================================== slime, imported lazily
class _Slime:
    """The slime objects this module uses, resolved at call time (never at import time)."""

    def __init__(self) -> None:
        try:
            self.Sample = _attr("slime.utils.types", "Sample")
            self.load_tokenizer = _attr("slime.utils.processing_utils", "load_tokenizer")
            self.load_function = _attr("slime.utils.misc", "load_function")
            self.run = _attr("slime.utils.async_utils", "run")
            self.RolloutDataSource = _attr("slime.rollout.data_source", "RolloutDataSource")
            self.async_rm = _attr("slime.rollout.rm_hub", "async_rm")
            self.batched_async_rm = _attr("slime.rollout.rm_hub", "batched_async_rm")
            self.call_dynamic_filter = _attr("slime.rollout.filter_hub.base_types", "call_dynamic_filter")
        except ImportError as e:
            raise ImportError(
                f"april_slime.rollout needs slime (THUDM/slime) on the Python path for this call: {e}"
            ) from e
        # Optional pieces: older slime builds lack them.
        self.RolloutFnTrainOutput = _optional_attr("slime.rollout.base_types", "RolloutFnTrainOutput")
        self.apply_rollout_sample_hooks = _optional_attr("slime.rollout.sample_hooks", "apply_rollout_sample_hooks")


def _attr(module: str, name: str) -> Any:
    mod = importlib.import_module(module)
    try:
        return getattr(mod, name)
    except AttributeError as e:
        raise ImportError(f"{module} has no {name}") from e


def _optional_attr(module: str, name: str) -> Any:
    try:
        return _attr(module, name)
    except ImportError:
        return None


def _run_on_loop(coro):
    """Run on slime's persistent event loop when slime is there (its own rollout code and HTTP
    clients live on that loop), else on this module's own persistent loop. A persistent loop is
    needed either way: the engine client's HTTP session is bound to the loop that created it."""
    try:
        run = _attr("slime.utils.async_utils", "run")
    except ImportError:
        run = _own_loop().run
    return run(coro)


class _OwnLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="april-rollout-loop", daemon=True).start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


_OWN_LOOP: _OwnLoop | None = None
_OWN_LOOP_LOCK = threading.Lock()


def _own_loop() -> _OwnLoop:
    global _OWN_LOOP
    with _OWN_LOOP_LOCK:
        if _OWN_LOOP is None:
            _OWN_LOOP = _OwnLoop()
        return _OWN_LOOP


_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(slime: _Slime, args: Any) -> Any:
    """slime's own tokenizer loader, once per checkpoint path (loading an HF tokenizer is slow)."""
    path = getattr(args, "hf_checkpoint", None)
    if not path:
        raise AprilConfigError("hf_checkpoint: must be set (the tokenizer is loaded from it)")
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = slime.load_tokenizer(path, trust_remote_code=True)
    return _TOKENIZERS[path]


# ====================================================================== configuration
def load_config(args: Any) -> AprilConfig:
    """The validated plugin settings of a slime job, cross-checked with slime's own arguments.

    Any problem raises ``AprilConfigError`` with one line naming the key, which stops the job at
    start (the data source is built when slime's rollout manager starts).
    """
    config = settings.for_job(args)
    if getattr(args, "rollout_max_response_len", None) is None:
        raise AprilConfigError("rollout_max_response_len: must be set; it is the response budget that "
                               "partial rollouts are resumed against")
    if getattr(args, "rollout_top_p", 1.0) != 1.0:
        raise AprilConfigError(f"rollout_top_p: must be 1.0 with april_slime (got {args.rollout_top_p}); "
                               "slime's top-p token replay is not carried through partial rollouts")
    if getattr(args, "use_rollout_routing_replay", False):
        raise AprilConfigError("use_rollout_routing_replay: not supported with april_slime; routed experts "
                               "are not carried through partial rollouts")
    if getattr(args, "custom_generate_function_path", None):
        raise AprilConfigError("custom_generate_function_path: not supported for training with april_slime, "
                               "whose scheduler makes the generate calls itself")
    return config


def _explicit_over_sampling(args: Any) -> int | None:
    """slime fills --over-sampling-batch-size with rollout_batch_size when unset, so only a larger
    value is the user's explicit choice; it then wins over april_over_sampling_factor."""
    over = getattr(args, "over_sampling_batch_size", None)
    return over if over is not None and over > args.rollout_batch_size else None


# ====================================================================== Sample <-> Group
def _sampling_seed(rollout_seed: int, group_uid: str, index: int) -> int:
    """Fixed per trajectory for its whole life, so a resumed call continues the same random stream,
    and reproducible across restarts (a pure function of the job seed and the trajectory id)."""
    digest = hashlib.blake2b(f"{rollout_seed}:{group_uid}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def _plain(value: Any) -> Any:
    """JSON-safe copy of a prompt sample's fields (datasets read from parquet hand numpy values)."""

    def default(obj: Any) -> Any:
        if hasattr(obj, "tolist"):
            return obj.tolist()
        if isinstance(obj, (set, frozenset)):
            return sorted(obj)
        raise TypeError(f"a prompt sample field of type {type(obj).__name__} cannot be buffered as JSON")

    return json.loads(json.dumps(value, default=default, allow_nan=False))


class _SampleCodec:
    """Converts between slime samples and the rollout records, at this boundary only."""

    def __init__(self, slime: _Slime, args: Any, config: AprilConfig) -> None:
        self.slime = slime
        self.args = args
        self.config = config
        self.n = args.n_samples_per_prompt
        self.budget = args.rollout_max_response_len
        self.seed = getattr(args, "rollout_seed", 42)

    @property
    def tokenizer(self) -> Any:
        return _tokenizer(self.slime, self.args)

    # ------------------------------------------------------------ prompts -> groups
    def prompt_ids(self, sample: Any) -> list[int]:
        inputs = getattr(sample, "multimodal_inputs", None) or {}
        if any(v is not None for v in inputs.values()):
            raise ValueError(f"prompt {sample.index}: multimodal prompts are not supported by april_slime")
        if sample.tokens:
            ids = list(sample.tokens)
        else:
            ids = list(self.tokenizer.encode(sample.prompt, add_special_tokens=False))
        if not ids:
            raise ValueError(f"prompt {sample.index}: encodes to no tokens")
        return ids

    def new_group(self, samples: list[Any], current_version: int) -> Group:
        """A fresh group from one prompt's slime samples (as slime's data source hands them out)."""
        if len(samples) != self.n:
            raise ValueError(f"a prompt group has {len(samples)} samples, expected n_samples_per_prompt={self.n}")
        first = samples[0]
        if first.group_index is None:
            raise ValueError("prompt samples carry no group_index; the data source must set it")
        uid = str(first.group_index)
        prompt_ids = self.prompt_ids(first)
        prompt = first.to_dict()
        prompt["tokens"] = []  # the prompt ids live in the group; never store them twice
        trajectories = [
            Trajectory(uid=f"{uid}/{i}", group_uid=uid, index_in_group=i, prompt_ids=list(prompt_ids),
                       max_new_tokens=self.budget, sampling_seed=_sampling_seed(self.seed, uid, i))
            for i in range(self.n)
        ]
        payload = {"prompt_sample": _plain(prompt), "group_index": first.group_index,
                   "indices": [s.index for s in samples]}
        return Group(uid=uid, prompt_ids=list(prompt_ids), trajectories=trajectories,
                     created_version=current_version, payload=payload)

    # ------------------------------------------------------------ groups -> slime samples
    def sample(self, group: Group, t: Trajectory, current_version: int | None) -> Any:
        """The slime sample of one trajectory, shaped as slime's own ``generate`` leaves it."""
        Sample = self.slime.Sample
        s = Sample.from_dict(group.payload["prompt_sample"])
        s.group_index = group.payload["group_index"]
        s.index = group.payload["indices"][t.index_in_group]
        s.tokens = list(t.prompt_ids) + list(t.response_ids)
        s.response_length = t.response_length
        # decoded once over the whole response: stage boundaries can split a multi-byte character
        s.response = (self.tokenizer.decode(t.response_ids, skip_special_tokens=bool(
            getattr(self.args, "rollout_skip_special_tokens", False))) if t.response_ids else "")
        s.rollout_log_probs = [float(lp) for lp in t.logprobs]
        s.loss_mask = self._loss_mask(t, current_version)
        s.status = Sample.Status[_STATUS_TO_SLIME[t.status]]
        # slime keeps one engine-reported string per generate call, resumptions included.
        s.weight_versions = [str(v) for v in t.call_versions]
        s.reward = t.reward
        runs = [[int(v), int(c)] for v, c in t.version_runs]
        info = {TOKEN_VERSIONS_KEY: runs, POLICY_VERSION_KEY: current_version}
        s.train_metadata = {**(s.train_metadata or {}), **info}
        s.metadata = {**(s.metadata or {}), **info, "april_num_calls": t.num_calls,
                      "april_num_aborts": t.num_aborts, "april_group_restarts": group.restarts}
        return s

    def _loss_mask(self, t: Trajectory, current_version: int | None) -> list[int]:
        # slime's --mask-offpolicy-in-partial-rollout trains only on tokens of the current policy
        if getattr(self.args, "mask_offpolicy_in_partial_rollout", False) and current_version is not None:
            return [int(v == current_version) for v in t.token_versions()]
        return [1] * t.response_length

    def samples(self, group: Group, current_version: int | None) -> list[Any]:
        return [self.sample(group, t, current_version) for t in group.trajectories]

    # ------------------------------------------------------------ slime samples -> groups
    def group_from_samples(self, samples: list[Any], current_version: int) -> Group:
        """A group from slime samples handed back through ``add_samples``, keeping every response
        whose tokens, log-probs and versions are known; any other is restarted from its prompt."""
        if len(samples) != self.n:
            raise ValueError(f"add_samples: a group has {len(samples)} samples, expected {self.n}")
        first = samples[0]
        prompt_len = len(first.tokens) - first.response_length if first.tokens else 0
        prompt_ids = list(first.tokens[:prompt_len]) if prompt_len > 0 else self.prompt_ids(first)
        group = self.new_group([self._as_prompt(s, prompt_ids) for s in samples], current_version)
        for s, t in zip(samples, group.trajectories):
            t.reward = s.reward
            self._restore_response(s, t, prompt_ids)
        return group

    def _as_prompt(self, s: Any, prompt_ids: list[int]) -> Any:
        Sample = self.slime.Sample
        p = Sample.from_dict(_plain_sample_dict(s))
        p.tokens, p.response, p.response_length = list(prompt_ids), "", 0
        p.loss_mask = p.rollout_log_probs = p.train_metadata = None
        p.weight_versions, p.reward, p.status = [], None, Sample.Status.PENDING
        p.metadata = {k: v for k, v in (p.metadata or {}).items() if not k.startswith("april_")}
        return p

    def _restore_response(self, s: Any, t: Trajectory, prompt_ids: list[int]) -> None:
        length = s.response_length
        status = s.status.name
        response = list(s.tokens[len(prompt_ids):]) if s.tokens else []
        logprobs = s.rollout_log_probs or []
        runs = self._known_versions(s, length)
        usable = (length > 0 and len(response) == length and len(logprobs) == length and runs is not None
                  and all(math.isfinite(float(x)) for x in logprobs) and length <= t.max_new_tokens
                  and status in ("COMPLETED", "TRUNCATED", "ABORTED"))
        if not usable:
            t.reward = None
            return
        t.response_ids = response
        t.logprobs = [float(x) for x in logprobs]
        t.version_runs = runs
        # The calls' versions go with the response: handed out again (``get_samples``) without a
        # new call, the sample must still say which policies generated it, or it would restart.
        t.call_versions = self._call_versions(s) or [v for v, _ in runs]
        t.status = TrajectoryStatus[status]
        t.finish_reason = {"COMPLETED": "stop", "TRUNCATED": "length", "ABORTED": "abort"}[status]
        if not t.status.finished:
            t.reward = None

    @staticmethod
    def _known_versions(s: Any, length: int) -> list[list[int]] | None:
        """Per-token versions: ours when the sample came from this module, else every token gets
        the oldest version slime recorded (overstates staleness, never understates it)."""
        runs = (s.train_metadata or {}).get(TOKEN_VERSIONS_KEY)
        if runs is not None:
            runs = [[int(v), int(c)] for v, c in runs]
            if sum(c for _, c in runs) == length:
                return runs
        versions = _SampleCodec._call_versions(s)
        return [[min(versions), length]] if versions else None

    @staticmethod
    def _call_versions(s: Any) -> list[int]:
        """The integer versions among slime's per-call ``weight_versions`` strings."""
        versions = []
        for v in s.weight_versions or []:
            try:
                versions.append(int(v))
            except (TypeError, ValueError):
                pass
        return versions


def _plain_sample_dict(s: Any) -> dict:
    d = s.to_dict()
    for key in ("rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_routed_experts",
                "multimodal_train_inputs"):
        d[key] = None
    return _plain(d)


# ====================================================================== the data source
class AprilDataSource:
    """slime data source (``--data-source-path april_slime.rollout.AprilDataSource``).

    Prompts are slime's: a ``slime.rollout.data_source.RolloutDataSource`` inside does the dataset,
    shuffling, epochs and its own checkpoint state, unchanged. Partial and surplus groups live in
    the ``PartialBuffer`` this class owns, and are saved with every slime checkpoint next to slime's
    data-source state (``<save>/rollout/``), so a restarted job resumes every partial.

    To the scheduler it is the ``PromptSource`` (``next_groups``). To slime it is a ``DataSource``:
    ``get_samples`` / ``add_samples`` behave like slime's ``RolloutDataSourceWithBuffer`` (buffered
    groups first, then fresh prompts) for rollout functions other than ours.
    """

    def __init__(self, args: Any) -> None:
        self.args = args
        self.config = load_config(args)
        self._slime = _Slime()
        self._codec = _SampleCodec(self._slime, args, self.config)
        self._prompts = self._slime.RolloutDataSource(args)
        self.buffer = PartialBuffer.from_config(self.config)
        # policy version of the latest training step (saved with the buffer)
        self.policy_version: int | None = None
        # version saved by the checkpoint this job was restored from; consumed by the first step
        self.restored_policy_version: int | None = None
        # rollout id -> state at the end of that rollout (the two latest; see april_slime.core.checkpoint)
        self._snapshots: dict[int, checkpoint.Snapshot] = {}

    # ------------------------------------------------------------ PromptSource
    def next_groups(self, n: int, current_version: int) -> list[Group]:
        if n <= 0:
            return []
        return [self._codec.new_group(samples, current_version) for samples in self._prompts.get_samples(n)]

    # ------------------------------------------------------------ slime DataSource
    def get_samples(self, num_samples: int) -> list[list[Any]]:
        version = self.policy_version or 0
        groups = self.buffer.take(num_samples, version)
        out = []
        for group in groups:
            samples = self._codec.samples(group, None)
            for s in samples:
                # another rollout function extends these responses, so versions recorded here would
                # no longer cover them; ``weight_versions`` still says which policies generated them
                s.train_metadata = None
            out.append(samples)
        if len(out) < num_samples:
            out += self._prompts.get_samples(num_samples - len(out))
        return out

    def add_samples(self, samples: list[list[Any]]) -> None:
        """Buffer groups handed back by slime code (its own partial rollout, or a user's
        ``--rollout-all-samples-process-path``). A group already buffered is refused, never doubled."""
        if not samples:
            return
        version = self.policy_version or 0
        groups = [self._codec.group_from_samples(group, version) for group in samples]
        for group in groups:
            self.buffer.put(group)

    def __len__(self) -> int:
        return len(self._prompts)

    # ------------------------------------------------------------ checkpoints
    # The design (what is saved, when, which file wins, what a kill leaves) is april_slime.core.checkpoint's
    # docstring.
    def _state_dir(self, base: str | None) -> Path | None:
        if self.config.buffer_dir:
            return Path(self.config.buffer_dir)
        return Path(base) / "rollout" if base else None

    def state_path(self, rollout_id: int, *, for_load: bool = False) -> Path | None:
        folder = self._state_dir(self.args.load if for_load else self.args.save)
        return checkpoint.state_file(folder, rollout_id) if folder else None

    def snapshot(self, rollout_id: int) -> None:
        """Record the state as of the end of rollout ``rollout_id``; ``save(rollout_id)`` writes it
        even when a later rollout has run in between (slime's train_async.py)."""
        self._snapshots[rollout_id] = checkpoint.Snapshot.take(
            rollout_id, self._prompts, self.buffer.state_dict(), self.policy_version)
        for old in sorted(self._snapshots)[:-2]:
            del self._snapshots[old]

    def save(self, rollout_id: int) -> None:
        path = self.state_path(rollout_id)
        if path is None:
            raise AprilConfigError("april_buffer_dir: unset and slime's --save is unset; the partial "
                                   "buffer has nowhere to be saved")
        snapshot = self._snapshots.get(rollout_id)
        if snapshot is None:
            snapshot = checkpoint.Snapshot.take(rollout_id, self._prompts, self.buffer.state_dict(),
                                                self.policy_version)
        checkpoint.remove_stale_tmp_files(path.parent)
        checkpoint.at_save_point("begin")
        with checkpoint.prompt_state_as(self._prompts, snapshot.prompt_state):
            self._prompts.save(rollout_id)
        if self.args.save:
            checkpoint.sync_slime_state(Path(self.args.save) / "rollout", rollout_id)
        checkpoint.at_save_point("prompt_state_written")
        write_text_atomic(path, snapshot.text(), at_point=checkpoint.at_save_point)
        checkpoint.at_save_point("end")
        logger.info("saved the data-source state of rollout %d (%d buffered groups, %d partial samples) "
                    "to %s", rollout_id, len(self.buffer), self.buffer.num_partial_trajectories(), path)

    def load(self, rollout_id: int | None = None) -> None:
        """Restore checkpoint ``rollout_id``: all of it, or stop the job naming the file."""
        if rollout_id is None or rollout_id < 0:
            self._prompts.load(rollout_id)
            return
        path = self.state_path(rollout_id, for_load=True)
        if path is None:  # no --load and no april_buffer_dir: nothing was ever saved for this job
            self._prompts.load(rollout_id)
            return
        checkpoint.remove_stale_tmp_files(path.parent)
        if not path.exists():
            slime_folder = Path(self.args.load) / "rollout" if self.args.load else None
            raise checkpoint.missing_state_error(path, rollout_id, slime_folder)
        state = checkpoint.parse_state(path, read_json(path), rollout_id)
        try:
            self.buffer.load_state_dict(state["buffer"])  # validates before replacing anything
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StateFileError(f"{path}: not a valid buffer state ({type(e).__name__}: {e})") from e
        if state["format"] >= 2:
            checkpoint.restore_prompt_state(self._prompts, state["prompt_state"], self.args)
        else:  # written before the prompt position moved into this file
            self._prompts.load(rollout_id)
        self.policy_version = self.restored_policy_version = state.get("policy_version")
        self._snapshots = {}
        self.snapshot(rollout_id)
        logger.info("restored %d buffered groups (%d partial samples) and the prompt position from %s",
                    len(self.buffer), self.buffer.num_partial_trajectories(), path)


# ====================================================================== the rollout function
class _PolicyVersionClient:
    """The engine client, with weight versions shifted into the job's continuous numbering.

    The shift is 0 except after a restore whose engines restarted counting (see module docstring).
    Every other call goes to the wrapped client unchanged.
    """

    def __init__(self, client: Any, offset: int = 0) -> None:
        self.client = client
        self.offset = offset

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def generate(self, *args: Any, **kwargs: Any):
        result = await self.client.generate(*args, **kwargs)
        if self.offset:
            result = dataclasses.replace(
                result, weight_version=result.weight_version + self.offset,
                version_runs=[[v + self.offset, n] for v, n in result.version_runs])
        return result

    async def weight_version(self, engine_url: str) -> int:
        return await self.client.weight_version(engine_url) + self.offset


class _Runtime:
    """Everything built once per process for the training rollouts of one data source."""

    def __init__(self, args: Any, data_source: AprilDataSource) -> None:
        self.args = args
        self.data_source = data_source
        self.config = data_source.config
        self.slime = data_source._slime
        self.codec = data_source._codec
        self.router_url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
        self.client: _PolicyVersionClient | None = None
        self.scheduler = None
        self.controller = None
        self.version_offset: int | None = None
        self.filter_fn = (self.slime.load_function(args.dynamic_sampling_filter_path)
                          if getattr(args, "dynamic_sampling_filter_path", None) else None)
        self.filter_drops: Counter[str] = Counter()
        self.current_version: int | None = None

    # ------------------------------------------------------------ engines
    async def _connect(self) -> None:
        """(Re)discover the engines behind slime's router at each step, so engines that slime's
        fault tolerance restarted on new ports are picked up."""
        from april_slime.core.engine import EngineClient

        fresh = await EngineClient.from_router(
            self.router_url, timeout_s=self.config.request_timeout_s, max_retries=self.config.max_retries,
            retry_backoff_s=self.config.retry_backoff_s, vocab_size=_vocab_size(self.codec))
        if self.client is not None and fresh.engine_urls == self.client.engine_urls:
            await fresh.close()
            return
        if self.client is not None:
            logger.info("rollout engines changed: %s -> %s", self.client.engine_urls, fresh.engine_urls)
            await self.client.close()
        self.client = _PolicyVersionClient(fresh, self.version_offset or 0)
        self.scheduler = self._build_scheduler()

    def _build_scheduler(self):
        from april_slime.core.scheduler import RolloutScheduler

        args = self.args
        if self.controller is None and self.config.adaptive_concurrency and self.config.policy == "copris":
            from april_slime.core.adaptive import AdaptiveConcurrencyController

            self.controller = AdaptiveConcurrencyController.from_config(
                self.config, args.rollout_batch_size, args.n_samples_per_prompt)
        return RolloutScheduler(
            self.config, self.client, self.data_source.buffer,
            rollout_batch_size=args.rollout_batch_size,
            n_samples_per_prompt=args.n_samples_per_prompt,
            sampling_params=sampling_params(args),
            reward_fn=self._reward_group,
            group_filter=self._keep_group if self.filter_fn is not None else None,
            controller=self.controller,
            over_sampling_batch_size=_explicit_over_sampling(args),
            eos_token_id=_eos_token_ids(self.codec),
        )

    async def _policy_version(self) -> int:
        """The engines' current weight version, in the job's continuous numbering. Asks only the
        engines the scheduler dispatches to, and needs one answer: an engine that stopped
        answering must not hold up the step (the scheduler's health probes bring it back)."""
        urls = self.scheduler.health.usable()
        replies = await asyncio.gather(*(self.client.client.weight_version(u) for u in urls),
                                       return_exceptions=True)
        raw = [r for r in replies if not isinstance(r, BaseException)]
        for url, r in zip(urls, replies):
            if isinstance(r, BaseException):
                if not isinstance(r, Exception):
                    raise r
                logger.warning("engine %s did not report its weight version: %s", url, r)
        if not raw:
            raise next(r for r in replies if isinstance(r, BaseException))
        if len(set(raw)) > 1:
            logger.warning("rollout engines report different weight versions %s; using the newest", raw)
        newest = max(raw)
        if self.version_offset is None:
            restored = self.data_source.restored_policy_version
            # after a restore, the first update the engines received is the saved policy's successor
            self.version_offset = max(0, restored + 1 - newest) if restored is not None else 0
            self.client.offset = self.version_offset
            if self.version_offset:
                logger.info("engine weight versions restarted after restore; shifting by %d to continue "
                            "the saved numbering (saved policy version %d)", self.version_offset, restored)
        return newest + self.version_offset

    # ------------------------------------------------------------ slime hooks used by the scheduler
    async def _hooked(self, sample: Any) -> Any:
        hooks = self.slime.apply_rollout_sample_hooks
        return await hooks(self.args, sample, evaluation=False) if hooks is not None else sample

    async def _samples(self, group: Group) -> list[Any]:
        return [await self._hooked(s) for s in self.codec.samples(group, self.current_version)]

    async def _reward_group(self, group: Group) -> None:
        """slime's reward path (``async_rm`` per sample, ``batched_async_rm`` with --group-rm);
        a reward already set (kept through ``add_samples``) is not recomputed, as in slime."""
        samples = await self._samples(group)
        args = self.args
        if getattr(args, "group_rm", False):
            rewards = await self.slime.batched_async_rm(args, samples)
            pairs = list(zip(group.trajectories, rewards, strict=True))
        else:
            todo = [(t, s) for t, s in zip(group.trajectories, samples) if t.reward is None]
            rewards = await asyncio.gather(*(self.slime.async_rm(args, s) for _, s in todo))
            pairs = [(t, r) for (t, _), r in zip(todo, rewards)]
        for t, reward in pairs:
            if reward is None:
                raise ValueError(f"reward function returned None for sample {t.uid}")
            t.reward = reward

    def _keep_group(self, group: Group) -> bool:
        """slime's dynamic sampling filter, ``f(args, samples) -> DynamicFilterOutput | bool``.
        ``keep_when_insufficient`` has no effect: the scheduler keeps generating until the batch is
        full, so dropping a group never leaves the batch short."""
        samples = self.codec.samples(group, self.current_version)
        output = self.slime.call_dynamic_filter(self.filter_fn, self.args, samples)
        if not output.keep and output.reason:
            self.filter_drops[output.reason] += 1
        return bool(output.keep)

    # ------------------------------------------------------------ one step
    async def train_step(self, rollout_id: int):
        await self._connect()
        version = await self._policy_version()
        self.current_version = version
        self.data_source.policy_version = version
        self.filter_drops.clear()
        result = await self.scheduler.run_step(self.data_source, version)
        expected = self.args.rollout_batch_size
        if len(result.groups) != expected:
            raise RuntimeError(f"rollout {rollout_id}: scheduler returned {len(result.groups)} groups, "
                               f"expected rollout_batch_size={expected}")
        groups = []
        for group in result.groups:
            if not group.complete:
                raise RuntimeError(f"rollout {rollout_id}: group {group.uid} returned incomplete")
            groups.append([await self._hooked(s) for s in self.codec.samples(group, version)])
        groups.sort(key=lambda g: g[0].index)
        metrics = dict(result.metrics)
        metrics.update({f"rollout/dynamic_filter/drop_{r}": c for r, c in self.filter_drops.items()})
        metrics[METRIC_PREFIX + "policy_version"] = version
        metrics[METRIC_PREFIX + "version_offset"] = self.version_offset
        return groups, metrics

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None


def _vocab_size(codec: "_SampleCodec") -> int | None:
    """Size of the model's vocabulary (its embedding rows), which every token id sent to or
    received from an engine must stay below: the checkpoint's config when it can be read, else the
    tokenizer's length, else unknown (then only ids >= 0 are checked)."""
    path = getattr(codec.args, "hf_checkpoint", None)
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, trust_remote_code=True)
        config = getattr(config, "text_config", None) or config
        if isinstance(getattr(config, "vocab_size", None), int):
            return config.vocab_size
    except Exception as e:  # no transformers, or no config next to the tokenizer
        logger.debug("vocabulary size not read from %s: %s", path, e)
    try:
        return len(codec.tokenizer)
    except TypeError:
        logger.warning("vocabulary size unknown (no model config, tokenizer without a length): token "
                       "ids are only checked to be >= 0")
        return None


def _eos_token_ids(codec: "_SampleCodec") -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and the checkpoint's
    ``generation_config.json`` eos_token_id (an id or a list; chat models list several)."""
    ids = []
    eos = getattr(codec.tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.append(eos)
    path = getattr(codec.args, "hf_checkpoint", None)
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except Exception as e:  # no transformers, or no generation config next to the tokenizer
        logger.debug("no generation config read from %s: %s", path, e)
        eos = None
    ids += [eos] if isinstance(eos, int) else [t for t in (eos or []) if isinstance(t, int)]
    return sorted(set(ids))


def sampling_params(args: Any) -> dict[str, Any]:
    """slime's rollout sampling parameters (as its ``GenerateState`` builds them), without
    ``max_new_tokens``: the scheduler sends each call the trajectory's remaining budget."""
    params = {
        "temperature": args.rollout_temperature,
        "top_p": getattr(args, "rollout_top_p", 1.0),
        "top_k": getattr(args, "rollout_top_k", -1),
        "stop": getattr(args, "rollout_stop", None),
        "stop_token_ids": getattr(args, "rollout_stop_token_ids", None),
        "skip_special_tokens": getattr(args, "rollout_skip_special_tokens", False),
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    return {k: v for k, v in params.items() if v is not None}


_RUNTIME: _Runtime | None = None
_RUNTIME_LOCK = threading.Lock()


def _runtime(args: Any, data_source: Any) -> _Runtime:
    global _RUNTIME
    if not isinstance(data_source, AprilDataSource):
        raise AprilConfigError(
            "data_source_path: april_slime.rollout.generate_rollout needs "
            f"--data-source-path april_slime.rollout.AprilDataSource, got {type(data_source).__name__}")
    with _RUNTIME_LOCK:
        if _RUNTIME is not None and _RUNTIME.data_source is data_source:
            return _RUNTIME
        if _RUNTIME is not None:
            _run_on_loop(_RUNTIME.close())
        _RUNTIME = _Runtime(args, data_source)
        return _RUNTIME


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False):
    """slime rollout function (``--rollout-function-path april_slime.rollout.generate_rollout``).

    Evaluation goes to slime's own ``slime.rollout.sglang_rollout.generate_rollout`` unchanged.
    Training returns ``RolloutFnTrainOutput(samples, metrics)``: ``rollout_batch_size`` groups of
    ``n_samples_per_prompt`` samples, each rewarded through slime's reward path and passed by the
    dynamic sampling filter, sorted by sample index as slime sorts them.
    """
    if evaluation:
        slime_rollout = importlib.import_module("slime.rollout.sglang_rollout")
        return slime_rollout.generate_rollout(args, rollout_id, data_source, evaluation=True)
    runtime = _runtime(args, data_source)
    samples, metrics = _run_on_loop(runtime.train_step(rollout_id))
    data_source.snapshot(rollout_id)  # what save(rollout_id) writes, also after rollout_id + 1 ran
    output_cls = runtime.slime.RolloutFnTrainOutput
    # slime builds older than RolloutFnTrainOutput take the bare sample groups
    return output_cls(samples=samples, metrics=metrics) if output_cls is not None else samples


def shutdown() -> None:
    """Close the engine client of this process (slime never calls this; tests and tools do)."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is not None:
            _run_on_loop(_RUNTIME.close())
            _RUNTIME = None
