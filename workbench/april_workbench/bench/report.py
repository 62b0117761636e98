"""Printing and plotting a ``BenchResult``."""

from __future__ import annotations

import os

import numpy as np

from .runner import BenchResult

# ============================================================================ reporting
_COLUMNS = [
    ("policy", "{}", None),
    ("steps/h", "{:.2f}", "steps_per_hour"),
    ("rollout s", "{:.1f}", "rollout_s_per_step"),
    ("train s", "{:.1f}", "train_s_per_step"),
    ("tok/s", "{:,.0f}", "throughput_tokens_per_s"),
    ("util", "{:.1%}", "utilization"),
    ("util mix", "{:.1%}", "utilization_token_mix"),
    ("bubble", "{:.1%}", "bubble_fraction"),
    ("off-policy", "{:.1%}", "offpolicy_token_fraction"),
    ("stale mean", "{:.2f}", "mean_staleness"),
    ("stale max", "{}", "max_staleness"),
    ("token lag", "{:.2f}", "token_staleness_mean"),
    ("lag max", "{}", "token_staleness_max"),
    ("recomputed", "{:,}", "recomputed_tokens"),
    ("discarded", "{:,}", "discarded_tokens"),
    ("fallback", "{:,}", "stale_discarded_tokens"),
    ("N'", "{}", "concurrency_final"),
    ("warm-up", "{}", "warmup_label"),
]


