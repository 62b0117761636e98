"""What an episode's model calls served, matched against the sample its generate function returned.

A function keeps each call's ``output_ids`` and log-probs in the sample it returns (slime's
``Sample.append_response_tokens``), with tool output between them, loss-masked. The trained tokens
must be exactly what the plugin served, so each gets the policy version, the top-p kept ids and the
routed experts of the call that generated it; a sample whose trainable tokens are not those fails
loudly (``EpisodeError``: the episode is re-run, then given up), and a function whose calls cannot
be replayed at all stops the job (``EpisodeRefused``). Nothing here knows slime: the face hands over
the returned sample's tokens, loss mask and log-probs.
"""

from __future__ import annotations

import math

from april_slime.core.episodes import EpisodeError, EpisodeRefused, ModelCall
from april_slime.core.replay import INT32, ReplaySpec, TokenReplay, float32_bytes, int32_bytes, stitch_calls
from april_slime.core.types import Trajectory

# a returned log-prob must be the served one up to float32 rounding done by the function's JSON
LOGPROB_MATCH_TOLERANCE = 1e-6


def match_served(uid: str, response: list[int], mask: list[int], logprobs: list[float],
                  served: list[ModelCall]) -> list[int]:
    """The policy version of every response token: trainable tokens, in order, must be exactly the
    tokens the plugin served the episode (their log-probs too); others take the version before them."""
    served_ids = [i for c in served for i in c.trajectory.response_ids]
    served_lps = [lp for c in served for lp in c.trajectory.logprobs]
    served_versions = [v for c in served for v in c.trajectory.token_versions()]
    trainable = [k for k, m in enumerate(mask) if m]
    if [response[k] for k in trainable] != served_ids:
        at = next((n for n, (k, s) in enumerate(zip(trainable, served_ids)) if response[k] != s),
                  min(len(trainable), len(served_ids)))
        raise EpisodeError(f"sample {uid}: its trainable tokens ({len(trainable)}) are not the {len(served_ids)} "
                           f"tokens its model calls returned (first difference at trainable token {at}); a "
                           "generate function must keep each call's output_ids as they are")
    for n, k in enumerate(trainable):
        if not math.isclose(logprobs[k], served_lps[n], abs_tol=LOGPROB_MATCH_TOLERANCE):
            raise EpisodeError(f"sample {uid}: rollout log-prob {logprobs[k]} of response token {k} is not "
                               f"the {served_lps[n]} its model call returned")
    return _spread(mask, served_versions)


def match_calls(uid: str, response: list[int], mask: list[int], logprobs: list[float],
                 served: list[ModelCall], skip: set[int] = frozenset()) -> tuple[list[int], list[int]]:
    """One sample of a fan-out: its trainable tokens, in order, must be the whole outputs (tokens and
    log-probs) of some of the served calls (those not in ``skip``), in call order. Returns the
    version of every response token and the indices of the calls it holds."""
    trainable = [k for k, m in enumerate(mask) if m]
    at, calls, versions = 0, [], []
    for k, call in enumerate(served):
        t = call.trajectory
        n = len(t.response_ids)
        if k in skip or n == 0 or at + n > len(trainable):
            continue
        here = trainable[at:at + n]
        if ([response[j] for j in here] == list(t.response_ids)
                and all(math.isclose(logprobs[j], lp, abs_tol=LOGPROB_MATCH_TOLERANCE)
                        for j, lp in zip(here, t.logprobs))):
            calls.append(k)
            versions += t.token_versions()
            at += n
    if at != len(trainable):
        raise EpisodeError(f"sample {uid}: its trainable tokens from token {at} of {len(trainable)} on are not "
                           f"the whole output of any further model call of its episode ({len(served)} calls); a "
                           "generate function must keep each call's output_ids and log-probs as they are")
    return _spread(mask, versions), calls


def _spread(mask: list[int], trainable_versions: list[int]) -> list[int]:
    """The version of every response token: trainable tokens in order take ``trainable_versions``;
    others (tool output) the version before them."""
    out, last = [], trainable_versions[0] if trainable_versions else 0
    by_token = iter(trainable_versions)
    for m in mask:
        if m:
            last = next(by_token)
        out.append(last)
    return out


