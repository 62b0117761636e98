"""``april-slime bench report``: the bench's figures in docs/results.md, docs/calibration.md and
docs/bench.md, rendered from the JSON files the bench commands wrote, and checked against them.

A document holds generated blocks::

    <!-- bench-report KIND PATH [PATH...] -->
    ...rendered from the JSON file(s)...
    <!-- /bench-report -->

``render`` rebuilds a block from its JSON; ``update`` rewrites every block of a document,
``check`` lists the blocks whose text differs from what their JSON renders (the test suite runs
it, so a figure typed by hand, or a JSON rerun without its document, fails). Counts ("k of n
held-out rows within +-10%") are computed here, never typed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from .tables import md_table

# A path holds no white space, so a marker never reaches past its own line (an empty block's end included).
BEGIN = re.compile(r"<!-- bench-report (?P<kind>[a-z-]+)(?P<paths>(?: \S+)+) -->\n")
END = "<!-- /bench-report -->"
DOCUMENTS = ("README.md", "docs/results.md", "docs/calibration.md", "docs/bench.md")
WITHIN = 0.10  # the "within +-10%" of the reproduce summary


def _load(root: str, path: str) -> Any:
    with open(os.path.join(root, path), encoding="utf-8") as fh:
        return json.load(fh)


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


# ============================================================================ reproduce
def reproduce_counts(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per role (fit, held-out, partly fitted: held out but with the training fit's run as an arm):
    rows, mean and worst |difference|, rows within +-WITHIN."""
    out = {}
    for role in ("fit", "held-out", "partly fitted"):
        errs = [abs(r["difference"]) for r in rows if r["role"] == role]
        if errs:
            out[role] = {"rows": len(errs), "mean": sum(errs) / len(errs), "max": max(errs),
                         "within": sum(e <= WITHIN for e in errs)}
    return out


def reproduce_summary(data: dict[str, Any]) -> str:
    c = reproduce_counts(data["rows"])
    fit, held = c["fit"], c["held-out"]
    text = (f"**Fit rows: {fit['mean']:.1%} mean |diff| over {fit['rows']} rows ({fit['within']} within "
            f"±{WITHIN:.0%}); held-out rows: {held['mean']:.1%} mean, {held['max']:.1%} worst, "
            f"{held['within']} of {held['rows']} within ±{WITHIN:.0%}")
    part = c.get("partly fitted")
    if part:
        text += (f"; partly fitted rows (held out, but one arm is the run veRL's training phase is fitted "
                 f"on): {part['mean']:.1%} mean, {part['max']:.1%} worst, {part['within']} of {part['rows']} "
                 f"within ±{WITHIN:.0%}")
    return text + ".**"


def reproduce_table(data: dict[str, Any]) -> str:
    rows = []
    for r in data["rows"]:
        num, den = r["numerator"], r["denominator"]
        rows.append([r["name"], f"{r['published']:.2f}x", f"{r['emulated']:.2f}x", f"{r['difference']:+.1%}",
                     f"{_seconds(num['published_s_per_step'])} / {_seconds(den['published_s_per_step'])}",
                     f"{num['step_s']:,.0f} / {den['step_s']:,.0f}", r["role"]])
    table = md_table(["figure", "published", "emulated", "diff", "published s/step", "emulated s/step", "role"],
                   rows)
    return table + "\n\n" + reproduce_summary(data)


def reproduce_statistics(data: dict[str, Any]) -> str:
    rows = []
    for s in data["statistics"]:
        pub = s["published"]
        published = (f"{s['low']:,.0f}-{s['high']:,.0f}" if "low" in s else
                     f"< {pub:,.0f}" if "high" in s else f"{pub:.0%}" if s["unit"] == "fraction" else f"{pub:,.0f}")
        emulated = f"{s['emulated']:.0%}" if s["unit"] == "fraction" else f"{s['emulated']:,.0f}"
        if s.get("solved"):
            emulated += " (solved input, not an output)"
        rows.append([s["name"], published, emulated, s["where"]])
    return md_table(["statistic", "published", "emulated", "emulated on"], rows)


