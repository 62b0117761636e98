"""The demo's RL loop: real SGLang engines, slime's rollout path, the plugin's loss, weight pushes.

One step, for each rollout policy (sync, april, copris):

1. rollout: ``april_slime.rollout.generate_rollout`` with ``AprilDataSource``, both loaded from
   slime's ``--rollout-function-path`` / ``--data-source-path`` with slime's ``load_function`` and
   called through slime's ``call_rollout_fn`` as its ``RolloutManager`` does (``args`` from slime's
   own argument parser), against SGLang CPU engines behind sglang-router. Prompts come from slime's
   ``RolloutDataSource`` (a JSONL file), rewards from slime's reward path (``custom_rm_path`` ->
   ``april_workbench.demo.task.reward``); april and copris abort at target and buffer the
   partials, which later steps resume first;
2. train: one rollout batch through ``april_slime.loss.policy_loss`` on a transformers copy of the
   policy (``trainer.PolicyTrainer``);
3. push: the new weights are saved and loaded by every engine with ``/update_weights_from_disk``
   under the next integer weight version, which the engines then report on every token.

Every policy starts from the same warm-started checkpoint (the engines are reset to it, version 0)
and sees the same prompt order. ``wall_s`` counts rollout + train + push; the held-out evaluation
(sampled answers of the current policy on fixed prompts, every ``eval_every`` steps) is left out
of it.

A caller that needs an event to have happened (a test: a call suspended at one step's target and
answered in a later one) passes ``until`` and ``max_steps`` to ``run_demo``: a policy whose series
do not satisfy ``until`` after ``steps`` steps goes on, one step at a time, until they do or it has
run ``max_steps``. The event is then waited for in steps, whatever the machine's speed. Those extra
steps are not evaluated on the held-out prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from april_workbench.demo import task, tool_task
from april_workbench.demo.policy import PolicySpec
from april_workbench.demo.tool_task import ToolPolicySpec

POLICIES = ("sync", "april", "copris")
TASKS = ("reverse", "tool")

# per-step series written for every policy (``--json``)
SERIES = ("reward", "wall_s", "offpolicy_token_fraction", "staleness_mean", "ess_ratio", "policy_version",
          "rollout_s", "train_s", "push_s", "resumed_trajectories", "buffered_partials", "aborted_tokens",
          "generated_tokens", "mean_response_length", "loss_offpolicy_token_frac", "behaviour_ratio_mean",
          "lr_scale", "episode_calls", "suspended_calls", "resumed_calls", "tool_s")


@dataclass(frozen=True)
class DemoSettings:
    policies: tuple[str, ...] = POLICIES
    steps: int = 40
    rollout_batch_size: int = 8  # groups (prompts) per training step
    n_samples_per_prompt: int = 8
    temperature: float = 1.0
    lr: float = 1e-3
    minibatches: int = 2  # optimizer steps per rollout batch
    engines: int = 1
    engine_max_running_requests: int = 128
    engine_max_total_tokens: int = 16384
    over_sampling_factor: float = 2.0  # april
    copris_concurrency: int | None = None  # default rollout_batch_size * n_samples_per_prompt
    is_mode: str = "copris"
    is_level: str = "token"
    is_correction: str = "truncate"
    is_high: float = 2.0
    vcpo_lr_scaling: bool = False  # VCPO's ESS-scaled learning rate (april_vcpo_lr_scaling)
    train_prompts: int = 2000
    eval_prompts: int = 256
    eval_every: int = 5
    seed: int = 0
    task: str = "reverse"  # or "tool": multi-turn episodes with a calculator (tool_task)
    policy: PolicySpec | ToolPolicySpec = field(default_factory=PolicySpec)
    # the tool task's calculator: log-normal latency per call (median, sigma, cap) and turns per episode
    tool_latency_median_s: float = 0.3
    tool_latency_sigma: float = 1.0
    tool_latency_max_s: float = 4.0
    tool_max_turns: int = 3

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task: choose from {', '.join(TASKS)}; got {self.task!r}")
        wanted = ToolPolicySpec if self.task == "tool" else PolicySpec
        if not isinstance(self.policy, wanted):
            raise ValueError(f"policy: the {self.task} task needs a {wanted.__name__}, got "
                             f"{type(self.policy).__name__}")
        if self.tool_latency_median_s < 0 or self.tool_latency_sigma < 0 or self.tool_max_turns < 1:
            raise ValueError("tool_latency_median_s and tool_latency_sigma must be >= 0, tool_max_turns >= 1")
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown or not self.policies:
            raise ValueError(f"policies: choose from {', '.join(POLICIES)}; got {list(self.policies)}")
        for name in ("steps", "rollout_batch_size", "n_samples_per_prompt", "minibatches", "engines",
                     "eval_prompts", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.n_samples_per_prompt < 2:
            raise ValueError("n_samples_per_prompt: GRPO needs at least 2 samples per prompt")


QUICK = DemoSettings(policies=("sync", "copris"), steps=15)
FULL = DemoSettings()
TOOL_QUICK = DemoSettings(task="tool", policy=ToolPolicySpec(), policies=("sync", "copris"), steps=15)
TOOL_FULL = DemoSettings(task="tool", policy=ToolPolicySpec())

# a condition on one policy's series so far: (policy name, series) -> satisfied
Until = Callable[[str, dict[str, list[float]]], bool]


# ====================================================================== slime arguments
def slime_args(settings: DemoSettings, policy: str, *, checkpoint: Path, prompts: Path, router_url: str,
               workdir: Path) -> argparse.Namespace:
    """The arguments of a slime job, parsed by slime's own argument parser (its rollout, reward,
    loss and SGLang groups; the Megatron groups are for the GPU trainer), plus the plugin's
    ``april_*`` settings, set as ``--custom-config-path`` sets them."""
    from slime.backends.sglang_utils.arguments import add_sglang_arguments
    from slime.utils.arguments import get_slime_extra_args_provider

    host, port = router_url.removeprefix("http://").rsplit(":", 1)
    argv = [
        # data: a JSONL prompt file read by slime's RolloutDataSource, no chat template
        "--prompt-data", str(prompts), "--input-key", "prompt", "--label-key", "label", "--rollout-shuffle",
        "--rollout-seed", str(settings.seed), "--hf-checkpoint", str(checkpoint),
        "--save", str(workdir / policy / "ckpt"),
        # rollout: the plugin's function and data source, loaded by import path as slime loads them
        "--rollout-function-path", "april_slime.rollout.generate_rollout",
        "--data-source-path", "april_slime.rollout.AprilDataSource",
        "--rollout-batch-size", str(settings.rollout_batch_size),
        "--n-samples-per-prompt", str(settings.n_samples_per_prompt),
        "--rollout-max-response-len", str(settings.policy.max_response_len),
        "--rollout-temperature", str(settings.temperature),
        "--sglang-router-ip", host, "--sglang-router-port", port,
        # reward: slime's reward path with the task's reward function
        "--custom-rm-path", f"{_task_module(settings).__name__}.reward",
        # loss: the plugin's policy loss, as a slime job selects it
        "--loss-type", "custom_loss", "--custom-loss-function-path", "april_slime.loss.policy_loss",
        "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
    ]
    if settings.task == "tool":
        # the episodes: slime's custom generate function, one model call per turn
        argv += ["--custom-generate-function-path", f"{tool_task.__name__}.generate"]
    if settings.vcpo_lr_scaling:
        # VCPO's state lives in slime's before-train-step hook (the demo's trainer calls it as slime does)
        argv += ["--custom-megatron-before-train-step-hook-path", "april_slime.vcpo.before_train_step"]
    parser = argparse.ArgumentParser(allow_abbrev=False)
    get_slime_extra_args_provider()(parser)
    add_sglang_arguments(parser)
    args = parser.parse_args(argv)
    # what slime's validation fills in when unset
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = args.rollout_batch_size
    plugin = {"policy": policy, "over_sampling_factor": settings.over_sampling_factor,
              "concurrency": settings.copris_concurrency, "is_mode": settings.is_mode,
              "is_level": settings.is_level, "is_correction": settings.is_correction,
              "is_high": settings.is_high, "vcpo_lr_scaling": settings.vcpo_lr_scaling,
              "request_timeout_s": 120.0}
    for key, value in plugin.items():
        setattr(args, f"april_{key}", value)
    return args


# ====================================================================== engines
def _post(url: str, body: dict, timeout_s: float) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            raw = reply.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST {url} answered HTTP {e.code}: {e.read()[:300]!r}") from e
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise RuntimeError(f"POST {url} failed: {e}") from e
    try:
        return json.loads(raw) if raw else None
    except json.JSONDecodeError as e:
        raise RuntimeError(f"POST {url}: reply is not JSON: {raw[:300]!r}") from e


def push_weights(engine_urls: list[str], model_path: Path, version: int, timeout_s: float = 300.0) -> None:
    """Load ``model_path`` into every engine as integer weight ``version`` (what slime's weight
    updater does between steps, from disk instead of NCCL/IPC)."""
    for url in engine_urls:
        reply = _post(f"{url}/update_weights_from_disk",
                      {"model_path": str(model_path), "weight_version": str(version)}, timeout_s)
        if not (isinstance(reply, dict) and reply.get("success")):
            raise RuntimeError(f"{url}/update_weights_from_disk refused {model_path} (version {version}): {reply!r}")


def _task_module(settings: DemoSettings):
    return tool_task if settings.task == "tool" else task


def evaluate(engine_urls: list[str], tokenizer: Any, prompts: list[dict], settings: DemoSettings, *,
             router_url: str, checkpoint: Path) -> float:
    """Mean reward of one sampled answer (the tool task: one episode) per held-out prompt from the
    engines' current weights."""
    if settings.task == "tool":
        return tool_task.evaluate(router_url, checkpoint, prompts, settings.temperature,
                                  settings.policy.max_response_len)
    ids = [tokenizer.encode(p["prompt"], add_special_tokens=False) for p in prompts]
    params = {"temperature": settings.temperature, "top_p": 1.0, "top_k": -1,
              "max_new_tokens": settings.policy.max_response_len, "no_stop_trim": True}
    total = 0.0
    share = math.ceil(len(prompts) / len(engine_urls))
    for i, url in enumerate(engine_urls):
        part = slice(i * share, (i + 1) * share)
        if not ids[part]:
            continue
        replies = _post(f"{url}/generate", {"input_ids": ids[part], "sampling_params": params}, 300.0)
        if not isinstance(replies, list) or len(replies) != len(ids[part]):
            raise RuntimeError(f"{url}/generate: expected {len(ids[part])} replies to a batched request")
        for prompt, reply in zip(prompts[part], replies):
            output_ids = reply.get("output_ids") if isinstance(reply, dict) else None
            if not isinstance(output_ids, list):
                raise RuntimeError(f"{url}/generate: a reply without output_ids: {str(reply)[:200]}")
            text = tokenizer.decode(output_ids, skip_special_tokens=False)
            total += task.score(text, prompt["label"])
    return total / len(prompts)


