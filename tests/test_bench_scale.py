"""``april-slime bench scale`` at toy sizes: every part runs, the plugin's CPU is told from the
emulator's, and the checkpoint figures relate to what was buffered (no verdict on speed: these
are the benchmark's job, and this machine's load moves them)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from april_workbench.bench import scale


def _children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    children = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:  # it ended while being read
            continue
        if fields.get("PPid", "").strip() == str(pid):
            children.append(int(fields["Pid"]))
    return children


def test_the_scheduler_cost_splits_the_step_cpu_and_counts_every_call():
    [unbounded] = [scale.scheduler_cost(64, None, steps=3, max_response_len=1024)]
    steps = unbounded["steps"]
    assert len(steps) == 3 and sum(s["engine_calls"] for s in steps) > 0
    assert all(s["plugin_cpu_s"] > 0 and s["emulator_cpu_s"] >= 0 for s in steps)
    assert any(s["emulator_cpu_s"] > 0 for s in steps), "the emulator's CPU was not measured"
    assert unbounded["steps_per_h_charged"] < unbounded["steps_per_h_virtual"]


def test_the_run_over_http_measures_only_the_client_and_leaves_no_engine_process():
    """The engines run in a child process: the step CPU measured is the client's (the plugin, its
    HTTP client, the JSON of the replies), every call of a step is counted, and the child is gone
    when the run ends."""
    result = scale.http_scheduler_cost(64, None, steps=3, max_response_len=1024, time_scale=50.0)
    steps = result["steps"]
    assert len(steps) == 3 and sum(s["engine_calls"] for s in steps) > 0  # a step may be served from the buffer
    assert all(s["plugin_cpu_s"] > 0 and s["emulator_cpu_s"] == 0 for s in steps)
    assert all(s["generated_tokens"] > 0 for s in steps if s["engine_calls"])
    assert 0 <= result["gc2_share"] < 1 and result["client_ms_per_call"] > 0
    assert not _children_of(os.getpid())
    table = scale.report({"scheduler": [], "http": [result], "checkpoint": [], "objects": None})
    assert "full collections / step" in table


def test_the_checkpoint_cost_reports_a_file_of_the_raw_bytes(tmp_path):
    plain = scale.checkpoint_cost(500_000, routed=None, folder=tmp_path, repeat=1)
    routed = scale.checkpoint_cost(3_000, routed=(4, 2), folder=tmp_path, repeat=1)
    for c in (plain, routed):
        assert 1.0 <= c["file_over_raw"] < 1.2, c
        assert c["resident_with_two_snapshots_over_buffer"] < 1.2, c
        # the untimed first load and the timed one, each (wall, CPU); the ratio is of the timed
        assert len(c["load_tries_wall_cpu_s"]) == 2 and c["load_s"] == c["load_tries_wall_cpu_s"][1][0], c
        assert len(c["numpy_load_tries_wall_cpu_s"]) == 1, c
    # an int32 id and a float64 log-prob each, plus the process's fixed costs (about 1 MB) spread over
    # the tokens; a Python list held 68 bytes per token (a pointer and an int, a pointer and a float)
    assert 12 <= plain["live_bytes_per_token"] < 16
    # routing rows: 8 ids per position (one trajectory of a 512-token prompt and 3,000 response
    # tokens), held and written one byte each (as int32 they were four), besides the ids and log-probs
    positions = 512 + 3_000 - 1
    assert routed["held_bytes"] == routed["raw_bytes"] == 512 * 4 + 3_000 * 12 + positions * 8


def test_the_command_writes_its_json(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert scale.main(["--quick", "--n-prime", "64", "--bounds", "2", "--tokens", "20000",
                       "--routed-tokens", "2000", "--json", str(out), "--dir", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert [r["bound"] for r in result["scheduler"]] == [2]
    assert [c["routed"] for c in result["checkpoint"]] == [None, list(scale.ROUTED)]
    assert "plugin ms / call" in capsys.readouterr().out


def test_the_command_measures_only_the_parts_asked_for(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert scale.main(["--quick", "--n-prime", "64", "--bounds", "none", "--parts", "scheduler",
                       "--json", str(out), "--dir", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert [r["bound"] for r in result["scheduler"]] == [None] and result["checkpoint"] == []
    [row] = result["scheduler"]
    assert sum(s["generated_tokens"] for s in row["steps"]) > 0 and row["plugin_ms_per_1k_tokens"] > 0
    assert scale.main(["--quick", "--parts", "scheduler,ckpt"]) == 2
    assert "ckpt is not one of scheduler, http, checkpoint, objects" in capsys.readouterr().err


def test_the_command_can_measure_the_checkpoint_alone(tmp_path):
    out = tmp_path / "scale.json"
    assert scale.main(["--parts", "checkpoint", "--tokens", "20000", "--routed-tokens", "2000",
                       "--json", str(out), "--dir", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert result["scheduler"] == [] and [c["response_tokens"] for c in result["checkpoint"]] == [20_000, 2_000]


def test_the_objects_a_call_holds_in_flight_are_counted_over_http_and_in_process(capsys):
    """Each transport's count is taken with every call running on the engine (a call that ended
    first fails the count): at least its task and the client's coroutines per call."""
    result = scale.objects_in_flight(8)
    assert result["calls"] == 8
    for census in (result["http"], result["in_process"]):
        assert census["per_call"] >= 3 and census["top_per_call"], census
        assert max(census["top_per_call"].values()) <= census["per_call"]
    table = scale.report({"scheduler": [], "checkpoint": [], "objects": result})
    assert "tracked objects per call in flight (8 calls)" in table and "HTTP (the plugin's client)" in table


def test_the_docs_show_the_committed_run():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = json.loads((root / "docs/results/bench_scale.json").read_text())
    doc = (root / "docs/performance.md").read_text()
    for table in scale.report(result).split("\n\n"):
        assert table in doc, "docs/performance.md does not show docs/results/bench_scale.json (rerun the report)"
    assert not result["quick"] and {r["n_prime"] for r in result["scheduler"]} >= {64, 4096}
    objects = json.loads((root / "docs/results/bench_scale_objects.json").read_text())
    assert objects["objects"]["calls"] >= 256 and scale.report(objects) in doc, (
        "docs/performance.md does not show docs/results/bench_scale_objects.json")
