"""Steady state (warm-up detected from the buffer's age distribution), the headline band and the
published-figure table."""

import json
import math
from dataclasses import replace

import pytest

from april_workbench.bench import ENGINE_PRESETS, Workload
from april_workbench.bench.band import Variant, headline_variants, length_spec, run_band
from april_workbench.bench.fit import FITS
from april_workbench.bench.laws import MEDIAN_INTERVALS, statistics
from april_workbench.bench.records import StepRecord
from april_workbench.bench.reproduce import Row, Run, format_rows, published, reproduce, rows
from april_workbench.bench.steady import detect_warmup


def steps(buffer, age):
    return [StepRecord(i, i, 0.0, 1.0, 1.0, {}, buffer_tokens=b, buffer_age_mean=a)
            for i, (b, a) in enumerate(zip(buffer, age))]


def test_buffer_age_reads_version_runs_as_version_and_count():
    from april_slime.core.types import Group, Trajectory
    from april_workbench.bench.runner import _buffer_age

    t = Trajectory(uid="p/0", group_uid="p", index_in_group=0, prompt_ids=[1, 2, 3, 4], max_new_tokens=10_000,
                   sampling_seed=0)
    t.append([5] * 5000, [-1.0] * 5000, 7)  # 5000 tokens of version 7, then 3000 of version 8
    t.append([5] * 3000, [-1.0] * 3000, 8)
    group = Group(uid="p", prompt_ids=[1, 2, 3, 4], trajectories=[t], created_version=7)
    # once version 9 is live: 5000 tokens 2 versions old, 3000 one version old
    assert _buffer_age([group], next_version=9) == (8000, (5000 * 2 + 3000 * 1) / 8000)


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
    spec = ENGINE_PRESETS["h100-qwen3-4b"]
    variants = {v.name.split(" (")[0]: v for v in headline_variants(w, spec)}
    assert [v.seed for v in list(variants.values())[:3]] == [0, 1, 2] and len(variants) == 9
    base = w.length_model()
    # the fitted median's interval: the median moves, the tail and the group spread follow so the
    # law stays on the family it was fitted on (APRIL's batch spread, groups within 1,500)
    sigma = statistics(w.length)["sigma_batch"]
    for name, median in zip(("short median", "long median"), MEDIAN_INTERVALS[w.length]):
        vw, vs = variants[name].apply(w, spec)
        lm = vw.length_model()
        assert lm.median_tokens == pytest.approx(median) and vs == spec
        assert replace(lm, median_tokens=base.median_tokens, prompt_sigma=base.prompt_sigma, shape=base.shape) == base
        assert statistics(vw.length)["sigma_batch"] == pytest.approx(sigma, rel=0.01)
        assert statistics(vw.length)["sigma_group"] <= 1500 * 1.01
    heavy_w, heavy_s = variants["heavy training"].apply(w, spec)
    assert heavy_w.length_model() == base
    assert heavy_s.train_time(10**6) == pytest.approx(1.5 * spec.train_time(10**6))
    light_s = variants["light training"].apply(w, spec)[1]
    assert light_s.train_time(10**6) == pytest.approx(0.5 * spec.train_time(10**6))
    assert Workload(name="x", length=length_spec(base)).length_model() == base
    # a law with a median of its own (the multi-turn per-turn law) has no fitted interval to span
    turn = Workload(name="t", length="dapo-math-qwen3-4b-16k:median_tokens=1000")
    assert not [v for v in headline_variants(turn, spec) if "median" in v.name]


def test_reproduce_rows_cover_every_published_figure_with_its_source():
    table = rows()
    pub = {r["name"]: r for r in published()["rows"]}
    assert {r.name for r in table} == set(pub)
    for r in table:
        assert r.published == pub[r.name]["published"] > 1.0
        assert r.source and r.role in ("fit", "held-out", "partly fitted")
        assert (r.role == "partly fitted") == (pub[r.name]["role"] == "held-out" and r.role != "held-out")
        assert r.numerator.preset in ENGINE_PRESETS and r.denominator.preset in ENGINE_PRESETS
        assert (r.published_s is not None) == ("published_s_per_step" in pub[r.name])
    # one fit row per length law, each the row its law is fitted on
    fit_rows = {r.name for r in table if r.role == "fit"}
    assert fit_rows == {f.row for f in FITS} and len(fit_rows) == 4
    # veRL's baseline splits the batch per engine; slime's (APRIL) and the agent loop's do not
    assert {r.denominator.policy for r in table if r.name.startswith("CoPRIS tab. 1")} == {"sync-split"}
    assert {r.denominator.policy for r in table if "GRPO" in r.name} == {"sync"}


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
