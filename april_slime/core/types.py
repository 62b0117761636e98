"""The records that flow through the rollout side.

prompts -> scheduler -> engine -> completed groups -> slime samples; partials -> buffer -> scheduler.

A ``Trajectory`` is one sample of a prompt group as the scheduler sees it: prompt ids, the response
generated so far over any number of generate calls ("stages"), the log-prob of every response token
as reported by the engine at the time it was generated (so after resumption this *is* CoPRIS's
concatenated log-prob vector), and the policy (weight) version that generated every token, stored
run-length encoded. Token ids and log-probs are held as immutable columns (``core.columns``): raw
bytes per token, nothing for the garbage collector to walk, and shared with the checkpoint's
snapshots; whatever sequence is assigned to them is converted on assignment. ``to_dict`` turns a
record into plain data (JSON-ready), and ``from_dict`` reads it back, so the buffer can be saved
with a checkpoint and loaded in another process.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import numpy as np

from april_slime.core.columns import LOGPROB_DTYPE, TOKEN_DTYPE, Column, logprob_column, token_column
from april_slime.core.replay import SegmentReplay, TokenReplay
from april_slime.core.versions import VersionRuns

# the per-token fields held as columns, and how an assigned sequence becomes one
_TOKEN_COLUMNS = {"prompt_ids": token_column, "response_ids": token_column, "logprobs": logprob_column}
_COLUMN_DTYPES = {"prompt_ids": TOKEN_DTYPE, "response_ids": TOKEN_DTYPE, "logprobs": LOGPROB_DTYPE}


class TrajectoryStatus(str, enum.Enum):
    PENDING = "pending"  # never sent, or waiting to be resumed
    RUNNING = "running"  # a generate call is in flight
    COMPLETED = "completed"  # engine finished with "stop"
    TRUNCATED = "truncated"  # engine finished with "length" (hit max_new_tokens)
    ABORTED = "aborted"  # the last call was aborted; holds a partial response, resumable
    # given up for an infrastructure fault and masked out of its group (april_mask_failed_samples):
    # it holds no tokens, never runs again, and trains nothing; its group's other samples train
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        """No more generation: the sample is done (a masked one included)."""
        return self in (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED, TrajectoryStatus.FAILED)


@dataclass
class Trajectory:
    uid: str  # unique for the whole job: f"{group_uid}/{index_in_group}"
    group_uid: str
    index_in_group: int
    prompt_ids: Column  # int32; assign any sequence of ids
    max_new_tokens: int  # budget for the whole response, across every stage
    sampling_seed: int  # fixed for the sample's life, so a resumed call continues the same stream
    response_ids: Column = field(default_factory=Column)  # int32
    logprobs: Column = field(default_factory=Column)  # float64, one per response token
    # policy version of every response token
    version_runs: VersionRuns = field(default_factory=VersionRuns)
    status: TrajectoryStatus = TrajectoryStatus.PENDING
    finish_reason: str | None = None
    num_calls: int = 0  # generate calls made (1 + number of resumptions)
    num_aborts: int = 0
    # policy version reported by every generate call that returned, in call order (slime's
    # Sample.weight_versions); a call that returned no token still counts
    call_versions: list[int] = field(default_factory=list)
    # set by the reward function once the whole group has finished; a float, or whatever slime's
    # reward model returns (a dict with --reward-key)
    reward: Any = None
    # calls an engine refused as invalid (HTTP 4xx) over the trajectory's whole life, saved with
    # the buffer, so a sample no engine accepts is dropped instead of failing every step
    rejected_calls: int = 0
    # an episode's sample (core.episodes): the response's loss mask (None: every token trains), and
    # the finished sample as its codec keeps it (JSON-safe)
    loss_mask: list[int] | None = None
    episode_sample: dict | None = None
    # an episode whose function returned list[Sample] (slime's compact shape): each sample as its codec
    # keeps it, with its own per-token versions and calls ({"sample", "version_runs", "call_versions",
    # "num_calls", "num_aborts"}); the member's own fields then hold every model token of the
    # episode, and ``reward`` is the list of the samples' rewards
    episode_samples: list[dict] | None = None
    # a model call of an episode: its own sampling parameters (None: the step's)
    sampling_params: dict | None = None
    # an unfinished episode: the oldest policy version of the tokens its calls hold (not saved)
    episode_oldest_version: int | None = field(default=None, compare=False, repr=False)
    # what training replays (core.replay): routed experts of every position, top-p kept ids of every
    # response token, stitched over the calls; None when the job replays nothing
    replay: TokenReplay | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.version_runs, VersionRuns):  # plain pairs: a checkpoint's, a caller's
            self.version_runs = VersionRuns.of(self.version_runs)

    def __setattr__(self, name: str, value: Any) -> None:
        column = _TOKEN_COLUMNS.get(name)
        if column is not None:
            value = column(value, f"{self.__dict__.get('uid', 'trajectory')}: {name}")
        object.__setattr__(self, name, value)

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def remaining_tokens(self) -> int:
        return self.max_new_tokens - len(self.response_ids)

    def input_ids(self) -> list[int]:
        """Prompt plus whatever was generated already, as a list."""
        return self.prompt_ids.tolist() + self.response_ids.tolist()

    def input_array(self) -> np.ndarray:
        """What a (re)submission sends: prompt plus response as one read-only int32 array. A
        request holds it until its reply: as a list it would be tens of thousands of Python
        references per request in flight, each visited by every full garbage collection."""
        out = np.concatenate([*self.prompt_ids.chunks, *self.response_ids.chunks])
        out.flags.writeable = False
        return out

    @property
    def replay_rows(self) -> int:
        """Positions whose routed experts are held: the next call needs the engine's from there on."""
        return self.replay.routed_rows if self.replay is not None else 0

    def append(self, output_ids: list[int], logprobs: list[float], version: int,
               version_runs: VersionRuns | None = None, replay: SegmentReplay | None = None) -> None:
        """Append one stage's output; ``logprobs`` must be aligned one-to-one with ``output_ids``.

        ``version`` is the call's reported policy version (recorded in ``call_versions``);
        ``version_runs`` the policy version of each of its tokens as ``[[version, count], ...]``
        when the weights changed during the call (default: every token has ``version``);
        ``replay`` what the reply carries for training to replay, stitched after what the earlier
        stages left (``TokenReplay.extend``). Nothing is appended when any of it is inconsistent."""
        if len(output_ids) != len(logprobs):
            raise ValueError(f"{self.uid}: {len(output_ids)} tokens but {len(logprobs)} log-probs")
        new_ids = token_column(output_ids, f"{self.uid}: output ids")
        new_logprobs = logprob_column(logprobs, f"{self.uid}: log-probs")
        if not np.isfinite(new_logprobs.array()).all():
            raise ValueError(f"{self.uid}: non-finite log-prob in engine output")
        if version_runs is None:
            version_runs = VersionRuns.single(version, len(output_ids))
        else:
            try:
                version_runs = VersionRuns.of(version_runs, total=len(output_ids))
            except ValueError as e:
                raise ValueError(f"{self.uid}: {e} (the tokens of the call)") from None
        if replay is not None and len(new_ids):
            held = self.replay if self.replay is not None else TokenReplay()
            try:
                held.extend(replay, input_len=len(self.prompt_ids) + len(self.response_ids),
                            response_len=len(self.response_ids), new_tokens=len(output_ids))
            except ValueError as e:
                raise ValueError(f"{self.uid}: {e}") from None
            self.replay = held
        self.call_versions.append(version)
        if not len(new_ids):
            return
        self.response_ids = self.response_ids.extended(new_ids.array())
        self.logprobs = self.logprobs.extended(new_logprobs.array())
        self.version_runs.extend_runs(version_runs)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` response tokens (with their log-probs and versions)."""
        if not 0 <= length <= len(self.response_ids):
            raise ValueError(f"{self.uid}: cannot cut a response of {len(self.response_ids)} tokens to {length}")
        self.response_ids, self.logprobs = self.response_ids[:length], self.logprobs[:length]
        self.version_runs = self.version_runs.truncated(length)
        if self.replay is not None:
            self.replay.truncate(len(self.prompt_ids), length)

    def token_versions(self) -> list[int]:
        return self.version_runs.expand()

    def oldest_version(self) -> int | None:
        own = self.version_runs.oldest()
        if self.episode_oldest_version is None:
            return own
        return self.episode_oldest_version if own is None else min(own, self.episode_oldest_version)

    def staleness(self, current_version: int) -> int:
        """Policy lag of the oldest generated token (0 for a sample with no tokens yet)."""
        oldest = self.oldest_version()
        return 0 if oldest is None else current_version - oldest

    def offpolicy_tokens(self, current_version: int) -> int:
        return self.version_runs.count_other_than(current_version)

    def reset(self) -> None:
        """Forget everything generated (used when a stale group is restarted from its prompt)."""
        self.response_ids, self.logprobs, self.version_runs, self.call_versions = [], [], VersionRuns(), []
        self.status, self.finish_reason = TrajectoryStatus.PENDING, None
        self.reward = None
        self.loss_mask, self.episode_sample, self.episode_oldest_version = None, None, None
        self.episode_samples = None
        self.replay = None

    def to_dict(self, *, shared: bool = False) -> dict[str, Any]:
        """Plain data (lists; the replay's arrays as ``bytes``). With ``shared``, the token columns
        and the replay's pieces themselves instead: immutable, so a snapshot holds them without a
        copy (``core.checkpoint``); ``from_dict`` reads both."""
        columns = (self.prompt_ids, self.response_ids, self.logprobs)
        prompt_ids, response_ids, logprobs = columns if shared else (c.tolist() for c in columns)
        return {
            "uid": self.uid,
            "group_uid": self.group_uid,
            "index_in_group": self.index_in_group,
            "prompt_ids": prompt_ids,
            "max_new_tokens": self.max_new_tokens,
            "sampling_seed": self.sampling_seed,
            "response_ids": response_ids,
            "logprobs": logprobs,
            "version_runs": self.version_runs.plain(),
            "status": self.status.value,
            "finish_reason": self.finish_reason,
            "num_calls": self.num_calls,
            "num_aborts": self.num_aborts,
            "call_versions": list(self.call_versions),
            "reward": self.reward,
            "rejected_calls": self.rejected_calls,
            "loss_mask": None if self.loss_mask is None else list(self.loss_mask),
            "episode_sample": self.episode_sample,
            "episode_samples": self.episode_samples,
            "sampling_params": self.sampling_params,
            "replay": None if self.replay is None else self.replay.to_dict(shared=shared),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        """The trajectory of ``to_dict``'s data (either form). A checkpoint restores thousands at a
        time, so the record is filled whole rather than through ``__init__``'s assignments (each a
        call of ``__setattr__``: most of the cost): every field ``__setattr__`` or
        ``__post_init__`` converts is converted here, and a field missing or unknown raises
        ``TypeError`` as ``__init__`` would."""
        names = d.keys()
        if not names <= _FIELDS.keys() or not names >= _REQUIRED:
            unknown, missing = sorted(names - _FIELDS.keys()), sorted(_REQUIRED - names)
            raise TypeError(f"trajectory {d.get('uid')!r}: unknown fields {unknown}, missing fields {missing}")
        values = {**_PLAIN_DEFAULTS, **d}
        for name in _MADE_DEFAULTS.keys() - names:
            values[name] = _MADE_DEFAULTS[name]()
        uid = values["uid"]
        for name, column in _TOKEN_COLUMNS.items():
            value = values[name]
            if type(value) is not Column or value.dtype != _COLUMN_DTYPES[name]:  # a restore's are columns already
                values[name] = column(value, f"{uid}: {name}")
        values["status"] = TrajectoryStatus(values["status"])
        # lists the trajectory changes in place are its own: ``d`` may be kept (a restored
        # checkpoint's state is the snapshot of what it restored)
        values["call_versions"] = list(values["call_versions"])
        if values["loss_mask"] is not None:
            values["loss_mask"] = list(values["loss_mask"])
        if not isinstance(values["version_runs"], VersionRuns):
            values["version_runs"] = VersionRuns.of(values["version_runs"])
        if values["replay"] is not None and not isinstance(values["replay"], TokenReplay):
            values["replay"] = TokenReplay.from_dict(values["replay"])
        t = cls.__new__(cls)
        t.__dict__.update(values)
        return t

    @classmethod
    def from_columns(cls, columns: dict[str, list]) -> list[Trajectory]:
        """The trajectories of ``columns``: each field of ``to_dict``'s data mapped to its values over
        every trajectory (a state file's layout, ``core.state_file``). Each is what ``from_dict``
        makes of its row, but every check and conversion runs once per column, mostly in C, instead
        of once per trajectory and field: a restore makes thousands. ``columns`` is left as it is,
        so it can be kept (the snapshot of a restored checkpoint)."""
        names = columns.keys()
        if not names <= _FIELDS.keys() or not names >= _REQUIRED:
            unknown, missing = sorted(names - _FIELDS.keys()), sorted(_REQUIRED - names)
            raise TypeError(f"trajectory columns: unknown fields {unknown}, missing fields {missing}")
        if not all(type(c) is list for c in columns.values()):
            raise TypeError("trajectory columns: a field's values are not a list")
        n = len(columns["uid"])
        if any(len(c) != n for c in columns.values()):
            lengths = sorted({len(c) for c in columns.values()})
            raise ValueError(f"trajectory columns: {lengths} values, not one per trajectory")
        uids = columns["uid"]
        values = {}
        for name in _FIELDS:  # the record's own order
            if name in columns:
                values[name] = columns[name]
            elif name in _PLAIN_DEFAULTS:
                values[name] = [_PLAIN_DEFAULTS[name]] * n  # immutable: None, 0, a status
            else:
                values[name] = [_MADE_DEFAULTS[name]() for _ in range(n)]
        for name, dtype in _COLUMN_DTYPES.items():
            values[name] = _as_columns(values[name], name, dtype, uids)
        values["status"] = _statuses(values["status"], uids)
        # lists the trajectory changes in place are its own: ``columns`` may be kept
        values["call_versions"] = list(map(list, values["call_versions"]))
        values["loss_mask"] = [None if m is None else list(m) for m in values["loss_mask"]]
        try:
            values["version_runs"] = VersionRuns.each(values["version_runs"])
        except (TypeError, ValueError):  # refused by name
            _each(_version_runs, values["version_runs"], uids, "version_runs")
            raise  # pragma: no cover (refused again above)
        if values["replay"].count(None) != n:  # a job that replays nothing has none
            values["replay"] = _each(_replay, values["replay"], uids, "replay")
        keys, new, out = tuple(values), cls.__new__, []
        for row in zip(*values.values()):
            t = new(cls)
            t.__dict__.update(zip(keys, row))
            out.append(t)
        return out


# Trajectory.from_dict: the fields, those without a default, and the defaults (values, or made
# fresh for each trajectory: lists and the mutable version runs)
_FIELDS = {f.name: f for f in fields(Trajectory)}
_REQUIRED = frozenset(n for n, f in _FIELDS.items() if f.default is MISSING and f.default_factory is MISSING)
_PLAIN_DEFAULTS = {n: f.default for n, f in _FIELDS.items() if f.default is not MISSING}
_MADE_DEFAULTS = {n: f.default_factory for n, f in _FIELDS.items() if f.default_factory is not MISSING}
_DTYPE_OF = operator.attrgetter("dtype")
# a status by its saved value, or itself (what ``TrajectoryStatus(value)`` accepts)
_STATUS_OF = {**{s.value: s for s in TrajectoryStatus}, **{s: s for s in TrajectoryStatus}}


def _as_columns(values: list, name: str, dtype: np.dtype, uids: list) -> list:
    """``values`` (field ``name`` of trajectories ``uids``) as columns of ``dtype``: the list itself
    when every one already is one, as a restore's are."""
    if set(map(type, values)) <= {Column} and set(map(_DTYPE_OF, values)) <= {dtype}:
        return values
    convert = _TOKEN_COLUMNS[name]
    return [v if type(v) is Column and v.dtype == dtype else convert(v, f"{uid}: {name}")
            for v, uid in zip(values, uids)]


def _statuses(values: list, uids: list) -> list[TrajectoryStatus]:
    try:
        return list(map(_STATUS_OF.__getitem__, values))
    except (KeyError, TypeError):  # none: refused by name
        return _each(TrajectoryStatus, values, uids, "status")


def _version_runs(value: Any) -> VersionRuns:
    return value if isinstance(value, VersionRuns) else VersionRuns.of(value)


def _replay(value: Any) -> TokenReplay | None:
    return value if value is None or isinstance(value, TokenReplay) else TokenReplay.from_dict(value)


def _each(convert: Any, values: list, uids: list, name: str) -> list:
    """``convert`` of each of ``values`` (the field ``name`` of trajectories ``uids``); an error
    names the trajectory whose value it refused."""
    try:
        return list(map(convert, values))
    except (TypeError, ValueError):
        for value, uid in zip(values, uids):
            try:
                convert(value)
            except (TypeError, ValueError) as e:
                raise (TypeError if isinstance(e, TypeError) else ValueError)(
                    f"trajectory {uid!r}: {name}: {e}") from e
        raise  # pragma: no cover (a value refused once is refused again)


@dataclass
class Group:
    """All ``n_samples_per_prompt`` trajectories of one prompt.

    ``payload`` is opaque to the scheduler and buffer: the slime adapter keeps the prompt's slime
    ``Sample`` objects (label, metadata, ...) there, so they come back out with the group. It must be
    JSON-serialisable for the buffer to be saved (the adapter stores ``Sample.to_dict()`` output).
    """

    uid: str
    prompt_ids: Column  # int32, shared with the trajectories (immutable); assign any sequence
    trajectories: list[Trajectory]
    created_version: int = 0  # policy version when the group was first scheduled
    payload: Any = None
    restarts: int = 0  # times the group was restarted from its prompt for staleness
    # times the group was suspended at a step's target (aborted with work left, carried over)
    interruptions: int = 0

    @property
    def complete(self) -> bool:
        return all(t.status.finished for t in self.trajectories)

    def unfinished(self) -> list[Trajectory]:
        return [t for t in self.trajectories if not t.status.finished]

    def finished(self) -> list[Trajectory]:
        return [t for t in self.trajectories if t.status.finished]

    def masked(self) -> list[Trajectory]:
        """Members masked out of the group (``TrajectoryStatus.FAILED``)."""
        return [t for t in self.trajectories if t.status is TrajectoryStatus.FAILED]

    def staleness(self, current_version: int) -> int:
        return max((t.staleness(current_version) for t in self.trajectories), default=0)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "prompt_ids":
            value = token_column(value, f"group {self.__dict__.get('uid', '?')}: prompt_ids")
        object.__setattr__(self, name, value)

    def to_dict(self, *, shared: bool = False) -> dict[str, Any]:
        """Plain data, or with ``shared`` the columns themselves (``Trajectory.to_dict``)."""
        return {
            "uid": self.uid,
            "prompt_ids": self.prompt_ids if shared else self.prompt_ids.tolist(),
            "trajectories": [t.to_dict(shared=shared) for t in self.trajectories],
            "created_version": self.created_version,
            "payload": self.payload,
            "restarts": self.restarts,
            "interruptions": self.interruptions,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Group:
        d = dict(d)
        d["trajectories"] = [Trajectory.from_dict(t) for t in d["trajectories"]]
        return cls(**d)

    @classmethod
    def from_columns(cls, groups: list[dict[str, Any]], columns: dict[str, list]) -> list[Group]:
        """The groups of ``groups``, whose ``"trajectories"`` each say how many of the trajectories
        of ``columns`` (``Trajectory.from_columns``), in order, are theirs."""
        counts = [g["trajectories"] for g in groups]
        if not all(type(n) is int and n >= 0 for n in counts):
            raise ValueError("a group's trajectory count is not an integer >= 0")
        trajectories = Trajectory.from_columns(columns) if columns else []
        if sum(counts) != len(trajectories):
            raise ValueError(f"the groups count {sum(counts)} trajectories, the columns hold {len(trajectories)}")
        out, start, new = [], 0, cls.__new__
        for group, count in zip(groups, counts):
            # filled whole, as ``Trajectory.from_dict`` fills a trajectory: ``__init__``'s assignments
            # would each call ``__setattr__``; its one conversion (the prompt) is made here
            names = group.keys()
            if not names <= _GROUP_FIELDS.keys() or not names >= _GROUP_REQUIRED:
                unknown, missing = sorted(names - _GROUP_FIELDS.keys()), sorted(_GROUP_REQUIRED - names)
                raise TypeError(f"group {group.get('uid')!r}: unknown fields {unknown}, missing fields {missing}")
            g = new(cls)
            g.__dict__.update(_GROUP_DEFAULTS)
            g.__dict__.update(group)
            g.trajectories = trajectories[start:start + count]
            if type(g.prompt_ids) is not Column or g.prompt_ids.dtype != TOKEN_DTYPE:
                g.prompt_ids = g.prompt_ids  # converted by __setattr__
            out.append(g)
            start += count
        return out


_GROUP_FIELDS = {f.name: f for f in fields(Group)}
_GROUP_REQUIRED = frozenset(n for n, f in _GROUP_FIELDS.items() if f.default is MISSING)
_GROUP_DEFAULTS = {n: f.default for n, f in _GROUP_FIELDS.items() if f.default is not MISSING}
