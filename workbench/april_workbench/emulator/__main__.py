"""``april-slime emulator`` (also ``python -m april_workbench.emulator``): serve an emulated SGLang
router and engines on loopback.

Every mistake on the command line (a port outside 0..65535, a port in use, a bad length preset,
a negative time) ends the program with one line on stderr naming the option, exit status 2 for a
bad option and 1 for a port that cannot be bound; never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import math
import socket
import sys
from dataclasses import fields

from .config import EngineConfig, TimeModel
from .model import LENGTH_PRESETS, LengthModel
from .testing import build_cluster

HOST = "127.0.0.1"
PROG = "april-slime emulator"
MAX_PORT = 65535


class UsageError(Exception):
    """A bad command-line value; the message is one line naming the option."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors as one line (its default prints the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog=prog,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Emulated SGLang router + engines on 127.0.0.1 (a stand-in for tests and "
                    "benchmarks: protocol, scheduling and memory behaviour, no language model).")
    p.add_argument("--port", type=int, default=30000,
                   help="router port, 0..65535; engines take the following ports (0 = free ports everywhere)")
    p.add_argument("--engines", type=int, default=1, help="number of engines")
    p.add_argument("--seed", type=int, default=0, help="seed of the token/length streams")
    p.add_argument("--length-dist", default="default",
                   help=f"length preset {sorted(LENGTH_PRESETS)}, optionally with overrides, e.g. "
                        "'dapo-math-qwen3-4b-16k:median_tokens=3000,truncation_fraction=0.1'")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="emulated seconds per wall second (e.g. 50 runs long contexts fast)")
    p.add_argument("--kv-capacity", type=int, default=EngineConfig.kv_capacity_tokens,
                   help="KV budget per engine, in tokens")
    p.add_argument("--max-running-requests", type=int, default=EngineConfig.max_running_requests,
                   help="requests one engine decodes at once")
    p.add_argument("--vocab-size", type=int, default=151936, help="token ids are below this")
    p.add_argument("--eos-token-id", type=int, default=151645, help="the id that ends a response")
    for f in fields(TimeModel):
        p.add_argument("--" + f.name.replace("_", "-"), type=float, default=f.default,
                       help=f"time model: {f.name} (seconds)")
    return p


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def check(args: argparse.Namespace) -> tuple[LengthModel, TimeModel]:
    """Validate the options; raises ``UsageError`` naming the first bad one."""
    if not 0 <= args.port <= MAX_PORT:
        raise UsageError(f"--port must be in 0..{MAX_PORT}, got {args.port}")
    if args.engines < 1:
        raise UsageError(f"--engines must be >= 1, got {args.engines}")
    if args.port and args.port + args.engines > MAX_PORT:
        raise UsageError(f"--port {args.port} leaves no room for {args.engines} engine port(s) after it "
                         f"(the last would be {args.port + args.engines} > {MAX_PORT})")
    if not (math.isfinite(args.time_scale) and args.time_scale > 0):
        raise UsageError(f"--time-scale must be a finite number > 0, got {args.time_scale}")
    for name in ("kv_capacity", "max_running_requests"):
        if getattr(args, name) < 1:
            raise UsageError(f"{_option(name)} must be >= 1, got {getattr(args, name)}")
    if args.vocab_size < 2:
        raise UsageError(f"--vocab-size must be >= 2, got {args.vocab_size}")
    if not 0 <= args.eos_token_id < args.vocab_size:
        raise UsageError(f"--eos-token-id must be in 0..{args.vocab_size - 1} (below --vocab-size), "
                         f"got {args.eos_token_id}")
    for f in fields(TimeModel):
        value = getattr(args, f.name)
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{_option(f.name)} must be a finite number >= 0, got {value}")
    try:
        length = LengthModel.parse(args.length_dist)
    except ValueError as e:
        raise UsageError(f"--length-dist: {e}") from e
    try:
        time_model = TimeModel(**{f.name: getattr(args, f.name) for f in fields(TimeModel)})
    except ValueError as e:
        raise UsageError(f"time model: {e}") from e
    return length, time_model


def _ports(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(port, what listens there) for every fixed port the options ask for."""
    if args.port == 0:
        return []
    return [(args.port, "router")] + [(args.port + 1 + i, f"engine {i + 1} of {args.engines}")
                                      for i in range(args.engines)]


def _port_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return True
    return False


def _bind_error(args: argparse.Namespace, exc: OSError) -> str:
    taken = [(port, role) for port, role in _ports(args) if _port_taken(port)]
    if exc.errno == errno.EADDRINUSE and taken:
        port, role = taken[0]
        return (f"port {port} ({role}) on {HOST} is already in use; choose another --port, "
                "or --port 0 for free ports")
    return f"cannot listen on {HOST} port(s) {[p for p, _ in _ports(args)] or 'chosen by the OS'}: " \
           f"{exc.strerror or exc}"


async def serve(args: argparse.Namespace, length: LengthModel, time_model: TimeModel) -> None:
    cluster = build_cluster(
        args.engines, args.seed, length=length,
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


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        length, time_model = check(args)
    except UsageError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(args, length, time_model))
    except OSError as exc:
        print(f"{prog}: {_bind_error(args, exc)}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m april_workbench.emulator"))
