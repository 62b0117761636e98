"""A tiny Qwen3 that speaks the tags of slime's example functions, for the real tier's engines.

slime's ``search-r1`` and ``retool`` functions act on tags: ``<search>q</search>`` (a retrieval),
``<answer>a</answer>`` (the end), ``<code>c</code>`` (a sandboxed Python run) and ``Answer:
\\boxed{x}``. A random model never writes them, so their tools never run. Here a model of the real
tier's shape and tokenizer (its weights can be pushed to the session's engines) is warm-started
with the demo's supervised phase (``april_workbench.demo.policy.supervised``) on
demonstrations of both functions' episodes:

* search-r1: ``Question: who wrote book 12?`` -> ``<think> five two </think>`` ``<search> book 12
  </search>``, the function's ``<information>`` observation of the stub's passages (untrained),
  ``<think> ... </think>`` ``<answer> author 12 </answer>``;
* retool: its own chat prompt with the tool list around ``What is 12 + 7?`` -> ``<think> ... </think>``
  ``<code>print(12+7)</code>`` EOS, the ``<interpreter>`` observation of the sandbox's output
  (untrained), ``Answer: \\boxed{19}`` EOS.

The ``<think>`` part has a random number of words, so model calls differ in length. Two weight sets
come out: ``A`` (warm-started) and ``B`` (``A`` with every tensor perturbed by 3% of its standard
deviation): both write the tags, and they give every token a different log-prob, so the version
recorded for a token decides which model's log-prob it must match.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.slime_examples import RetrievalStub

THINK_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SFT_STEPS = 200
SFT_BATCH = 16
SFT_LR = 5e-3
PERTURBATION = 0.03  # of each tensor's standard deviation


def think(rng: random.Random) -> str:
    words = 0
    while words < 16 and rng.random() < 0.8:
        words += 1
    return "<think>" + "".join(" " + rng.choice(THINK_WORDS) for _ in range(words)) + " </think>\n"


# ------------------------------------------------------------------ search-r1
def search_prompt(i: int) -> str:
    return f"Question: who wrote book {i}?\n"


def information(search: Any, query: str) -> str:
    """The observation search-r1 appends after ``<search>query</search>`` with the stub's passages."""
    topk = search.SEARCH_R1_CONFIGS["topk"]
    passages = search._passages2string([{"document": {"contents": RetrievalStub.contents(query, k)}}
                                        for k in range(topk)])
    return f"\n\n<information>{passages.strip()}</information>\n\n"


def search_demonstration(search: Any) -> Callable[[random.Random], tuple[str, list[tuple[str, bool]]]]:
    def demonstrate(rng: random.Random):
        i = rng.randint(0, 999)
        query = f"book {i}"
        return search_prompt(i), [(think(rng) + f"<search> {query} </search>", True),
                                  (information(search, query), False),
                                  (think(rng) + f"<answer> author {i} </answer>", True)]
    return demonstrate


def write_search_prompts(path: Path, n: int) -> Path:
    """slime's prompt file for search-r1: labels as its ``reward_func`` reads them."""
    path.write_text("".join(json.dumps({"prompt": search_prompt(i), "label": {"ground_truth": {"target": [
        f"author {i}"]}}}) + "\n" for i in range(n)), encoding="utf-8")
    return path


# ------------------------------------------------------------------ retool
def retool_question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def retool_prompt(retool: Any, question: str) -> str:
    """The prompt retool's ``generate`` builds around a question (its template and tool list)."""
    return retool.format_conversation_with_tools(prompt=question, tools=retool.tool_registry.get_tool_specs())


def interpreter(output: str) -> str:
    """The observation retool appends after a ``<code>`` run whose sandbox answered ``output``."""
    return f"\n\n<interpreter>\n{output}\n</interpreter>\n\n"


def retool_demonstration(retool: Any, eos: str) -> Callable[[random.Random], tuple[str, list[tuple[str, bool]]]]:
    def demonstrate(rng: random.Random):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return retool_prompt(retool, retool_question(a, b)), [
            (think(rng) + f"<code>print({a}+{b})</code>{eos}", True),
            (interpreter(f"Output:\n{a + b}"), False),
            (f"Answer: \\boxed{{{a + b}}}{eos}", True)]
    return demonstrate


def write_retool_prompts(path: Path, n: int, seed: int = 0) -> Path:
    """slime's prompt file for retool: a question and its answer (a string, as its reward reads it)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append(json.dumps({"prompt": retool_question(a, b), "label": str(a + b)}) + "\n")
    path.write_text("".join(rows), encoding="utf-8")
    return path


# ------------------------------------------------------------------ the weights
def build_tag_policies(root: Path, tokenizer: Any, search: Any, retool: Any, *, seed: int = 0,
                       log: Callable[[str], None] = print) -> tuple[Path, Path]:
    """``(A, B)``: checkpoints of the real tier's model shape and ``tokenizer`` under ``root``."""
    import torch
    from transformers import AutoModelForCausalLM

    from april_workbench.demo.policy import supervised
    from april_workbench.tiny_qwen3 import build_tiny_qwen3

    a, b = root / "A", root / "B"
    build_tiny_qwen3(a, tokenizer=tokenizer, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    supervised(model, tokenizer, [search_demonstration(search), retool_demonstration(retool, tokenizer.eos_token)],
               steps=SFT_STEPS, batch_size=SFT_BATCH, lr=SFT_LR, seed=seed, log=log)
    model.save_pretrained(a)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * PERTURBATION * p.std())
    model.save_pretrained(b)
    tokenizer.save_pretrained(b)
    return a, b
