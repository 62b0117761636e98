"""The bench's figures in the README, docs/results.md, docs/calibration.md and docs/bench.md are what their
JSON renders.

Every generated block (``<!-- bench-report KIND PATH -->``) must equal ``april-slime bench report``'s
rendering of the JSON the bench command wrote; a figure typed by hand, or a JSON rerun without its
document, fails here. The counts in the reproduce summary are computed, not typed."""

import json
import shutil
from pathlib import Path

import pytest

from april_workbench.bench import docs_report
from april_workbench.bench.docs_report import check, render, reproduce_counts, update

ROOT = Path(__file__).resolve().parent.parent

# Which blocks each document must carry: removing one is as wrong as editing it.
REQUIRED = {
    # the README's first performance figure is measured on real engines, the emulated one beside it
    "README.md": {"real-readme", "real-checks", "headline"},
    "docs/results.md": {"headline", "multi-turn", "bounds", "real-readme"},
    "docs/calibration.md": {"reproduce-summary"},
    "docs/bench.md": {"headline", "reproduce-table", "reproduce-statistics", "reproduce-absolute", "fit",
                      "cpu-engine", "multi-turn", "bounds", "real", "real-checks", "real-repeat"},
}


@pytest.mark.parametrize("document", sorted(REQUIRED))
def test_documents_match_their_json(document):
    text = (ROOT / document).read_text(encoding="utf-8")
    kinds = {kind for kind, *_ in docs_report.blocks(text)}
    assert REQUIRED[document] <= kinds, f"{document} lacks blocks {REQUIRED[document] - kinds}"
    assert check(text, str(ROOT)) == [], (f"{document} differs from its JSON: run `april-slime bench report` "
                                          f"after the bench command that wrote it")


def test_a_changed_figure_or_json_is_caught(tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("*.png"))
    doc = "# x\n<!-- bench-report headline docs/results/bench_headline.json -->\nstale\n<!-- /bench-report -->\n"
    text = update(doc, str(tmp_path))
    assert check(text, str(tmp_path)) == [] and "stale" not in text
    # a hand-edited figure
    copris = json.loads((tmp_path / "docs/results/bench_headline.json").read_text())["band"]["policies"]["copris"]
    typed = text.replace(f"**{copris['ratio_to_sync']:.2f}x**", f"**{copris['ratio_to_sync'] + 0.01:.2f}x**", 1)
    assert typed != text and check(typed, str(tmp_path)) == ["headline docs/results/bench_headline.json"]
    # a JSON rerun without its document
    data = json.loads((tmp_path / "docs/results/bench_headline.json").read_text())
    data["band"]["policies"]["copris"]["ratio_to_sync_max"] = 3.0
    (tmp_path / "docs/results/bench_headline.json").write_text(json.dumps(data))
    assert check(text, str(tmp_path)) == ["headline docs/results/bench_headline.json"]


def test_reproduce_counts_are_computed():
    rows = [{"role": "fit", "difference": 0.01}, {"role": "held-out", "difference": -0.05},
            {"role": "held-out", "difference": 0.10}, {"role": "held-out", "difference": 0.2}]
    c = reproduce_counts(rows)
    assert c["held-out"]["within"] == 2 and c["held-out"]["rows"] == 3 and c["fit"]["within"] == 1
    assert c["held-out"]["max"] == 0.2


def test_bad_blocks_are_named():
    with pytest.raises(ValueError, match="unknown"):
        render("no-such-table", ["docs/results/bench_headline.json"], str(ROOT))
    with pytest.raises(ValueError, match="has no"):
        docs_report.blocks("<!-- bench-report headline docs/results/bench_headline.json -->\nno end\n")


def test_an_empty_block_is_found_empty():
    text = "x\n<!-- bench-report headline docs/results/bench_headline.json -->\n<!-- /bench-report -->\ny\n"
    [(kind, paths, start, end)] = docs_report.blocks(text)
    assert kind == "headline" and paths == ["docs/results/bench_headline.json"] and start == end


