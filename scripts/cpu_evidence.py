#!/usr/bin/env python
"""Run the CPU off-policy evidence experiment (see docs/evidence.md and april_slime/workbench/experiments/evidence.py).

    .venv/bin/python scripts/cpu_evidence.py            # docs/evidence.png + .json
    .venv/bin/python scripts/cpu_evidence.py --lr 3e-3 --name evidence_stress

Writes <out-dir>/<name>.png and <out-dir>/<name>.json and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import fields, replace
from pathlib import Path

from april_slime.workbench.experiments import evidence


def _json_safe(value):
    """NaN (steps after a divergence, metrics a method does not have) becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    defaults = evidence.EvidenceSettings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(evidence.DEFAULT_METHODS),
                        choices=list(evidence.METHODS))
    parser.add_argument("--workers", type=int, default=2,
                        help="processes, one torch thread each (1 = run in this process)")
    parser.add_argument("--out-dir", type=Path, default=Path("docs"))
    parser.add_argument("--name", default="evidence",
                        help="file stem of the outputs: <out-dir>/<name>.png and <name>.json")
    for f in fields(evidence.EvidenceSettings):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)),
                            default=getattr(defaults, f.name), dest=f.name)
    args = parser.parse_args(argv)
    settings = replace(defaults, **{f.name: getattr(args, f.name)
                                    for f in fields(evidence.EvidenceSettings)})

    results = evidence.run_experiment(settings, args.methods, args.seeds, workers=args.workers,
                                      log=lambda line: print(line, flush=True))
    rows = evidence.summarize(results)
    results["summary"] = rows
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out_dir / f"{args.name}.json", args.out_dir / f"{args.name}.png"
    json_path.write_text(
        json.dumps(_json_safe(results), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    evidence.plot(results, png_path)
    print()
    print(evidence.markdown_table(rows, settings))
    print(f"\nwall time {results['wall_seconds']:.0f}s with {args.workers} worker(s); "
          f"wrote {png_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
