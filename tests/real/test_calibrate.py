"""``april-slime calibrate`` against the real tier's SGLang CPU engines behind sglang-router.

Its default grid (batches up to the engine's running limit, a context per batch that fills 80% of
the KV pool): it must find the router's engines, read the KV pool, the running limit and the GPUs
per engine (tensor parallel 1 here) the engines were started with, measure decode steps that cost
time, abort a request the engine reports running, and write a spec that ``april-slime bench
--engine-spec`` runs. Nothing here is bounded by a clock: the numbers go to docs/bench.md
(``APRIL_CALIBRATE_OUT=path`` keeps the spec, ``APRIL_CALIBRATE_COMPARE_OUT=path`` the comparison)."""

import json
import math
import os
from pathlib import Path

from april_workbench.bench import EngineSpec, Workload, run_benchmark
from april_workbench.bench.calibrate import compare
from april_workbench.bench.calibrate import main as calibrate_main
from tests.support.real_tier import MAX_RUNNING_REQUESTS, MAX_TOTAL_TOKENS


def test_calibrate_measures_the_real_engine(real_stack, tmp_path, capsys):
    out = os.environ.get("APRIL_CALIBRATE_OUT") or str(tmp_path / "spec.json")
    rc = calibrate_main(["--url", real_stack.router_url, "--out", out, "--decode-tokens", "12",
                         "--prefill-lengths", "32,512,2048", "--repeats", "3", "--base-preset", "h100-qwen3-4b"])
    assert rc == 0, capsys.readouterr().err
    real_stack.wait_idle()
    spec_json = json.loads(Path(out).read_text())
    m = spec_json["measurements"]
    assert m["engine_url"].rstrip("/") in [u.rstrip("/") for u in real_stack.engine_urls]
    assert m["num_engines"] == len(real_stack.engine_urls)
    assert 0 < m["kv_capacity_tokens"] <= MAX_TOTAL_TOKENS + 1024
    assert m["max_running_requests"] == MAX_RUNNING_REQUESTS
    assert m["gpus_per_engine"] == 1 and spec_json["gpus_per_engine"] == 1  # from /server_info's tp_size
    # the default grid reaches the running limit and most of the pool
    assert m["largest_batch"] == MAX_RUNNING_REQUESTS
    assert m["largest_kv_tokens"] >= 0.5 * m["kv_capacity_tokens"]
    assert all(point["decode_step_s"] > 0 for point in m["decode_grid"])
    assert m["decode_t0"] >= 0 and m["decode_per_request"] >= 0 and m["decode_per_kv_token"] >= 0
    assert m["decode_t0"] + m["decode_per_request"] > 0
    assert math.isfinite(m["decode_fit"]["max_relative_error"])
    assert m["abort_latency_s"] >= 0  # the reply came back aborted (measure checks its finish reason)
    spec = EngineSpec.load(out)
    assert spec.kv_capacity() == m["kv_capacity_tokens"] and spec.num_gpus == len(real_stack.engine_urls)
    w = Workload(name="t", length="short", max_response_len=64, prompt_len=16, rollout_batch_size=4,
                 n_samples_per_prompt=2, steps=2, warmup_steps=1, policies=("sync", "copris"))
    result = run_benchmark(w, spec)
    assert all(s["throughput_tokens_per_s"] > 0 for s in result.summaries.values())
    # the real-engine comparison: batches off the grid, real vs emulated on this spec
    shapes = [(2, 64, 24), (6, 128, 24), (12, 32, 16)]
    rows = compare(real_stack.router_url, spec, shapes)
    real_stack.wait_idle()
    keep = os.environ.get("APRIL_CALIBRATE_COMPARE_OUT")
    if keep:
        with open(keep, "w") as fh:
            json.dump(rows, fh, indent=2)
    assert [(r["batch"], r["prompt_len"], r["new_tokens"]) for r in rows] == shapes
    assert all(r["real_s"] > 0 and r["emulated_s"] > 0 and math.isfinite(r["ratio"]) for r in rows)
