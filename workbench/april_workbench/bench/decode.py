"""How fast the engine client decodes and checks one long SGLang ``/generate`` reply, as a ratio
to a bare ``orjson.loads`` of the same bytes, measured interleaved in one run.

    python -m april_workbench.bench.decode                 # 16,384 tokens, 30 rounds
    python -m april_workbench.bench.decode --tokens 32768 --rounds 50 --json decode.json

The reply is what SGLang 0.5.23 sends for a request with ``return_logprob``: ``text``,
``output_ids``, and ``meta_info`` with its ``[logprob, token_id, null]`` triples (float32 log-probs
widened to double, as SGLang's ``tolist`` gives them), two ``weight_versions`` spans and the
bookkeeping fields, encoded with orjson as SGLang encodes it. Every round times, in turn, on the
same bytes:

* ``orjson.loads`` alone: the floor, decoding and nothing else;
* the client: ``decode_generate_reply`` + ``parse_generate_reply``, what ``HttpTransport.request``
  and ``EngineClient.generate`` do with every reply;
* the reference: the standard library's ``json.loads`` + the item-by-item reply checks, which is
  what the client did before it used orjson and whole-list checks.

Times are the thread's CPU time (tokens/s per core: the time spent waiting for a core while other
jobs hold it is not counted), the fastest of ``--calls`` calls per path and round. A ratio is taken
within each round, so a machine whose speed drifts (other jobs sharing caches and memory
bandwidth) moves numerator and denominator alike; the report gives each ratio's median and its
min-max over the rounds, and tokens/s for each path.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from april_slime.core.sglang_protocol import (
    output_tokens,
    output_tokens_reference,
    parse_generate_reply,
)
from april_slime.core.transport import decode_generate_reply

VOCAB_SIZE = 151936  # Qwen3's
ENGINE_URL = "http://engine-0:30000"
RID = "bench-decode-0"


def sglang_reply(tokens: int, seed: int = 0) -> dict[str, Any]:
    """A ``/generate`` reply of ``tokens`` output tokens in SGLang 0.5.23's shape (the fields of
    tests/data/sglang-0.5.23-golden.json), with a weight update half-way through."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB_SIZE, tokens).tolist()
    logprobs = (-rng.exponential(0.8, tokens)).astype(np.float32).astype(np.float64).tolist()
    words = rng.choice(np.array(list("etaoinshrdlu ,.\n")), tokens * 4)
    half = tokens // 2
    meta = {
        "id": RID, "finish_reason": {"type": "length", "length": tokens}, "prompt_tokens": 512,
        "weight_version": "8", "num_retractions": 0, "reasoning_tokens": 0, "input_token_logprobs": [],
        "output_token_logprobs": [[lp, i, None] for lp, i in zip(logprobs, ids)],
        "output_token_logprobs_length": tokens, "completion_tokens": tokens, "cached_tokens": 512,
        "cached_tokens_details": {"device": 512, "host": 0}, "dp_rank": None,
        "weight_versions": [{"version": "7", "start": 0, "end": half},
                            {"version": "8", "start": half, "end": tokens}],
        "e2e_latency": 412.5, "response_sent_to_client_ts": 1795403149.6671498,
    }
    return {"text": "".join(words.tolist()), "output_ids": ids, "meta_info": meta}


def _client(raw: bytes) -> Any:
    return parse_generate_reply(decode_generate_reply(raw), engine_url=ENGINE_URL, rid=RID,
                                max_new_tokens=1 << 20, vocab_size=VOCAB_SIZE)


def _reference(raw: bytes) -> Any:
    reply = json.loads(raw)
    return output_tokens_reference(reply["output_ids"], reply["meta_info"]["output_token_logprobs"],
                               VOCAB_SIZE, f"engine {ENGINE_URL} rid {RID}")


PATHS: dict[str, Callable[[bytes], Any]] = {
    "orjson.loads": orjson.loads,
    "client": _client,
    "reference": _reference,
}
LABELS = {
    "orjson.loads": "orjson.loads alone (the floor)",
    "client": "client: decode_generate_reply + parse_generate_reply",
    "reference": "before: json.loads + item-by-item checks",
}


