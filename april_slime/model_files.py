"""What the rollout reads of the model's own files: its vocabulary size and its end-of-sequence ids.

Both come from the Hugging Face checkpoint slime loads the tokenizer from (``--hf-checkpoint``),
through ``transformers`` when it can read them, else from the tokenizer.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def vocab_size(checkpoint: str | None, tokenizer: Any) -> int | None:
    """Size of the model's vocabulary (its embedding rows), which every token id sent to or
    received from an engine must stay below: the checkpoint's config when it can be read, else the
    tokenizer's length, else unknown (then only ids >= 0 are checked)."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=True)
        config = getattr(config, "text_config", None) or config
        if isinstance(getattr(config, "vocab_size", None), int):
            return config.vocab_size
    except Exception as e:  # no transformers, or no config next to the tokenizer
        logger.debug("vocabulary size not read from %s: %s", checkpoint, e)
    try:
        return len(tokenizer)
    except TypeError:
        logger.warning("vocabulary size unknown (no model config, tokenizer without a length): token "
                       "ids are only checked to be >= 0")
        return None


def eos_token_ids(checkpoint: str | None, tokenizer: Any) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and the checkpoint's
    ``generation_config.json`` eos_token_id (an id or a list; chat models list several)."""
    ids = []
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.append(eos)
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(checkpoint).eos_token_id
    except Exception as e:  # no transformers, or no generation config next to the tokenizer
        logger.debug("no generation config read from %s: %s", checkpoint, e)
        eos = None
    ids += [eos] if isinstance(eos, int) else [t for t in (eos or []) if isinstance(t, int)]
    return sorted(set(ids))
