"""Which slime the plugin runs in (april_slime.slime_compat): the pinned layout, slime 0.4.0's layout
built here as a synthetic package (its data source moved to ``slime.data.data_source``, version
0.4.0 in its metadata), and the refusals at start of what the plugin cannot serve there."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from argparse import Namespace
from pathlib import Path

import pytest

from april_slime import slime_compat
from april_slime.core.config import AprilConfigError
from april_slime.slime_args import SlimeArgs
from tests.support import ROOT, child_process_kwargs

# the modules of slime the plugin imports, as slime 0.4.0 lays them out (data source moved)
NEWER_SLIME = {
    "slime/__init__.py": "",
    "slime/utils/__init__.py": "",
    "slime/utils/types.py": "class Sample:\n    pass\n",
    "slime/utils/processing_utils.py": "def load_tokenizer(path, **kw):\n    return None\n",
    "slime/utils/misc.py": "def load_function(path):\n    return None\n",
    "slime/data/__init__.py": "",
    "slime/data/data_source.py": "class RolloutDataSource:\n    def __init__(self, args):\n        self.args = args\n",
    "slime/rollout/__init__.py": "",
    "slime/rollout/base_types.py": "class RolloutFnTrainOutput:\n    pass\n",
    "slime/rollout/rm_hub/__init__.py": ("async def async_rm(*a, **k):\n    pass\n\n\n"
                                         "async def batched_async_rm(*a, **k):\n    pass\n"),
    "slime/rollout/filter_hub/__init__.py": "",
    "slime/rollout/filter_hub/base_types.py": "def call_dynamic_filter(*a, **k):\n    pass\n",
    "slime/rollout/sglang_rollout.py": "",
    "slime-0.4.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: slime\nVersion: 0.4.0\n",
}

PROBE = textwrap.dedent("""
    import json
    from argparse import Namespace
    from april_slime import slime_compat
    from april_slime.core.config import AprilConfigError
    from april_slime.samples import Slime
    from april_slime.slime_args import SlimeArgs

    out = {"version": slime_compat.slime_version(), "layout": slime_compat.layout(),
           "module": slime_compat.data_source_module(),
           "data_source": Slime().RolloutDataSource.__module__, "describe": slime_compat.describe(),
           "notes": slime_compat.notes(SlimeArgs.read(Namespace(flush_cache_interval=0)))}
    for args in (Namespace(rollout_data_transport="straw"), Namespace(buffer_sort_by_staleness=True)):
        try:
            slime_compat.check_job(SlimeArgs.read(args))
        except AprilConfigError as e:
            out.setdefault("refusals", []).append(str(e))
    slime_compat.check_job(SlimeArgs(rollout_data_transport="object-store", buffer_sort_by_staleness=False))
    print(json.dumps(out))
""")


@pytest.fixture
def newer_slime(tmp_path) -> Path:
    root = tmp_path / "site"
    for rel, text in NEWER_SLIME.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def run_with(site: Path, *argv: str) -> subprocess.CompletedProcess:
    kw = child_process_kwargs()
    kw["env"]["PYTHONPATH"] = f"{site}:{ROOT}"  # the synthetic slime shadows any installed one
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, **kw)


def test_newer_slime_layout_is_detected_and_its_data_source_resolved(newer_slime):
    done = run_with(newer_slime, "-c", PROBE)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["version"] == "0.4.0" and out["layout"] == "0.4"
    assert out["module"] == out["data_source"] == "slime.data.data_source"
    level, line = out["describe"]
    assert level == "warn" and line.startswith("slime 0.4.0: data source in slime.data.data_source")
    assert any("--flush-cache-interval 0" in n for n in out["notes"])
    straw, staleness = out["refusals"]
    assert straw.startswith("rollout_data_transport: slime 0.4.0 with --rollout-data-transport straw is not "
                            "supported") and "\n" not in straw
    assert "leased tasks" in straw and "saved and resumed by both" in straw
    assert staleness.startswith("buffer_sort_by_staleness: slime 0.4.0's --buffer-sort-by-staleness")
    assert "april_resume_priority: stalest" in staleness


def test_check_env_reports_the_newer_slime(newer_slime):
    done = run_with(newer_slime, str(ROOT / "scripts" / "check_env.py"))
    line = next(ln for ln in done.stdout.splitlines() if "slime version" in ln)
    assert line.startswith("[warn]") and "slime 0.4.0" in line and "0.4.0's layout" in line, done.stdout


def test_a_slime_without_any_data_source_module_is_a_one_line_failure(newer_slime):
    (newer_slime / "slime" / "data" / "data_source.py").unlink()
    done = run_with(newer_slime, "-c", "from april_slime.samples import Slime; Slime()")
    assert done.returncode != 0
    assert "slime has no RolloutDataSource module (looked for slime.rollout.data_source and " \
           "slime.data.data_source)" in done.stderr


def test_the_refusals_stop_a_job_at_start_before_anything_runs():
    """The rollout side's settings check (run when slime builds the data source) refuses them."""
    from april_slime.data_source import load_config

    base = dict(rollout_max_response_len=8, rollout_batch_size=1, n_samples_per_prompt=1)
    with pytest.raises(AprilConfigError, match="^rollout_data_transport: slime"):
        load_config(Namespace(rollout_data_transport="straw", **base))
    with pytest.raises(AprilConfigError, match="^buffer_sort_by_staleness: slime"):
        load_config(Namespace(buffer_sort_by_staleness=True, **base))
    assert load_config(Namespace(flush_cache_interval=3, **base)).policy == "copris"


def test_pinned_layout_where_real_slime_is_installed():
    if slime_compat.layout() == "unknown":
        pytest.skip("slime is not installed here (the synthetic layouts above still ran)")
    assert slime_compat.layout() == "0.3"
    assert slime_compat.data_source_module() == "slime.rollout.data_source"
    assert slime_compat.describe()[0] == "ok"
    assert slime_compat.notes(SlimeArgs.read(Namespace())) == []