def reproduce_absolute(data: dict[str, Any]) -> str:
    """The rows with published seconds: rollout, log-prob and step seconds, both arms."""
    rows = []
    for r in data["rows"]:
        for side in ("numerator", "denominator"):
            a = r[side]
            if a["published_s_per_step"] is None:
                continue
            rows.append([r["name"].split(":")[0], f"{a['policy']} ({a['preset']})",
                         f"{_seconds(a['published_rollout_s'])} / {a['rollout_s_per_step']:,.0f}",
                         f"{_seconds(a['published_logprob_s'])} / {a['buffered_logprob_s_per_step']:,.0f}",
                         f"{a['published_s_per_step']:,.0f} / {a['step_s']:,.0f}",
                         f"{a['step_s'] / a['published_s_per_step']:.2f}"])
    return md_table(["row", "run", "rollout s: published / emulated", "log-probs of buffered partials s (emulated)",
                   "step s: published / emulated", "emulated / published"], rows)


# ============================================================================ headline band
def headline(data: dict[str, Any]) -> str:
    rows = []
    for policy, b in data["band"]["policies"].items():
        ratio = "—" if policy == "sync" else f"{b['ratio_to_sync_min']:.2f}-{b['ratio_to_sync_max']:.2f}x"
        rows.append([policy, f"{b['steps_per_hour']:.2f}",
                     f"{b['steps_per_hour_min']:.2f}-{b['steps_per_hour_max']:.2f}",
                     f"**{b['ratio_to_sync']:.2f}x**" if policy != "sync" else "1.00x", ratio,
                     f"{b['throughput_tokens_per_s']:,.0f}", f"{b['utilization']:.1%}",
                     f"{b['offpolicy_token_fraction']:.1%}"])
    table = md_table(["policy", "steps/h", "band", "vs sync", "band", "rollout tok/s", "util", "off-policy tokens"],
                   rows)
    variants = ", ".join(v["name"] for v in data["band"]["variants"])
    nominal = data["band"]["runs"][data["band"]["variants"][0]["name"]]
    shares = ", ".join(f"{p} {s['train_s_per_step'] / s['step_s']:.0%}" for p, s in nominal.items())
    steady = all(b["stationary_everywhere"] for b in data["band"]["policies"].values())
    return (table + f"\n\nBand: min-max over {len(data['band']['variants'])} variants ({variants}). Training "
            f"share of a step (nominal): {shares}. Every run stationary: {'yes' if steady else 'no'}.")


# ============================================================================ context sweep
def context_sweep(data: dict[str, Any]) -> str:
    res = data["results"]
    budgets = sorted({int(k.split("@")[1].rstrip("k")) for k in res})
    rows = []
    for k in budgets:
        s, a, c = (res[f"{p}@{k}k"] for p in ("sync", "april", "copris"))
        rows.append([f"{k}K", f"{s['steps_per_hour']:.2f}", f"{a['steps_per_hour']:.2f}", f"{c['steps_per_hour']:.2f}",
                     f"{c['steps_per_hour'] / s['steps_per_hour']:.2f}x",
                     f"{a['steps_per_hour'] / s['steps_per_hour']:.2f}x",
                     f"{c['steps_per_hour'] / a['steps_per_hour']:.2f}x",
                     f"{s['utilization']:.1%} / {c['utilization']:.1%}"])
    return md_table(["budget", "sync steps/h", "april", "copris", "copris / sync", "april / sync", "copris / april",
                   "util sync / copris"], rows)


# ============================================================================ multi-turn
def multiturn(data: dict[str, Any]) -> str:
    band = data["band"]
    rows = []
    for policy, c in band["comparison"].items():
        def show(key: str, c: dict[str, Any] = c) -> str:
            v = c[key]
            return f"{v['nominal']:.2f}x ({v['min']:.2f}-{v['max']:.2f}x)"
        rows.append([policy, show("multi_turn"), show("single_turn"), show("gain")])
    table = md_table(["policy", "vs sync, multi-turn", "vs sync, single turn of equal tokens",
                    "multi-turn gain / single-turn gain"], rows)
    runs = [(side.replace("_", "-"), name, policy, summary) for side in ("multi_turn", "single_turn")
            for name, by_policy in band[side]["runs"].items() for policy, summary in by_policy.items()]
    unsteady = [f"{policy} {side} ({name})" for side, name, policy, summary in runs if not summary["stationary"]]
    steps = data["workload"]["steps"]
    steady = ("Every run stationary." if not unsteady else
              f"Not stationary in {steps} steps (the partial buffer still trended over the second half), "
              f"{len(unsteady)} of {len(runs)} runs: {', '.join(unsteady)}.")
    e = data["episodes"]
    return (table + f"\n\nNominal value (min-max over {len(band['multi_turn']['variants'])} variants). Episodes: "
            f"{e['turns_mean']:.2f} turns and {e['model_tokens_mean']:,.0f} model tokens on average, "
            f"{e['tool_s_per_episode_mean']:.1f} s of tools per episode. {steady}")


