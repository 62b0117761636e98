"""The demo's policy: a tiny Qwen3 for the reverse-digits task, warm-started by supervised learning.

The supervised phase gives RL something to improve: demonstrations whose answer digits are each
replaced by a random digit with probability ``label_noise``, and which with probability
``ramble_prob`` keep emitting random digits (geometric length, mean ``ramble_mean``) before the
stop. The warm policy therefore answers exactly only part of the time, and some of its responses
run long, up to the response budget: the long tail that partial rollouts exist for. RL removes
both (neither a wrong digit nor a ramble is rewarded).

The built checkpoint (model, tokenizer, config with the task's stop token) is cached under a name
derived from every setting that shapes it, and written to a temporary folder that is renamed into
place only once complete, so an interrupted build is never reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from april_workbench.demo import task

# (prompt, response) text of one demonstration, drawn with the given generator; the response is a
# text, or (text, trained) segments: a multi-turn demonstration's tool outputs are not trained on
Demonstrate = Callable[[random.Random], tuple[str, "str | list[tuple[str, bool]]"]]

SHARED_PREFIX_MIN = 32  # tokens of shared prompt prefix worth a forward of its own

# Bump when the build below changes in a way the settings do not capture.
BUILD_FORMAT = 1


@dataclass(frozen=True)
class WarmStartSpec:
    """What every demo policy has: the tiny Qwen3's shape and its supervised warm start. A task's
    spec adds its own fields, names those that must be >= 1 (``POSITIVE``) or lie in [0, 1]
    (``PROBABILITIES``), and checks the rest in ``_check``."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    sft_steps: int = 300
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    seed: int = 0

    POSITIVE: ClassVar[tuple[str, ...]] = ()
    PROBABILITIES: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for name in (*self.POSITIVE, "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "sft_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.sft_steps < 0:
            raise ValueError(f"sft_steps: must be >= 0, got {self.sft_steps}")
        for name in self.PROBABILITIES:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: must lie in [0, 1], got {getattr(self, name)}")
        self._check()

    def _check(self) -> None:
        pass


@dataclass(frozen=True)
class PolicySpec(WarmStartSpec):
    num_digits: int = 5
    label_noise: float = 0.2
    ramble_prob: float = 0.3
    ramble_mean: float = 12.0
    max_response_len: int = 32

    POSITIVE: ClassVar[tuple[str, ...]] = ("num_digits", "ramble_mean")
    PROBABILITIES: ClassVar[tuple[str, ...]] = ("label_noise", "ramble_prob")

    def _check(self) -> None:
        if self.max_response_len < self.num_digits + 1:
            raise ValueError(f"max_response_len: must fit the answer and its stop ({self.num_digits + 1} "
                             f"tokens), got {self.max_response_len}")

    def key(self) -> str:
        blob = json.dumps({"format": BUILD_FORMAT, "vocab": task.VOCAB, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def demonstration(rng: random.Random, spec: PolicySpec) -> tuple[str, str]:
    """(prompt, response) text of one noisy demonstration."""
    digits = task.random_digits(rng, spec.num_digits)
    answer = "".join(rng.choice("0123456789") if rng.random() < spec.label_noise else d
                     for d in task.answer_text(digits))
    if rng.random() < spec.ramble_prob:
        while len(answer) < spec.max_response_len - 1:
            answer += rng.choice("0123456789")
            if rng.random() < 1.0 / spec.ramble_mean:
                break
    return task.prompt_text(digits), answer + task.EOS


def _sft_rows(tokenizer, rng: random.Random, demonstrate: Demonstrate, batch_size: int):
    """Token ids of ``batch_size`` demonstrations (prompt + response), each one's prompt length, and
    which tokens are trained on (the response's, less its untrained segments)."""
    rows, prompt_lengths, trained = [], [], []
    for _ in range(batch_size):
        prompt, response = demonstrate(rng)
        p = tokenizer.encode(prompt, add_special_tokens=False)
        segments = [(response, True)] if isinstance(response, str) else response
        r, keep = [], []
        for text, trainable in segments:  # one by one, as a multi-turn function tokenizes them
            ids = tokenizer.encode(text, add_special_tokens=False)
            r += ids
            keep += [trainable] * len(ids)
        rows.append(p + r)
        prompt_lengths.append(len(p))
        trained.append([False] * len(p) + keep)
    return rows, prompt_lengths, trained


def _padded(rows: list[list[int]], trained: list[list[bool]], pad: int):
    """Right-padded input ids, attention mask and labels (-100 where not trained)."""
    import torch

    width = max(len(r) for r in rows)
    labels = [[t if k else -100 for t, k in zip(r, keep)] for r, keep in zip(rows, trained)]
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    target = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    return ids, mask, target


def shared_prefix(rows: list[list[int]], prompt_lengths: list[int]) -> int:
    """Tokens every row begins with, short of each prompt's last token (whose logits predict the
    first response token and so must be computed with the row)."""
    limit = min(prompt_lengths) - 1
    n = 0
    while n < limit and all(r[n] == rows[0][n] for r in rows):
        n += 1
    return max(n, 0)


def sft_loss(model, rows: list[list[int]], prompt_lengths: list[int], trained: list[list[bool]], pad: int):
    """Mean cross-entropy of the response tokens. Demonstrations that share a long prompt prefix (a
    system prompt) run it once, batch 1, and their suffixes on its key/value cache, rather than
    the prefix once per row: the same loss, for a fraction of the compute."""
    import torch

    shared = shared_prefix(rows, prompt_lengths)
    if shared < SHARED_PREFIX_MIN:
        ids, mask, target = _padded(rows, trained, pad)
        return model(input_ids=ids, attention_mask=mask, labels=target).loss
    cache = model(input_ids=torch.tensor([rows[0][:shared]]), use_cache=True).past_key_values
    cache.batch_repeat_interleave(len(rows))
    ids, mask, target = _padded([r[shared:] for r in rows], [k[shared:] for k in trained], pad)
    mask = torch.cat([torch.ones(len(rows), shared, dtype=mask.dtype), mask], dim=1)
    logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             target[:, 1:].reshape(-1), ignore_index=-100)


def supervised(model, tokenizer, demonstrate: Demonstrate | Sequence[Demonstrate], *, steps: int, batch_size: int,
               lr: float, seed: int, log: Callable[[str], None] = print) -> list[float]:
    """Supervised phase: ``steps`` AdamW steps on batches of ``demonstrate(rng)`` (prompt, response)
    texts, the loss on the response tokens only; returns the loss of every step. Several
    ``demonstrate`` functions take turns, one batch each (a batch of one kind shares its prompt
    prefix, which ``sft_loss`` computes once)."""
    import torch

    kinds = [demonstrate] if callable(demonstrate) else list(demonstrate)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    started = time.perf_counter()
    for step in range(steps):
        rows, prompt_lengths, trained = _sft_rows(tokenizer, rng, kinds[step % len(kinds)], batch_size)
        loss = sft_loss(model, rows, prompt_lengths, trained, tokenizer.pad_token_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % 100 == 0 or step + 1 == steps:
            log(f"warm start: step {step + 1}/{steps}, loss {sum(losses[-20:]) / len(losses[-20:]):.3f}, "
                f"{time.perf_counter() - started:.0f}s")
    model.eval()
    return losses


def build_policy(cache_dir: str | Path, spec: PolicySpec, log: Callable[[str], None] = print) -> Path:
    """The warm-started checkpoint for ``spec``: reused from ``cache_dir`` when built before."""
    return build_checkpoint(cache_dir, spec, task.build_tokenizer(), lambda rng: demonstration(rng, spec), log)


def build_checkpoint(cache_dir: str | Path, spec, tokenizer, demonstrate: Demonstrate,
                     log: Callable[[str], None] = print) -> Path:
    """A tiny Qwen3 over ``tokenizer``, shaped and warm-started as ``spec`` says (its model shape,
    ``sft_*`` settings and ``seed``) on ``demonstrate``; built once under ``cache_dir`` as
    ``policy-<spec.key()>`` and reused from there."""
    import torch
    from transformers import AutoModelForCausalLM

    from april_workbench.tiny_qwen3 import build_tiny_qwen3

    cache_dir = Path(cache_dir)
    out = cache_dir / f"policy-{spec.key()}"
    if (out / "demo_policy.json").exists():
        log(f"warm-started policy: reusing {out}")
        return out
    tmp = cache_dir / f".policy-{spec.key()}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_qwen3(tmp, tokenizer=tokenizer, vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
                     num_layers=spec.num_layers, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                     head_dim=spec.head_dim, seed=spec.seed)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    set_stop_token(model, tokenizer)
    log(f"warm start: {sum(p.numel() for p in model.parameters())} parameters, {spec.sft_steps} supervised steps")
    losses = supervised(model, tokenizer, demonstrate, steps=spec.sft_steps, batch_size=spec.sft_batch_size,
                        lr=spec.sft_lr, seed=spec.seed, log=log)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "demo_policy.json").write_text(json.dumps(
        {"spec": dataclasses.asdict(spec), "final_sft_loss": losses[-1] if losses else None}, indent=1))
    if out.exists():  # built concurrently by another process: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


def set_stop_token(model, tokenizer) -> None:
    """The engines stop on the config's EOS id: make it the task's end-of-text token."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.config.eos_token_id = eos
    model.config.pad_token_id = pad
    model.config.bos_token_id = None
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = pad
        model.generation_config.bos_token_id = None
