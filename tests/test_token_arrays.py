"""The emulator's token arrays (``LogprobArrays``, the in-process form of a reply's tokens) against
SGLang's wire form: the same checks, the same errors, and the same runs bit for bit, of the rollout
scheduler and of the benchmark."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json

import numpy as np
import pytest

from april_slime.core.buffer import PartialBuffer
from april_slime.core.config import AprilConfig
from april_slime.core.engine import EngineClient
from april_slime.core.scheduler import RolloutScheduler
from april_slime.core.sglang_protocol import (
    EngineReplyError,
    LogprobArrays,
    _checked_arrays,
    output_tokens,
    output_tokens_reference,
    parse_generate_reply,
)
from april_workbench.bench import ENGINE_PRESETS, SyntheticPrompts, Workload, run_policy
from april_workbench.emulator import EmulatorCluster, SyntheticLM, run_virtual
from april_workbench.emulator.model import LengthModel
from april_workbench.emulator.server import wire_form
from tests.support.reply_tokens import VOCAB, WHERE, base_reply, mutated, outcome


def arrays_of(ids: list[int], triples: list[list]) -> tuple[np.ndarray, LogprobArrays]:
    token_ids = np.array([t[1] for t in triples], dtype=np.int64)
    return np.array(ids, dtype=np.int64), LogprobArrays(np.array([t[0] for t in triples], dtype=np.float64),
                                                        token_ids)


@pytest.mark.parametrize("name", ["well formed", "log-prob 0.0 and -0.0", "log-prob above the tolerance",
                                  "positive log-prob", "nan log-prob", "-inf log-prob", "negative token id",
                                  "token id at the vocabulary size", "output_ids other token",
                                  "output_ids one more", "output_ids one fewer", "no tokens"])
def test_token_arrays_give_what_their_wire_form_gives(name):
    ids, triples = mutated(name)
    output_ids, arrays = arrays_of(ids, triples)
    wire = wire_form({"output_ids": output_ids, "meta_info": {"output_token_logprobs": arrays}})
    assert wire["output_ids"] == ids and all(type(t) is int for t in wire["output_ids"])
    expected = outcome(output_tokens, wire["output_ids"], wire["meta_info"]["output_token_logprobs"], VOCAB, WHERE)
    assert expected == outcome(output_tokens_reference, ids, copy.deepcopy(triples), VOCAB, WHERE)
    assert outcome(output_tokens, output_ids, arrays, VOCAB, WHERE) == expected
    triples_only = outcome(output_tokens_reference, None, copy.deepcopy(triples), VOCAB, WHERE)
    assert outcome(output_tokens, None, arrays, VOCAB, WHERE) == triples_only
    if expected[0] == "ok":
        assert _checked_arrays(output_ids, arrays, VOCAB) is not None


def test_token_arrays_of_other_dtypes_are_read_as_their_values():
    ids, triples = base_reply()
    output_ids, arrays = arrays_of(ids, triples)
    narrow = LogprobArrays(arrays.logprobs.astype(np.float32), arrays.token_ids.astype(np.int32))
    assert _checked_arrays(output_ids.astype(np.int32), narrow, VOCAB) is None  # not the emulator's arrays
    got_ids, got_logprobs = output_tokens(output_ids.astype(np.int32), narrow, VOCAB, WHERE)
    assert got_ids == ids and got_logprobs == arrays.logprobs.astype(np.float32).tolist()
    floats = LogprobArrays(arrays.logprobs, arrays.token_ids.astype(np.float64))
    with pytest.raises(EngineReplyError, match="token id at position 0 is 5.0"):
        output_tokens(None, floats, VOCAB, WHERE)


def test_a_reply_with_token_arrays_parses_like_its_wire_form():
    ids, triples = base_reply(40)
    output_ids, arrays = arrays_of(ids, triples)
    meta = {"id": "r", "finish_reason": {"type": "length"}, "prompt_tokens": 3, "completion_tokens": 40,
            "weight_version": "2", "weight_versions": [{"version": "1", "start": 0, "end": 15},
                                                       {"version": "2", "start": 15, "end": 40}]}
    in_process = {"text": "", "output_ids": output_ids, "meta_info": dict(meta, output_token_logprobs=arrays)}
    wire = wire_form(in_process)
    assert isinstance(in_process["output_ids"], np.ndarray)  # the copy is converted, not the reply
    kw = dict(engine_url="http://e", rid="r", max_new_tokens=64, vocab_size=VOCAB)
    assert parse_generate_reply(in_process, **kw) == parse_generate_reply(json.loads(json.dumps(wire)), **kw)
    in_process["meta_info"]["output_token_logprobs"].logprobs[7] = np.nan
    with pytest.raises(EngineReplyError, match="log-prob at position 7 is not finite"):
        parse_generate_reply(in_process, **kw)


# ---------------------------------------------------------------------------------- whole runs
def _scheduler_run(token_arrays: bool) -> tuple[list, list]:
    """Three copris steps on two emulated engines (partials resumed across weight versions, one
    update inside a step): every trajectory after every step, and every step's metrics."""

    async def main():
        model = SyntheticLM(seed=5, length=LengthModel(median_tokens=120, truncation_fraction=0.1))
        cluster = EmulatorCluster(2, model=model, engine_config=ENGINE_PRESETS["h100-qwen3-4b"].engine_config())
        await cluster.start()
        client = EngineClient(cluster.engine_urls, transport=cluster.transport(token_arrays=token_arrays),
                              timeout_s=1e9, vocab_size=model.vocab_size)
        config = AprilConfig.from_dict({"policy": "copris", "concurrency": 24})
        buffer = PartialBuffer.from_config(config)
        scheduler = RolloutScheduler(config, client, buffer, rollout_batch_size=4, n_samples_per_prompt=4,
                                     sampling_params={"temperature": 1.0})
        prompts = SyntheticPrompts(16, 4, 600, model.vocab_size, seed=2)
        loop = asyncio.get_running_loop()
        seen, metrics = [], []
        try:
            for version in range(3):
                if version == 1:  # weights change under the calls in flight
                    loop.call_at(loop.time() + 0.5, cluster.bump_weight_version)
                result = await scheduler.run_step(prompts, version)
                metrics.append(result.metrics)
                for g in [*result.groups, *buffer.groups()]:
                    for t in g.trajectories:
                        seen.append((t.uid, t.status.value, t.response_ids, np.array(t.logprobs).tobytes(),
                                     t.version_runs, t.call_versions, [type(x) for x in t.logprobs[:1]]))
                cluster.bump_weight_version()
        finally:
            await client.close()
            await cluster.close()
        return seen, metrics

    return run_virtual(main())


