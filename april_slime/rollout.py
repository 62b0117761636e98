"""slime's plugin point for rollouts: the rollout function and the per-job runtime behind it.

Use in a slime job::

    --rollout-function-path april_slime.rollout.generate_rollout
    --data-source-path april_slime.rollout.AprilDataSource
    --custom-config-path april.yaml          # april_* settings

``generate_rollout`` runs one training step through the scheduler (``april_slime.core.scheduler``)
on a runtime built once per data source (``_Runtime``: the engine client, the scheduler, slime's
reward and filter hooks), on slime's event loop or this module's own. The data source
(``AprilDataSource``, re-exported here) is ``april_slime.data_source``; the slime ``Sample`` codec
is ``april_slime.samples``. Everything slime-specific is imported lazily, so the module imports
without slime and fails with a clear ``ImportError`` only on a path that needs it.

Policy versions. slime's trainer counts weight updates (``weight_updater.weight_version``, starting
at ``--update-weight-start-version``, default 0, +1 per ``update_weights``) and pushes the count to
the engines with every update; SGLang reports it as ``meta_info["weight_version"]`` on each reply
and on ``GET /get_weight_version``. That engine-reported number is the policy version used here: it
is what actually generated each token, also under ``train_async.py`` where several rollout ids can
share one version. ``rollout_id`` is not used, because it is not the policy that generated a token.
The trainer's count restarts after a job restart while the saved buffer keeps the old numbers, so
the data source saves the last version with the buffer and the first step after a restore shifts
the engines' numbers by a constant (``EngineClient.version_offset``) to continue the saved numbering.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import threading
import uuid
from collections import Counter
from typing import TYPE_CHECKING, Any

from april_slime.core.config import AprilConfigError
from april_slime.core.dispatch import DeploymentHints, router_dropped_fields
from april_slime.core.episodes import EpisodeRunner
from april_slime.core.front import EpisodeFront
from april_slime.core.keys import METRIC_PREFIX
from april_slime.core.sglang_protocol import EngineError
from april_slime.core.types import Group, TrajectoryStatus
from april_slime.data_source import AprilDataSource, load_config
from april_slime.generate_functions import GenerateFunctions
from april_slime.masking import is_masked, masked_reward
from april_slime.samples import SampleCodec, leaves, one_shape, slime_attr

if TYPE_CHECKING:
    from april_slime.core.engine import EngineClient

logger = logging.getLogger(__name__)

__all__ = [
    "AprilDataSource",
    "generate_rollout",
    "load_config",
    "shutdown",
]


# ====================================================================== the event loop
def _run_on_loop(coro):
    """Run on slime's persistent event loop when slime is there (its own rollout code and HTTP
    clients live on that loop), else on this module's own persistent loop. A persistent loop is
    needed either way: the engine client's HTTP session is bound to the loop that created it."""
    try:
        run = slime_attr("slime.utils.async_utils", "run")
    except ImportError:
        run = _own_loop().run
    return run(coro)


class _OwnLoop:
    """This module's own persistent event loop, on a daemon thread (for processes without slime)."""

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


