"""The recorded SGLang 0.5.23 replies the emulator is held to (tests/data/sglang-0.5.23-golden.json)
still describe the live engine: the same scenarios, compared field by field."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from april_workbench.emulator.testing import golden_differences, golden_replies
from tests.support.real_tier import MAX_RUNNING_REQUESTS

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "sglang-0.5.23-golden.json"


def test_recorded_replies_match_the_live_engine(real_stack):
    import sglang

    recorded = json.loads(GOLDEN.read_text())
    assert sglang.__version__ == recorded["sglang_version"]
    start = real_stack.weight_version()
    try:
        live = asyncio.run(golden_replies(real_stack.engine_urls[0], max_running_requests=MAX_RUNNING_REQUESTS,
                                          new_weights_path=str(real_stack.other_model_path),
                                          weight_version=start))
    finally:
        real_stack.restore_weights()
    assert golden_differences(live, recorded["scenarios"]) == []
    for name, scenario in recorded["scenarios"].items():
        if name.startswith("bad_") and name != "bad_duplicate_rid":
            assert live[name]["reply"] == scenario["reply"], name
    meta = live["generate_after_update"]["reply"]["body"]["meta_info"]
    assert meta["weight_version"] == str(start + 1)
    assert live["model_info_after_update"]["reply"]["body"]["weight_version"] == str(start + 1)
