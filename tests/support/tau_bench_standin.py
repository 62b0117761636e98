"""A stand-in for the ``tau_bench`` package (not installable here), with the API slime's
``examples/tau-bench`` uses of it: ``envs.get_env`` (an environment with ``tools_info``, ``wiki``,
``reset`` and ``step``), ``types.RunConfig`` and ``types.Action``, ``agents.base.Agent`` and
``agents.tool_calling_agent`` (``ToolCallingAgent``, ``RESPOND_ACTION_NAME``). The environment is a
retail desk: every ``step`` answers as a user would, the episode is done after ``TURNS`` steps with
reward 1.0. ``STEPS`` records every action taken, per task index.
"""

from __future__ import annotations

import sys
import types
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

RESPOND_ACTION_NAME = "respond"
TURNS = 2
STEPS: dict[int, list[str]] = defaultdict(list)
TOOLS_INFO = [{"type": "function", "function": {
    "name": "find_order", "description": "Find an order by its id.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}]


@dataclass
class RunConfig:
    model_provider: str
    user_model_provider: str
    model: str
    user_model: str = "gpt-4o"
    num_trials: int = 1
    env: str = "retail"
    agent_strategy: str = "tool-calling"
    temperature: float = 0.0
    task_split: str = "test"
    user_strategy: str = "llm"


@dataclass
class Action:
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Info:
    data: dict[str, Any]

    def model_dump(self) -> dict[str, Any]:
        return dict(self.data)


@dataclass
class _Result:
    observation: str
    reward: float = 0.0
    done: bool = False
    info: _Info = field(default_factory=lambda: _Info({}))


class Env:
    tools_info = TOOLS_INFO
    wiki = "You are a retail agent. Help the user with their order."

    def __init__(self, task_index: int | None):
        self.task_index = task_index

    def reset(self, task_index: int | None = None) -> _Result:
        self.task_index = task_index
        return _Result(observation=f"Hi, where is my order {task_index}?", info=_Info({"task": task_index}))

    def step(self, action: Action) -> _Result:
        STEPS[self.task_index].append(action.name)
        done = len(STEPS[self.task_index]) % TURNS == 0
        return _Result(observation="It is order 12.", reward=1.0 if done else 0.0, done=done,
                       info=_Info({"steps": len(STEPS[self.task_index])}))


def get_env(env_name: str, user_strategy: str, user_model: str, task_split: str, user_provider: str | None = None,
            task_index: int | None = None) -> Env:
    return Env(task_index)


class Agent:
    pass


class ToolCallingAgent(Agent):
    def __init__(self, tools_info, wiki, model, provider, temperature=0.0):
        self.tools_info, self.wiki, self.model, self.provider, self.temperature = (
            tools_info, wiki, model, provider, temperature)


def install(monkeypatch) -> None:
    """Put the stand-in's modules in ``sys.modules`` (taken out again by ``monkeypatch``)."""
    here = sys.modules[__name__]
    modules = {
        "tau_bench": {},
        "tau_bench.envs": {"get_env": get_env},
        "tau_bench.types": {"RunConfig": RunConfig, "Action": Action},
        "tau_bench.agents": {},
        "tau_bench.agents.base": {"Agent": Agent},
        "tau_bench.agents.tool_calling_agent": {"ToolCallingAgent": ToolCallingAgent,
                                                "RESPOND_ACTION_NAME": RESPOND_ACTION_NAME},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs, __standin__=here)
        monkeypatch.setitem(sys.modules, name, module)
    STEPS.clear()


class ChatToyTokenizer:
    """The jobs' toy tokenizer (``slime_standin.ToyTokenizer``) with a chat template, which tau-bench
    renders its conversation with: each message as ``<role>content</role>``, then ``<assistant>``
    as the generation prompt."""

    def __init__(self):
        from tests.support.slime_standin import ToyTokenizer

        self.toy = ToyTokenizer()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.toy.encode(text)

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        return self.toy.decode(ids)

    def __call__(self, text: str, **kwargs) -> dict:
        return self.toy(text)

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = False,
                            tools=None, **kwargs):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text
