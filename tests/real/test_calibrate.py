"""``april-slime calibrate`` against the real tier's SGLang CPU engines behind sglang-router.

A small grid (tiny model): it must find the router's engines, read the KV pool the engines were
started with, measure positive step costs, abort within the ~0.1 s real SGLang takes, and write a
spec that ``april-slime bench --engine-spec`` runs. The spec is also what docs/bench.md's
real-engine comparison uses (``APRIL_CALIBRATE_OUT=path`` keeps it)."""

import json
import os

from april_slime.workbench.bench import EngineSpec, Workload, run_benchmark
from april_slime.workbench.bench.calibrate import compare
from april_slime.workbench.bench.calibrate import main as calibrate_main
from tests.support.real_tier import MAX_TOTAL_TOKENS


def test_calibrate_measures_the_real_engine(real_stack, tmp_path, capsys):
    out = os.environ.get("APRIL_CALIBRATE_OUT") or str(tmp_path / "spec.json")
    rc = calibrate_main(["--url", real_stack.router_url, "--out", out, "--batches", "1,4",
                         "--contexts", "32,256", "--decode-tokens", "9", "--prefill-lengths",
                         "32,512", "--repeats", "3", "--base-preset", "h100-qwen3-4b"])
    assert rc == 0, capsys.readouterr().err
    real_stack.wait_idle()
    spec_json = json.loads(open(out).read())
    m = spec_json["measurements"]
    assert m["engine_url"].rstrip("/") in [u.rstrip("/") for u in real_stack.engine_urls]
    assert m["num_engines"] == len(real_stack.engine_urls)
    assert 0 < m["kv_capacity_tokens"] <= MAX_TOTAL_TOKENS + 1024
    assert m["decode_t0"] > 0 and m["prefill_t0"] >= 0
    assert 0 <= m["abort_latency_s"] < 2.0
    spec = EngineSpec.load(out)
    assert spec.kv_capacity() == m["kv_capacity_tokens"]
    w = Workload(name="t", length="short", max_response_len=64, prompt_len=16, rollout_batch_size=4,
                 n_samples_per_prompt=2, steps=2, warmup_steps=1, policies=("sync", "copris"))
    result = run_benchmark(w, spec)
    assert all(s["throughput_tokens_per_s"] > 0 for s in result.summaries.values())
    # the real-engine comparison: batches outside the grid, real vs emulated on this spec
    shapes = [(2, 64, 24), (6, 128, 24), (12, 32, 16)]
    rows = compare(real_stack.router_url, spec, shapes)
    real_stack.wait_idle()
    keep = os.environ.get("APRIL_CALIBRATE_COMPARE_OUT")
    if keep:
        with open(keep, "w") as fh:
            json.dump(rows, fh, indent=2)
    for row in rows:
        # a shared 2-core machine: a loose bound, the numbers themselves go to docs/bench.md
        assert 0.3 < row["ratio"] < 3.0, row
