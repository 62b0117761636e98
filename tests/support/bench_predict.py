"""``april-slime bench predict`` on a job's lengths, as the fast and the real tier's tests run it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def predict(lengths: Path, folder: Path, *, engines: int, rounds: int) -> dict[str, Any]:
    """The prediction for ``lengths`` (a dump or JSONL) on the preset engine spec, unbounded arms only:
    the one workload entry of the command's JSON."""
    from april_workbench.bench.cli import main as bench_main

    spec = folder / "spec.json"
    spec.write_text(json.dumps({"base_preset": "h100-qwen3-4b", "num_engines": engines}))
    out = folder / "p.json"
    assert bench_main(["predict", "--lengths", str(lengths), "--engine-spec", str(spec), "--rounds", str(rounds),
                       "--bounds", "-", "--json", str(out)]) == 0
    (entry,) = json.loads(out.read_text())["workloads"].values()
    return entry