# ============================================================================ staleness bounds
def _bound_of(label: str) -> str:
    _, _, bound = label.partition("@s")
    return bound or "unbounded"


def bounds(data: dict[str, Any]) -> str:
    """Each policy at each staleness bound (a ``bench --band`` or ``bench multi-turn --band`` JSON
    run with ``--bounds``): its ratio to sync with the band, the share of its unbounded gain it
    keeps, the lag of its trained tokens, and the tokens thrown away, by the staleness fallback
    (restart / drop) apart from the rest (pacing itself discards nothing). Bounded rows first."""
    pair = "multi_turn" in data["band"]
    band = data["band"]["multi_turn"] if pair else data["band"]
    single = data["band"]["single_turn"]["policies"] if pair else {}
    retained = band.get("gain_retained", {})
    labels = [k for k in band["policies"] if k != "sync"]
    order = {"2": 0, "4": 1, "1": 2, "unbounded": 3}
    labels.sort(key=lambda k: (order.get(_bound_of(k), 4), k))

    def ratio(b: dict[str, Any]) -> str:
        return f"{b['ratio_to_sync']:.2f}x ({b['ratio_to_sync_min']:.2f}-{b['ratio_to_sync_max']:.2f})"

    rows = []
    for label in labels:
        b = band["policies"][label]
        policy = label.partition("@s")[0]
        g = retained.get(label)
        kept = f"{g['nominal']:.0%} ({g['min']:.0%}-{g['max']:.0%})" if g else "—"
        lag = (f"{b['token_staleness_mean']:.2f} ({b['token_staleness_mean_min']:.2f}-"
               f"{b['token_staleness_mean_max']:.2f}) / {b['token_staleness_max']}")
        row = [policy, _bound_of(label), ratio(b), kept, lag, f"{b['stale_discarded_tokens_max']:,}",
               f"{b['other_discarded_tokens']:,}", f"{b['trained_tokens']:,}"]
        if pair:
            row.insert(3, ratio(single[label]) if label in single else "—")
        rows.append(row)
    side = ", multi-turn" if pair else ""
    header = ["policy", "max_staleness", "vs sync" + side, f"share of the unbounded gain kept{side}",
              f"trained-token lag{side}, mean (band) / max",
              f"tokens discarded by the staleness fallback{side} (worst variant)", "discarded otherwise",
              "trained tokens"]
    if pair:
        header.insert(3, "vs sync, single turn of equal tokens")
    runs = [(side, name, label, summary) for side in (("multi_turn", "single_turn") if pair else (None,))
            for name, by_label in (data["band"][side] if side else band)["runs"].items()
            for label, summary in by_label.items()]
    unsteady = [f"{label} {side.replace('_', '-') + ' ' if side else ''}({name})"
                for side, name, label, summary in runs if not summary["stationary"]]
    warm = [summary["warmup_steps"] for *_, summary in runs]
    variants = ", ".join(v["name"] for v in band["variants"])
    w = data["workload"]
    steady = ("every run stationary" if not unsteady else
              f"not stationary (the partial buffer still trended over the second half): {', '.join(unsteady)}")
    return (md_table(header, rows) + f"\n\n{w['rollout_batch_size']} prompts x {w['n_samples_per_prompt']} samples "
            f"per step, {w['steps']} steps, warm-up {min(warm)}-{max(warm)} steps left out (MSER), {steady}. "
            f"Nominal value (min-max over {len(band['variants'])} variants: {variants}); every ratio and "
            f"share measured within its variant. Discarded tokens: totals over the measured steps of the "
            f"nominal variant, the fallback's over the worst variant.")


