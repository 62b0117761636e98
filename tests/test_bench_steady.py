"""Steady state (warm-up detected from the buffer's age distribution), the headline band and the
published-figure table."""

import json
import math
from dataclasses import replace

import pytest

from april_slime.workbench.bench import ENGINE_PRESETS, Workload
from april_slime.workbench.bench.band import Variant, headline_variants, length_spec, run_band
from april_slime.workbench.bench.reproduce import Row, Run, _published, format_rows, reproduce, rows
from april_slime.workbench.bench.runner import StepRecord, detect_warmup


def steps(buffer, age):
    return [StepRecord(i, i, 0.0, 1.0, 1.0, {}, buffer_tokens=b, buffer_age_mean=a)
            for i, (b, a) in enumerate(zip(buffer, age))]


def test_warmup_ends_where_the_buffer_stops_filling():
    ramp = [0, 4e4, 8e4, 1.2e5, 1.6e5, 2e5, 2.3e5, 2.5e5]
    flat = [2.5e5 + (7e3 if i % 2 else -7e3) for i in range(22)]
    age = [0, 0.5, 1.0, 1.4, 1.8, 2.0, 2.1, 2.2] + [2.2 + (0.05 if i % 2 else -0.05) for i in range(22)]
    warmup, stationary = detect_warmup(steps(ramp + flat, age), minimum=1)
    assert 6 <= warmup <= 9 and stationary
    # a buffer that never stops filling is reported as such
    growing = [1e4 * i for i in range(30)]
    _, stationary = detect_warmup(steps(growing, [0.1 * i for i in range(30)]))
    assert not stationary
    # sync: nothing buffered, the minimum warm-up; too short a run is never called stationary
    assert detect_warmup(steps([0] * 30, [0] * 30), minimum=1) == (1, True)
    assert detect_warmup(steps([0] * 3, [0] * 3), minimum=1)[1] is False


def tiny(**kw):
    args = dict(name="tiny", length="short:median_tokens=120,truncation_fraction=0.05",
                max_response_len=500, prompt_len=16, rollout_batch_size=6, n_samples_per_prompt=4,
                steps=4, warmup_steps=1, policies=("sync", "copris"), timeline_interval_s=0.5)
    args.update(kw)
    return Workload(**args)


SPEC = replace(ENGINE_PRESETS["h100-qwen3-4b"], num_engines=2, kv_capacity_tokens=8_000,
               train_fixed_s=0.5)


def test_band_spans_the_variants_and_keeps_ratios_within_each():
    variants = [Variant("nominal", 0), Variant("seed 1", 1),
                Variant("heavy tail", 0, {"truncation_fraction": 0.2})]
    band = run_band(tiny(), SPEC, variants)
    sync, copris = band["policies"]["sync"], band["policies"]["copris"]
    assert sync["ratio_to_sync"] == sync["ratio_to_sync_min"] == sync["ratio_to_sync_max"] == 1.0
    for b in (sync, copris):
        assert b["steps_per_hour_min"] <= b["steps_per_hour"] <= b["steps_per_hour_max"]
        assert b["ratio_to_sync_min"] <= b["ratio_to_sync"] <= b["ratio_to_sync_max"]
    runs = band["runs"]
    heavy = runs["heavy tail"]["copris"]["steps_per_hour"] / runs["heavy tail"]["sync"]["steps_per_hour"]
    assert copris["ratio_to_sync_min"] <= heavy <= copris["ratio_to_sync_max"]
    assert set(runs) == {v.name for v in variants}


def test_headline_variants_change_only_what_they_name():
    w = Workload(name="dapo16k")
    variants = headline_variants(w, ENGINE_PRESETS["h100-qwen3-4b"])
    assert [v.seed for v in variants[:3]] == [0, 1, 2] and len(variants) == 7
    heavy = next(v for v in variants if v.name == "heavy tail")
    hw, hs = heavy.apply(w, ENGINE_PRESETS["h100-qwen3-4b"])
    lm, base = hw.length_model(), w.length_model()
    assert lm.truncation_fraction == pytest.approx(2 * base.truncation_fraction)
    assert lm.median_tokens == base.median_tokens and hs == ENGINE_PRESETS["h100-qwen3-4b"]
    assert Workload(name="x", length=length_spec(base)).length_model() == base


def test_reproduce_rows_cover_every_published_figure_with_its_source():
    table = rows()
    published = _published()
    assert {r.name for r in table} == set(published)
    for r in table:
        assert r.published == published[r.name]["published"] > 1.0
        assert r.source and r.role in ("fit", "held-out")
        assert r.numerator.preset in ENGINE_PRESETS and r.denominator.preset in ENGINE_PRESETS
    assert sum(r.role == "fit" for r in table) == 3  # one per length law


def test_reproduce_fills_published_vs_emulated_and_shares_runs():
    w = tiny(policies=("copris",))
    num = Run("h100-qwen3-4b", w)
    den = Run("h100-qwen3-4b", replace(w, policies=("sync",)))
    table = [Row("a", 1.5, "paper, fig. 1", "fit", num, den, "steps_per_hour"),
             Row("b", 1.2, "paper, tab. 2", "held-out", num, den, "throughput_tokens_per_s")]
    result = reproduce([replace(r, numerator=replace(r.numerator, preset="h100-qwen3-4b"))
                        for r in table])
    assert [r["name"] for r in result] == ["a", "b"]
    for r in result:
        assert {"name", "published", "emulated", "source"} <= set(r)
        assert math.isfinite(r["emulated"]) and r["emulated"] > 0
        assert r["difference"] == pytest.approx(r["emulated"] / r["published"] - 1)
    json.dumps({"rows": result})
    text = format_rows(result)
    assert "held-out: mean |diff|" in text and "fit: mean |diff|" in text
