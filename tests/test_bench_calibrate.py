"""``april-slime calibrate`` against the emulator on its virtual clock: it must recover the time
model the emulator runs with, and its spec must load into the bench."""

import json

import pytest

from april_workbench.bench import EngineSpec, Workload, run_benchmark
from april_workbench.bench.calibrate import engine_spec, measure
from april_workbench.bench.calibrate import main as calibrate_main
from april_workbench.emulator import EmulatorCluster, EngineConfig, TimeModel, run_virtual

TRUTH = TimeModel(decode_t0=0.03, decode_per_request=0.004, decode_per_kv_token=4e-6,
                  prefill_t0=0.02, prefill_per_token=2e-5, prefill_per_request=0.003)


def test_calibrate_recovers_the_emulated_engine_and_writes_a_loadable_spec():
    """On the emulator's virtual clock (its in-process transport), so the measured times are the
    engine's own and the fit must recover the law it runs, whatever the machine's load; the HTTP
    path is the same code with ``HttpTransport`` (tests/real/test_calibrate.py, the CLI test)."""

    async def run():
        cluster = EmulatorCluster(2, engine_config=EngineConfig(
            time=TRUTH, kv_capacity_tokens=40_000, max_running_requests=64))
        await cluster.start()
        try:
            m = await measure(cluster.router_url, batches=(1, 4, 8), contexts=(64, 512), decode_tokens=12,
                              prefill_lengths=(64, 1024), repeats=2, timeout_s=30, transport=cluster.transport())
        finally:
            await cluster.close()
        return m, cluster.engine_urls[0]

    m, first_engine = run_virtual(run())
    assert m["num_engines"] == 2 and m["engine_url"] == first_engine
    assert m["kv_capacity_tokens"] == 40_000
    # the fitted law predicts the engine's decode step over the grid, and over a point outside it
    fitted = TimeModel(decode_t0=m["decode_t0"], decode_per_request=m["decode_per_request"],
                       decode_per_kv_token=m["decode_per_kv_token"])
    for batch, kv in [(1, 100), (4, 2_000), (8, 4_000), (16, 8_000)]:
        assert fitted.decode_step(batch, kv) == pytest.approx(TRUTH.decode_step(batch, kv), rel=1e-3)
    for key in ("decode_t0", "decode_per_request", "decode_per_kv_token", "prefill_t0", "prefill_per_request",
                "prefill_per_token"):
        assert m[key] == pytest.approx(getattr(TRUTH, key), rel=1e-3), key
    assert m["decode_fit"]["max_relative_error"] < 1e-9
    assert 0 <= m["abort_latency_s"] < 0.5
    spec = EngineSpec.from_dict(json.loads(json.dumps(engine_spec(m, "h100-qwen3-4b"))))
    assert spec.kv_capacity() == 40_000 and spec.num_engines == 2
    tm = spec.time_model()
    assert tm.decode_t0 == m["decode_t0"] and tm.decode_flops_per_request == 0  # measured: no roofline
    assert tm.prefill_per_request == m["prefill_per_request"]
    assert tm.prefill_per_token_pair == m["prefill_per_token_pair"]
    # the bench runs on it
    w = Workload(name="t", length="short", max_response_len=64, prompt_len=16, rollout_batch_size=4,
                 n_samples_per_prompt=2, steps=2, warmup_steps=1, policies=("sync",))
    result = run_benchmark(w, spec)  # its own (virtual) event loop
    assert result.summaries["sync"]["throughput_tokens_per_s"] > 0


def test_concurrent_calibration_runs_every_engine_at_once():
    """``concurrent``: each grid point on every engine behind the router at the same time (engines
    sharing a machine's cores slow each other; the emulator's do not, so the law is the same)."""
    seen: set[str] = set()

    async def run():
        cluster = EmulatorCluster(2, engine_config=EngineConfig(
            time=TRUTH, kv_capacity_tokens=40_000, max_running_requests=64))
        await cluster.start()
        inner = cluster.transport()

        class Watch:
            async def request(self, method, url, path, payload, timeout_s):
                if path == "/generate":
                    seen.add(url)
                return await inner.request(method, url, path, payload, timeout_s)

            async def close(self):
                await inner.close()

        try:
            return await measure(cluster.router_url, batches=(1, 4, 8), contexts=(64, 512), decode_tokens=12,
                                 prefill_lengths=(64, 1024), repeats=1, timeout_s=30, transport=Watch(),
                                 concurrent=True)
        finally:
            await cluster.close()

    m = run_virtual(run())
    assert m["concurrent"] is True and len(seen) == 2
    assert m["decode_per_request"] == pytest.approx(TRUTH.decode_per_request, rel=1e-3)