# ====================================================================== one policy
def run_policy(policy: str, settings: DemoSettings, *, checkpoint: Path, prompts: Path, eval_prompts: list[dict],
               router_url: str, engine_urls: list[str], workdir: Path,
               log: Callable[[str], None] = print, until: Until | None = None,
               max_steps: int | None = None) -> dict[str, list[float]]:
    """``settings.steps`` steps of ``policy`` from the warm start; then, with ``until``, more steps
    until ``until(policy, series)`` holds or ``max_steps`` were run."""
    import torch
    from slime.rollout.base_types import call_rollout_fn
    from slime.rollout.sample_hooks import set_current_rollout_id
    from slime.utils.misc import load_function
    from transformers import AutoTokenizer

    from april_slime import rollout, vcpo
    from april_workbench.demo.trainer import PolicyTrainer

    torch.manual_seed(settings.seed)
    vcpo.reset_runtime()  # rho_on is measured afresh on each policy's first (on-policy) step
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    args = slime_args(settings, policy, checkpoint=checkpoint, prompts=prompts, router_url=router_url,
                      workdir=workdir)
    push_weights(engine_urls, checkpoint, 0)  # every policy starts from the warm start, version 0
    trainer = PolicyTrainer(checkpoint, args, lr=settings.lr, minibatches=settings.minibatches)
    # as slime's RolloutManager builds them
    data_source = load_function(args.data_source_path)(args)
    generate_rollout = load_function(args.rollout_function_path)
    history: dict[str, list[float]] = {k: [] for k in SERIES}
    history.update(eval_step=[0], eval_wall_s=[0.0],
                   eval_reward=[evaluate(engine_urls, tokenizer, eval_prompts, settings, router_url=router_url,
                                         checkpoint=checkpoint)])
    log(f"[{policy}] warm start: held-out reward {history['eval_reward'][0]:.3f}")
    wall = 0.0
    weights_dir = workdir / policy / "weights"

    def more(step: int) -> bool:
        if step < settings.steps:
            return True
        return until is not None and step < (max_steps or 0) and not until(policy, history)

    step = 0
    try:
        while more(step):
            t0 = time.perf_counter()
            set_current_rollout_id(step)
            out = call_rollout_fn(generate_rollout, args, step, data_source, evaluation=False)
            t1 = time.perf_counter()
            train = trainer.step(out.samples, step)
            t2 = time.perf_counter()
            version = step + 1
            path = trainer.save(weights_dir / f"v{version}")
            push_weights(engine_urls, path, version)
            t3 = time.perf_counter()
            shutil.rmtree(weights_dir / f"v{version - 1}", ignore_errors=True)  # loaded; no longer needed
            wall += t3 - t0
            _record(history, out, train, wall, (t1 - t0, t2 - t1, t3 - t2))
            if version <= settings.steps and (version % settings.eval_every == 0 or version == settings.steps):
                history["eval_step"].append(version)
                history["eval_wall_s"].append(wall)
                history["eval_reward"].append(evaluate(engine_urls, tokenizer, eval_prompts, settings,
                                                       router_url=router_url, checkpoint=checkpoint))
            log(_progress(policy, step, settings.steps, history))
            step += 1
    finally:
        rollout.shutdown()
        shutil.rmtree(weights_dir, ignore_errors=True)
    return history


