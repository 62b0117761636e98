"""The demo's multi-turn task (``april-slime demo --task tool``): multiply two numbers with a calculator.

A prompt is ``37*48=``. The policy cannot multiply; it calls the calculator by writing
``<calc>37*48</calc>``, the episode's function runs the tool and appends ``<result>1776</result>``
(not trained on), and the policy answers ``<answer>1776</answer>``. Reward 1.0 when the last answer
is the product, else 0.0 (a wrong or missing answer, a call cut at its budget). The tool answers
after a latency drawn per call from a log-normal distribution (``TOOL``), as a remote service does;
its long tail, and the policy's own long turns, are what partial rollout has to deal with.

``generate`` is a custom generate function with slime's contract (``--custom-generate-function-path
april_workbench.demo.tool_task.generate``), written as slime's search-r1 example is: one
``/generate`` per turn at ``http://{args.sglang_router_ip}:{args.sglang_router_port}``, stop strings at
the closing tags, the tool's tokens appended with loss mask 0 and log-prob 0.0. It uses plain aiohttp
and token ids. Under the plugin each call is scheduled, aborted at a step's target and resumed in a
later step (the function sees one reply per call); the held-out evaluation runs it against the
router directly.

The warm start imitates noisy demonstrations: with ``skip_prob`` the answer is a guess without the
tool; the numbers copied into the call and out of the result are each digit wrong with
``copy_noise``; with ``ramble_prob`` a run of digits (mean ``ramble_mean``) precedes the call, and may
run to the call's budget. RL has to learn to call the tool, copy exactly and not ramble.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import hashlib
import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from april_workbench.demo import task
from april_workbench.demo.policy import WarmStartSpec, build_checkpoint

TAGS = ["<calc>", "</calc>", "<result>", "</result>", "<answer>", "</answer>"]
VOCAB = [str(d) for d in range(10)] + ["*", "="] + TAGS + [task.EOS, task.PAD]
PATTERN = r"</?(?:calc|result|answer)>|."  # a tag is one token, anything else one per character
STOPS = ["</calc>", "</answer>"]
CALL = re.compile(r"<calc>([0-9*]{1,16})</calc>")
ANSWER = re.compile(r"<answer>([0-9]*)</answer>")

# the tool and the episode; the demo sets them from its settings (module-level, as slime's examples do)
TOOL = {"latency_median_s": 0.3, "latency_sigma": 1.0, "latency_max_s": 4.0, "max_turns": 3}

BUILD_FORMAT = 1


@dataclass(frozen=True)
class ToolPolicySpec(WarmStartSpec):
    sft_batch_size: int = 32
    sft_lr: float = 5e-3
    num_digits: int = 2  # of each factor
    skip_prob: float = 0.4
    copy_noise: float = 0.1
    ramble_prob: float = 0.3
    ramble_mean: float = 8.0
    max_response_len: int = 16  # per model call

    POSITIVE: ClassVar[tuple[str, ...]] = ("num_digits", "ramble_mean")
    PROBABILITIES: ClassVar[tuple[str, ...]] = ("skip_prob", "copy_noise", "ramble_prob")

    def _check(self) -> None:
        longest = 2 + 2 * self.num_digits + 1  # <calc>a*b</calc>
        if self.max_response_len < longest:
            raise ValueError(f"max_response_len: must fit a calculator call ({longest} tokens), got "
                             f"{self.max_response_len}")

    def key(self) -> str:
        blob = json.dumps({"task": "tool", "format": BUILD_FORMAT, "vocab": VOCAB, **dataclasses.asdict(self)},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_tokenizer():
    return task.build_tokenizer(VOCAB, PATTERN)


def factors(rng: random.Random, num_digits: int) -> tuple[int, int]:
    low, high = 10 ** (num_digits - 1), 10 ** num_digits - 1
    return rng.randint(low, high), rng.randint(low, high)


def prompt_text(a: int, b: int) -> str:
    return f"{a}*{b}="


def calculate(expression: str) -> str:
    """The calculator: a product of non-negative integers; ``error`` for anything else."""
    parts = expression.split("*")
    if not all(p.isdigit() for p in parts):
        return "error"
    return str(math.prod(int(p) for p in parts))


def observation(value: str) -> str:
    return f"<result>{value}</result>"


def score(response: str, label: str) -> float:
    """1.0 when the last ``<answer>`` of ``response`` is ``label``."""
    answers = ANSWER.findall(response)
    return 1.0 if answers and answers[-1] == label else 0.0


async def reward(args: Any, sample: Any, **kwargs: Any) -> float:
    """slime custom reward (``--custom-rm-path april_workbench.demo.tool_task.reward``)."""
    if not isinstance(sample.label, str):
        raise ValueError(f"sample {sample.index}: the tool task's reward needs a string label, got "
                         f"{type(sample.label).__name__}")
    return score(sample.response or "", sample.label)


# ====================================================================== the warm start
def _noisy(rng: random.Random, digits: str, noise: float) -> str:
    return "".join(rng.choice("0123456789") if rng.random() < noise else d for d in digits)


def demonstration(rng: random.Random, spec: ToolPolicySpec) -> tuple[str, list[tuple[str, bool]]]:
    """(prompt, response segments) of one noisy demonstration; the tool's result is not trained on."""
    a, b = factors(rng, spec.num_digits)
    ramble = ""
    if rng.random() < spec.ramble_prob:
        room = spec.max_response_len - (2 + 2 * spec.num_digits + 1)
        while len(ramble) < room:
            ramble += rng.choice("0123456789")
            if rng.random() < 1.0 / spec.ramble_mean:
                break
    if rng.random() < spec.skip_prob:
        guess = str(rng.randint(10 ** (2 * spec.num_digits - 2), 10 ** (2 * spec.num_digits) - 1))
        return prompt_text(a, b), [(ramble + f"<answer>{guess}</answer>", True)]
    call = f"{_noisy(rng, str(a), spec.copy_noise)}*{_noisy(rng, str(b), spec.copy_noise)}"
    result = calculate(call)
    return prompt_text(a, b), [(ramble + f"<calc>{call}</calc>", True), (observation(result), False),
                               (f"<answer>{_noisy(rng, result, spec.copy_noise)}</answer>", True)]


