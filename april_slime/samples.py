"""slime's ``Sample`` at the plugin's boundary: the codec between slime samples and ``Group`` records,
and the slime objects the plugin uses, imported lazily.

This is the only module that knows slime's ``Sample``: prompts come in as slime samples and leave as
``Group`` records for the scheduler; completed groups come back and leave as slime samples for the
trainer. Everything slime-specific is imported lazily (``Slime``), so the plugin imports without
slime and fails with a clear ``ImportError`` only on a path that needs it.

Each sample carries its per-token policy versions (``TOKEN_VERSIONS_KEY``, run-length encoded) and
the policy version of the step it trains in (``POLICY_VERSION_KEY``) in ``train_metadata`` and
``metadata``, where the loss reads them (``april_slime.core.keys``). What slime's trainer replays
(``rollout_routed_experts`` with ``--use-rollout-routing-replay``, ``rollout_top_p_token_ids`` /
``_offsets`` with ``--rollout-top-p`` < 1; with slime 0.4.0's ``--use-score-centering`` also
``rollout_top_p_log_probs``, or ``rollout_topk_token_ids`` / ``rollout_topk_log_probs`` at top-p 1)
comes from the trajectory's ``TokenReplay``, stitched over its segments (``april_slime.core.replay``),
in the shapes slime's own ``Sample`` code makes.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import json
import math
from typing import TYPE_CHECKING, Any

from april_slime.core.columns import token_column
from april_slime.core.config import AprilConfig, AprilConfigError
from april_slime.core.keys import MASKED_MEMBERS_KEY, POLICY_VERSION_KEY, TOKEN_VERSIONS_KEY
from april_slime.core.replay import INT32, ReplaySpec, TokenReplay, int32_bytes
from april_slime.core.types import Group, Trajectory, TrajectoryStatus
from april_slime.core.versions import VersionRuns
from april_slime.masking import masked_reward
from april_slime.slime_compat import data_source_module

if TYPE_CHECKING:
    from april_slime.slime_args import SlimeArgs

_STATUS_TO_SLIME = {
    TrajectoryStatus.PENDING: "PENDING",
    TrajectoryStatus.RUNNING: "PENDING",
    TrajectoryStatus.COMPLETED: "COMPLETED",
    TrajectoryStatus.TRUNCATED: "TRUNCATED",
    TrajectoryStatus.ABORTED: "ABORTED",
    TrajectoryStatus.FAILED: "FAILED",
}


# ====================================================================== slime, imported lazily
class Slime:
    """The slime objects the plugin uses, resolved at call time (never at import time)."""

    def __init__(self) -> None:
        try:
            self.Sample = slime_attr("slime.utils.types", "Sample")
            self.load_tokenizer = slime_attr("slime.utils.processing_utils", "load_tokenizer")
            self.load_function = slime_attr("slime.utils.misc", "load_function")
            # moved to slime.data.data_source in slime 0.4.0 (april_slime.slime_compat)
            self.RolloutDataSource = slime_attr(data_source_module(), "RolloutDataSource")
            self.async_rm = slime_attr("slime.rollout.rm_hub", "async_rm")
            self.batched_async_rm = slime_attr("slime.rollout.rm_hub", "batched_async_rm")
            self.call_dynamic_filter = slime_attr("slime.rollout.filter_hub.base_types", "call_dynamic_filter")
        except ImportError as e:
            raise ImportError(
                f"april_slime.rollout needs slime (THUDM/slime) on the Python path for this call: {e}"
            ) from e
        # Optional pieces: older slime builds lack them.
        self.RolloutFnTrainOutput = _optional_attr("slime.rollout.base_types", "RolloutFnTrainOutput")
        self.apply_rollout_sample_hooks = _optional_attr("slime.rollout.sample_hooks", "apply_rollout_sample_hooks")


def slime_attr(module: str, name: str) -> Any:
    """``module.name``, imported now; an ``ImportError`` naming both when either is missing."""
    mod = importlib.import_module(module)
    try:
        return getattr(mod, name)
    except AttributeError as e:
        raise ImportError(f"{module} has no {name}") from e


def _optional_attr(module: str, name: str) -> Any:
    try:
        return slime_attr(module, name)
    except ImportError:
        return None


_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(slime: Slime, path: str | None) -> Any:
    """slime's own tokenizer loader, once per checkpoint path (loading an HF tokenizer is slow)."""
    if not path:
        raise AprilConfigError("hf_checkpoint: must be set (the tokenizer is loaded from it)")
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = slime.load_tokenizer(path, trust_remote_code=True)
    return _TOKENIZERS[path]