def test_calibrate_cli_names_bad_input(capsys):
    assert calibrate_main(["--url", "http://127.0.0.1:9", "--batches", "1,x"]) == 2
    assert "--batches" in capsys.readouterr().err
    assert calibrate_main(["--url", "http://127.0.0.1:9", "--batches", "1", "--contexts", "64"]) == 2
    assert "grid" in capsys.readouterr().err
    # nothing listens on port 9: a clear error, not a traceback
    assert calibrate_main(["--url", "http://127.0.0.1:9", "--timeout", "5"]) == 2
    assert "127.0.0.1:9" in capsys.readouterr().err


def test_engine_spec_json_rejects_unknown_keys(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"base_preset": "h100-qwen3-4b", "decode_t0": 0.01, "decod_t0": 1}))
    with pytest.raises(ValueError, match="decod_t0"):
        EngineSpec.load(str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="spec.json"):
        EngineSpec.load(str(path))


def test_default_grid_reaches_the_bench_regime():
    from april_workbench.bench import ENGINE_PRESETS
    from april_workbench.bench.calibrate import plan_grid

    preset = ENGINE_PRESETS["h100-qwen3-4b"]  # the headline: ~250 requests, ~0.7M KV tokens per engine
    points = plan_grid(None, None, capacity=preset.kv_capacity(), max_running=1024, context_len=40960,
                       decode_tokens=16)
    assert max(b for b, _ in points) == 256
    assert max(b * (c + 16) for b, c in points) >= 0.75 * preset.kv_capacity()
    assert all(b * (c + 16) <= 0.9 * preset.kv_capacity() for b, c in points)
    # a small engine: the running limit and the context bound the grid, nothing overflows the pool
    small = plan_grid(None, None, capacity=32768, max_running=16, context_len=4096, decode_tokens=12)
    assert {b for b, _ in small} == {1, 4, 16} and max(c + 8 * 12 for _, c in small) <= 4096 - 2
    assert all(b * (c + 8 * 12) <= 0.9 * 32768 for b, c in small)


def test_spec_counts_every_gpu_of_an_engine():
    m = {"engine_url": "http://x", "num_engines": 4, "model_path": None, "decode_t0": 0.005,
         "decode_per_request": 1e-5, "decode_per_kv_token": 1e-8, "prefill_t0": 0.01, "prefill_per_token": 1e-5,
         "prefill_per_token_pair": 0.0, "kv_capacity_tokens": 700_000, "abort_latency_s": 0.02,
         "max_running_requests": 1024, "gpus_per_engine": 2}
    spec = EngineSpec.from_dict(json.loads(json.dumps(engine_spec(m, "h100-qwen3-4b"))))
    assert spec.gpus_per_engine == 2 and spec.num_gpus == 8  # a 4 x TP2 node trains on 8 GPUs
    assert EngineSpec.from_dict(engine_spec(m, "h100-qwen3-4b", gpus_per_engine=4)).num_gpus == 16
    unknown = dict(m, gpus_per_engine=None)  # an engine that does not say: the base preset's layout
    assert EngineSpec.from_dict(engine_spec(unknown, "a800-r1-distill-1.5b-vllm")).gpus_per_engine == 1
    assert EngineSpec.from_dict(engine_spec(unknown, "h100-qwen3-4b")).gpus_per_engine == 2


def test_fit_report_states_the_extrapolation_error():
    from april_workbench.bench.calibrate import fit_report

    rows = [[1.0, b, k] for b, k in [(1, 100), (4, 2000), (16, 8000), (64, 40000), (256, 600000)]]
    linear = [0.003 + 2e-6 * b + 1e-8 * k for _, b, k in rows]
    exact = fit_report(rows, linear)
    assert exact["max_relative_error"] < 1e-9 and exact["extrapolation_relative_error"] < 1e-9
    assert exact["extrapolated_point"] == 600000
    # a step law that bends at large batches (compute-bound): the left-out point says by how much
    bent = [t + (0.004 if b >= 256 else 0.0) for t, (_, b, _) in zip(linear, rows)]
    assert fit_report(rows, bent)["extrapolation_relative_error"] > 0.2
