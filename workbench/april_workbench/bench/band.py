"""The headline's band: the same workload over seeds and over the inputs we are least sure of.

A ratio from one run of one seed says little: the response-length law decides how long sync
waits, and the training phase dilutes every rollout gain. ``headline_variants`` spans three seeds
at the nominal inputs; the length law's median at both ends of its fitted interval (the medians at
which the law's fit row stays within 5% of the published ratio, ``laws.MEDIAN_INTERVALS``; the
tail re-solved so the batch's spread stays APRIL's); the training phase half and one and a half
times as costly; and the engine's per-decode-step overhead halved and doubled. ``run_band`` runs
every (variant, policy) pair in its own process (each on a fresh emulated cluster, as
``run_benchmark`` does) and reports, per policy, the nominal steps/h with the min-max over the
variants, and the same for the ratio to sync, where each variant's ratio is measured within that
variant (same seed, same inputs for both policies).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from april_workbench.emulator import LengthModel

from .laws import MEDIAN_INTERVALS, length_spec
from .reproduce import april_family
from .runner import run_benchmark, run_jobs
from .spec import EngineSpec
from .workloads import Workload, split_label


@dataclass(frozen=True)
class Variant:
    name: str
    seed: int = 0
    length: dict[str, float] = field(default_factory=dict)  # LengthModel field -> value
    spec: dict[str, float] = field(default_factory=dict)  # EngineSpec field -> value
    workload: dict[str, float] = field(default_factory=dict)  # Workload field -> value

    def apply(self, workload: Workload, spec: EngineSpec) -> tuple[Workload, EngineSpec]:
        w = replace(workload, seed=self.seed, **self.workload)
        if self.length:
            w = replace(w, length=length_spec(replace(workload.length_model(), **self.length)))
        return w, replace(spec, **self.spec)


def median_variants(workload: Workload) -> list[Variant]:
    """The law's median at both ends of its fitted interval, on the family it was fitted on (its
    tail and group spread re-solved for APRIL's statistics); none for a law without an interval."""
    if workload.length not in MEDIAN_INTERVALS:  # a law of its own (a median of its own): no fit to span
        return []
    out = []
    for label, median in zip(("short median", "long median"), MEDIAN_INTERVALS[workload.length]):
        model = LengthModel.parse(april_family(workload.length, median))
        out.append(Variant(f"{label} ({median:,.0f})", 0, {"median_tokens": model.median_tokens,
                                                            "prompt_sigma": model.prompt_sigma,
                                                            "shape": model.shape}))
    return out


def headline_variants(workload: Workload, spec: EngineSpec | None = None) -> list[Variant]:
    """Seeds 0-2; the median at the ends of its fitted interval; the training phase x0.5 / x1.5
    (its MFUs x2 / x2/3); the per-decode-step overhead halved / doubled."""
    spec = spec or EngineSpec.from_dict({"base_preset": workload.preset})
    train, logprob = spec.train_mfu, spec.logprob_mfu if spec.logprob_mfu is not None else spec.train_mfu
    return [
        Variant("seed 0 (nominal)", 0),
        Variant("seed 1", 1),
        Variant("seed 2", 2),
        *median_variants(workload),
        Variant("light training", 0, spec={"train_mfu": min(1.0, 2 * train), "logprob_mfu": min(1.0, 2 * logprob),
                                           "train_fixed_s": spec.train_fixed_s / 2}),
        Variant("heavy training", 0, spec={"train_mfu": train / 1.5, "logprob_mfu": logprob / 1.5,
                                           "train_fixed_s": spec.train_fixed_s * 1.5}),
        Variant("low overhead", 0, spec={"step_overhead_s": spec.step_overhead_s / 2}),
        Variant("high overhead", 0, spec={"step_overhead_s": spec.step_overhead_s * 2}),
    ]


def run_variant(job: tuple[Workload, EngineSpec, Variant, str]) -> tuple[str, str, dict[str, Any]]:
    """One run label (``copris`` or ``copris@s2``: a policy at a staleness bound) of a variant."""
    workload, spec, variant, label = job
    policy, bound = split_label(label)
    one = replace(workload, policies=(policy,), sweep="none", staleness_bounds=())
    if workload.staleness_bounds and not policy.startswith("sync"):
        one = replace(one, max_staleness=bound)
    w, s = variant.apply(one, spec)
    result = run_benchmark(w, s)
    return variant.name, label, result.summaries[policy]