def test_the_scheduler_on_token_arrays_makes_the_same_trajectories_bit_for_bit():
    seen, metrics = _scheduler_run(token_arrays=True)
    assert (seen, metrics) == _scheduler_run(token_arrays=False)
    assert sum(m["april/aborted_tokens"] for m in metrics) > 0  # partials were made and resumed
    assert any(len(runs) > 1 for *_, runs, _, _ in seen), "no trajectory spans two weight versions"
    assert all(types in ([float], []) for *_, types in seen)


@pytest.mark.parametrize("policy", ["april", "copris"])
def test_the_benchmark_on_token_arrays_measures_the_same_figures(policy):
    workload = Workload(name="tiny", length="short:median_tokens=150,truncation_fraction=0.05",
                        max_response_len=600, prompt_len=16, rollout_batch_size=8, n_samples_per_prompt=4,
                        steps=3, warmup_steps=1, policies=(policy,), timeline_interval_s=0.5,
                        load_poll_interval_s=1.0)
    spec = dataclasses.replace(ENGINE_PRESETS["h100-qwen3-4b"], num_engines=2, kv_capacity_tokens=12_000)

    def run(token_arrays: bool) -> dict:
        result = run_virtual(run_policy(policy, policy, workload, spec, token_arrays=token_arrays))
        figures = dataclasses.asdict(result)
        figures.pop("wall_s")
        return figures

    arrays = run(True)
    assert arrays == run(False)
    assert sum(s["metrics"]["april/aborted_tokens"] for s in arrays["steps"]) > 0
