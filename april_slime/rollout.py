"""slime's plugin point for rollouts: the rollout function and the per-job runtime behind it.

Use in a slime job::

    --rollout-function-path april_slime.rollout.generate_rollout
    --data-source-path april_slime.rollout.AprilDataSource
    --custom-config-path april.yaml          # april_* settings

``generate_rollout`` runs one training step through the scheduler (``april_slime.core.scheduler``)
on a runtime built once per data source (``_Runtime``: the engine client, the scheduler, slime's
reward and filter hooks), on slime's event loop or the plugin's own (``april_slime.event_loop``). The data source
(``AprilDataSource``, re-exported here) is ``april_slime.data_source``; the slime ``Sample`` codec
is ``april_slime.samples``. Everything slime-specific is imported lazily, so the module imports
without slime and fails with a clear ``ImportError`` only on a path that needs it.

Policy versions. slime's trainer counts weight updates (``weight_updater.weight_version``, starting
at ``--update-weight-start-version``, default 0, +1 per ``update_weights``) and pushes the count to
the engines with every update. The engine-reported number is the policy version used here
(``april_slime.core.connection``): it is what actually generated each token, also under
``train_async.py`` where several rollout ids can share one version. ``rollout_id`` is not used,
because it is not the policy that generated a token. The data source saves the last version with
the buffer, so a restored job continues the saved numbering.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import threading
import uuid
from collections import Counter
from typing import TYPE_CHECKING, Any

from april_slime import model_files
from april_slime.core.config import AprilConfigError
from april_slime.core.connection import EngineConnection
from april_slime.core.episodes import EpisodeRunner
from april_slime.core.front import EpisodeFront
from april_slime.core.keys import METRIC_PREFIX
from april_slime.core.types import Group, TrajectoryStatus
from april_slime.data_source import AprilDataSource, load_config
from april_slime.event_loop import run_on_loop
from april_slime.generate_functions import GenerateFunctions
from april_slime.masking import is_masked, masked_reward
from april_slime.samples import leaves, one_shape

if TYPE_CHECKING:
    from april_slime.core.engine import EngineClient

logger = logging.getLogger(__name__)

__all__ = [
    "AprilDataSource",
    "generate_rollout",
    "load_config",
    "shutdown",
]


# ====================================================================== the per-job runtime
class _Runtime:
    """Everything built once per process for the training rollouts of one data source."""

    def __init__(self, data_source: AprilDataSource) -> None:
        self.data_source = data_source
        self.job = data_source.job
        self.config = data_source.config
        self.slime = data_source.slime
        self.codec = data_source.codec
        self.engines: EngineConnection | None = None  # at the first step (the tokenizer is read then)
        self.scheduler = None
        slime_args = self.job.slime
        self.filter_fn = (self.slime.load_function(slime_args.dynamic_sampling_filter_path)
                          if slime_args.dynamic_sampling_filter_path else None)
        self.filter_drops: Counter[str] = Counter()
        self.current_version: int | None = None
        # jobs with a custom generate function: its episodes, and the front their calls reach
        self.functions = (GenerateFunctions(self.slime, self.job, self.codec)
                          if slime_args.custom_generate_function_path else None)
        self.episodes: EpisodeRunner | None = None
        self.front: EpisodeFront | None = None

    @property
    def client(self) -> EngineClient | None:
        """The engine client of the latest step (None before the first)."""
        return self.engines.client if self.engines is not None else None

    async def _start_episodes(self) -> None:
        """Once per job, on the persistent loop: the runner of its episodes and the front (on
        127.0.0.1) that their generate functions call instead of slime's router."""
        if self.functions is None or self.episodes is not None:
            return
        config = self.config
        self.episodes = EpisodeRunner(self.functions, max_failures=config.max_episode_failures,
                                      tool_timeout_s=config.episode_tool_timeout_s,
                                      max_given_up_in_a_row=config.max_given_up_in_a_row,
                                      restored=self.data_source.restored_episodes,
                                      mask_failed=config.mask_failed_samples)
        self.front = EpisodeFront(self.episodes, tokenize=self.functions.tokenize,
                                  vocab_size=self._engines().vocab_size,
                                  default_max_new_tokens=self.job.slime.rollout_max_response_len)
        await self.front.start()
        self.functions.point_at(self.front.host, self.front.port)

    def _engines(self) -> EngineConnection:
        if self.engines is None:
            slime_args = self.job.slime
            self.engines = EngineConnection(
                slime_args.router_url, self.config, hints=slime_args.deployment_hints,
                expected_engines=slime_args.engines_started, replay=self.job.replay,
                vocab_size=model_files.vocab_size(slime_args.hf_checkpoint, self.codec.tokenizer),
                sampling_params=self.job.sampling_params)
        return self.engines

    async def _check_replay_support(self, client: EngineClient) -> None:
        """A job that replays routed experts, top-p kept ids or the sampler's top-k needs engines that
        return them: one one-token call per set of engines says so before any work, instead of a
        failed call per request. An engine that cannot stops the job with one line naming the key."""
        if not self.job.replay.active:
            return
        from april_slime.core.sglang_protocol import ReplayReplyError

        try:
            await client.generate(client.engine_urls[0], [0], max_new_tokens=1,
                                  rid=f"april-replay-check-{uuid.uuid4().hex}",
                                  sampling_params=dict(self.job.sampling_params), sampling_seed=0)
        except ReplayReplyError as e:
            raise AprilConfigError(f"{REPLAY_KEYS[e.part]}: the rollout engines do not return what training "
                                   f"replays: {e}") from None

    def _build_scheduler(self):
        from april_slime.core.scheduler import assemble_scheduler

        slime_args = self.job.slime
        return assemble_scheduler(
            self.config, self.engines.client, self.data_source.buffer,
            rollout_batch_size=slime_args.rollout_batch_size,
            n_samples_per_prompt=slime_args.n_samples_per_prompt,
            sampling_params=dict(self.job.sampling_params),
            reward_fn=self._reward_group,
            group_filter=self._keep_group if self.filter_fn is not None else None,
            over_sampling_batch_size=slime_args.explicit_over_sampling,
            eos_token_id=model_files.eos_token_ids(slime_args.hf_checkpoint, self.codec.tokenizer),
            episodes=self.episodes,
        )

    # ------------------------------------------------------------ slime hooks used by the scheduler
    async def _hooked(self, sample: Any) -> Any:
        hooks = self.slime.apply_rollout_sample_hooks
        return await hooks(self.job.args, sample, evaluation=False) if hooks is not None else sample

    async def _samples(self, group: Group) -> list[Any]:
        return [await self._hooked(s) for s in self.codec.samples(group, self.current_version)]

    async def _reward_group(self, group: Group) -> None:
        """slime's reward path (``async_rm`` per sample, ``batched_async_rm`` with --group-rm over
        every sample of the group); a reward already set (kept through ``add_samples``, or set by a
        generate function) is not recomputed, as in slime. An episode that returned list[Sample]
        gets the list of its samples' rewards."""
        entries = await self._samples(group)
        args, slime_args = self.job.args, self.job.slime
        # (trajectory, its samples, which of them need a reward); a masked member has its placeholder
        shapes = [(t, e if isinstance(e, list) else [e]) for t, e in zip(group.trajectories, entries)
                  if t.status is not TrajectoryStatus.FAILED]
        for t in group.masked():
            t.reward = masked_reward(slime_args.reward_key)
        group_rm = slime_args.group_rm
        todo = [(t, n, s) for t, samples in shapes for n, s in enumerate(samples)
                if group_rm or (t.reward is None and (t.episode_samples is None or s.reward is None))]
        if group_rm:
            rewards = await self.slime.batched_async_rm(args, [s for _, _, s in todo])
        else:
            rewards = await asyncio.gather(*(self.slime.async_rm(args, s) for _, _, s in todo))
        new = {}
        for (t, n, _), reward in zip(todo, rewards, strict=True):
            if reward is None:
                raise ValueError(f"reward function returned None for sample {t.uid}")
            new[(t.uid, n)] = reward
        for t, samples in shapes:
            if t.episode_samples is None:
                if (t.uid, 0) in new:
                    t.reward = new[(t.uid, 0)]
            elif t.reward is None or group_rm:
                t.reward = [new.get((t.uid, n), s.reward) for n, s in enumerate(samples)]

    def _keep_group(self, group: Group) -> bool:
        """slime's dynamic sampling filter, ``f(args, samples) -> DynamicFilterOutput | bool``.
        ``keep_when_insufficient`` has no effect: the scheduler keeps generating until the batch is
        full, so dropping a group never leaves the batch short."""
        samples = [s for s in leaves(self.codec.samples(group, self.current_version)) if not is_masked(s)]
        output = self.slime.call_dynamic_filter(self.filter_fn, self.job.args, samples)
        if not output.keep and output.reason:
            self.filter_drops[output.reason] += 1
        return bool(output.keep)

    # ------------------------------------------------------------ one step
    async def train_step(self, rollout_id: int):
        await self._start_episodes()
        engines = self._engines()
        if await engines.refresh(check_new=self._check_replay_support):
            self.scheduler = self._build_scheduler()
        version = await engines.policy_version(self.scheduler.health.usable(),
                                               self.data_source.restored_policy_version)
        self.current_version = version
        self.data_source.policy_version = version
        self.filter_drops.clear()
        result = await self.scheduler.run_step(self.data_source, version)
        expected = self.job.slime.rollout_batch_size
        if len(result.groups) != expected:
            raise RuntimeError(f"rollout {rollout_id}: scheduler returned {len(result.groups)} groups, "
                               f"expected rollout_batch_size={expected}")
        groups = []
        for group in result.groups:
            if not group.complete:
                raise RuntimeError(f"rollout {rollout_id}: group {group.uid} returned incomplete")
            groups.append([await self._hooked(s) for s in self.codec.samples(group, version)])
        groups.sort(key=lambda g: leaves(g)[0].index)
        groups = one_shape(groups)
        metrics = dict(result.metrics)
        metrics.update({f"rollout/dynamic_filter/drop_{r}": c for r, c in self.filter_drops.items()})
        metrics[METRIC_PREFIX + "masked_samples"] = sum(len(g.masked()) for g in result.groups)
        metrics[METRIC_PREFIX + "policy_version"] = version
        metrics[METRIC_PREFIX + "version_offset"] = engines.version_offset
        # what save(rollout_id) writes, also after rollout_id + 1 ran; taken here, on the loop, because
        # episodes go on between steps on this loop (a function returning fills its member)
        self.data_source.snapshot(rollout_id)
        return groups, metrics

    async def close(self) -> None:
        if self.episodes is not None:  # first: its calls' requests then end, and the front closes at once
            await self.episodes.close()
            self.episodes = None
        if self.front is not None:
            await self.front.close()
            self.front = None
        if self.engines is not None:
            await self.engines.close()


# the slime argument that asks for each part of the replay data (core.replay_wire's parts)
REPLAY_KEYS = {"routed_experts": "use_rollout_routing_replay", "top_p_ids": "rollout_top_p",
               "top_p_log_probs": "use_score_centering", "sampler_topk": "use_score_centering"}


# ====================================================================== slime's entry points
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
            run_on_loop(_RUNTIME.close())
        _RUNTIME = _Runtime(data_source)
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
    samples, metrics = run_on_loop(runtime.train_step(rollout_id))  # snapshots the data source
    output_cls = runtime.slime.RolloutFnTrainOutput
    # slime builds older than RolloutFnTrainOutput take the bare sample groups
    return output_cls(samples=samples, metrics=metrics) if output_cls is not None else samples


def shutdown() -> None:
    """Close the engine client of this process (slime never calls this; tests and tools do)."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is not None:
            run_on_loop(_RUNTIME.close())
            _RUNTIME = None
