"""CPU evidence experiment: the rollout emulation is what it claims to be, and a tiny end-to-end
run (every method, two updates) produces finite curves, a table and a plot."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from april_workbench.experiments import evidence, result_file, summary

TINY = evidence.EvidenceSettings(
    num_digits=3, d_model=16, n_heads=2, n_layers=1, sft_steps=3, sft_batch_size=16,
    rl_steps=2, prompts_per_step=4, samples_per_prompt=4, minibatches_per_step=2,
    eval_prompts=16, policy_lag=1, partial_max_extra_lag=2, last_steps=1)


def test_reward_is_exact_match_of_the_reversed_digits():
    prompts = torch.tensor([[1, 2, 3, evidence.SEPARATOR], [4, 5, 6, evidence.SEPARATOR]])
    responses = torch.tensor([[3, 2, 1], [6, 5, 5]])
    assert evidence.exact_match_reward(prompts, responses).tolist() == [1.0, 0.0]


def test_partial_rollouts_store_the_log_probs_of_the_policy_that_generated_each_token():
    settings = replace(TINY, partial_fraction=1.0, prompts_per_step=8)
    torch.manual_seed(0)
    models = {v: evidence.build_model(settings).requires_grad_(False) for v in (3, 4, 5)}
    batch = evidence.generate_stale_batch(models, 5, settings, torch.Generator().manual_seed(1),
                                          partial=True)
    versions = batch.token_versions
    # Every row is partial: an older prefix (1..2 versions back) then the current version, and
    # versions never decrease along a trajectory.
    assert (versions[:, 0] < 5).all() and (versions[:, -1] == 5).all()
    assert (versions[:, 1:] >= versions[:, :-1]).all()
    # The stored vector is the concatenation of each stage's own log-probs: recompute every token
    # under the policy recorded for it.
    expected = torch.empty_like(batch.behaviour_logprobs)
    for version, model in models.items():
        recomputed = evidence.response_logprobs(model, batch.prompts, batch.responses, 1.0)
        expected = torch.where(versions == version, recomputed, expected)
    torch.testing.assert_close(batch.behaviour_logprobs, expected, rtol=1e-5, atol=1e-5)
    # ...and differs from what the newest policy alone would give.
    newest = evidence.response_logprobs(models[5], batch.prompts, batch.responses, 1.0)
    assert not torch.allclose(batch.behaviour_logprobs, newest, atol=1e-3)


def test_tiny_run_of_every_method(tmp_path):
    methods = list(evidence.METHODS)
    results = evidence.run_experiment(TINY, methods, [0], workers=1, log=lambda _: None)
    assert [r["method"] for r in results["runs"]] == methods
    for run in results["runs"]:
        assert run["diverged_at"] is None
        assert run["eval_step"] == [0, 2] and len(run["eval_reward"]) == 2
        for key in ("eval_reward", "ess_ratio", "behaviour_kl", "grad_norm", "lr_scale"):
            assert all(math.isfinite(v) for v in run[key]), (run["method"], key)
        assert all(0.0 < v <= 1.0 + 1e-9 for v in run["ess_ratio"])
        if evidence.METHODS[run["method"]].stale:
            # update 0 trains on the warm-start batch (version 0): staleness 0; update 1 trains on
            # the batch generated at version 0 with lag 1: staleness exactly 1 (no partial
            # prefix can be older than version 0).
            assert run["mean_staleness"] == [0.0, 1.0]
        else:
            assert run["mean_staleness"] == [0.0, 0.0]
            assert run["ess_ratio"] == [pytest.approx(1.0)] * TINY.rl_steps
    vcpo_run = next(r for r in results["runs"] if r["method"] == "copris_vcpo")
    assert all(math.isfinite(b) for b in vcpo_run["opob_baseline"])
    # the first VCPO step is on-policy, so it defines rho_on and its learning-rate factor is 1
    assert vcpo_run["lr_scale"][0] == pytest.approx(1.0)

    rows = summary.summarize(results)
    table = summary.markdown_table(rows, TINY)
    for method in methods:
        assert evidence.METHODS[method].label in table
    summary.plot(results, tmp_path / "evidence.png")
    assert (tmp_path / "evidence.png").stat().st_size > 10_000


def test_script_writes_png_and_strict_json(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(repo / "scripts" / "cpu_evidence.py"), "--seeds", "0",
           "--methods", "sync", "copris", "--workers", "1", "--out-dir", str(tmp_path)]
    for name in ("num_digits", "d_model", "n_heads", "n_layers", "sft_steps", "rl_steps",
                 "prompts_per_step", "samples_per_prompt", "eval_prompts", "policy_lag"):
        cmd += ["--" + name.replace("_", "-"), str(getattr(TINY, name))]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "(b) CoPRIS IS" in out
    text = (tmp_path / "evidence.json").read_text()
    data = json.loads(text)  # strict: no NaN literals
    assert [r["method"] for r in data["runs"]] == ["sync", "copris"]
    assert text == result_file.to_text(data)  # the compact form: one line per series
    assert (tmp_path / "evidence.png").exists()



def test_result_file_keeps_the_summary_exact_and_each_series_on_one_line():
    run = {"method": "copris", "seed": 0, "diverged_at": 2, "eval_step": [0, 2, 4],
           "eval_reward": [0.587890625, 0.9, math.nan], "ess_ratio": [0.123456789, 1.0, math.nan],
           "lr_scale": [1.0, 0.98765, math.nan], "seconds": 12.345}
    results = {"settings": {"lr": 1e-3}, "methods": ["copris"], "seeds": [0], "workers": 1,
               "warm_start_seconds": {0: 1.234}, "wall_seconds": 5.678, "runs": [run],
               "summary": [{"method": "copris", "final_reward_mean": 0.9046875123456, "steps_to_0.8": math.nan}]}
    text = result_file.to_text(results)
    data = json.loads(text)
    assert data["summary"] == [{"method": "copris", "final_reward_mean": 0.9046875123456, "steps_to_0.8": None}]
    got = data["runs"][0]
    assert got["eval_reward"] == [0.587890625, 0.9, None]  # exact: the summary's rewards come from it
    assert got["ess_ratio"] == [0.1235, 1.0, None] and got["lr_scale"] == [1.0, 0.9877, None]
    assert (got["seconds"], data["wall_seconds"], data["warm_start_seconds"]) == (12.3, 5.7, {"0": 1.2})
    for key in ("eval_step", "eval_reward", "ess_ratio", "lr_scale"):
        assert sum(line.strip().startswith(f'"{key}": [') and line.rstrip(",}").endswith("]")
                   for line in text.splitlines()) == 1, key


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match="unknown methods"):
        evidence.run_experiment(TINY, ["nope"], [0], workers=1)
