"""Record what a real SGLang CPU engine answers to the emulator's protocol scenarios.

    python scripts/real-stack/record_golden.py                 # starts its own engine (tiny model)
    python scripts/real-stack/record_golden.py --python "$(cat .venv/sglang-0.5.15.post1-python)"
    python scripts/real-stack/record_golden.py --engine-url URL --model DIR --other-model DIR2 \
        --max-running-requests R

writes tests/data/sglang-<version>-golden.json (the version the engine reports on /v1/loads).
tests/test_emulator.py compares the emulator's replies with 0.5.23's (field by field,
``reply_shape``), tests/test_sglang_versions.py holds the engine client to both versions' replies,
and the real tier re-checks each against a live engine. ``--python`` serves the engine from another
interpreter (the SGLang 0.5.15.post1 layer ``setup.sh`` builds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

from april_workbench.emulator.testing import golden_replies
from april_workbench.localstack import LocalEngine, real_stack_missing
from april_workbench.tiny_qwen3 import build_tiny_qwen3

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"


def engine_sglang_version(engine_url: str) -> str:
    with urllib.request.urlopen(f"{engine_url}/v1/loads") as r:
        return json.loads(r.read())["version"]


def record(engine_url: str, other_model: str, max_running_requests: int) -> dict:
    with urllib.request.urlopen(f"{engine_url}/model_info") as r:
        version = int(json.loads(r.read())["weight_version"])
    sglang_version = engine_sglang_version(engine_url)
    replies = asyncio.run(golden_replies(engine_url, max_running_requests=max_running_requests,
                                         new_weights_path=other_model, weight_version=version))
    return {"sglang_version": sglang_version, "max_running_requests": max_running_requests,
            "scenarios": replies}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine-url")
    parser.add_argument("--other-model", help="weights /update_weights_from_disk loads (same shape)")
    parser.add_argument("--max-running-requests", type=int, default=4)
    parser.add_argument("--python", help="interpreter that serves the engine (default: this one)")
    parser.add_argument("--out", type=Path, default=None, help="default: tests/data/sglang-<version>-golden.json")
    ns = parser.parse_args()
    missing = real_stack_missing()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    if ns.engine_url:
        result = record(ns.engine_url, ns.other_model, ns.max_running_requests)
    else:
        from transformers import AutoTokenizer

        with tempfile.TemporaryDirectory() as tmp:
            model = build_tiny_qwen3(Path(tmp) / "a", eos_rate=1 / 24)
            other = build_tiny_qwen3(Path(tmp) / "b", tokenizer=AutoTokenizer.from_pretrained(model), seed=1,
                                     eos_rate=1 / 24)
            with LocalEngine(model, max_running_requests=ns.max_running_requests, python=ns.python) as engine:
                result = record(engine.url, str(other), ns.max_running_requests)
    out = ns.out or DATA / f"sglang-{result['sglang_version']}-golden.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
