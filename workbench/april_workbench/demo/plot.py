"""The demo's figure: reward against wall-clock time per policy, off-policy share and ESS per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"sync": "tab:gray", "april": "tab:blue", "copris": "tab:red"}


def plot(result: dict[str, Any], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_reward, ax_off, ax_ess) = plt.subplots(1, 3, figsize=(16, 4.4))
    for name, h in result["policies"].items():
        color = COLORS.get(name)
        ax_reward.plot(h["eval_wall_s"], h["eval_reward"], "o-", color=color, lw=1.8,
                       label=f"{name}: held-out reward")
        ax_reward.plot(h["wall_s"], h["reward"], ".", color=color, alpha=0.35, ms=5,
                       label=f"{name}: training-batch reward")
        steps = list(range(1, len(h["reward"]) + 1))
        ax_off.plot(steps, h["offpolicy_token_fraction"], "o-", color=color, ms=3, label=name)
        ax_ess.plot(steps, h["ess_ratio"], "o-", color=color, ms=3, label=name)
    ax_reward.set(title="reward vs wall-clock (rollout + train + weight push)", xlabel="seconds", ylabel="reward")
    ax_off.set(title="off-policy token share of the training batch", xlabel="step", ylim=(-0.02, 1.02))
    ax_ess.set(title="ESS ratio of the training batch (pi_old / pi_rollout)", xlabel="step", ylim=(0, 1.05))
    ax_reward.legend(fontsize=7, loc="lower right")
    ax_off.legend(fontsize=8)
    ax_ess.legend(fontsize=8, loc="lower left")
    s = result.get("settings", {})
    digits = s.get("policy", {}).get("num_digits", "?")
    what = (f"multiply two {digits}-digit numbers with a calculator tool (multi-turn)" if s.get("task") == "tool"
            else f"reverse {digits} digits")
    fig.suptitle(f"april-slime demo: {what}, tiny Qwen3 on "
                 f"{s.get('engines', '?')} SGLang CPU engine(s), {s.get('rollout_batch_size', '?')} prompts x "
                 f"{s.get('n_samples_per_prompt', '?')} samples per step", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