# ============================================================================ the fit
def fit_table(data: dict[str, Any]) -> str:
    rows = []
    for law, f in data["laws"].items():
        best = next(p for p in f["grid"] if p["law"] == f["best"])
        st = best["statistics"]
        num, den = best["numerator"], best["denominator"]
        on_seconds = num["published_s_per_step"] is not None
        if on_seconds:
            target = (f"s/step {num['step_s']:,.0f} / {den['step_s']:,.0f} vs {num['published_s_per_step']:,.0f} / "
                      f"{den['published_s_per_step']:,.0f} ({best['emulated']:.2f}x vs {best['published']:.2f}x)")
            median = f"{best['median_tokens']:,.0f}"
        else:
            lo, hi = f["median_interval"]
            target = (f"{best['emulated']:.2f}x vs {best['published']:.2f}x; carried-over tokens "
                      f"{num['carried_token_fraction']:.0%} vs 40%")
            median = f"{best['median_tokens']:,.0f} ({lo:,.0f}-{hi:,.0f})"
        rows.append([f"`{law}`", f["row"].split(":")[0], median, f"{best['prompt_sigma']:.2f}",
                     f"{st['median']:,.0f} / {st['mean']:,.0f}", f"{st['sigma_batch']:,.0f} / {st['sigma_group']:,.0f}",
                     target, f"{len(f['grid'])}, {best['score']:.2f}"])
    table = md_table(["law", "fit row", "median_tokens (interval)", "prompt_sigma", "median / mean at 16K",
                    "sigma batch / group at 16K", "fit row: emulated vs published", "candidates, best score"], rows)
    t = data.get("verl_training") or {}
    if t:
        table += (f"\n\nveRL's training phase (CoPRIS tab. 2 at N' = 1024): update MFU {t['train_mfu']:.1%}, "
                  f"log-prob MFU {t['logprob_mfu']:.1%}.")
    return table


# ============================================================================ the CPU engine
def cpu_engine(spec: dict[str, Any], compare: list[dict[str, Any]]) -> str:
    m = spec["measurements"]
    fit = m["decode_fit"]
    grid = ", ".join(f"{p['decode_step_s'] * 1e3:.1f} ms at {p['batch']} x {p['context']}" for p in m["decode_grid"])
    text = (f"Measured: KV pool {m['kv_capacity_tokens']:,} tokens, {m['max_running_requests']} running "
            f"requests, parallel size {spec['gpus_per_engine']} from `/server_info` (the spec's devices per "
            f"engine); decode "
            f"step {m['decode_t0'] * 1e3:.1f} ms + {m['decode_per_request'] * 1e3:.2f} ms per request + "
            f"{m['decode_per_kv_token'] * 1e9:.1f} ns per KV token, worst error on the grid "
            f"{fit['max_relative_error']:.0%}, {fit.get('extrapolation_relative_error', float('nan')):.0%} at the "
            f"point of most KV ({fit.get('extrapolated_point', 0):,.0f} tokens) predicted from the others; prefill "
            f"{m['prefill_t0'] * 1e3:.0f} ms + {m['prefill_per_token'] * 1e6:.1f} us per token; abort latency "
            f"{m['abort_latency_s'] * 1e3:.0f} ms. Grid (batch x prompt tokens): {grid}.")
    rows = [[f"{r['batch']} x {r['prompt_len']}, {r['new_tokens']}", f"{r['real_s']:.3f} s", f"{r['emulated_s']:.3f} s",
             f"{r['ratio']:.2f}"] for r in compare]
    return text + "\n\n" + md_table(["batch x prompt, new tokens", "real", "emulated", "emulated / real"], rows)


