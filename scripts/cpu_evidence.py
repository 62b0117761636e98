#!/usr/bin/env python
"""Run the CPU off-policy evidence experiment (docs/evidence.md, april_workbench/experiments/evidence.py).

    .venv/bin/python scripts/cpu_evidence.py            # docs/results/evidence.png + .json
    .venv/bin/python scripts/cpu_evidence.py --lr 3e-3 --name evidence_stress

Writes <out-dir>/<name>.png and <out-dir>/<name>.json (compact, see
workbench/april_workbench/experiments/result_file.py) and prints the markdown table.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace
from pathlib import Path

from april_workbench.experiments import evidence, result_file, summary


def main(argv: list[str] | None = None) -> int:
    defaults = evidence.EvidenceSettings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(evidence.DEFAULT_METHODS),
                        choices=list(evidence.METHODS))
    parser.add_argument("--workers", type=int, default=2,
                        help="processes, one torch thread each (1 = run in this process)")
    parser.add_argument("--out-dir", type=Path, default=Path("docs/results"))
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
    rows = summary.summarize(results)
    results["summary"] = rows
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out_dir / f"{args.name}.json", args.out_dir / f"{args.name}.png"
    result_file.write(results, json_path)  # compact: one line per series (see result_file)
    summary.plot(results, png_path)
    print()
    print(summary.markdown_table(rows, settings))
    print(f"\nwall time {results['wall_seconds']:.0f}s with {args.workers} worker(s); "
          f"wrote {png_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
