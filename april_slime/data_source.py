"""slime's data source for the plugin (``AprilDataSource``) and the rollout side's settings check.

slime jobs name it through the rollout module, ``--data-source-path april_slime.rollout.AprilDataSource``,
which re-exports it. It joins slime's prompts (slime's own ``RolloutDataSource``, inside), the
partial buffer the scheduler resumes from, and their checkpoints: the save and load order lives in
``april_slime.core.checkpoint``; this class keeps slime's ``save(rollout_id)`` / ``load(rollout_id)``
and the policy versions the rollout function sets.
"""

from __future__ import annotations

import logging
from typing import Any

from april_slime import job_checks, slime_compat
from april_slime.core import checkpoint
from april_slime.core.buffer import PartialBuffer
from april_slime.core.config import AprilConfig
from april_slime.core.replay import TokenReplay
from april_slime.core.types import Group
from april_slime.generate_functions import load_generate_function
from april_slime.job import SlimeJob, describe
from april_slime.samples import SampleCodec, Slime, leaves

logger = logging.getLogger(__name__)


def rollout_job(args: Any) -> SlimeJob:
    """The job, read and checked for the plugin's rollout.

    Any problem raises ``AprilConfigError`` with one line naming the key, which stops the job at
    start (the data source is built when slime's rollout manager starts, before the trainer and the
    first rollout): every refusal that needs only the settings and slime's arguments runs here
    (``april_slime.job_checks``), the loss hooks' and VCPO's included.
    """
    job = describe(args)
    job_checks.check_rollout(job.slime)
    for note in slime_compat.notes(job.slime):
        logger.warning("april_slime: %s", note)
    return job


def load_config(args: Any) -> AprilConfig:
    """The validated rollout settings of a slime job (``rollout_job(args).rollout``)."""
    return rollout_job(args).rollout


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
        self.job = rollout_job(args)
        self.config = self.job.rollout
        self.slime = Slime()
        self.codec = SampleCodec(self.slime, self.config, self.job.slime, self.job.replay)
        self.generate_function_path = self.job.slime.custom_generate_function_path
        if self.generate_function_path:
            load_generate_function(self.slime, self.generate_function_path, "custom_generate_function_path")
        self._prompts = self.slime.RolloutDataSource(args)
        self.buffer = PartialBuffer.from_config(self.config)
        # policy version of the latest training step (saved with the buffer)
        self.policy_version: int | None = None
        # version saved by the checkpoint this job was restored from; consumed by the first step
        self.restored_policy_version: int | None = None
        self._checkpoints = checkpoint.Checkpoints(
            self._prompts, self.buffer, save_dir=self.job.slime.save, load_dir=self.job.slime.load,
            buffer_dir=self.config.buffer_dir, rollout_shuffle=bool(self.job.slime.rollout_shuffle))
        # members of unfinished episodes that load() restored (see _restart_unfinished_episodes); the
        # job's episode runner shares this set, so it is only ever changed in place
        self.restored_episodes: set[str] = set()

    # ------------------------------------------------------------ PromptSource
    def next_groups(self, n: int, current_version: int) -> list[Group]:
        if n <= 0:
            return []
        return [self.codec.new_group(samples, current_version) for samples in self._prompts.get_samples(n)]

    # ------------------------------------------------------------ slime DataSource
    def get_samples(self, num_samples: int) -> list[list[Any]]:
        version = self.policy_version or 0
        groups = self.buffer.take(num_samples, version)
        out = []
        for group in groups:
            samples = self.codec.samples(group, None)
            for s in leaves(samples):
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
        groups = [self.codec.group_from_samples(group, version) for group in samples]
        for group in groups:
            self.buffer.put(group)

    def __len__(self) -> int:
        return len(self._prompts)

    # ------------------------------------------------------------ checkpoints
    # The design (what is saved, when, which file wins, what a kill leaves) and its order are
    # april_slime.core.checkpoint's; these are the calls slime and the rollout function make.
    def snapshot(self, rollout_id: int) -> None:
        """Record the state as of the end of rollout ``rollout_id``; ``save(rollout_id)`` writes it
        even when a later rollout has run in between (slime's train_async.py)."""
        self._checkpoints.snapshot(rollout_id, self.policy_version)

    def save(self, rollout_id: int) -> None:
        """Write checkpoint ``rollout_id`` (slime calls it right after saving the model)."""
        self._checkpoints.save(rollout_id, self.policy_version)

    def load(self, rollout_id: int | None = None) -> None:
        """Restore checkpoint ``rollout_id``: all of it, or stop the job naming the file."""
        restored = self._checkpoints.load(rollout_id)
        if restored is not None:
            self.policy_version = self.restored_policy_version = restored.policy_version
            self._restart_unfinished_episodes()
            self._restart_without_replay()

    def _restart_unfinished_episodes(self) -> None:
        """In a job with a generate function every member is an episode's record. A checkpoint keeps
        the finished ones (their data is complete); an unfinished one lost its live state (coroutine,
        pending call) with the job that saved it, so it starts again from its prompt. It is reset here,
        before any step sees it (a checkpoint of the same job run without its generate function holds
        partial responses), and named to the episode runner, which counts it as ``restarted`` when a
        step first opens it."""
        self.restored_episodes.clear()
        if not self.generate_function_path:
            return
        for group in self.buffer.groups():
            for member in group.unfinished():
                member.reset()
                self.restored_episodes.add(member.uid)

    def _restart_without_replay(self) -> None:
        """A checkpoint saved by a job that replayed less (or another model) holds responses whose
        routed experts or top-p kept ids are unknown: they restart from their prompts, as training
        could not replay them. Replay data this job does not use is dropped (it can be large)."""
        spec = self.codec.replay
        restarted = 0
        for group in self.buffer.groups():
            for t in group.trajectories:
                if not spec.active:
                    t.replay = None
                    for entry in t.episode_samples or []:
                        entry["replay"] = None
                elif t.response_ids and not _holds_replay(t, spec):
                    t.reset()
                    restarted += 1
                    if self.generate_function_path:
                        self.restored_episodes.add(t.uid)
        if restarted:
            logger.warning("%d buffered samples hold no routed experts / top-p kept ids for what they "
                           "generated; they restart from their prompts", restarted)


def _holds_replay(t: Any, spec: Any) -> bool:
    """Whether a buffered trajectory holds what ``spec`` replays for each sample it trains as: its
    own tokens, an episode's returned sample's, or each of a fan-out's samples'."""
    if t.episode_samples is not None:
        return all(_covers(entry.get("replay"), spec, entry["sample"]) for entry in t.episode_samples)
    if t.episode_sample is not None:
        return _covers(t.replay, spec, t.episode_sample)
    return t.replay is not None and t.replay.covers(spec, len(t.prompt_ids), t.response_length) is None


def _covers(replay: Any, spec: Any, sample: dict) -> bool:
    if replay is None:
        return False
    if isinstance(replay, dict):
        try:
            replay = TokenReplay.from_dict(replay)
        except ValueError:
            return False  # damaged: the sample restarts from its prompt
    tokens, length = len(sample.get("tokens") or []), int(sample.get("response_length") or 0)
    return replay.covers(spec, tokens - length, length) is None
