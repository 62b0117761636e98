"""slime's custom generate functions under partial rollout: multi-turn, tool-using and agent jobs.

A job with ``--custom-generate-function-path`` (or a prompt with ``Sample.generate_function_path``)
gets one episode per sample (``april_slime.core.episodes``). Its function runs unchanged:
``await generate(args, sample, sampling_params[, evaluation=False])`` on the job's persistent event
loop, with

* ``args``: slime's arguments, except that ``sglang_router_ip`` / ``sglang_router_port`` name the
  plugin's front (``core.front``, on 127.0.0.1) and ``partial_rollout`` is False: the plugin aborts
  and resumes the function's model calls under it, so the function never sees an abort it caused;
* ``sampling_params``: slime's rollout parameters (as its ``GenerateState`` builds them, with
  ``max_new_tokens = rollout_max_response_len``), the sample's ``sampling_seed``, and the episode's
  marker in ``custom_params``, which the front reads to know whose call a request is. A function
  must pass these parameters on to ``/generate`` (changed as it likes: stop strings, budgets).

``GenerateFunctions`` is the ``EpisodeAgent`` the core runs, the slime side of it: it loads and
starts a function (``launch``), decodes tokens with the job's tokenizer for the reply the core
builds (``reply``: ``core.front.sglang_reply``, the wire of an episode's calls in one place), and
turns the returned ``Sample`` into the member's record (``finish``). The function does not copy
versions into its sample: each model token of the response is matched, in order, against the tokens
the plugin served the episode (``core.served``); a response whose trainable tokens are not exactly
those fails loudly (the episode is re-run, then given up). A function may return ``list[Sample]``
(slime's compact shape): each sample's trainable tokens are then whole calls' outputs in call order,
and together the samples hold every call's output. With ``--use-rollout-routing-replay`` each
returned sample's routed experts are stitched over the calls that ran its tokens
(``core.served.served_routed``; the rule, and why, in ``core.replay``).
"""

from __future__ import annotations

import copy
import inspect
from typing import TYPE_CHECKING, Any

from april_slime.core.config import AprilConfigError
from april_slime.core.episodes import Episode, EpisodeError, EpisodeRefused, ModelCall
from april_slime.core.front import EPISODE_MARKER, sglang_reply
from april_slime.core.replay import TokenReplay
from april_slime.core.served import match_calls, match_served, release_routed, served_routed, served_sampler
from april_slime.core.types import Group, Trajectory, TrajectoryStatus
from april_slime.core.versions import VersionRuns
from april_slime.samples import SampleCodec, Slime, plain

if TYPE_CHECKING:
    from april_slime.job import SlimeJob


def load_generate_function(slime: Slime, path: str, key: str) -> Any:
    """The function at ``path``, checked to have slime's contract; else ``AprilConfigError`` naming
    ``key`` in one line (a job with a path that cannot serve stops at start)."""
    try:
        fn = slime.load_function(path)
    except Exception as e:
        reason = f"{type(e).__name__}: {e}".replace("\n", " ")
        raise AprilConfigError(f"{key}: cannot load {path!r}: {reason}") from e
    if not inspect.iscoroutinefunction(fn):
        raise AprilConfigError(f"{key}: {path!r} is not an async function "
                               "(async def generate(args, sample, sampling_params))")
    if len(inspect.signature(fn).parameters) < 3:
        raise AprilConfigError(f"{key}: {path!r} must take (args, sample, sampling_params)")
    return fn


