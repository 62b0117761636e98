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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from april_slime.workbench.demo import task

# Bump when the build below changes in a way the settings do not capture.
BUILD_FORMAT = 1


@dataclass(frozen=True)
class PolicySpec:
    num_digits: int = 5
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    sft_steps: int = 300
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    label_noise: float = 0.2
    ramble_prob: float = 0.3
    ramble_mean: float = 12.0
    max_response_len: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_digits", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "sft_batch_size", "ramble_mean"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.sft_steps < 0:
            raise ValueError(f"sft_steps: must be >= 0, got {self.sft_steps}")
        for name in ("label_noise", "ramble_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: must lie in [0, 1], got {getattr(self, name)}")
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


def _sft_batch(tokenizer, rng: random.Random, spec: PolicySpec):
    """Right-padded input ids, attention mask and labels (-100 outside the responses)."""
    import torch

    rows, labels = [], []
    for _ in range(spec.sft_batch_size):
        prompt, response = demonstration(rng, spec)
        p = tokenizer.encode(prompt, add_special_tokens=False)
        r = tokenizer.encode(response, add_special_tokens=False)
        rows.append(p + r)
        labels.append([-100] * len(p) + r)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    target = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    return ids, mask, target


def warm_start(model, tokenizer, spec: PolicySpec, log: Callable[[str], None] = print) -> list[float]:
    """Supervised phase on noisy demonstrations; returns the loss of every step."""
    import torch

    rng = random.Random(spec.seed)
    torch.manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    model.train()
    losses = []
    started = time.perf_counter()
    for step in range(spec.sft_steps):
        ids, mask, target = _sft_batch(tokenizer, rng, spec)
        loss = model(input_ids=ids, attention_mask=mask, labels=target).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % 100 == 0 or step + 1 == spec.sft_steps:
            log(f"warm start: step {step + 1}/{spec.sft_steps}, loss {sum(losses[-20:]) / len(losses[-20:]):.3f}, "
                f"{time.perf_counter() - started:.0f}s")
    model.eval()
    return losses


def build_policy(cache_dir: str | Path, spec: PolicySpec, log: Callable[[str], None] = print) -> Path:
    """The warm-started checkpoint for ``spec``: reused from ``cache_dir`` when built before."""
    import torch
    from transformers import AutoModelForCausalLM

    from april_slime.workbench.tiny_qwen3 import build_tiny_qwen3

    cache_dir = Path(cache_dir)
    out = cache_dir / f"policy-{spec.key()}"
    if (out / "demo_policy.json").exists():
        log(f"warm-started policy: reusing {out}")
        return out
    tmp = cache_dir / f".policy-{spec.key()}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = task.build_tokenizer()
    build_tiny_qwen3(tmp, tokenizer=tokenizer, vocab_size=len(task.VOCAB), hidden_size=spec.hidden_size,
                     num_layers=spec.num_layers, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                     head_dim=spec.head_dim, seed=spec.seed)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    set_stop_token(model, tokenizer)
    log(f"warm start: {sum(p.numel() for p in model.parameters())} parameters, {spec.sft_steps} supervised steps")
    losses = warm_start(model, tokenizer, spec, log)
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
