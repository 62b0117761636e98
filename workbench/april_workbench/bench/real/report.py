"""The real bench's tables in the documents, rendered from its JSON (``april-slime bench report``
blocks ``real``, ``real-checks``, ``real-repeat`` and ``real-readme``). Every count here ("k of n
within 10%") is computed from the JSON, never typed."""

from __future__ import annotations

import math
from typing import Any

from ..tables import md_table

WITHIN = 0.10  # an emulated ratio "predicts" a real one within +-10%, or inside the real band


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def _band(s: dict[str, Any]) -> str:
    sp = s["speedup"]
    if sp["low"] is None or sp["low"] == sp["high"]:
        return f"{sp['ratio']:.2f}x"
    return f"{sp['ratio']:.2f}x ({sp['low']:.2f}-{sp['high']:.2f})"


def predicted(real: dict[str, Any], emulated: dict[str, Any]) -> bool:
    """Whether the emulated ratio is within WITHIN of the real one or inside its band."""
    r, e = real["speedup"], emulated["speedup"]["ratio"]
    inside = r["low"] is not None and r["low"] <= e <= r["high"]
    return inside or abs(e / r["ratio"] - 1.0) <= WITHIN


def table(data: dict[str, Any]) -> str:
    """Every workload of a sweep: each arm's speed-up on the engines with its band, the emulated
    twin's, and where the step's time went."""
    base = data["baseline"]
    rows = []
    for name, w in data["workloads"].items():
        real, emu = w["real"], w["emulated"] or {}
        for arm, s in real.items():
            e = emu.get(arm)
            diff = "—" if e is None or arm == base else f"{e['speedup']['ratio'] / s['speedup']['ratio'] - 1:+.0%}"
            rows.append([name, arm, _num(s["step_s"], ".2f"), _band(s),
                         "—" if e is None else f"{e['speedup']['ratio']:.2f}x", diff,
                         _num(s["target_s"], ".2f"), _num(s["drain_s"], ".2f"), _num(s["in_flight"], ".1f"),
                         _num(s["engine_idle_s"], ".2f"), _num(s["free_slots"], ".1f"), _num(s["transit_ms"], ".0f"),
                         _num(s["client_cpu_s"], ".2f"), _num(s["engine_cpu_s"], ".2f")])
    return md_table(["workload", "arm", "step s", f"x {base} (95% band)", "emulated", "diff", "to target s",
                   "drain s", "in flight", "idle engine-s", "free slots", "transit ms", "client CPU s",
                   "engines' CPU s"], rows)


def _order_holds(real: dict[str, Any], bound: str) -> tuple[bool, str]:
    copris, april = real.get("copris" + bound), real.get("april" + bound)
    if copris is None or april is None:
        return True, ""
    c, a = copris["speedup"]["ratio"], april["speedup"]["ratio"]
    return c >= a >= 1.0, f"copris{bound} {c:.2f}x, april{bound} {a:.2f}x"


def checks(data: dict[str, Any]) -> str:
    """What the sweep set out to show, counted: the order copris >= april >= sync per workload and
    bound, and how many arms the emulated twin predicted (by the workload's role for the model)."""
    lines = []
    held, total, hits, arms = 0, 0, 0, 0
    passed: dict[str, list[str]] = {"tuned": [], "held-out": []}
    for name, w in data["workloads"].items():
        real, emu = w["real"], w["emulated"] or {}
        for bound in ("", "@s2"):
            ok, text = _order_holds(real, bound)
            if text:
                total += 1
                held += ok
                if not ok:
                    lines.append(f"- {name}: copris >= april >= sync does not hold at bound "
                                 f"{bound[2:] or 'none'} ({text})")
        scored = [a for a in real if a != data["baseline"] and a in emu]
        missed = [a for a in scored if not predicted(real[a], emu[a])]
        hits, arms = hits + len(scored) - len(missed), arms + len(scored)
        role = w["workload"].get("role", "held-out")
        if scored and not missed:
            passed.setdefault(role, []).append(name)
        for a in missed:
            r, e = real[a]["speedup"], emu[a]["speedup"]["ratio"]
            lines.append(f"- {name} ({role}): the emulated {a} {e:.2f}x is {e / r['ratio'] - 1:+.0%} from the "
                         f"measured {r['ratio']:.2f}x, outside its band")
    head = [f"- copris >= april >= sync: {held} of {total} (workload, bound) pairs."]
    if arms:
        roles = {role: sum(w["workload"].get("role", "held-out") == role for w in data["workloads"].values())
                 for role in ("tuned", "held-out")}
        head.append(f"- The emulated twin within ±{WITHIN:.0%} of the real speed-up, or inside its band: {hits} of "
                    f"{arms} arms; every arm of {len(passed['held-out'])} of the {roles['held-out']} held-out "
                    f"workloads ({', '.join(passed['held-out']) or 'none'}) and of {len(passed['tuned'])} of the "
                    f"{roles['tuned']} the engine model was developed on ({', '.join(passed['tuned']) or 'none'}).")
    return "\n".join(head + lines)


def repeat(first: dict[str, Any], second: dict[str, Any]) -> str:
    """Two runs of one command: each arm's speed-up and band in both, and whether the bands overlap."""
    rows, overlap, count = [], 0, 0
    for name, w in first["workloads"].items():
        other = second["workloads"].get(name)
        if other is None:
            continue
        for arm, s in w["real"].items():
            t = other["real"].get(arm)
            if t is None or arm == first["baseline"]:
                continue
            a, b = s["speedup"], t["speedup"]
            ok = a["low"] <= b["high"] and b["low"] <= a["high"]
            overlap, count = overlap + ok, count + 1
            rows.append([name, arm, _band(s), _band(t), "yes" if ok else "**no**"])
    return (md_table(["workload", "arm", "run 1", "run 2", "bands overlap"], rows)
            + f"\n\nBands overlapping: {overlap} of {count} arms.")


def readme(data: dict[str, Any]) -> str:
    """The README's first performance figure: each workload's policies on the real engines, with
    the emulated twin beside them."""
    rows = []
    for name, w in data["workloads"].items():
        real, emu = w["real"], w["emulated"] or {}
        cells = [name]
        for arm in ("april", "copris", "april@s2", "copris@s2"):
            s = real.get(arm)
            e = emu.get(arm)
            cells.append("—" if s is None else _band(s) + ("" if e is None else f" / {e['speedup']['ratio']:.2f}x"))
        rows.append(cells)
    return md_table(["workload", "april", "copris", "april, bound 2", "copris, bound 2"], rows)