class GenerateFunctions:
    """Runs a job's custom generate functions as episodes (``core.episodes.EpisodeAgent``)."""

    def __init__(self, slime: Slime, job: SlimeJob, codec: SampleCodec) -> None:
        self.slime = slime
        self.job = job
        self.codec = codec
        self.default_path = job.slime.custom_generate_function_path
        spec = job.replay
        self.top_p_replay = spec.top_p  # calls' replies carry their top-p kept ids
        self.replay_spec = spec
        self.routed_width = spec.routed_width  # int32 per routed-experts row; 0: none replayed
        self.sampling_params = {**job.sampling_params, "max_new_tokens": job.slime.rollout_max_response_len}
        self.function_args: Any = None  # set by point_at(front)
        self._functions: dict[str, Any] = {}

    def _function(self, path: str, key: str) -> Any:
        if path not in self._functions:
            self._functions[path] = load_generate_function(self.slime, path, key)
        return self._functions[path]

    def point_at(self, host: str, port: int) -> None:
        """Functions get slime's arguments with the router address replaced by the front's."""
        self.function_args = self.job.args_for_functions(host, port)

    # ------------------------------------------------------------------ tokens
    def tokenize(self, text: str) -> list[int]:
        """As SGLang tokenizes a text prompt (its tokenizer's defaults, special tokens included)."""
        return list(self.codec.tokenizer(text)["input_ids"])

    def _decode(self, ids: list[int], params: dict) -> str:
        return self.codec.tokenizer.decode(
            ids, skip_special_tokens=bool(params.get("skip_special_tokens", True)),
            spaces_between_special_tokens=bool(params.get("spaces_between_special_tokens", True)))

    # ------------------------------------------------------------------ EpisodeAgent
    def _path(self, sample: Any) -> str | None:
        return getattr(sample, "generate_function_path", None) or self.default_path

    def function_name(self, member: Trajectory, group: Group) -> str:
        return f"generate function {self._path(self.codec.prompt_sample(group, member))}"

    def launch(self, member: Trajectory, group: Group):
        sample = self.codec.prompt_sample(group, member)
        path = self._path(sample)
        if not path:
            raise EpisodeError(f"sample {member.uid}: no generate function (custom_generate_function_path)")
        fn = self._function(path, f"sample {member.uid}: generate_function_path")
        params = copy.deepcopy(self.sampling_params)
        params["sampling_seed"] = member.sampling_seed
        params["custom_params"] = {**(params.get("custom_params") or {}), EPISODE_MARKER: member.uid}
        if "evaluation" in inspect.signature(fn).parameters:
            return fn(self.function_args, sample, params, evaluation=False)
        return fn(self.function_args, sample, params)

    def reply(self, call: ModelCall) -> dict:
        return sglang_reply(call, self._decode, routed_width=self.routed_width, top_p=self.top_p_replay)

    def finish(self, member: Trajectory, episode: Episode, result: Any) -> None:
        if isinstance(result, list):
            self._finish_fanout(member, episode, result)
            return
        status, response, mask, logprobs = self._checked(member.uid, result)
        versions = match_served(member.uid, response, mask, logprobs, episode.served)
        member.response_ids, member.logprobs = response, [float(x) for x in logprobs]
        member.loss_mask = mask
        member.version_runs = VersionRuns.from_versions(versions)
        member.replay = self._replay(member.uid, result, mask, episode.served, episode.served)
        member.max_new_tokens = max(member.max_new_tokens, len(response))
        member.call_versions = [v for c in episode.served for v in c.trajectory.call_versions]
        member.num_calls = sum(c.trajectory.num_calls for c in episode.served)
        member.num_aborts = sum(c.trajectory.num_aborts for c in episode.served)
        member.status = TrajectoryStatus[status]
        member.finish_reason = "length" if status == "TRUNCATED" else "stop"
        member.reward = result.reward
        member.episode_sample = plain(self.codec.sample_dict(result))
        release_routed(episode.served)

    def _finish_fanout(self, member: Trajectory, episode: Episode, results: list) -> None:
        """slime's compact shape: one episode, several training samples (e.g. one per turn, each
        with the conversation before it as its prompt). Each sample's trainable tokens must be the
        whole outputs of some of the episode's calls, in call order, and every call's tokens must
        reach a sample. The member keeps every model token the episode generated (for staleness and
        the step's counts); each sample keeps its own per-token versions."""
        if not results:
            raise EpisodeError(f"sample {member.uid}: the generate function returned an empty list")
        rollout_ids = [getattr(r, "rollout_id", None) for r in results]
        if len(results) > 1 and hasattr(results[0], "rollout_id") and (None in rollout_ids
                                                                       or len(set(rollout_ids)) > 1):
            raise EpisodeError(f"sample {member.uid}: the {len(results)} samples of one episode must share one "
                               f"Sample.rollout_id, so that slime's loss counts the episode once; got {rollout_ids}")
        served = episode.served
        used: set[int] = set()
        entries, statuses = [], []
        for n, result in enumerate(results):
            where = f"{member.uid}[{n}]"
            status, response, mask, logprobs = self._checked(where, result)
            try:
                # calls no earlier sample holds first: concurrent calls (one per agent) can return
                # the same tokens, and each must reach its own sample
                versions, calls = match_calls(where, response, mask, logprobs, served, skip=used)
            except EpisodeError:
                versions, calls = match_calls(where, response, mask, logprobs, served)
            used.update(calls)
            statuses.append(status)
            entries.append({"sample": plain(self.codec.sample_dict(result)),
                            "version_runs": VersionRuns.from_versions(versions).plain(),
                            "call_versions": [v for k in calls for v in served[k].trajectory.call_versions],
                            "num_calls": sum(served[k].trajectory.num_calls for k in calls),
                            "num_aborts": sum(served[k].trajectory.num_aborts for k in calls),
                            "replay": _as_dict(self._replay(where, result, mask, [served[k] for k in calls],
                                                            served))})
        unused = [k for k, c in enumerate(served) if c.trajectory.response_ids and k not in used]
        if unused:
            raise EpisodeError(f"sample {member.uid}: the tokens of model call(s) {unused} of {len(served)} reach "
                               "none of the returned samples; a generate function must keep every call's output_ids")
        member.response_ids = [i for c in served for i in c.trajectory.response_ids]
        member.logprobs = [float(lp) for c in served for lp in c.trajectory.logprobs]
        member.loss_mask = None
        member.version_runs = VersionRuns().extend_runs(r for c in served for r in c.trajectory.version_runs)
        # what the member holds, for the checks of a restored checkpoint (each sample has its own)
        member.replay = self._sampler([1] * len(member.response_ids), served)
        member.max_new_tokens = max(member.max_new_tokens, len(member.response_ids))
        member.call_versions = [v for c in served for v in c.trajectory.call_versions]
        member.num_calls = sum(c.trajectory.num_calls for c in served)
        member.num_aborts = sum(c.trajectory.num_aborts for c in served)
        truncated = "TRUNCATED" in statuses
        member.status = TrajectoryStatus.TRUNCATED if truncated else TrajectoryStatus.COMPLETED
        member.finish_reason = "length" if truncated else "stop"
        rewards = [r.reward for r in results]
        member.reward = None if any(r is None for r in rewards) else plain(rewards)
        member.episode_samples = entries
        release_routed(served)

    def _replay(self, where: str, result: Any, mask: list[int], calls: list[ModelCall],
                served: list[ModelCall]) -> TokenReplay | None:
        """What training replays of one returned sample, from the calls whose tokens it holds (in
        order) and the episode's other ``served`` calls that ran a prefix of it."""
        replay = self._sampler(mask, calls)
        if self.routed_width:
            replay = replay if replay is not None else TokenReplay()
            replay.routed_width = self.routed_width
            replay.routed = served_routed(where, list(result.tokens), mask, calls, served, self.routed_width)
        return replay

    def _sampler(self, mask: list[int], calls: list[ModelCall]) -> TokenReplay | None:
        """The top-p kept ids and sampler top-k rows of a response, from the calls that served it."""
        spec = self.replay_spec
        if not (spec.top_p or spec.topk):
            return None
        return served_sampler(mask, calls, spec)

    def _checked(self, where: str, result: Any) -> tuple[str, list[int], list[int], list[float]]:
        """A returned sample's status, response tokens, loss mask and log-probs, or ``EpisodeError``."""
        Sample = self.slime.Sample
        if not isinstance(result, Sample):
            raise EpisodeError(f"sample {where}: the generate function returned {type(result).__name__}, "
                               "not a Sample")
        status = _status_name(Sample, where, result.status)
        if status not in ("COMPLETED", "TRUNCATED"):
            raise EpisodeError(f"sample {where}: the generate function returned a sample with status {status}")
        result.status = Sample.Status[status]  # as trained (slime's Sample.to_dict needs a member)
        length = int(result.response_length or 0)
        response = list(result.tokens[len(result.tokens) - length:]) if length else []
        mask = list(result.loss_mask) if result.loss_mask is not None else [1] * length
        if result.rollout_log_probs is None and length:
            raise EpisodeRefused(NO_ROLLOUT_LOG_PROBS.format(where=where, n=length))
        logprobs = list(result.rollout_log_probs) if result.rollout_log_probs is not None else None
        if len(mask) != length or logprobs is None or len(logprobs) != length:
            raise EpisodeError(f"sample {where}: response of {length} tokens with a loss mask of "
                               f"{len(mask)} and {0 if logprobs is None else len(logprobs)} log-probs")
        return status, response, mask, logprobs


