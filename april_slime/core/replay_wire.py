"""What training replays, on SGLang's wire: asking a ``/generate`` call for it and reading it from
the reply (routed experts of every position, slime's top-p kept ids and their log-probs, the
sampler's top-k). ``core.replay`` holds and stitches what is read here; every value is checked
before it is kept (``EngineReplyError`` names the field), as every other part of a reply is.
"""

from __future__ import annotations

import contextlib

from april_slime.core.replay import (
    INT32,
    ReplaySpec,
    SegmentReplay,
    decode_int32,
    decode_log_probs,
    float32_bytes,
    int32_bytes,
    int32_values,
)
from april_slime.core.sglang_values import (
    LOGPROB_TOLERANCE,
    EngineReplyError,
    ReplayReplyError,
    split_logprob_triples,
)

TOP_P_ID_KEYS = ("top_p_token_ids", "top_p_kept_token_ids")  # slime reads either name
TOP_P_OFFSET_KEYS = ("top_p_token_offsets", "top_p_kept_token_offsets")


def ask_for_replay(payload: dict, spec: ReplaySpec, routed_start: int) -> None:
    """Add to a ``/generate`` payload what ``spec`` replays: the routed experts of the positions
    from ``routed_start`` on, (slime's top-p patch) the top-p kept ids of every token and their
    log-probs, and the sampler top-k of every token (``top_logprobs_num``, as slime 0.4.0's
    ``slime/utils/score_centering.py`` asks)."""
    if spec.routed:
        payload["return_routed_experts"] = True
        if routed_start:
            payload["routed_experts_start_len"] = routed_start
    if spec.top_p:
        params = payload["sampling_params"]
        asked = {"return_top_p_token_ids": True, **({"return_top_p_log_probs": True} if spec.top_p_log_probs else {})}
        params["custom_params"] = {**(params.get("custom_params") or {}), **asked}
    if spec.topk:
        payload["return_logprob"] = True
        payload["top_logprobs_num"] = spec.topk