def served_sampler(mask: list[int], served: list[ModelCall], spec: ReplaySpec) -> TokenReplay:
    """What the sampler kept for an episode's response, token by token, as ``spec`` (its top-p and
    top-k parts) asks: each trainable token's from the call that served it (``match_served`` checked
    they are those tokens, in order): its top-p kept ids (and their log-probs) and its sampler top-k
    row. The others (tool output, loss-masked) hold no kept id, as slime pads them, and a top-k row
    no loss reads: the ids 0..k-1 at log(1/k) each (a valid distribution, so a score computed over it
    stays finite)."""
    sampler = ReplaySpec(top_p=spec.top_p, top_p_log_probs=spec.top_p_log_probs, topk=spec.topk)
    topk, row = spec.topk, spec.topk * INT32
    ids, counts, lps = bytearray(), [], bytearray()
    topk_ids, topk_lps = bytearray(), bytearray()
    filler_ids = int32_bytes(range(topk))
    filler_lps = float32_bytes([-math.log(topk)] * topk) if topk else b""
    calls = iter(served)
    call: ModelCall | None = None
    pos, held = 0, 0
    for m in mask:
        if not m:
            counts.append(0)
            topk_ids += filler_ids
            topk_lps += filler_lps
            continue
        while call is None or pos >= held:
            call, pos = next(calls), 0
            t = call.trajectory
            held = t.response_length
            missing = "no sampler data" if t.replay is None else t.replay.covers(sampler, len(t.prompt_ids), held)
            if missing is not None:
                raise EpisodeError(f"model call {t.uid} holds {missing}")
            offsets = t.replay.top_p_offsets() if spec.top_p else None
        replay = call.trajectory.replay
        if spec.top_p:
            start, end = offsets[pos] * INT32, offsets[pos + 1] * INT32
            ids += replay.top_p_ids[start:end]
            if spec.top_p_log_probs:
                lps += replay.top_p_log_probs[start:end]
            counts.append(offsets[pos + 1] - offsets[pos])
        if topk:
            topk_ids += replay.topk_ids[pos * row:(pos + 1) * row]
            topk_lps += replay.topk_log_probs[pos * row:(pos + 1) * row]
        pos += 1
    out = TokenReplay()
    if spec.top_p:
        out.top_p_ids, out.top_p_counts = ids, bytearray(int32_bytes(counts))
        out.top_p_log_probs = lps if spec.top_p_log_probs else None
    if topk:
        out.topk, out.topk_ids, out.topk_log_probs = topk, topk_ids, topk_lps
    return out


ROUTED_NOT_A_PREFIX = (
    "sample {where}: with use_rollout_routing_replay each model call's input_ids must be the returned "
    "sample's tokens before that call's output_ids (model call {n} of {calls}: {what}); the routed experts "
    "the engine ran are those of the call's own input, so a function whose calls do not continue its "
    "sample's tokens (concurrent calls, a prompt re-tokenized differently) cannot be replayed")


def served_routed(where: str, tokens: list[int], mask: list[int], calls: list[ModelCall],
                   served: list[ModelCall], width: int) -> bytearray:
    """The routed experts of a returned sample's ``len(tokens) - 1`` positions, stitched over the
    episode's calls that ran a prefix of it, in the order they were made (``core.replay.stitch_calls``:
    each position's from the first call that ran it, a tool's observation's from the call that read
    it as prompt; one sample of a fan-out gets the rows its conversation got in the calls before
    its own). Each of ``calls`` (those whose tokens it holds) must have run a prefix of the sample:
    ``EpisodeRefused`` otherwise (the function's code, not this episode's luck)."""
    if not mask:
        return bytearray()
    own = [c for c in calls if c.trajectory.response_ids]
    for n, call in enumerate(own):
        t = call.trajectory
        start, end = len(t.prompt_ids), len(t.prompt_ids) + len(t.response_ids)
        what = None
        if tokens[:start] != t.prompt_ids:
            what = f"its {start} input ids are not the sample's first {start} tokens"
        elif tokens[start:end] != t.response_ids:
            what = f"its {end - start} output ids are not the sample's tokens {start} to {end}"
        if what is not None:
            raise EpisodeRefused(ROUTED_NOT_A_PREFIX.format(where=where, n=n, calls=len(own), what=what))
    mine = {id(c) for c in own}
    ran = [c for c in served if id(c) in mine or (c.trajectory.response_ids and _ran_a_prefix(c.trajectory, tokens))]
    try:
        return stitch_calls(width, len(tokens) - 1, [c.trajectory.replay for c in ran])
    except ValueError as e:
        raise EpisodeError(f"sample {where}: {e}") from None


def _ran_a_prefix(t: Trajectory, tokens: list[int]) -> bool:
    start, end = len(t.prompt_ids), len(t.prompt_ids) + len(t.response_ids)
    return end <= len(tokens) and tokens[:start] == t.prompt_ids and tokens[start:end] == t.response_ids


def release_routed(calls: list[ModelCall]) -> None:
    """A finished episode's samples hold their stitched rows; its calls' own (each a whole prefix of
    the conversation) are not needed again, though the calls stay with the episode until its group
    is trained."""
    for call in calls:
        if call.trajectory.replay is not None:
            call.trajectory.replay.routed = None