def test_results_vcpo_cpu_figures_are_the_json_and_unbacked_figures_are_gone():
    """docs/results.md's VCPO CPU overhead is what docs/results/vcpo_overhead_cpu.json holds; figures no
    committed JSON of the current code backs (the old H100 ratios, the real-SGLang policy timing)
    are not quoted."""
    readme = (ROOT / "docs/results.md").read_text(encoding="utf-8")
    rows = {r["variant"]: r for r in json.loads((ROOT / "docs/results/vcpo_overhead_cpu.json").read_text())["rows"]}
    for variant in ("opob_packed", "opob_single"):
        r = rows[variant]
        quoted = f"{r['ratio_to_plain_median']:.2f}x the plain\nstep's time" if variant == "opob_packed" else \
            f"{r['ratio_to_plain_median']:.2f}x at {r['peak_rss_ratio_to_plain']:.2f}x"
        assert quoted in readme, f"docs/results.md lacks the {variant} figures of the JSON ({quoted!r})"
    assert f"at {rows['opob_packed']['peak_rss_ratio_to_plain']:.2f}x its peak memory" in readme
    for unbacked in ("1.32x step", "7.9x at 4K", "2.2x\nthe step time", "(1.91x", "(2.45x"):
        assert unbacked not in readme, (f"docs/results.md quotes {unbacked!r}, which no committed JSON of this "
                                        "code backs")


def test_rows_with_the_training_fit_run_as_an_arm_are_partly_fitted():
    """The training phase is fitted on CoPRIS tab. 2's N' = 1024 run; a row published as held out
    with that run as an arm is counted apart, in the code and in the committed JSON alike; the
    length statistics a law is solved to meet are flagged as inputs."""
    from april_workbench.bench.reproduce import PARTLY_FITTED, SOLVED_STATISTICS, rows, tab2_reference

    table = rows()
    ref = tab2_reference()
    marked = {r.name for r in table if r.role == PARTLY_FITTED}
    assert marked == {r.name for r in table if r.role != "fit" and ref in (r.numerator, r.denominator)}
    assert len(marked) == 5 and not any("Distill-Qwen-7B" in name for name in marked)
    data = json.loads((ROOT / "docs/results/bench_reproduce.json").read_text())
    assert {r["name"]: r["role"] for r in data["rows"]} == {r.name: r.role for r in table}
    assert {s["name"] for s in data["statistics"] if s.get("solved")} == set(SOLVED_STATISTICS)
    assert reproduce_counts(data["rows"])["partly fitted"]["rows"] == 5


BOUNDS_BANDS = ("docs/results/bench_multiturn_bounds.json", "docs/results/bench_multiturn_bounds_oldest.json",
                "docs/results/bench_dapo16k_bounds.json")


@pytest.mark.parametrize("path", BOUNDS_BANDS)
def test_the_bounds_table_is_its_json(tmp_path, path):
    """The staleness-bounds tables render the committed bands (multi-turn beside its twin, and the
    single-turn headline workload): a changed share of the gain kept or a fallback that threw tokens
    away shows up as a document that no longer matches; docs/bench.md carries each band's table."""
    blocks = [(kind, paths) for kind, paths, *_ in docs_report.blocks((ROOT / "docs/bench.md").read_text("utf-8"))]
    assert ("bounds", [path]) in blocks, f"docs/bench.md lacks the bench-report bounds block of {path}"
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("*.png"))
    text = update(f"<!-- bench-report bounds {path} -->\n<!-- /bench-report -->\n", str(tmp_path))
    data = json.loads((tmp_path / path).read_text())
    band = data["band"].get("multi_turn", data["band"])
    kept = band["gain_retained"]["copris@s2"]
    assert f"{kept['nominal']:.0%} ({kept['min']:.0%}-{kept['max']:.0%})" in text
    assert check(text, str(tmp_path)) == []
    band["policies"]["copris@s2"]["stale_discarded_tokens_max"] += 1000
    (tmp_path / path).write_text(json.dumps(data))
    assert check(text, str(tmp_path)) == [f"bounds {path}"]


def test_the_readme_leads_with_a_figure_measured_on_real_engines():
    kinds = [kind for kind, *_ in docs_report.blocks((ROOT / "README.md").read_text(encoding="utf-8"))]
    assert kinds.index("real-readme") < kinds.index("headline")  # the emulated GPU figure comes after