# ============================================================================ the presets (from code)
def engine_presets() -> str:
    from .spec import ENGINE_PRESETS

    rows = []
    for name, p in ENGINE_PRESETS.items():
        tm = p.time_model()
        training = (f"update {p.train_mfu:.0%}, log-probs {p.logprob_mfu or p.train_mfu:.0%} MFU"
                    + (", + buffered partials" if p.logprob_buffered else "")
                    + (f", + {p.train_fixed_s:g} s" if p.train_fixed_s else ""))
        rows.append([f"`{name}`", f"{p.num_engines} x TP{p.gpus_per_engine} {p.gpu or 'GPU'}, {p.engine}, mem "
                     f"{p.mem_fraction_static:g}" + (", eager" if p.enforce_eager else ""), p.model,
                     f"{p.kv_capacity():,}", f"{tm.decode_t0 * 1e3:.2f} ms", f"{1.0 / tm.decode_step(1, 1000):,.0f}",
                     training])
    return md_table(["preset", "GPUs, engine", "model", "KV tokens / engine", "decode_t0", "1-stream tok/s",
                   "training"], rows)


def _real(name: str) -> Callable[..., str]:
    """A renderer of ``april-slime bench real``'s JSON (``real/report.py``, which uses this module's
    table helper, so it is imported when first used)."""
    def render(*data: Any) -> str:
        from .real import report

        return getattr(report, name)(*data)

    return render


RENDERERS: dict[str, tuple[int, Callable[..., str]]] = {
    "engine-presets": (0, engine_presets),
    "reproduce-table": (1, reproduce_table), "reproduce-summary": (1, reproduce_summary),
    "reproduce-statistics": (1, reproduce_statistics), "reproduce-absolute": (1, reproduce_absolute),
    "headline": (1, headline), "context-sweep": (1, context_sweep), "multi-turn": (1, multiturn),
    "bounds": (1, bounds),
    "fit": (1, fit_table), "cpu-engine": (2, cpu_engine),
    "real": (1, _real("table")), "real-checks": (1, _real("checks")), "real-repeat": (2, _real("repeat")),
    "real-readme": (1, _real("readme")),
}


def render(kind: str, paths: list[str], root: str = ".") -> str:
    if kind not in RENDERERS:
        raise ValueError(f"unknown bench-report block {kind!r}; known: {sorted(RENDERERS)}")
    count, function = RENDERERS[kind]
    paths = [p for p in paths if p != "-"]
    if len(paths) != count:
        raise ValueError(f"bench-report {kind} takes {count} JSON path(s), got {paths}")
    return function(*(_load(root, p) for p in paths))


def blocks(text: str) -> list[tuple[str, list[str], int, int]]:
    """(kind, paths, start, end) of every generated block's body in ``text``."""
    out = []
    for match in BEGIN.finditer(text):
        end = text.find(END, match.end())
        if end < 0:
            raise ValueError(f"bench-report {match['kind']} block has no {END}")
        out.append((match["kind"], match["paths"].split(), match.end(), end))
    return out


def update(text: str, root: str = ".") -> str:
    for kind, paths, start, end in reversed(blocks(text)):
        text = text[:start] + render(kind, paths, root) + "\n" + text[end:]
    return text


def check(text: str, root: str = ".") -> list[str]:
    """The blocks whose text is not what their JSON renders (empty: the document is true)."""
    problems = []
    for kind, paths, start, end in blocks(text):
        if text[start:end] != render(kind, paths, root) + "\n":
            problems.append(f"{kind} {' '.join(paths)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="april-slime bench report",
                                description="Render the bench's tables in docs/results.md, docs/calibration.md and "
                                            "docs/bench.md from the JSON the bench commands wrote "
                                            "(--check: only compare).")
    p.add_argument("--check", action="store_true", help="exit 1 if a document differs from its JSON")
    p.add_argument("--root", default=".", help="the repository (default: the current directory)")
    p.add_argument("documents", nargs="*", default=list(DOCUMENTS))
    args = p.parse_args(argv)
    failed = False
    for doc in args.documents:
        path = os.path.join(args.root, doc)
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        try:
            if args.check:
                problems = check(text, args.root)
                for problem in problems:
                    print(f"{doc}: block {problem} differs from what its JSON renders", file=sys.stderr)
                failed |= bool(problems)
            else:
                new = update(text, args.root)
                if new != text:
                    with open(path, "w", encoding="utf-8") as fh:
                        fh.write(new)
                    print(f"{doc}: updated")
        except (OSError, ValueError, KeyError) as exc:
            print(f"{doc}: {exc!r}", file=sys.stderr)
            failed = True
    return 1 if failed else 0
