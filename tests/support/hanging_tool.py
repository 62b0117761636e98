"""An in-process agent (``core.episodes.EpisodeAgent``) whose chosen samples run a tool that never
returns, for the step deadline's tests on the emulator's virtual clock.

Every episode makes a model call, runs a tool, and makes a second model call. The tool of a member
named in ``hang`` is an asyncio future nobody resolves, on every attempt: only the plugin can end
that episode. ``hung`` counts the tool calls that started hanging, so a test can check that the
hang it arranged happened.
"""

from __future__ import annotations

import asyncio
from typing import Any

from april_slime.core.episodes import CallRequest, Episode, EpisodeRunner, ModelCall
from april_slime.core.types import Group, Trajectory, TrajectoryStatus

TOOL_IDS = [5, 6, 7]  # the tool's result, put in the context between the two calls
SAMPLING = {"temperature": 1.0, "ignore_eos": True}


class HangingToolAgent:
    def __init__(self, hang: set[str], call_tokens: int = 6):
        self.hang = set(hang)
        self.call_tokens = call_tokens
        self.runner: EpisodeRunner | None = None
        self.hung: list[str] = []  # member uids, one per tool call that started hanging

    def launch(self, member: Trajectory, group: Group):
        return self._episode(member)

    async def _episode(self, member: Trajectory) -> list[int]:
        assert self.runner is not None, "set the agent's runner"
        context = list(member.prompt_ids)
        first = await self.runner.call(member.uid, CallRequest(
            input_ids=list(context), max_new_tokens=self.call_tokens, sampling_params=dict(SAMPLING)))
        context += first["output_ids"]
        if member.uid in self.hang:
            self.hung.append(member.uid)
            await asyncio.get_running_loop().create_future()  # the tool never returns
        context += TOOL_IDS
        second = await self.runner.call(member.uid, CallRequest(
            input_ids=list(context), max_new_tokens=self.call_tokens, sampling_params=dict(SAMPLING)))
        return context + second["output_ids"]

    def reply(self, call: ModelCall) -> dict:
        t = call.trajectory
        return {"output_ids": list(t.response_ids),
                "meta_info": {"finish_reason": {"type": t.finish_reason}, "completion_tokens": t.response_length}}

    def finish(self, member: Trajectory, episode: Episode, result: Any) -> None:
        """The member as a generate function's sample: both calls' tokens with their versions, the
        tool's result between them (masked)."""
        calls = [c.trajectory for c in episode.served]
        mask: list[int] = []
        for k, t in enumerate(calls):
            if k:
                member.append(TOOL_IDS, [0.0] * len(TOOL_IDS), member.version_runs.newest())
                mask += [0] * len(TOOL_IDS)
            member.append(t.response_ids, t.logprobs, t.call_versions[-1], version_runs=t.version_runs)
            mask += [1] * t.response_length
        assert list(result) == member.prompt_ids + member.response_ids, "the context is not the calls and the tool"
        member.loss_mask = mask
        member.status, member.finish_reason = TrajectoryStatus.COMPLETED, "stop"


# ------------------------------------------------------------------ slime's contract, real engines
# sample indices whose tool never returns, and the indices whose tool started hanging (the test
# checks that the hang it arranged happened)
HANG_INDICES: set[int] = set()
HUNG_INDICES: list[int] = []
REAL_PER_CALL = 16


async def call_then_hung_tool(args, sample, sampling_params):
    """A slime custom generate function: a model call with the prompt as text, a tool, a second
    call with ``input_ids``; the tool of a sample in ``HANG_INDICES`` never returns."""
    from slime.utils.http_utils import post
    from slime.utils.processing_utils import load_tokenizer

    from tests.support.agent_functions import OBSERVATION, completed

    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    tokenizer = load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
    prompt = tokenizer(sample.prompt)["input_ids"]
    observation = tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"]
    response, mask, logprobs = [], [], []
    for turn in range(2):
        params = {**sampling_params, "max_new_tokens": REAL_PER_CALL}
        body = {"text": sample.prompt} if turn == 0 else {"input_ids": prompt + response}
        out = await post(url, {**body, "sampling_params": params, "return_logprob": True})
        pairs = out["meta_info"]["output_token_logprobs"]
        response += [int(t[1]) for t in pairs]
        mask += [1] * len(pairs)
        logprobs += [float(t[0]) for t in pairs]
        if turn == 0:
            if sample.index in HANG_INDICES:
                HUNG_INDICES.append(sample.index)
                await asyncio.Event().wait()  # the tool never returns
            response += observation
            mask += [0] * len(observation)
            logprobs += [0.0] * len(observation)
    completed(sample, prompt, response, mask, logprobs, tokenizer)
    return sample