# ====================================================================== what training replays
def replay_spec(slime_args: SlimeArgs) -> ReplaySpec:
    """What the job's trainer replays, from slime's arguments; ``AprilConfigError`` naming the key."""
    top_p = slime_args.rollout_top_p
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise AprilConfigError(f"rollout_top_p: must lie in (0, 1], got {top_p!r}")
    layers = topk = 0
    if slime_args.use_rollout_routing_replay:
        layers, topk = slime_args.num_layers, slime_args.moe_router_topk
        for key, value in (("num_layers", layers), ("moe_router_topk", topk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AprilConfigError(f"use_rollout_routing_replay: needs {key} (slime's model arguments) as an "
                                       f"integer >= 1 to read the engines' routed experts, got {value!r}")
    top_p_log_probs, sampler_topk = sampler_capture(slime_args, top_p)
    return ReplaySpec(routed_layers=layers, routed_topk=topk, top_p=top_p < 1.0, top_p_log_probs=top_p_log_probs,
                      topk=sampler_topk)


TOP_P_LOG_PROBS_FIELD = "rollout_top_p_log_probs"
TOPK_FIELDS = ("rollout_topk_token_ids", "rollout_topk_log_probs")


def sampler_capture(slime_args: SlimeArgs, top_p: float) -> tuple[bool, int]:
    """What slime 0.4.0's score centering trains on (``slime/utils/score_centering.py``): at top-p < 1
    the nucleus with the sampler's log-probs of its ids, else the sampler's top-k of every token.
    (False, 0) when the job does not ask, or when the installed slime's ``Sample`` has no field for
    it (the pinned slime has neither the arguments nor the fields)."""
    if not slime_args.use_score_centering:
        return False, 0
    if top_p < 1.0:
        return sample_declares(TOP_P_LOG_PROBS_FIELD), 0
    if not sample_declares(*TOPK_FIELDS):
        return False, 0
    k = slime_args.score_centering_top_k
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise AprilConfigError(f"score_centering_top_k: must be an integer >= 1, got {k!r}")
    return False, k


def sample_declares(*names: str) -> bool:
    """Whether the installed slime's ``Sample`` declares every one of ``names`` as a field."""
    try:
        fields = getattr(slime_attr("slime.utils.types", "Sample"), "__dataclass_fields__", {})
    except ImportError:
        return False
    return all(name in fields for name in names)


def _le_int32(value: Any) -> bytearray:
    import torch

    return bytearray(torch.as_tensor(value, dtype=torch.int32).reshape(-1).numpy().astype("<i4").tobytes())


def _int32_tensor(raw: bytes | bytearray | None) -> Any:
    import torch

    return torch.frombuffer(bytearray(bytes(raw)), dtype=torch.int32) if raw else torch.zeros(0, dtype=torch.int32)


def _float32_tensor(raw: bytes | bytearray | None) -> Any:
    import torch

    return torch.frombuffer(bytearray(bytes(raw)), dtype=torch.float32) if raw else torch.zeros(0, dtype=torch.float32)


def _le_float32(value: Any) -> bytearray:
    import torch

    return bytearray(torch.as_tensor(value, dtype=torch.float32).reshape(-1).numpy().astype("<f4").tobytes())


def put_replay(s: Any, replay: TokenReplay | None, spec: ReplaySpec, uid: str) -> None:
    """Set slime's replay fields of ``s`` from a trajectory's stitched data; a trajectory that does
    not hold all of it stops here, naming what is missing, rather than train on shifted rows."""
    if not spec.active:
        return
    replay = replay if replay is not None else TokenReplay()
    missing = replay.covers(spec, len(s.tokens) - s.response_length, s.response_length)
    if missing:
        raise RuntimeError(f"sample {uid}: holds {missing}; it cannot be replayed in training")
    if spec.routed:
        s.rollout_routed_experts = _int32_tensor(replay.routed_int32()).reshape(-1, spec.routed_layers,
                                                                                spec.routed_topk)
    if spec.top_p:
        import torch

        s.rollout_top_p_token_ids = _int32_tensor(replay.top_p_ids)
        s.rollout_top_p_token_offsets = torch.tensor(replay.top_p_offsets(), dtype=torch.int32)
    if spec.top_p_log_probs:
        s.rollout_top_p_log_probs = _float32_tensor(replay.top_p_log_probs)
    if spec.topk:
        s.rollout_topk_token_ids = _int32_tensor(replay.topk_ids).reshape(-1, spec.topk)
        s.rollout_topk_log_probs = _float32_tensor(replay.topk_log_probs).reshape(-1, spec.topk)


def put_placeholder_replay(s: Any, spec: ReplaySpec) -> None:
    """Replay fields of the shapes slime checks for a sample that trains nothing (a masked member:
    loss mask 0, ``remove_sample``): no engine computed its positions, and none of its values
    reaches a loss. Routed rows name the experts 0..top-k-1, valid and distinct, so the replayed
    forward runs as on any sample."""
    if not spec.active:
        return
    import torch

    n = len(s.tokens)
    if spec.routed:
        row = torch.arange(spec.routed_topk, dtype=torch.int32)
        s.rollout_routed_experts = row.repeat(n - 1, spec.routed_layers, 1)
    if spec.top_p:
        s.rollout_top_p_token_ids = torch.tensor(s.tokens[n - s.response_length:], dtype=torch.int32)
        s.rollout_top_p_token_offsets = torch.arange(s.response_length + 1, dtype=torch.int32)
    if spec.top_p_log_probs:
        s.rollout_top_p_log_probs = torch.zeros(s.response_length, dtype=torch.float32)
    if spec.topk:
        s.rollout_topk_token_ids = torch.arange(spec.topk, dtype=torch.int32).repeat(s.response_length, 1)
        s.rollout_topk_log_probs = torch.zeros(s.response_length, spec.topk, dtype=torch.float32)


def take_replay(s: Any, spec: ReplaySpec) -> TokenReplay | None:
    """A slime sample's replay fields as a ``TokenReplay`` (None when it holds none of them), as
    slime's own code leaves them; a shape that does not fit ``spec`` raises ``ValueError``."""
    if not spec.active:
        return None
    import torch

    replay = TokenReplay(routed_width=spec.routed_width)
    experts = getattr(s, "rollout_routed_experts", None)
    if spec.routed and experts is not None:
        experts = torch.as_tensor(experts, dtype=torch.int32)
        if experts.ndim != 3 or tuple(experts.shape[1:]) != (spec.routed_layers, spec.routed_topk):
            raise ValueError(f"rollout_routed_experts of shape {tuple(experts.shape)}, expected "
                             f"(*, {spec.routed_layers}, {spec.routed_topk})")
        replay.routed = _le_int32(experts)
    ids, offsets = getattr(s, "rollout_top_p_token_ids", None), getattr(s, "rollout_top_p_token_offsets", None)
    if spec.top_p and ids is not None and offsets is not None:
        offsets = [int(x) for x in torch.as_tensor(offsets).reshape(-1).tolist()]
        counts = [b - a for a, b in zip(offsets, offsets[1:])]
        replay.top_p_ids = _le_int32(ids)
        replay.top_p_counts = bytearray(int32_bytes(counts))
        if not offsets or offsets[0] != 0 or min(counts, default=0) < 0 or offsets[-1] * INT32 != len(
                replay.top_p_ids):
            raise ValueError("rollout_top_p_token_offsets do not split rollout_top_p_token_ids")
        if spec.top_p_log_probs and getattr(s, TOP_P_LOG_PROBS_FIELD, None) is not None:
            replay.top_p_log_probs = _le_float32(s.rollout_top_p_log_probs)
    ids, log_probs = (getattr(s, name, None) for name in TOPK_FIELDS)
    if spec.topk and ids is not None and log_probs is not None:
        ids, log_probs = torch.as_tensor(ids, dtype=torch.int32), torch.as_tensor(log_probs, dtype=torch.float32)
        if ids.ndim != 2 or ids.shape[1] != spec.topk or log_probs.shape != ids.shape:
            raise ValueError(f"rollout_topk_token_ids {tuple(ids.shape)} / rollout_topk_log_probs "
                             f"{tuple(log_probs.shape)}, expected (*, {spec.topk}) both")
        replay.topk, replay.topk_ids, replay.topk_log_probs = spec.topk, _le_int32(ids), _le_float32(log_probs)
    return replay


# ====================================================================== Sample <-> Group
def sampling_seed(rollout_seed: int, group_uid: str, index: int) -> int:
    """Fixed per trajectory for its whole life, so a resumed call continues the same random stream,
    and reproducible across restarts (a pure function of the job seed and the trajectory id)."""
    digest = hashlib.blake2b(f"{rollout_seed}:{group_uid}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def plain(value: Any) -> Any:
    """JSON-safe copy of a prompt sample's fields (datasets read from parquet hand numpy values)."""

    def default(obj: Any) -> Any:
        if hasattr(obj, "tolist"):
            return obj.tolist()
        if isinstance(obj, (set, frozenset)):
            return sorted(obj)
        raise TypeError(f"a prompt sample field of type {type(obj).__name__} cannot be buffered as JSON")

    return json.loads(json.dumps(value, default=default, allow_nan=False))


class SampleCodec:
    """Converts between slime samples and the rollout records, at this boundary only."""

    def __init__(self, slime: Slime, config: AprilConfig, slime_args: SlimeArgs, replay: ReplaySpec) -> None:
        self.slime = slime
        self.config = config
        self.slime_args = slime_args
        self.n = slime_args.n_samples_per_prompt
        self.budget = slime_args.rollout_max_response_len
        self.seed = slime_args.rollout_seed
        self.replay = replay

    @property
    def tokenizer(self) -> Any:
        return _tokenizer(self.slime, self.slime_args.hf_checkpoint)

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
        prompt_ids = token_column(self.prompt_ids(first), f"prompt of group {uid}")  # one, shared
        prompt = first.to_dict()
        prompt["tokens"] = []  # the prompt ids live in the group; never store them twice
        trajectories = [
            Trajectory(uid=f"{uid}/{i}", group_uid=uid, index_in_group=i, prompt_ids=prompt_ids,
                       max_new_tokens=self.budget, sampling_seed=sampling_seed(self.seed, uid, i))
            for i in range(self.n)
        ]
        payload = {"prompt_sample": plain(prompt), "group_index": first.group_index,
                   "indices": [s.index for s in samples]}
        return Group(uid=uid, prompt_ids=prompt_ids, trajectories=trajectories,
                     created_version=current_version, payload=payload)

    # ------------------------------------------------------------ groups -> slime samples
    def prompt_sample(self, group: Group, t: Trajectory) -> Any:
        """A fresh slime sample of ``t``'s prompt, as slime hands one to a generate function."""
        s = self.slime.Sample.from_dict(copy.deepcopy(group.payload["prompt_sample"]))
        s.group_index = group.payload["group_index"]
        s.index = group.payload["indices"][t.index_in_group]
        return s

    @staticmethod
    def sample_dict(s: Any) -> dict:
        """A sample's fields, JSON-safe (what an episode's finished sample is kept as)."""
        return _plain_sample_dict(s)

    def sample(self, group: Group, t: Trajectory, current_version: int | None) -> Any:
        """The slime sample of one trajectory, shaped as slime's own ``generate`` leaves it (an
        episode's: as its generate function returned it, with the plugin's metadata added; a list
        of samples where the function returned one)."""
        if t.status is TrajectoryStatus.FAILED:
            return self._masked_sample(group, t, current_version)
        if t.episode_samples is not None:
            return self._fanout_samples(group, t, current_version)
        if t.episode_sample is not None:
            return self._episode_sample(group, t, current_version)
        Sample = self.slime.Sample
        s = self.prompt_sample(group, t)
        s.tokens = t.input_ids()
        s.response_length = t.response_length
        # decoded once over the whole response: stage boundaries can split a multi-byte character
        s.response = (self.tokenizer.decode(t.response_ids.tolist(), skip_special_tokens=bool(
            self.slime_args.rollout_skip_special_tokens)) if t.response_ids else "")
        s.rollout_log_probs = t.logprobs.tolist()
        s.loss_mask = self._loss_mask(t.loss_mask, t.token_versions(), current_version)
        s.status = Sample.Status[_STATUS_TO_SLIME[t.status]]
        put_replay(s, t.replay, self.replay, t.uid)
        return self._with_plugin_fields(s, group.restarts, t.reward, t.version_runs, t.call_versions, t.num_calls,
                                        t.num_aborts, current_version)

    def _masked_sample(self, group: Group, t: Trajectory, current_version: int | None) -> Any:
        """A member masked out of its group (``april_slime.masking``): one placeholder token,
        trained on by nothing."""
        s = self.prompt_sample(group, t)
        s.tokens = t.prompt_ids.tolist() + [t.prompt_ids[-1]]
        s.response, s.response_length = "", 1
        s.rollout_log_probs, s.loss_mask = [0.0], [0]
        s.status, s.remove_sample = self.slime.Sample.Status.FAILED, True
        put_placeholder_replay(s, self.replay)
        version = current_version if current_version is not None else 0
        return self._with_plugin_fields(s, group.restarts, masked_reward(self.slime_args.reward_key),
                                        VersionRuns.single(version, 1), [], 0, 0, current_version)

    def _episode_sample(self, group: Group, t: Trajectory, current_version: int | None) -> Any:
        s = self.slime.Sample.from_dict(copy.deepcopy(t.episode_sample))
        s.group_index = group.payload["group_index"]
        s.index = group.payload["indices"][t.index_in_group]
        s.loss_mask = self._loss_mask(t.loss_mask, t.token_versions(), current_version)
        put_replay(s, t.replay, self.replay, t.uid)
        return self._with_plugin_fields(s, group.restarts, t.reward, t.version_runs, t.call_versions, t.num_calls,
                                        t.num_aborts, current_version)

    def _fanout_samples(self, group: Group, t: Trajectory, current_version: int | None) -> list[Any]:
        """The samples of an episode whose function returned a list, as it returned them (their
        indices and rollout_id its own, as slime keeps them), each with its own versions."""
        out = []
        for n, entry in enumerate(t.episode_samples):
            s = self.slime.Sample.from_dict(copy.deepcopy(entry["sample"]))
            runs = VersionRuns.of(entry["version_runs"])
            versions = runs.expand()
            s.loss_mask = self._loss_mask(s.loss_mask, versions, current_version)
            reward = t.reward[n] if t.reward is not None else s.reward
            replay = entry.get("replay")
            put_replay(s, TokenReplay.from_dict(replay) if replay is not None else None, self.replay,
                       f"{t.uid}[{n}]")
            out.append(self._with_plugin_fields(s, group.restarts, reward, runs, entry["call_versions"],
                                                entry["num_calls"], entry["num_aborts"], current_version))
        return out

    @staticmethod
    def _with_plugin_fields(s: Any, group_restarts: int, reward: Any, version_runs: VersionRuns,
                            call_versions: list[int], num_calls: int, num_aborts: int,
                            current_version: int | None) -> Any:
        """What the plugin adds to every sample it returns: reward, per-call versions, and the
        per-token versions the loss reads (``train_metadata``; also in ``metadata`` for logs)."""
        # slime keeps one engine-reported string per generate call, resumptions included.
        s.weight_versions = [str(v) for v in call_versions]
        s.reward = reward
        info = {TOKEN_VERSIONS_KEY: version_runs.plain(), POLICY_VERSION_KEY: current_version}
        s.train_metadata = {**(s.train_metadata or {}), **info}
        s.metadata = {**(s.metadata or {}), **info, "april_num_calls": num_calls,
                      "april_num_aborts": num_aborts, "april_group_restarts": group_restarts}
        return s

    def _loss_mask(self, mask: list[int] | None, versions: list[int], current_version: int | None) -> list[int]:
        # slime's --mask-offpolicy-in-partial-rollout trains only on tokens of the current policy
        mask = list(mask) if mask is not None else [1] * len(versions)
        if self.slime_args.mask_offpolicy_in_partial_rollout and current_version is not None:
            return [m * int(v == current_version) for m, v in zip(mask, versions)]
        return mask

    def samples(self, group: Group, current_version: int | None) -> list[Any]:
        """One entry per trajectory: a sample, or the list an episode's function returned."""
        entries = [self.sample(group, t, current_version) for t in group.trajectories]
        masked = [t.index_in_group for t in group.masked()]
        if masked:
            for s in leaves(entries):
                s.train_metadata[MASKED_MEMBERS_KEY] = masked
        return entries

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
        try:
            replay = take_replay(s, self.replay)
        except ValueError:
            replay = None
        usable = (length > 0 and len(response) == length and len(logprobs) == length and runs is not None
                  and all(math.isfinite(float(x)) for x in logprobs) and length <= t.max_new_tokens
                  and status in ("COMPLETED", "TRUNCATED", "ABORTED")
                  and (not self.replay.active or (replay is not None and replay.covers(
                      self.replay, len(prompt_ids), length) is None)))
        if not usable:
            t.reward = None
            return
        t.replay = replay
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
    def _known_versions(s: Any, length: int) -> VersionRuns | None:
        """Per-token versions: ours when the sample came from this module, else every token gets
        the oldest version slime recorded (overstates staleness, never understates it)."""
        runs = (s.train_metadata or {}).get(TOKEN_VERSIONS_KEY)
        if runs is not None:
            with contextlib.suppress(TypeError, ValueError):
                return VersionRuns.of(([int(v), int(c)] for v, c in runs), total=length)
        versions = SampleCodec._call_versions(s)
        return VersionRuns.single(min(versions), length) if versions else None

    @staticmethod
    def _call_versions(s: Any) -> list[int]:
        """The integer versions among slime's per-call ``weight_versions`` strings."""
        versions = []
        for v in s.weight_versions or []:
            with contextlib.suppress(TypeError, ValueError):
                versions.append(int(v))
        return versions


def leaves(entries: list[Any]) -> list[Any]:
    """The samples of a group's entries (``SampleCodec.samples``), lists of a fan-out flattened."""
    return [s for e in entries for s in (e if isinstance(e, list) else [e])]


def one_shape(groups: list[list[Any]]) -> list[list[Any]]:
    """slime flattens the rollout's output one level at a time while its first element is a list,
    so a batch in which some episode returned list[Sample] must be nested alike throughout: every
    other sample then becomes a list of one (slime's compact shape, prompt x rollout x samples)."""
    if not any(isinstance(e, list) for g in groups for e in g):
        return groups
    return [[e if isinstance(e, list) else [e] for e in g] for g in groups]


def _plain_sample_dict(s: Any) -> dict:
    d = s.to_dict()
    for key in ("rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_routed_experts",
                "multimodal_train_inputs"):
        d[key] = None
    return plain(d)