def _record(history: dict[str, list[float]], out: Any, train: dict[str, float], wall: float,
            times: tuple[float, float, float]) -> None:
    m = out.metrics
    samples = [s for g in out.samples for s in g]
    history["reward"].append(sum(float(s.reward) for s in samples) / len(samples))
    history["wall_s"].append(wall)
    history["offpolicy_token_fraction"].append(m["april/offpolicy_token_fraction"])
    history["staleness_mean"].append(m["april/staleness_mean"])
    history["ess_ratio"].append(train["ess_ratio"])
    history["policy_version"].append(m["april/policy_version"])
    history["rollout_s"].append(times[0])
    history["train_s"].append(times[1])
    history["push_s"].append(times[2])
    history["resumed_trajectories"].append(m["april/resumed_trajectories"])
    history["buffered_partials"].append(m["april/buffer_partial_trajectories"])
    history["aborted_tokens"].append(m["april/aborted_tokens"])
    history["generated_tokens"].append(m["april/generated_tokens"])
    history["mean_response_length"].append(sum(s.response_length for s in samples) / len(samples))
    history["loss_offpolicy_token_frac"].append(train.get("april/offpolicy_token_frac", math.nan))
    history["behaviour_ratio_mean"].append(train.get("april/behaviour_ratio_mean", math.nan))
    history["lr_scale"].append(train.get("lr_scale", 1.0))
    # episodes (the tool task): model calls answered, calls left pending at the step's end, calls
    # that took more than one segment, seconds spent in tools (summed over episodes)
    history["episode_calls"].append(m.get("april/episodes/calls", 0.0))
    history["suspended_calls"].append(m.get("april/episodes/suspended", 0.0))
    history["resumed_calls"].append(m.get("april/episodes/resumed_calls", 0.0))
    history["tool_s"].append(m.get("april/episodes/tool_seconds", 0.0))


