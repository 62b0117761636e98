"""The result file of the CPU evidence experiment (``evidence.run_experiment`` plus its ``summary``),
as ``scripts/cpu_evidence.py`` writes it to ``docs/<name>.json``.

The file is read by people and diffed in review, so it is compact JSON: the settings and the
summary rows (every number docs/evidence.md quotes) at full precision, one line per top-level entry
and per summary row; each run's scalars on one line and each of its per-step series on one line,
rounded to the precision a curve needs (``SERIES_DIGITS``), except the held-out reward, which
stays exact (``EXACT_SERIES``); durations to 0.1 s. NaN is written as
null, so the file is strict JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

SERIES_DIGITS = 4  # significant digits of each value of a per-step series
# Kept exact: the summary's reward columns are computed from them (a mean of multiples of
# 1/eval_prompts can sit exactly on a rounding boundary of the 3 decimals the tables show).
EXACT_SERIES = ("eval_step", "eval_reward")
SERIES_ROUNDING = (f"per-step series other than {', '.join(EXACT_SERIES)} rounded to {SERIES_DIGITS} significant "
                   "digits; the summary was computed before rounding; null = NaN (after a divergence, or a "
                   "metric the method does not have)")


def _json_safe(value: Any) -> Any:
    """NaN (steps after a divergence, metrics a method does not have) becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _rounded(value: Any, digits: int) -> Any:
    return float(f"{value:.{digits}g}") if isinstance(value, float) else value


def _line(value: Any) -> str:
    return json.dumps(value, allow_nan=False, ensure_ascii=False)


def to_text(results: dict[str, Any]) -> str:
    """``results`` (``run_experiment``'s, with its ``summary``) as the compact JSON text of the
    result file: one line per top-level entry, per summary row and per series of a run."""
    data = _json_safe(results)
    head = {k: v for k, v in data.items() if k not in ("summary", "runs")}
    head["wall_seconds"] = round(head["wall_seconds"], 1)
    head["warm_start_seconds"] = {k: round(v, 1) for k, v in head["warm_start_seconds"].items()}
    head["series_rounding"] = SERIES_ROUNDING
    entries = [f"{_line(key)}: {_line(value)}" for key, value in head.items()]
    entries.append(_block("summary", [_line(row) for row in data.get("summary", [])]))
    entries.append(_block("runs", [_run_text(run) for run in data["runs"]]))
    return "{\n " + ",\n ".join(entries) + "\n}\n"


def _block(key: str, items: list[str]) -> str:
    return f"{_line(key)}: [\n  " + ",\n  ".join(items) + "\n ]"


def _run_text(run: dict[str, Any]) -> str:
    """One run: its scalars on the first line, then one line per series."""
    scalars = {k: (round(v, 1) if k == "seconds" else v) for k, v in run.items() if not isinstance(v, list)}
    lines = [f"{_line(k)}: {_line(v)}" for k, v in scalars.items()]
    lines = [", ".join(lines)] if lines else []
    lines += [f"{_line(k)}: {_line(v if k in EXACT_SERIES else [_rounded(x, SERIES_DIGITS) for x in v])}"
              for k, v in run.items() if isinstance(v, list)]
    return "{" + ",\n   ".join(lines) + "}"


def write(results: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(to_text(results), encoding="utf-8")