# ====================================================================== the per-job runtime
class _Runtime:
    """Everything built once per process for the training rollouts of one data source."""

    def __init__(self, args: Any, data_source: AprilDataSource) -> None:
        self.args = args
        self.data_source = data_source
        self.config = data_source.config
        self.slime = data_source._slime
        self.codec = data_source._codec
        self.router_url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
        self.client: EngineClient | None = None
        self.scheduler = None
        self.version_offset: int | None = None
        self.filter_fn = (self.slime.load_function(args.dynamic_sampling_filter_path)
                          if getattr(args, "dynamic_sampling_filter_path", None) else None)
        self.filter_drops: Counter[str] = Counter()
        self.current_version: int | None = None
        # jobs with a custom generate function: its episodes, and the front their calls reach
        self.functions = (GenerateFunctions(self.slime, args, self.codec, sampling_params(args))
                          if getattr(args, "custom_generate_function_path", None) else None)
        self.episodes: EpisodeRunner | None = None
        self.front: EpisodeFront | None = None

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
                                  vocab_size=_vocab_size(self.codec),
                                  default_max_new_tokens=self.args.rollout_max_response_len)
        await self.front.start()
        self.functions.point_at(self.front.host, self.front.port)

    # ------------------------------------------------------------ engines
    async def _connect(self) -> None:
        """(Re)discover the engines behind slime's router at each step, so engines that slime's
        fault tolerance restarted on new ports are picked up."""
        from april_slime.core.engine import EngineClient, EngineWait

        await self._start_episodes()
        if self.client is None:  # job start: the engines slime started may not be listed yet
            wait = EngineWait(expected=engines_slime_started(self.args), deadline_s=self.config.engine_wait_s,
                              stable_reads=3)
        else:  # later steps take what is listed (an engine slime is restarting joins when listed)
            wait = EngineWait(deadline_s=self.config.engine_wait_s)
        fresh = await EngineClient.from_router(
            self.router_url, dispatch=self.config.dispatch, hints=deployment_hints(self.args), wait=wait,
            timeout_s=self.config.request_timeout_s, max_retries=self.config.max_retries,
            retry_backoff_s=self.config.retry_backoff_s, vocab_size=_vocab_size(self.codec),
            replay=self.codec.replay)
        if self.client is not None and fresh.dispatch == self.client.dispatch:
            await fresh.close()
            return
        try:
            check_router_fields(fresh.dispatch, self.args)
            await self._check_replay_support(fresh)
        except BaseException:
            await fresh.close()
            raise
        if self.client is None or fresh.dispatch.mode != self.client.dispatch.mode:
            logger.info("april_slime: %s", fresh.dispatch.describe())
            for note in fresh.dispatch.notes:
                logger.info("april_slime: %s", note)
        if self.client is not None:
            logger.info("rollout engines changed: %s -> %s", self.client.worker_urls, fresh.worker_urls)
            await self.client.close()
        fresh.version_offset = self.version_offset or 0
        self.client = fresh
        self.scheduler = self._build_scheduler()

    async def _check_replay_support(self, client: Any) -> None:
        """A job that replays routed experts, top-p kept ids or the sampler's top-k needs engines that
        return them: one one-token call per set of engines says so before any work, instead of a
        failed call per request. An engine that cannot stops the job with one line naming the key."""
        spec = self.codec.replay
        if not spec.active:
            return
        from april_slime.core.sglang_protocol import EngineReplyError

        url = client.engine_urls[0]
        try:
            await client.generate(url, [0], max_new_tokens=1, rid=f"april-replay-check-{uuid.uuid4().hex}",
                                  sampling_params=sampling_params(self.args), sampling_seed=0)
        except EngineReplyError as e:
            text = str(e)
            key = ("use_rollout_routing_replay" if "routed_experts" in text else
                   "use_score_centering" if "score centering" in text or "top_logprobs_num" in text else
                   "rollout_top_p")
            raise AprilConfigError(f"{key}: the rollout engines do not return what training replays: {e}") from None

    def _build_scheduler(self):
        from april_slime.core.scheduler import assemble_scheduler

        args = self.args
        return assemble_scheduler(
            self.config, self.client, self.data_source.buffer,
            rollout_batch_size=args.rollout_batch_size,
            n_samples_per_prompt=args.n_samples_per_prompt,
            sampling_params=sampling_params(args),
            reward_fn=self._reward_group,
            group_filter=self._keep_group if self.filter_fn is not None else None,
            over_sampling_batch_size=_explicit_over_sampling(args),
            eos_token_id=_eos_token_ids(self.codec),
            episodes=self.episodes,
        )

    async def _policy_version(self) -> int:
        """The engines' current weight version, in the job's continuous numbering. Asks only the
        engines the scheduler dispatches to, and needs one answer: an engine that stopped
        answering must not hold up the step (the scheduler's health probes bring it back)."""
        usable = self.scheduler.health.usable()
        # the engines out of dispatch are asked only when none in dispatch answers: one of them may
        # be back, and the step's own probes readmit it (else one dead engine would end the job)
        others = [u for u in self.client.engine_urls if u not in usable]
        raw, errors = [], []
        for urls in (usable, others):
            replies = await asyncio.gather(*(self.client.engine_weight_version(u) for u in urls),
                                           return_exceptions=True)
            raw = [r for r in replies if not isinstance(r, BaseException)]
            for url, r in zip(urls, replies):
                if isinstance(r, BaseException):
                    if not isinstance(r, Exception):
                        raise r
                    logger.warning("engine %s did not report its weight version: %s", url, r)
                    errors.append(r)
            if raw:
                break
        if not raw:
            # every engine was asked (in dispatch or not) and none answered: the step cannot start;
            # the last engine's own error says why (a caller retries the step on EngineError)
            raise errors[-1] if errors else EngineError("no rollout engine to ask for its weight version")
        if len(set(raw)) > 1:
            logger.warning("rollout engines report different weight versions %s; using the newest", raw)
        newest = max(raw)
        if self.version_offset is None:
            restored = self.data_source.restored_policy_version
            # after a restore, the first update the engines received is the saved policy's successor
            self.version_offset = max(0, restored + 1 - newest) if restored is not None else 0
            self.client.version_offset = self.version_offset
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
        """slime's reward path (``async_rm`` per sample, ``batched_async_rm`` with --group-rm over
        every sample of the group); a reward already set (kept through ``add_samples``, or set by a
        generate function) is not recomputed, as in slime. An episode that returned list[Sample]
        gets the list of its samples' rewards."""
        entries = await self._samples(group)
        args = self.args
        # (trajectory, its samples, which of them need a reward); a masked member has its placeholder
        shapes = [(t, e if isinstance(e, list) else [e]) for t, e in zip(group.trajectories, entries)
                  if t.status is not TrajectoryStatus.FAILED]
        for t in group.masked():
            t.reward = masked_reward(args)
        group_rm = getattr(args, "group_rm", False)
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
        groups.sort(key=lambda g: leaves(g)[0].index)
        groups = one_shape(groups)
        metrics = dict(result.metrics)
        metrics.update({f"rollout/dynamic_filter/drop_{r}": c for r, c in self.filter_drops.items()})
        metrics[METRIC_PREFIX + "masked_samples"] = sum(len(g.masked()) for g in result.groups)
        metrics[METRIC_PREFIX + "policy_version"] = version
        metrics[METRIC_PREFIX + "version_offset"] = self.version_offset
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
        if self.client is not None:
            await self.client.close()
            self.client = None