def format_table(result: BenchResult) -> str:
    rows = [[title for title, _, _ in _COLUMNS]]
    for label, s in result.summaries.items():
        row = []
        for _, fmt, key in _COLUMNS:
            if key == "warmup_label":
                value = f"{s['warmup_steps']}" + ("" if s["stationary"] else " (not stationary)")
            else:
                value = label if key is None else s.get(key)
            row.append("-" if value is None else fmt.format(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def headline(result: BenchResult) -> list[str]:
    """Ratios the benchmark exists to show, measured in this run."""
    s = result.summaries
    out = []
    w = result.workload
    for budget, ideal in result.ideal.items():
        ls = result.lengths[budget]
        out.append(f"ideal @ {budget} tokens: {ideal['tokens_per_s']:,.0f} tok/s "
                   f"({ideal['batch_per_engine']:.0f} requests/engine at the KV limit; "
                   f"N' at the KV limit ~ {ideal['kv_limited_concurrency']:.0f}); response length "
                   f"mean {ls.mean:,.0f}, median {ls.median:,.0f}, {ls.truncated_fraction:.1%} "
                   f"hit the budget")

    def ratio(a: str, b: str, what: str) -> None:
        if a in s and b in s and s[b]["steps_per_hour"] > 0 and s[b]["throughput_tokens_per_s"] > 0:
            r = s[a]["steps_per_hour"] / s[b]["steps_per_hour"]
            t = s[a]["throughput_tokens_per_s"] / s[b]["throughput_tokens_per_s"]
            out.append(f"{what}: {r:.2f}x steps/h, end to end (rollout tok/s {t:.2f}x; off-policy "
                       f"tokens {s[a]['offpolicy_token_fraction']:.1%} vs "
                       f"{s[b]['offpolicy_token_fraction']:.1%})")

    if w.sweep == "none":
        for p in ("april", "copris", "copris-adaptive"):
            ratio(p, "sync", f"{p} / sync")
            for label in s:
                if label.startswith(f"{p}@s"):
                    ratio(label, "sync", f"{label} / sync")
        ratio("copris", "april", "copris / april")
        out += bound_lines(s)
    elif w.sweep == "context":
        for value in w.sweep_values:
            k = f"{int(value) // 1024}k"
            ratio(f"copris@{k}", f"sync@{k}", f"copris / sync @ {k}")
            ratio(f"april@{k}", f"sync@{k}", f"april / sync @ {k}")
    elif w.sweep == "concurrency":
        fixed = {k: v for k, v in s.items() if k.startswith("copris@N=")}
        if fixed:
            best = max(fixed, key=lambda k: fixed[k]["throughput_tokens_per_s"])
            out.append(f"best fixed N': {best} at {fixed[best]['throughput_tokens_per_s']:,.0f} tok/s")
            if "copris-adaptive" in s:
                a = s["copris-adaptive"]
                out.append(f"copris-adaptive: {a['throughput_tokens_per_s']:,.0f} tok/s = "
                           f"{a['throughput_tokens_per_s'] / fixed[best]['throughput_tokens_per_s']:.1%}"
                           f" of the best fixed N' (final N' {a['concurrency_final']}, "
                           f"mean {a['concurrency_mean']:.0f})")
    unsteady = [k for k, v in s.items() if not v["stationary"]]
    warm = ", ".join(f"{k} {v['warmup_steps']}" for k, v in s.items())
    out.append(f"steady state: steps left out until the buffer's age distribution is stationary "
               f"(MSER): {warm}")
    if unsteady:
        out.append(f"NOT STATIONARY by the end of the run: {', '.join(unsteady)} (buffer still "
                   f"trending over the second half; run more steps)")
    return out


def bound_lines(summaries: dict) -> list[str]:
    """Per bounded run: its share of the unbounded gain, the lag of its trained tokens, and what
    was thrown away (the restart / drop fallback apart: pacing itself discards nothing)."""
    out = []
    sync = summaries.get("sync")
    for label, b in summaries.items():
        policy, _, bound = label.partition("@s")
        if not bound or sync is None or policy not in summaries:
            continue
        free = summaries[policy]["steps_per_hour"] / sync["steps_per_hour"] - 1.0
        kept = (b["steps_per_hour"] / sync["steps_per_hour"] - 1.0) / free if free > 0 else float("nan")
        out.append(f"{label}: keeps {kept:.0%} of {policy}'s unbounded gain; trained-token lag mean "
                   f"{b['token_staleness_mean']:.2f} / max {b['token_staleness_max']} (unbounded "
                   f"{summaries[policy]['token_staleness_mean']:.2f} / {summaries[policy]['token_staleness_max']}); "
                   f"discarded by the staleness fallback {b['stale_discarded_tokens']:,} tokens, otherwise "
                   f"{b['discarded_tokens'] - b['stale_discarded_tokens']:,}")
    return out


def format_band(band: dict) -> str:
    """The headline table: steps/h (end to end, steady state) with its band over the variants,
    the ratio to sync with its band, and the secondary columns of the nominal run."""
    rows = [["policy", "steps/h", "band", "vs sync", "band", "rollout tok/s", "util", "off-policy",
             "token lag mean (band)", "lag max", "fallback discarded", "other discarded"]]
    for policy, b in band["policies"].items():
        lag = (f"{b['token_staleness_mean']:.2f} ({b['token_staleness_mean_min']:.2f}-"
               f"{b['token_staleness_mean_max']:.2f})" if "token_staleness_mean" in b else "-")
        rows.append([
            policy, f"{b['steps_per_hour']:.2f}",
            f"{b['steps_per_hour_min']:.2f}-{b['steps_per_hour_max']:.2f}",
            f"{b['ratio_to_sync']:.2f}x", f"{b['ratio_to_sync_min']:.2f}-{b['ratio_to_sync_max']:.2f}x",
            f"{b['throughput_tokens_per_s']:,.0f}", f"{b['utilization']:.1%}",
            f"{b['offpolicy_token_fraction']:.1%}", lag, f"{b.get('token_staleness_max', '-')}",
            f"{b.get('stale_discarded_tokens', 0):,}", f"{b.get('other_discarded_tokens', 0):,}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("band: min-max over " + ", ".join(v["name"] for v in band["variants"]))
    for label, g in band.get("gain_retained", {}).items():
        lines.append(f"{label} keeps {g['nominal']:.0%} ({g['min']:.0%}-{g['max']:.0%}) of the unbounded gain")
    return "\n".join(lines)


def plot(result: BenchResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = result.workload
    runs = result.runs
    if w.sweep == "none":
        fig, axes = plt.subplots(len(runs) + 1, 1, figsize=(11, 2.3 * len(runs) + 3.2),
                                 squeeze=False)
        axes = axes[:, 0]
        t_max = max(max(r.timeline["t"], default=1.0) for r in runs)
        for ax, run in zip(axes, runs):
            t = np.asarray(run.timeline["t"])
            kv = np.asarray(run.timeline["kv_used"]) / run.capacity_tokens
            ax.fill_between(t, kv, step="post", alpha=0.35, color="tab:blue", label="KV in use")
            ax.set_ylim(0, 1.05)
            ax.set_xlim(0, t_max)
            ax.set_ylabel("KV used")
            for s in run.steps:
                ax.axvspan(s.rollout_start + s.rollout_s, s.rollout_start + s.rollout_s + s.train_s,
                           color="grey", alpha=0.25, lw=0)
            ax2 = ax.twinx()
            ax2.step(t, run.timeline["running"], where="post", color="tab:red", lw=0.8,
                     label="running requests")
            ax2.set_ylabel("running", color="tab:red")
            summary = result.summaries[run.label]
            ax.set_title(f"{run.label}: {summary['throughput_tokens_per_s']:,.0f} tok/s, "
                         f"utilisation {summary['utilization']:.0%}, "
                         f"{summary['steps_per_hour']:.1f} steps/h (grey: training)",
                         fontsize=9, loc="left")
        axes[-2].set_xlabel("emulated time (s)")
        ax = axes[-1]
        labels = list(result.summaries)
        values = [result.summaries[k]["utilization"] for k in labels]
        bars = ax.bar(labels, values, color="tab:blue")
        for bar, k in zip(bars, labels):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                    f"{result.summaries[k]['throughput_tokens_per_s']:,.0f} tok/s", ha="center",
                    va="bottom", fontsize=8)
        ax.set_ylabel("utilisation (of ideal)")
        ax.set_ylim(0, 1.15)
    elif w.sweep == "context":
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        xs = [int(v) for v in w.sweep_values]
        for p in w.policies:
            ys = [result.summaries[f"{p}@{x // 1024}k"]["throughput_tokens_per_s"] for x in xs]
            axes[0].plot([x / 1024 for x in xs], ys, marker="o", label=p)
            if p != "sync":
                base = [result.summaries[f"sync@{x // 1024}k"]["throughput_tokens_per_s"] for x in xs]
                axes[1].plot([x / 1024 for x in xs], [a / b for a, b in zip(ys, base)], marker="o",
                             label=f"{p} / sync")
        axes[0].plot([x / 1024 for x in xs], [result.ideal[x]["tokens_per_s"] for x in xs], "k--",
                     label="ideal (KV-limited)")
        axes[0].set_xlabel("max response length (K tokens)")
        axes[0].set_ylabel("rollout throughput (tok/s)")
        axes[1].set_xlabel("max response length (K tokens)")
        axes[1].set_ylabel("speedup over sync")
        for ax in axes:
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    elif w.sweep == "concurrency":
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        fixed = [(p.concurrency, result.summaries[p.label]) for p in result.points
                 if p.policy == "copris"]
        xs = [n for n, _ in fixed]
        axes[0].plot(xs, [s["throughput_tokens_per_s"] for _, s in fixed], marker="o",
                     label="copris, fixed N'")
        if "copris-adaptive" in result.summaries:
            a = result.summaries["copris-adaptive"]
            axes[0].axhline(a["throughput_tokens_per_s"], color="tab:green", ls="--",
                            label=f"copris-adaptive (final N' {a['concurrency_final']})")
        axes[0].set_xscale("log", base=2)
        axes[0].set_xlabel("N' (requests in flight)")
        axes[0].set_ylabel("rollout throughput (tok/s)")
        axes[1].plot(xs, [s["recomputed_tokens"] for _, s in fixed], marker="o", color="tab:red",
                     label="tokens recomputed (retraction)")
        axes[1].set_xscale("log", base=2)
        axes[1].set_xlabel("N'")
        axes[1].set_ylabel("recomputed tokens")
        ax3 = axes[1].twinx()
        ax3.plot(xs, [s["offpolicy_token_fraction"] for _, s in fixed], marker="s",
                 color="tab:purple", label="off-policy token fraction")
        ax3.set_ylabel("off-policy token fraction", color="tab:purple")
        for ax in axes:
            ax.legend(fontsize=8, loc="upper left")
            ax.grid(alpha=0.3)
    else:  # oversampling
        fig, ax = plt.subplots(1, 1, figsize=(7, 4))
        pts = [(p.over_sampling_factor, result.summaries[p.label]) for p in result.points
               if p.policy == "april"]
        xs = [f for f, _ in pts]
        ax.plot(xs, [s["throughput_tokens_per_s"] for _, s in pts], marker="o",
                label="april throughput")
        ax.set_xlabel("over-sampling factor")
        ax.set_ylabel("rollout throughput (tok/s)")
        ax2 = ax.twinx()
        ax2.plot(xs, [s["offpolicy_token_fraction"] for _, s in pts], marker="s",
                 color="tab:purple", label="off-policy token fraction")
        ax2.set_ylabel("off-policy token fraction", color="tab:purple")
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(alpha=0.3)
    fig.suptitle(f"april-slime bench {w.name}: {result.spec.model} on {result.spec.num_engines} x "
                 f"{result.spec.gpus_per_engine} H100 ({result.mode})", fontsize=10)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


