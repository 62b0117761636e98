"""A tiny Qwen3 for the local real stack: a random Qwen3 and a tokenizer trained here, no hub access.

    build_tiny_qwen3(dir)                     # random Qwen3 + a locally trained tokenizer
    build_tiny_qwen3(dir, num_experts=8)      # the same as a Qwen3-MoE (top-2 routing by default)

Only the standard library is imported at module level; transformers / tokenizers / torch are
imported by ``build_tiny_qwen3`` when it runs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_tiny_qwen3", "tiny_corpus"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_corpus(n: int = 6000, seed: int = 0) -> list[str]:
    """Deterministic short texts (arithmetic questions and answers, number words) to train the
    tokenizer on: enough distinct strings for a 2K-token BPE vocabulary."""
    import random

    rng = random.Random(seed)
    words = ("zero one two three four five six seven eight nine ten eleven twelve plus minus times "
             "equals answer question what is the sum of and product difference between number "
             "result think step first then finally so therefore because check again box").split()
    texts = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op, value = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
        phrase = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        texts.append(f"Question: what is {a} {op} {b}? {phrase}. Answer: \\boxed{{{value}}}")
    return texts


def build_tiny_qwen3(out_dir: str | os.PathLike, *, texts: Sequence[str] | None = None, tokenizer: Any = None,
                     vocab_size: int = 2048, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     num_kv_heads: int = 2, head_dim: int = 16, seed: int = 0,
                     eos_rate: float | None = None, num_experts: int = 0, experts_per_token: int = 2) -> Path:
    """Save a random Qwen3 and its tokenizer to ``out_dir`` (``save_pretrained``); no hub access.

    The tokenizer is ``tokenizer`` when given, else a byte-level BPE trained here on ``texts``
    (default ``tiny_corpus()``) up to ``vocab_size`` tokens, with Qwen's special tokens and EOS
    ``<|im_end|>``. The model's vocabulary is the tokenizer's size, so every id it samples decodes.

    ``eos_rate``: when set, the weights are shaped so that sampling at temperature 1 ends a response
    with about this probability per token (lengths spread geometrically: a long tail under a
    budget); the other tokens' logits get a standard deviation of 2 so the distribution is not flat.
    Unset, EOS is as likely as any token (about 1/vocab) and nearly every response runs to its
    budget. Deterministic for a given ``seed``.

    ``num_experts`` > 0 builds a Qwen3-MoE instead (every layer sparse, ``experts_per_token`` experts
    routed per token, expert width ``hidden_size // 2``): what routing replay is tested on.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = _train_tokenizer(list(texts) if texts is not None else tiny_corpus(seed=seed), vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token) if tokenizer.eos_token else None
    if eos_id is None:
        raise ValueError("the tokenizer has no eos_token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="float32",
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
    )
    if num_experts > 0:
        if not 1 <= experts_per_token <= num_experts:
            raise ValueError(f"experts_per_token must lie in [1, {num_experts}], got {experts_per_token}")
        config = Qwen3MoeConfig(**common, num_experts=num_experts, num_experts_per_tok=experts_per_token,
                                moe_intermediate_size=max(1, hidden_size // 2), decoder_sparse_step=1,
                                mlp_only_layers=[], norm_topk_prob=True)
        model_cls = Qwen3MoeForCausalLM
    else:
        config, model_cls = Qwen3Config(**common), Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if num_experts > 0:
        # initialised at std 0.02, the router's logits are nearly equal and its top-k a near tie that
        # any two float32 implementations may break differently; std 2/sqrt(hidden) spreads them
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, 2.0 / hidden_size ** 0.5)
    if eos_rate is not None:
        if not 0.0 < eos_rate < 1.0:
            raise ValueError(f"eos_rate must lie in (0, 1), got {eos_rate}")
        _shape_eos(model, eos_id, eos_rate, seed)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not texts:
        raise ValueError("texts is empty: the tokenizer needs something to train on")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _shape_eos(model: Any, eos_id: int, eos_rate: float, seed: int) -> None:
    """Make hidden dimension 0 a constant the layers never write (embedding column 0 constant,
    row 0 of every attention / MLP output projection zero), read only by the EOS row of the
    untied LM head. The EOS logit is then ``w * h0`` with ``h0`` (dimension 0 after the final RMS
    norm) nearly constant, and ``w`` is solved so the mean EOS probability over random contexts is
    ``eos_rate``."""
    import torch

    inner = model.model
    with torch.no_grad():
        emb = inner.embed_tokens.weight
        emb[:, 0] = emb[:, 1:].norm(dim=1).mean()
        for layer in inner.layers:
            layer.self_attn.o_proj.weight[0, :] = 0
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None:  # MoE: the fused experts' down projections, [experts, hidden, width]
                experts.down_proj[:, 0, :] = 0
            else:
                layer.mlp.down_proj.weight[0, :] = 0
        head = model.lm_head.weight
        head[:, 0] = 0
        head[eos_id] = 0
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, emb.shape[0], (8, 64), generator=g)
        h = inner(input_ids=ids).last_hidden_state.reshape(-1, emb.shape[1])
        logits = h @ head.T
        others = torch.ones(emb.shape[0], dtype=torch.bool)
        others[eos_id] = False
        head[others] *= 2.0 / logits[:, others].std()
        log_z = torch.logsumexp((h @ head.T)[:, others], dim=1)
        h0 = h[:, 0]

        def rate(w: float) -> float:
            return float(torch.sigmoid(w * h0 - log_z).mean())

        lo, hi = 0.0, 1.0
        while rate(hi) < eos_rate:
            hi *= 2.0
            if hi > 1e6:
                raise RuntimeError("cannot reach the requested eos_rate")
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if rate(mid) < eos_rate else (lo, mid)
        head[eos_id, 0] = (lo + hi) / 2
