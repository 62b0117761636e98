"""The CPU evidence's results as people read them: one row per method over seeds, the markdown
table of docs/evidence.md, and the reward / ESS plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from april_workbench.experiments.evidence import METHODS, EvidenceSettings, nanmin


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _std(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mu = _mean(values)
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (len(values) - 1))


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method, aggregated over seeds."""
    settings = EvidenceSettings(**results["settings"])
    rows = []
    for name in results["methods"]:
        runs = [r for r in results["runs"] if r["method"] == name]
        finals, first_hits, collapses = [], [], 0
        for run in runs:
            curve = run["eval_reward"]
            window = [v for s, v in zip(run["eval_step"], curve)
                      if s > settings.rl_steps - settings.last_steps]
            finals.append(_mean(window))
            hit = next((s for s, v in zip(run["eval_step"], curve) if v >= 0.8), None)
            first_hits.append(hit)
            peak = -math.inf
            for value in curve:
                if not math.isfinite(value):
                    break
                peak = max(peak, value)
                if peak - value >= settings.divergence_drop:
                    collapses += 1
                    break
        reached = [h for h in first_hits if h is not None]
        rows.append({
            "method": name,
            "label": METHODS[name].label,
            "final_reward_mean": _mean(finals),
            "final_reward_std": _std(finals),
            "final_reward_per_seed": finals,
            "steps_to_0.8": _mean(reached) if reached else math.nan,
            "runs_reaching_0.8": len(reached),
            "min_ess_ratio": nanmin([v for r in runs for v in r["ess_ratio"]]),
            "mean_ess_ratio": _mean([v for r in runs for v in r["ess_ratio"] if math.isfinite(v)]),
            "max_behaviour_kl": max(v for r in runs for v in r["behaviour_kl"] if math.isfinite(v)),
            "min_lr_scale": nanmin([v for r in runs for v in r["lr_scale"]]),
            "nan_divergences": sum(r["diverged_at"] is not None for r in runs),
            "collapses": collapses,
            "runs": len(runs),
        })
    return rows


def markdown_table(rows: list[dict[str, Any]], settings: EvidenceSettings) -> str:
    lines = [
        f"| method | final reward (evaluations in the last {settings.last_steps} updates; "
        "mean ± sd over seeds) "
        "| per seed | steps to reward 0.8 | min ESS ratio | mean ESS ratio | max KL(behaviour ‖ "
        "current) | min LR factor | diverged (NaN) / collapsed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        per_seed = ", ".join(f"{v:.3f}" for v in row["final_reward_per_seed"])
        reach = (f"{row['steps_to_0.8']:.1f}" if math.isfinite(row["steps_to_0.8"]) else "never")
        if row["runs_reaching_0.8"] < row["runs"]:
            reach += f" ({row['runs_reaching_0.8']}/{row['runs']} runs)"
        lines.append(
            f"| {row['label']} | {row['final_reward_mean']:.3f} ± {row['final_reward_std']:.3f} "
            f"| {per_seed} | {reach} | {row['min_ess_ratio']:.3f} | {row['mean_ess_ratio']:.3f} "
            f"| {row['max_behaviour_kl']:.3f} | {row['min_lr_scale']:.3f} "
            f"| {row['nan_divergences']}/{row['runs']} / {row['collapses']}/{row['runs']} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: str | Path) -> None:
    """Reward, ESS ratio and behaviour KL vs step: mean over seeds, band = min..max over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = EvidenceSettings(**results["settings"])
    panels = (("eval_reward", "held-out reward (current policy)"),
              ("ess_ratio", "ESS ratio of the training batch"),
              ("behaviour_kl", "KL(behaviour ‖ current), per token"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2))
    for name in results["methods"]:
        runs = [r for r in results["runs"] if r["method"] == name]
        for ax, (key, title) in zip(axes, panels):
            curves = torch.tensor([r[key] for r in runs], dtype=torch.float64)
            steps = (torch.tensor(runs[0]["eval_step"]) if key == "eval_reward" else
                     torch.arange(1, curves.shape[1] + 1))
            mean = curves.nanmean(dim=0)
            line, = ax.plot(steps, mean, label=METHODS[name].label, lw=1.6,
                            ls="--" if not METHODS[name].stale else "-")
            if len(runs) > 1:
                low = torch.where(curves.isnan(), torch.inf, curves).min(dim=0).values
                high = torch.where(curves.isnan(), -torch.inf, curves).max(dim=0).values
                ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.12, lw=0)
            ax.set_title(title)
            ax.set_xlabel("update")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"reverse {settings.num_digits} digits, lr {settings.lr:g}, "
                 f"policy lag {settings.policy_lag}, "
                 f"{settings.partial_fraction:.0%} partial rollouts (prefix 1-"
                 f"{settings.partial_max_extra_lag} versions older), {len(results['seeds'])} seeds",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