def measure(raw: bytes, rounds: int, calls: int) -> dict[str, list[float]]:
    """CPU seconds per call of every path in every round (this thread's CPU time, so the time it
    waits for a core on a loaded machine is left out): the fastest of ``calls`` calls, the paths'
    order rotating by round."""
    names = list(PATHS)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm up: first calls allocate
        PATHS[name](raw)
    gc.collect()
    for r in range(rounds):
        for name in names[r % 3:] + names[:r % 3]:
            fn = PATHS[name]
            best = float("inf")
            for _ in range(calls):
                t0 = time.thread_time()
                fn(raw)
                best = min(best, time.thread_time() - t0)
            seconds[name].append(best)
    return seconds


def summarize(seconds: dict[str, list[float]], tokens: int) -> dict[str, dict[str, float]]:
    base = seconds["orjson.loads"]
    out = {}
    for name, times in seconds.items():
        rate = [tokens / t for t in times]
        ratio = [t / b for t, b in zip(times, base)]
        out[name] = {"tokens_per_s_median": statistics.median(rate), "tokens_per_s_min": min(rate),
                     "tokens_per_s_max": max(rate), "ratio_median": statistics.median(ratio),
                     "ratio_min": min(ratio), "ratio_max": max(ratio)}
    return out


def format_report(summary: dict[str, dict[str, float]], tokens: int, size: int, rounds: int, calls: int) -> str:
    lines = [f"one /generate reply: {tokens:,} tokens, {size / 1e6:.2f} MB of JSON (text, output_ids, "
             f"log-prob triples, weight_versions spans)",
             f"{rounds} rounds, the paths interleaved, each round the fastest of {calls} calls; CPU time of one thread",
             f"{'path':<46} {'M tokens/s per core: median (min-max)':<39} {'time / orjson.loads: median (min-max)'}"]
    for name, s in summary.items():
        rate = (f"{s['tokens_per_s_median'] / 1e6:.2f} ({s['tokens_per_s_min'] / 1e6:.2f}-"
                f"{s['tokens_per_s_max'] / 1e6:.2f})")
        ratio = f"{s['ratio_median']:.2f}x ({s['ratio_min']:.2f}-{s['ratio_max']:.2f})"
        lines.append(f"{LABELS[name]:<46} {rate:<39} {ratio}")
    ref, client = summary["reference"], summary["client"]
    lines.append(f"client / before: {client['ratio_median'] / ref['ratio_median']:.2f} of the time "
                 f"({ref['ratio_median'] / client['ratio_median']:.1f}x faster)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m april_workbench.bench.decode",
                                description="Decode and check one long SGLang reply: tokens/s and the ratio to "
                                            "a bare orjson.loads, interleaved in one run.")
    p.add_argument("--tokens", type=int, default=16384, help="output tokens of the reply (default 16384)")
    p.add_argument("--rounds", type=int, default=30, help="rounds, each path in turn (default 30)")
    p.add_argument("--calls", type=int, default=5,
                   help="calls per path and round; the round keeps the fastest (default 5)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if min(args.tokens, args.rounds, args.calls) < 1:
        print("--tokens, --rounds and --calls must be >= 1", file=sys.stderr)
        return 2
    raw = orjson.dumps(sglang_reply(args.tokens))
    # the three paths must agree before their speed means anything
    result = _client(raw)
    reply = orjson.loads(raw)
    expected = output_tokens(reply["output_ids"], reply["meta_info"]["output_token_logprobs"], VOCAB_SIZE, "")
    if (result.output_ids.tolist(), result.logprobs.tolist()) != expected or _reference(raw) != expected:
        print("the client and the reference checks disagree on the reply", file=sys.stderr)
        return 1
    summary = summarize(measure(raw, args.rounds, args.calls), args.tokens)
    print(format_report(summary, args.tokens, len(raw), args.rounds, args.calls))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"tokens": args.tokens, "bytes": len(raw), "rounds": args.rounds, "calls": args.calls,
                       "paths": summary}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
