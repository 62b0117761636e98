"""The demo's verifiable task: reverse a string of digits.

A prompt is ``"31415="``; the answer is the digits reversed followed by the end-of-text token,
``"51413<|endoftext|>"``. The reward is 1.0 for exactly that response and 0.0 for anything else
(a wrong digit, a missing stop, extra digits before the stop). It is computed from the sample's
text and label only, so slime's reward path (``--custom-rm-path april_workbench.demo.task.reward``)
calls it as it calls any user reward.

The tokenizer has one token per character (10 digits, ``=``) plus the end-of-text and padding
tokens, so reversing is a token-level operation a two-layer model can learn.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SEPARATOR = "="
VOCAB = [str(d) for d in range(10)] + [SEPARATOR, EOS, PAD]


def build_tokenizer(vocab: list[str] = VOCAB, pattern: str = "."):
    """A ``PreTrainedTokenizerFast`` over ``vocab`` (no training, no hub): the text is split where
    ``pattern`` matches (default: every character), each piece one token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(vocab)}, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=PAD,
                                   clean_up_tokenization_spaces=False)


def prompt_text(digits: str) -> str:
    return digits + SEPARATOR


def answer_text(digits: str) -> str:
    return digits[::-1]


def random_digits(rng: random.Random, num_digits: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(num_digits))


def write_prompts(path: str | Path, num_prompts: int, num_digits: int, seed: int) -> Path:
    """A slime prompt file (JSONL, ``prompt`` and ``label`` keys) of distinct random prompts."""
    rng = random.Random(seed)
    seen: set[str] = set()
    while len(seen) < num_prompts:
        seen.add(random_digits(rng, num_digits))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for digits in sorted(seen, key=lambda _: rng.random()):
            f.write(json.dumps({"prompt": prompt_text(digits), "label": answer_text(digits)}) + "\n")
    return path


def score(response: str, label: str) -> float:
    """1.0 when ``response`` is the label followed by the stop token, else 0.0."""
    return 1.0 if response == label + EOS else 0.0


async def reward(args: Any, sample: Any, **kwargs: Any) -> float:
    """slime custom reward (``--custom-rm-path april_workbench.demo.task.reward``)."""
    if not isinstance(sample.label, str):
        raise ValueError(f"sample {sample.index}: the reverse-digits reward needs a string label, got "
                         f"{type(sample.label).__name__}")
    return score(sample.response or "", sample.label)