def _status_name(Sample: Any, where: str, status: Any) -> str:
    """The name of a returned sample's status. slime compares statuses with its ``Sample.Status``
    members and otherwise trains the sample as it is, so a function may set a string (tau-bench sets
    ``"completed"``, ``"truncated"``, ``"aborted"``): a string naming a truncation is TRUNCATED; any
    other value of ``Sample.Status`` is trained as COMPLETED, as slime trains it (it is not its
    ``ABORTED`` member, so slime neither re-runs nor drops it)."""
    if isinstance(status, str):
        values = {s.value: s.name for s in Sample.Status}
        name = values.get(status.lower()) or (status.upper() if status.upper() in Sample.Status.__members__ else None)
        if name is None:
            raise EpisodeError(f"sample {where}: status {status!r} is none of slime's Sample.Status values "
                               f"{sorted(values)}")
        return "TRUNCATED" if name == "TRUNCATED" else "COMPLETED"
    return status.name


NO_ROLLOUT_LOG_PROBS = (
    "sample {where}: a response of {n} tokens and no rollout_log_probs; under the plugin a generate "
    "function must keep each model call's output_ids and output_token_logprobs in its sample (slime's "
    "Sample.append_response_tokens does), since every trained token's log-prob and policy version are "
    "those of the call that served it (a function that trains re-tokenized text, as slime's tau-bench "
    "does, cannot run under partial rollout)")


def _as_dict(replay: TokenReplay | None) -> dict | None:
    return replay.to_dict() if replay is not None else None