def band_labels(workload: Workload) -> list[str]:
    """The run labels of a band, sync first (every ratio is to sync)."""
    labels = [label for label, *_ in workload.run_labels()]
    return labels if "sync" in labels else ["sync", *labels]


def run_band(workload: Workload, spec: EngineSpec, variants: list[Variant], *,
             jobs: int = 1) -> dict[str, Any]:
    """``{"variants": [...], "policies": {policy: {steps_per_hour, _min, _max, ratio_to_sync,
    _min, _max, throughput_tokens_per_s, utilization, offpolicy_token_fraction}}, "runs": ...}``."""
    policies = band_labels(workload)
    todo = [(workload, spec, v, p) for v in variants for p in policies]
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for name, policy, summary in run_jobs(run_variant, todo, jobs):
        runs.setdefault(name, {})[policy] = summary
    return summarize_band(runs, variants, policies)


def summarize_band(runs: dict[str, dict[str, dict[str, Any]]], variants: list[Variant],
                   policies: list[str]) -> dict[str, Any]:
    """``run_band``'s answer from the summaries of its runs (variant name -> policy -> summary)."""
    nominal = variants[0].name
    out: dict[str, Any] = {}
    for policy in policies:
        rates = [runs[v.name][policy]["steps_per_hour"] for v in variants]
        ratios = [runs[v.name][policy]["steps_per_hour"] / runs[v.name]["sync"]["steps_per_hour"]
                  for v in variants]
        n = runs[nominal][policy]
        out[policy] = {
            "steps_per_hour": n["steps_per_hour"], "steps_per_hour_min": min(rates),
            "steps_per_hour_max": max(rates), "ratio_to_sync": ratios[0],
            "ratio_to_sync_min": min(ratios), "ratio_to_sync_max": max(ratios),
            "throughput_tokens_per_s": n["throughput_tokens_per_s"],
            "utilization": n["utilization"], "offpolicy_token_fraction": n["offpolicy_token_fraction"],
            "stationary_everywhere": all(runs[v.name][policy]["stationary"] for v in variants),
            **_spread(runs, variants, policy, "token_staleness_mean"),
            "token_staleness_max": max(runs[v.name][policy].get("token_staleness_max", 0) for v in variants),
            "stale_discarded_tokens": n.get("stale_discarded_tokens", 0),
            "stale_discarded_tokens_max": max(runs[v.name][policy].get("stale_discarded_tokens", 0) for v in variants),
            "other_discarded_tokens": n["discarded_tokens"] - n.get("stale_discarded_tokens", 0),
            "trained_tokens": n["trained_tokens"],
        }
    out = {"variants": [asdict(v) for v in variants], "policies": out, "runs": runs}
    retained = gain_retained(runs, variants, policies)
    if retained:
        out["gain_retained"] = retained
    return out


def _spread(runs: dict[str, dict[str, dict[str, Any]]], variants: list[Variant], label: str,
            key: str) -> dict[str, float]:
    values = [runs[v.name][label].get(key, 0.0) for v in variants]
    return {key: values[0], f"{key}_min": min(values), f"{key}_max": max(values)}


def gain_retained(runs: dict[str, dict[str, dict[str, Any]]], variants: list[Variant],
                  labels: list[str]) -> dict[str, dict[str, float]]:
    """Per bounded label (``copris@s2``): the share of its policy's unbounded gain over sync that
    it keeps, (ratio at the bound - 1) / (unbounded ratio - 1), measured within each variant;
    nominal, min and max over the variants."""
    out = {}
    for label in labels:
        policy, bound = split_label(label)
        if bound is None or policy not in labels:
            continue
        shares = []
        for v in variants:
            r = runs[v.name]
            sync = r["sync"]["steps_per_hour"]
            free = r[policy]["steps_per_hour"] / sync - 1.0
            shares.append((r[label]["steps_per_hour"] / sync - 1.0) / free if free > 0 else float("nan"))
        out[label] = {"nominal": shares[0], "min": min(shares), "max": max(shares)}
    return out
