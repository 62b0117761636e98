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
                member.append(TOOL_IDS, [0.0] * len(TOOL_IDS), member.version_runs[-1][0])
                mask += [0] * len(TOOL_IDS)
            member.append(t.response_ids, t.logprobs, t.call_versions[-1], version_runs=t.version_runs)
            mask += [1] * t.response_length
        assert list(result) == member.prompt_ids + member.response_ids, "the context is not the calls and the tool"
        member.loss_mask = mask
        member.status, member.finish_reason = TrajectoryStatus.COMPLETED, "stop"