def _progress(policy: str, step: int, steps: int, h: dict[str, list[float]]) -> str:
    of = f"{steps}" if step < steps else f"{steps}+"  # past ``steps``: waiting for ``until``
    line = (f"[{policy}] step {step + 1}/{of}  reward {h['reward'][-1]:.3f}  "
            f"wall {h['wall_s'][-1]:6.1f}s (rollout {h['rollout_s'][-1]:.1f} train {h['train_s'][-1]:.1f} "
            f"push {h['push_s'][-1]:.1f})  off-policy {h['offpolicy_token_fraction'][-1]:.2f}  "
            f"staleness {h['staleness_mean'][-1]:.2f}  ESS {h['ess_ratio'][-1]:.3f}  "
            f"resumed {int(h['resumed_trajectories'][-1])}  buffered {int(h['buffered_partials'][-1])}  "
            f"len {h['mean_response_length'][-1]:.1f}")
    if h["episode_calls"][-1]:
        line += (f"  calls {int(h['episode_calls'][-1])} suspended {int(h['suspended_calls'][-1])} "
                 f"resumed {int(h['resumed_calls'][-1])}")
    if h["eval_step"][-1] == step + 1:
        line += f"  held-out {h['eval_reward'][-1]:.3f}"
    return line


# ====================================================================== the whole demo
def run_demo(settings: DemoSettings, *, cache_dir: Path, workdir: Path,
             log: Callable[[str], None] = print, until: Until | None = None,
             max_steps: int | None = None) -> dict[str, Any]:
    """Build (or reuse) the warm-started policy, start the engines and router, run every policy
    (``settings.steps`` steps each; with ``until``, each goes on until its series satisfy it, at
    most ``max_steps`` steps in all)."""
    if until is not None and (max_steps is None or max_steps < settings.steps):
        raise ValueError(f"until needs max_steps >= steps ({settings.steps}), got {max_steps}")
    from transformers.utils import logging as hf_logging

    from april_workbench.demo.policy import build_policy
    from april_workbench.localstack import local_stack

    if settings.task == "tool":
        tool_task.TOOL.update(latency_median_s=settings.tool_latency_median_s,
                              latency_sigma=settings.tool_latency_sigma,
                              latency_max_s=settings.tool_latency_max_s, max_turns=settings.tool_max_turns)

    hf_logging.disable_progress_bar()  # a save and a load per step: their bars would bury the progress lines
    started = time.perf_counter()
    build = tool_task.build_policy if settings.task == "tool" else build_policy
    checkpoint = build(cache_dir, settings.policy, log)
    t_policy = time.perf_counter() - started
    prompts = _write_prompts(settings, workdir / "prompts.jsonl", settings.train_prompts, settings.seed)
    train_set = {json.loads(line)["prompt"] for line in prompts.read_text().splitlines()}
    held_out_path = _write_prompts(settings, workdir / "held_out.jsonl", settings.eval_prompts + len(train_set),
                                   settings.seed + 1)
    held_out = [p for p in map(json.loads, held_out_path.read_text().splitlines())
                if p["prompt"] not in train_set][:settings.eval_prompts]
    log(f"starting {settings.engines} SGLang CPU engine(s) behind sglang-router")
    t0 = time.perf_counter()
    with local_stack(checkpoint, n_engines=settings.engines,
                     max_total_tokens=settings.engine_max_total_tokens,
                     max_running_requests=settings.engine_max_running_requests) as stack:
        t_engines = time.perf_counter() - t0
        log(f"engines up in {t_engines:.0f}s: {', '.join(stack.engine_urls)}; router {stack.router_url}")
        results = {}
        for policy in settings.policies:
            results[policy] = run_policy(policy, settings, checkpoint=checkpoint, prompts=prompts,
                                         eval_prompts=held_out, router_url=stack.router_url,
                                         engine_urls=list(stack.engine_urls), workdir=workdir, log=log,
                                         until=until, max_steps=max_steps)
    return {"policies": results, "settings": _plain(dataclasses.asdict(settings)),
            "checkpoint": str(checkpoint), "policy_build_s": t_policy, "engine_start_s": t_engines,
            "total_s": time.perf_counter() - started}


def _write_prompts(settings: DemoSettings, path: Path, n: int, seed: int) -> Path:
    if settings.task == "tool":
        return tool_task.write_prompts(path, n, settings.policy, seed)
    return task.write_prompts(path, n, settings.policy.num_digits, seed)


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value))
