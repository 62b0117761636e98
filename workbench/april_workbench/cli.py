"""``april-slime`` command line: ``demo``, ``bench``, ``calibrate``, ``emulator``, ``settings``."""

from __future__ import annotations

import argparse
import os
import sys


def _settings(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="april-slime settings",
        description="Print every plugin setting (april_* keys) as a Markdown table.")
    parser.parse_args(argv)
    from april_slime.settings import settings_table_markdown

    print(settings_table_markdown())
    return 0


def _emulator(argv: list[str]) -> int:
    from april_workbench.emulator.__main__ import main as emulator_main

    return emulator_main(argv, prog="april-slime emulator")


def _bench(argv: list[str]) -> int:
    from april_workbench.bench import main as bench_main

    return int(bench_main(argv) or 0)


def _calibrate(argv: list[str]) -> int:
    from april_workbench.bench.calibrate import main as calibrate_main

    return int(calibrate_main(argv) or 0)


def _demo(argv: list[str]) -> int:
    from april_workbench.demo.cli import main as demo_main

    return int(demo_main(argv) or 0)


COMMANDS = {
    "demo": (_demo, "RL on CPU: real SGLang engines, partial rollouts, the plugin's loss"),
    "bench": (_bench, "rollout-policy benchmark against the SGLang emulator"),
    "calibrate": (_calibrate, "measure a live SGLang engine; write an engine spec for bench"),
    "emulator": (_emulator, "run SGLang-protocol emulator engines behind a router"),
    "settings": (_settings, "print the plugin settings table"),
}


def _usage() -> str:
    lines = ["usage: april-slime <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`april-slime <command> --help` shows the options of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"april-slime: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    handler, _ = COMMANDS[command]
    try:
        return handler(rest)
    except BrokenPipeError:
        # `april-slime settings | head`: the reader left; not an error of ours.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (stays open: it is stdout until exit)
        return 0


if __name__ == "__main__":
    sys.exit(main())