def build_policy(cache_dir: str | Path, spec: ToolPolicySpec, log: Callable[[str], None] = print) -> Path:
    return build_checkpoint(cache_dir, spec, build_tokenizer(), lambda rng: demonstration(rng, spec), log)


def write_prompts(path: str | Path, num_prompts: int, spec: ToolPolicySpec, seed: int) -> Path:
    """A slime prompt file (JSONL, ``prompt`` and ``label``) of distinct products."""
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    while len(seen) < num_prompts:
        seen.add(factors(rng, spec.num_digits))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for a, b in sorted(seen, key=lambda _: rng.random()):
            f.write(json.dumps({"prompt": prompt_text(a, b), "label": str(a * b)}) + "\n")
    return path


# ====================================================================== the episode
@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def tool_latency(rng: random.Random) -> float:
    draw = TOOL["latency_median_s"] * math.exp(TOOL["latency_sigma"] * rng.gauss(0.0, 1.0))
    return min(draw, TOOL["latency_max_s"])


async def _post(session, url: str, payload: dict) -> dict:
    async with session.post(url, json=payload) as reply:
        body = await reply.json(content_type=None)
        if reply.status != 200:
            raise RuntimeError(f"POST {url} answered HTTP {reply.status}: {str(body)[:300]}")
        return body


async def generate(args: Any, sample: Any, sampling_params: dict) -> Any:
    """slime's custom generate function for the task: up to ``TOOL["max_turns"]`` model calls, the
    calculator between them."""
    import aiohttp
    from slime.utils.types import Sample

    tokenizer = _tokenizer(str(args.hf_checkpoint))
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    params = {**sampling_params, "stop": STOPS, "no_stop_trim": True}
    prompt_ids = tokenizer.encode(sample.prompt, add_special_tokens=False)
    rng = random.Random(f"{sample.index}/{sample.prompt}")  # the tool's latencies, per sample
    ids, mask, logprobs = [], [], []
    status = Sample.Status.TRUNCATED  # out of turns after a tool call
    async with aiohttp.ClientSession() as session:
        for _ in range(TOOL["max_turns"]):
            out = await _post(session, url, {"input_ids": prompt_ids + ids, "sampling_params": params,
                                             "return_logprob": True})
            finish = out["meta_info"]["finish_reason"]["type"]
            if finish == "abort":
                sample.status = Sample.Status.ABORTED
                return sample
            turn = [int(t[1]) for t in out["meta_info"]["output_token_logprobs"]]
            ids += turn
            mask += [1] * len(turn)
            logprobs += [float(t[0]) for t in out["meta_info"]["output_token_logprobs"]]
            if finish == "length":
                break
            call = CALL.search(tokenizer.decode(turn))
            if call is None:  # an answer, or a stop without a call: the episode ends
                status = Sample.Status.COMPLETED
                break
            await asyncio.sleep(tool_latency(rng))
            result = tokenizer.encode(observation(calculate(call.group(1))), add_special_tokens=False)
            ids += result
            mask += [0] * len(result)
            logprobs += [0.0] * len(result)
    sample.tokens = prompt_ids + ids
    sample.response_length = len(ids)
    sample.response = tokenizer.decode(ids)
    sample.loss_mask = mask
    sample.rollout_log_probs = logprobs
    sample.status = status
    return sample


def evaluate(router_url: str, checkpoint: Path, prompts: list[dict], temperature: float,
             max_response_len: int) -> float:
    """Mean reward of one episode per held-out prompt, run by ``generate`` against the router."""
    from slime.utils.types import Sample

    host, port = router_url.removeprefix("http://").rsplit(":", 1)
    args = argparse.Namespace(sglang_router_ip=host, sglang_router_port=int(port), hf_checkpoint=str(checkpoint))
    params = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_response_len}

    async def run_all() -> list[float]:
        samples = [Sample(index=i, prompt=p["prompt"], label=p["label"]) for i, p in enumerate(prompts)]
        done = await asyncio.gather(*(generate(args, s, params) for s in samples))
        return [score(s.response or "", s.label) for s in done]

    rewards = asyncio.run(run_all())
    return sum(rewards) / len(rewards)
