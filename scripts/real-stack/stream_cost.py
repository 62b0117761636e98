"""What streaming SGLang's /generate replies would cost the rollout client, per token.

A reply that an engine fault cuts off is lost whole: with non-streaming replies the client sees a
call's tokens only when the call ends. Streaming (``"stream": true``) would show them as they come,
so a fault would lose only the tokens since the last chunk; but every chunk is one more JSON body
for the client's single event loop to read and check. This measures that price on a real SGLang
0.5.23 CPU engine: it records the raw bytes of the same long response asked for without streaming,
streamed (SGLang's default: every chunk repeats the whole output so far), and streamed with
``--incremental-streaming-output`` (every chunk holds only its new tokens) at ``--stream-interval``
1 (a chunk per token, the default) and 16; then it times, on this process's
CPU and away from the engine, what the client does with those bytes (decode the JSON and check
the tokens the way ``april_slime.core.sglang_protocol`` does).

    python scripts/real-stack/stream_cost.py [--tokens 2000] [--json out.json]

Needs the real-stack environment (``scripts/real-stack/setup.sh``); starts its own engines (one at
a time) and stops them. The figures are CPU microseconds per output token (median of repeats).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from april_slime.core.replay import NO_REPLAY
from april_slime.core.sglang_protocol import generate_request, output_tokens, parse_generate_reply
from april_slime.core.transport import decode_json
from april_workbench.localstack import LocalEngine, real_stack_missing
from april_workbench.tiny_qwen3 import build_tiny_qwen3

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
# (incremental streaming output, --stream-interval): SGLang's default, then chunks of their new
# tokens only, one per token and one per 16 tokens
CONFIGS = ((False, 1), (True, 1), (True, 16))


def post_raw(url: str, payload: dict) -> bytes:
    request = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return reply.read()


def sse_bodies(raw: bytes) -> list[bytes]:
    """The JSON bodies of an SSE stream (``data: {...}`` events, ending with ``data: [DONE]``)."""
    bodies = []
    for event in raw.split(b"\n\n"):
        event = event.strip()
        if event.startswith(b"data:"):
            body = event[5:].strip()
            if body != b"[DONE]":
                bodies.append(body)
    return bodies


def parse_whole(raw: bytes, tokens: int) -> int:
    result = parse_generate_reply(decode_json(raw), engine_url="e", rid="whole", max_new_tokens=tokens)
    return len(result.output_ids)


def parse_stream(raw: bytes, incremental: bool) -> int:
    """What a streaming client must do: read every chunk, check its tokens, keep them."""
    ids: list[int] = []
    logprobs: list[float] = []
    for body in sse_bodies(raw):
        chunk = decode_json(body)
        triples = chunk["meta_info"]["output_token_logprobs"]
        new_ids, new_lps = output_tokens(chunk["output_ids"], triples, None, "stream")
        if incremental:
            ids += new_ids
            logprobs += new_lps
        else:  # every chunk repeats the output so far
            ids, logprobs = new_ids, new_lps
    return len(ids)


def cpu_us_per_token(fn, raw: bytes, tokens: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        got = fn(raw)
        times.append(time.process_time() - start)
        assert got == tokens, f"parsed {got} tokens, expected {tokens}"
    return statistics.median(times) / tokens * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000, help="output tokens of the measured response")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--save-dir", type=Path, default=None, help="keep the recorded reply bytes here")
    ns = parser.parse_args(argv)
    missing = real_stack_missing()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    payload = generate_request(PROMPT, max_new_tokens=ns.tokens, rid="stream-cost", sampling_seed=0,
                               sampling_params={"temperature": 1.0, "ignore_eos": True}, vocab_size=None,
                               replay=NO_REPLAY, replay_rows=0, where="stream cost")
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_qwen3(Path(tmp) / "tiny")
        for incremental, interval in CONFIGS:
            extra = ["--stream-interval", str(interval)]
            if incremental:
                extra.append("--incremental-streaming-output")
            with LocalEngine(model, extra_args=extra) as engine:
                whole = post_raw(engine.url, {**payload, "rid": "whole"})
                streamed = post_raw(engine.url, {**payload, "rid": "streamed", "stream": True})
            name = f"{'incremental' if incremental else 'cumulative'}, interval {interval}"
            if ns.save_dir:
                ns.save_dir.mkdir(parents=True, exist_ok=True)
                (ns.save_dir / f"{name.replace(', ', '-').replace(' ', '')}.sse").write_bytes(streamed)
                (ns.save_dir / "whole.json").write_bytes(whole)
            parse = (lambda r: parse_stream(r, True)) if incremental else (lambda r: parse_stream(r, False))
            figures[name] = {
                "chunks": len(sse_bodies(streamed)),
                "bytes_per_token": len(streamed) / ns.tokens,
                "cpu_us_per_token": cpu_us_per_token(parse, streamed, ns.tokens, ns.repeats),
            }
            figures.setdefault("one reply", {
                "chunks": 1,
                "bytes_per_token": len(whole) / ns.tokens,
                "cpu_us_per_token": cpu_us_per_token(lambda r: parse_whole(r, ns.tokens), whole, ns.tokens,
                                                     ns.repeats),
            })
            print(f"{name}: {figures[name]}", flush=True)
    print(f"one reply: {figures['one reply']}")
    print(f"\n{ns.tokens} output tokens; client CPU microseconds per token (median of {ns.repeats}):")
    for name, f in figures.items():
        print(f"  {name:28s} {f['cpu_us_per_token']:9.2f} us/token  {f['bytes_per_token']:8.0f} "
              f"bytes/token  {f['chunks']} chunks")
    if ns.json:
        ns.json.write_text(json.dumps({"tokens": ns.tokens, "figures": figures}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
