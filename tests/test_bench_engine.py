"""The engine model behind the bench: SGLang-like admission and retraction, prefill attention at
long context, the CUDA-graph batch limit, abort latency, and the specs that switch them on."""

import asyncio

import pytest

from april_workbench.bench.spec import ENGINE_PRESETS
from april_workbench.emulator import EngineConfig, SyntheticLM, TimeModel, run_virtual
from april_workbench.emulator.batching import EmulatedEngine
from april_workbench.emulator.model import SampleProfile
from april_workbench.emulator.request import _Request

NEVER_STOPS = SyntheticLM(seed=0)


def _running(engine, specs):
    """Put requests straight into the running set: (rid, input_len, generated, max_new_tokens)."""
    loop = asyncio.get_running_loop()
    for rid, input_len, generated, budget in specs:
        req = _Request(rid, input_len, 0, 0, budget, SampleProfile(0, 0, None), False,
                       loop.create_future(), 0.0)
        req.generated = generated
        req.state = "running"
        engine._requests[rid] = req
        engine._running.append(req)
        engine._kv_used += req.kv_tokens


async def _retracted(config):
    engine = EmulatedEngine(NEVER_STOPS, config)
    # admission order: a (long output), c (no output yet, long prompt), b (no output, short prompt)
    _running(engine, [("a", 100, 400, 1000), ("c", 300, 0, 1000), ("b", 50, 0, 1000)])
    engine._kv_used = config.kv_capacity_tokens  # the next decode step overflows
    engine._retract_to_fit()
    return [r.rid for r in engine._waiting], engine


def test_sglang_retraction_takes_fewest_outputs_longest_input_first_to_the_back():
    async def main():
        config = EngineConfig(kv_capacity_tokens=900, admission_reserve_tokens=0, retraction="sglang",
                              admission_new_token_ratio=0.7, new_token_ratio_decay=0.001,
                              min_new_token_ratio=0.098, retract_decode_steps=20)
        waiting, engine = await _retracted(config)
        # SGLang's retract_decode: fewest output tokens first, then the longest input -> c;
        # vLLM-like "newest-front" would take b, the last admitted
        assert waiting[0] == "c"
        assert [r.rid for r in engine._running][0] == "a"
        # the new-token ratio jumps to (decoded + 20 x running) / budget of what still runs
        still = engine._running
        expected = min(1.0, (sum(r.generated for r in still) + 20 * len(still))
                       / (sum(r.max_new_tokens for r in still) + 1))
        assert engine._new_token_ratio == pytest.approx(expected)
        old, _ = await _retracted(EngineConfig(kv_capacity_tokens=900, admission_reserve_tokens=0))
        assert old[0] == "b"

    run_virtual(main())


def test_new_token_ratio_decays_per_decode_step_to_its_floor():
    async def main():
        config = EngineConfig(time=TimeModel(decode_t0=0.01), kv_capacity_tokens=100_000,
                              admission_new_token_ratio=0.7, new_token_ratio_decay=0.01,
                              min_new_token_ratio=0.3, retraction="sglang")
        engine = EmulatedEngine(NEVER_STOPS, config)
        engine.start()
        reply = await engine.generate("r", [1, 2, 3, 4], 20, 0, ignore_eos=True)
        assert reply["meta_info"]["completion_tokens"] == 20
        assert engine._new_token_ratio == pytest.approx(0.7 - 0.01 * 20)
        await engine.generate("s", [1, 2, 3, 4], 40, 0, ignore_eos=True)
        assert engine._new_token_ratio == pytest.approx(0.3)  # floored
        await engine.stop()

    run_virtual(main())


def test_prefill_pays_attention_per_query_key_pair():
    tm = TimeModel(decode_t0=0.01, prefill_t0=0.002, prefill_per_token=1e-5, prefill_per_token_pair=1e-8)
    assert tm.prefill_step(1000, 1000 * 1001 / 2) == pytest.approx(0.002 + 0.01 + 0.005005)

    async def main():
        engine = EmulatedEngine(NEVER_STOPS, EngineConfig(time=tm, kv_capacity_tokens=100_000))
        engine.start()
        await engine.generate("r", list(range(1, 4001)), 1, 0, ignore_eos=True)
        n = 4000
        assert engine.prefill_s == pytest.approx(0.002 + 1e-5 * n + 1e-8 * n * (n + 1) / 2)
        await engine.stop()

    run_virtual(main())


def test_decode_over_the_cuda_graph_limit_runs_eagerly_and_matmuls_overlap_the_weight_read():
    tm = TimeModel(decode_t0=0.003, decode_per_request=1e-6, graph_max_batch=256,
                   eager_step_extra_s=0.002, decode_flops_per_request=6e-6, decode_overlap_s=0.0016)
    assert tm.decode_step(256, 0) == pytest.approx(0.003 + 256e-6 * 1 + max(0, 256 * 6e-6 - 0.0016))
    assert tm.decode_step(257, 0) - tm.decode_step(256, 0) == pytest.approx(0.002 + 1e-6)
    # below the crossover (266 requests) the matmuls hide under the weight read: one more
    # request costs 1 us; above it, its matmuls too
    assert tm.decode_step(101, 0) - tm.decode_step(100, 0) == pytest.approx(1e-6)
    assert tm.decode_step(401, 0) - tm.decode_step(400, 0) == pytest.approx(7e-6)


def test_abort_reply_comes_after_the_abort_latency():
    async def main():
        engine = EmulatedEngine(NEVER_STOPS, EngineConfig(time=TimeModel(decode_t0=0.01),
                                                          abort_latency_s=0.05))
        engine.start()
        loop = asyncio.get_running_loop()
        task = loop.create_task(engine.generate("r", [1, 2, 3, 4], 10_000, 0, ignore_eos=True))
        await asyncio.sleep(0.5)
        t0 = loop.time()
        assert engine.abort("r") == 1
        reply = await task
        assert reply["meta_info"]["finish_reason"]["type"] == "abort"
        assert loop.time() - t0 == pytest.approx(0.05)
        assert engine.load()["num_running_reqs"] == 0  # the engine freed it at once
        await engine.stop()

    run_virtual(main())


def test_presets_switch_on_the_engine_they_model():
    sglang = ENGINE_PRESETS["h100-qwen3-4b"]
    config = sglang.engine_config()
    assert config.retraction == "sglang" and config.admission_new_token_ratio == 0.7
    assert config.time.graph_max_batch == 256  # TP 2 < 4
    assert config.time.prefill_per_token_pair > 0 and config.abort_latency_s > 0
    vllm = ENGINE_PRESETS["h800-qwen3-8b-vllm"].engine_config()
    assert vllm.retraction == "newest-front" and vllm.admission_new_token_ratio == 0.0