def parse_replay(meta: dict, where: str, spec: ReplaySpec, *, input_len: int, output_len: int,
                 routed_start: int, vocab_size: int | None) -> SegmentReplay | None:
    """The replay data of a reply of ``output_len`` tokens (None without tokens: an abort before
    the first token says nothing about any position)."""
    if output_len == 0:
        return None
    seg = SegmentReplay(routed_start=routed_start, routed_width=spec.routed_width)
    if spec.routed:
        with _replay_part("routed_experts"):
            seg.routed = parse_routed_experts(meta, where, spec, input_len=input_len, output_len=output_len,
                                              start=routed_start)
    if spec.top_p:
        with _replay_part("top_p_ids"):
            seg.top_p_ids, seg.top_p_counts = parse_top_p_token_ids(meta, where, output_len=output_len,
                                                                    vocab_size=vocab_size)
        if spec.top_p_log_probs:
            with _replay_part("top_p_log_probs"):
                seg.top_p_log_probs = _log_probs(meta, "top_p_log_probs", where, len(seg.top_p_ids) // INT32)
    if spec.topk:
        seg.topk = spec.topk
        with _replay_part("sampler_topk"):
            seg.topk_ids, seg.topk_log_probs = parse_sampler_topk(meta, where, k=spec.topk, output_len=output_len,
                                                                  vocab_size=vocab_size)
    return seg


@contextlib.contextmanager
def _replay_part(part: str):
    """A reply error raised while reading ``part`` of the replay data says which part it was."""
    try:
        yield
    except ReplayReplyError:
        raise
    except EngineReplyError as e:
        raise ReplayReplyError(str(e), part) from None


def _log_probs(meta: dict, key: str, where: str, count: int) -> bytes:
    try:
        return decode_log_probs(meta.get(key), f"meta_info.{key}", count, LOGPROB_TOLERANCE)
    except ValueError as e:
        raise EngineReplyError(f"{where}: {e} (slime's score centering needs the sampler's log-probs)") from None


def parse_sampler_topk(meta: dict, where: str, *, k: int, output_len: int,
                       vocab_size: int | None) -> tuple[bytes, bytes]:
    """The sampler's top-``k`` of every output token -> (ids int32, log-probs float32), rows in the
    engine's order: slime's patched SGLang sends ``output_topk_token_ids`` / ``_log_probs`` (base64,
    ``output_topk_shape`` [tokens, k]); stock SGLang ``output_top_logprobs`` (per token, ``k``
    ``[logprob, token_id, text]`` triples)."""
    if meta.get("output_topk_token_ids") is not None:
        if meta.get("output_topk_shape") != [output_len, k]:
            raise EngineReplyError(f"{where}: meta_info.output_topk_shape {meta.get('output_topk_shape')!r} is not "
                                   f"[{output_len}, {k}]")
        try:
            ids_raw = decode_int32(meta["output_topk_token_ids"], "meta_info.output_topk_token_ids")
        except ValueError as e:
            raise EngineReplyError(f"{where}: {e}") from None
        ids = list(int32_values(ids_raw))
        log_probs_raw = _log_probs(meta, "output_topk_log_probs", where, output_len * k)
    else:
        rows = meta.get("output_top_logprobs")
        if not isinstance(rows, list) or len(rows) != output_len or any(
                not isinstance(row, list) or len(row) != k for row in rows):
            raise EngineReplyError(f"{where}: meta_info.output_top_logprobs is not {output_len} rows of {k} entries "
                                   f"(the request asked top_logprobs_num={k})")
        log_probs, ids = split_logprob_triples([entry for row in rows for entry in row], where)
        log_probs_raw = float32_bytes(log_probs)
    if len(ids) != output_len * k:
        raise EngineReplyError(f"{where}: sampler top-{k} ids of {len(ids)} entries for {output_len} tokens")
    for row in range(output_len):
        chunk = ids[row * k:(row + 1) * k]
        if len(set(chunk)) != k or min(chunk) < 0 or (vocab_size is not None and max(chunk) >= vocab_size):
            raise EngineReplyError(f"{where}: sampler top-{k} ids of token {row} are not {k} distinct ids in the "
                                   f"vocabulary: {chunk}")
    return int32_bytes(ids), log_probs_raw


def parse_routed_experts(meta: dict, where: str, spec: ReplaySpec, *, input_len: int, output_len: int,
                         start: int) -> bytes:
    """``meta_info.routed_experts`` -> the rows of positions ``[start, input_len + output_len - 1)``.

    SGLang honours ``routed_experts_start_len`` (and sends only those rows); an engine that ignores
    it sends every position from 0, and the rows before ``start`` are dropped here. Any other row
    count is an error: a row short or over would shift every later token's routing."""
    value = meta.get("routed_experts")
    if value is None:
        raise EngineReplyError(f"{where}: no meta_info.routed_experts (routing replay needs engines started "
                               "with --enable-return-routed-experts)")
    try:
        raw = decode_int32(value, "meta_info.routed_experts")
    except ValueError as e:
        raise EngineReplyError(f"{where}: {e}") from None
    width = spec.routed_width * INT32
    end = input_len + output_len - 1
    if len(raw) % width:
        raise EngineReplyError(f"{where}: meta_info.routed_experts holds {len(raw) // INT32} values, not rows of "
                               f"{spec.routed_layers} layers x top-{spec.routed_topk}")
    rows = len(raw) // width
    if rows == end - start:
        return raw
    if start and rows == end:
        return raw[start * width:]
    raise EngineReplyError(f"{where}: meta_info.routed_experts has {rows} rows, but {input_len} input ids + "
                           f"{output_len} output tokens from position {start} need {end - start}")


def parse_top_p_token_ids(meta: dict, where: str, *, output_len: int,
                          vocab_size: int | None) -> tuple[bytes, bytes]:
    """slime's top-p replay fields -> (kept ids, one count per output token), both int32 bytes."""
    ids_key = next((k for k in TOP_P_ID_KEYS if meta.get(k) is not None), None)
    offsets_key = next((k for k in TOP_P_OFFSET_KEYS if meta.get(k) is not None), None)
    if ids_key is None or offsets_key is None:
        raise EngineReplyError(
            f"{where}: no meta_info.top_p_token_ids / top_p_token_offsets for {output_len} tokens sampled with "
            "top-p < 1 (the engine must return the top-p kept token ids: SGLang with slime's "
            "sglang-top_p.patch, as in slime's images)")
    try:
        ids_raw = decode_int32(meta[ids_key], f"meta_info.{ids_key}")
        offsets = int32_values(decode_int32(meta[offsets_key], f"meta_info.{offsets_key}"))
    except ValueError as e:
        raise EngineReplyError(f"{where}: {e}") from None
    n_ids = len(ids_raw) // INT32
    if len(offsets) != output_len + 1 or offsets[0] != 0 or offsets[-1] != n_ids:
        raise EngineReplyError(
            f"{where}: meta_info.{offsets_key} ({len(offsets)} offsets, first "
            f"{offsets[0] if offsets else None}, last {offsets[-1] if offsets else None}) does not split "
            f"{n_ids} kept ids over {output_len} tokens")
    counts = [b - a for a, b in zip(offsets, offsets[1:])]
    if min(counts) < 0:
        raise EngineReplyError(f"{where}: meta_info.{offsets_key} decreases at token {counts.index(min(counts))}")
    if n_ids:
        ids = int32_values(ids_raw)
        if min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
            raise EngineReplyError(f"{where}: meta_info.{ids_key} holds a token id outside [0, {vocab_size})")
    return ids_raw, int32_bytes(counts)
