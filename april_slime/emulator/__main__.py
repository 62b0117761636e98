"""``python -m april_slime.emulator``: serve an emulated SGLang router and engines on loopback."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from dataclasses import fields

from .batching import EngineConfig, TimeModel
from .model import LENGTH_PRESETS, LengthModel
from .testing import build_cluster

HOST = "127.0.0.1"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m april_slime.emulator",
        description="Emulated SGLang router + engines on 127.0.0.1 (a stand-in for tests and "
                    "benchmarks: protocol, scheduling and memory behaviour, no language model).")
    p.add_argument("--port", type=int, default=30000,
                   help="router port; engines take the following ports (0 = free ports everywhere)")
    p.add_argument("--engines", type=int, default=1, help="number of engines")
    p.add_argument("--seed", type=int, default=0, help="seed of the token/length streams")
    p.add_argument("--length-dist", default="default",
                   help=f"length preset {sorted(LENGTH_PRESETS)}, optionally with overrides, e.g. "
                        "'dapo-math-qwen3-4b-16k:median_tokens=3000,truncation_fraction=0.1'")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="emulated seconds per wall second (e.g. 50 runs long contexts fast)")
    p.add_argument("--kv-capacity", type=int, default=EngineConfig.kv_capacity_tokens,
                   help="KV budget per engine, in tokens")
    p.add_argument("--max-running-requests", type=int, default=EngineConfig.max_running_requests)
    p.add_argument("--vocab-size", type=int, default=151936)
    p.add_argument("--eos-token-id", type=int, default=151645)
    for f in fields(TimeModel):
        p.add_argument("--" + f.name.replace("_", "-"), type=float, default=f.default,
                       help=f"time model: {f.name} (seconds)")
    return p


async def serve(args: argparse.Namespace) -> None:
    time_model = TimeModel(**{f.name: getattr(args, f.name) for f in fields(TimeModel)})
    cluster = build_cluster(
        args.engines, args.seed, length=LengthModel.parse(args.length_dist),
        vocab_size=args.vocab_size, eos_token_id=args.eos_token_id, time=time_model,
        time_scale=args.time_scale, kv_capacity_tokens=args.kv_capacity,
        max_running_requests=args.max_running_requests)
    await cluster.start()
    engine_ports = [0 if args.port == 0 else args.port + 1 + i for i in range(args.engines)]
    try:
        await cluster.serve_http(HOST, args.port, engine_ports)
        print(f"router {cluster.router_url}", flush=True)
        for url in cluster.engine_urls:
            print(f"engine {url}", flush=True)
        await asyncio.Event().wait()  # until Ctrl-C
    finally:
        await cluster.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(args))
    except (ValueError, OSError) as exc:
        print(f"emulator: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