# ====================================================================== what the scheduler is built from
def _explicit_over_sampling(args: Any) -> int | None:
    """slime fills --over-sampling-batch-size with rollout_batch_size when unset, so only a larger
    value is the user's explicit choice; it then wins over april_over_sampling_factor."""
    over = getattr(args, "over_sampling_batch_size", None)
    return over if over is not None and over > args.rollout_batch_size else None


def _vocab_size(codec: SampleCodec) -> int | None:
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


def _eos_token_ids(codec: SampleCodec) -> list[int]:
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


def deployment_hints(args: Any) -> DeploymentHints:
    """What slime's own arguments say about its router: PD disaggregation (``--prefill-num-servers``,
    the router's ``--router-pd-disaggregation``), a DP-aware router, the router's policy."""
    return DeploymentHints(
        pd_disaggregation=getattr(args, "prefill_num_servers", None) is not None
        or bool(getattr(args, "router_pd_disaggregation", False)),
        dp_aware_router=bool(getattr(args, "router_dp_aware", False)),
        router_policy=getattr(args, "router_policy", None))


def engines_slime_started(args: Any) -> int | None:
    """How many engines slime's launcher registers with its router, where its own arguments say:
    one per ``--rollout-num-gpus-per-engine`` GPUs of ``--rollout-num-gpus`` (an engine spanning nodes
    registers once, from its first node). None where the layout comes from elsewhere (``--sglang-config``,
    PD disaggregation, external engines): then the first list that stays the same is taken."""
    if (getattr(args, "sglang_config", None) is not None or getattr(args, "rollout_external", False)
            or getattr(args, "prefill_num_servers", None) is not None):
        return None
    gpus = getattr(args, "rollout_num_gpus", None)
    per_engine = getattr(args, "rollout_num_gpus_per_engine", None)
    if not (isinstance(gpus, int) and isinstance(per_engine, int) and gpus >= per_engine >= 1):
        return None
    return gpus // per_engine


def check_router_fields(dispatch: Any, args: Any) -> None:
    """Before the first call: a job whose requests carry a field the router drops cannot run with
    router dispatch (its replies would silently lack what the field asks for)."""
    if dispatch.mode != "router":
        return
    probe = {"sampling_params": sampling_params(args),
             "return_routed_experts": bool(getattr(args, "use_rollout_routing_replay", False))}
    dropped = router_dropped_fields(probe)
    if dropped:
        raise AprilConfigError(f"april_dispatch: {dispatch.describe()}, but the router drops {', '.join(dropped)}, "
                               "which this job's requests need; run the engines without the router's help "
                               "(april_dispatch: direct, regular workers)")


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
    if params["top_p"] != 1.0:  # slime's top-p token replay (its SGLang patch reads this)
        params["custom_params"] = {"return_top_p_token_ids": True}
    return {k: v for k, v in params.items() if v is not None}


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
    samples, metrics = _run_on_loop(runtime.train_step(rollout_id))  # snapshots the data source
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
