"""Checkpoints and settings against real slime's code (``RolloutDataSource``, its torch-saved state
file, its argument parser): restarts under train.py's and train_async.py's orders, real SIGKILLs
mid-save, shuffled epochs, and the custom-YAML key check against slime's own argument names."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

pytestmark = pytest.mark.real

try:
    importlib.import_module("slime.rollout.data_source")
except ImportError as e:  # one line, as the real tier reports what it could not run
    pytest.skip(f"real slime is not importable ({e})", allow_module_level=True)

import slime_standin  # noqa: E402
import test_rollout_slime as base  # noqa: E402
import test_save_kill  # noqa: E402

from april_slime import rollout  # noqa: E402
from april_slime.config import AprilConfigError, check_keys  # noqa: E402


@pytest.fixture
def slime_mode(monkeypatch):
    assert slime_standin.install(monkeypatch) == "real"
    slime_standin.patch_real_tokenizer(monkeypatch)
    yield "real"
    rollout.shutdown()


@pytest.fixture
def cluster(slime_mode):
    c = base.Cluster()
    c.bump(1)
    yield c
    rollout.shutdown()
    c.stop()


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q{i:03d}", "label": str(i)}) + "\n" for i in range(40)))
    return path


@pytest.mark.parametrize("loop", ["train", "train_async"])
def test_a_restart_from_n_loses_and_repeats_nothing_on_real_slime(cluster, tmp_path, prompts, loop):
    base.test_a_restart_from_n_loses_and_repeats_nothing(cluster, tmp_path, prompts, loop)


def test_snapshot_across_a_shuffled_epoch_restores_slimes_order(slime_mode, tmp_path, prompts):
    """train_async order across an epoch boundary with --rollout-shuffle: the restarted job hands out
    the prompts the first job's rollout N+1 had taken, in the same shuffled order."""
    args = base.make_args(tmp_path, prompts, rollout_shuffle=True)
    source = rollout.AprilDataSource(args)
    source.next_groups(36, 1)
    source.snapshot(0)
    taken_by_1 = [g.payload["prompt_sample"]["prompt"] for g in source.next_groups(8, 1)]  # wraps the epoch
    source.snapshot(1)
    source.save(0)
    assert source._prompts.epoch_id == 1
    torch = importlib.import_module("torch")
    slime_file = torch.load(tmp_path / "ckpt" / "rollout" / "global_dataset_state_dict_0.pt")
    assert (slime_file["sample_offset"], slime_file["epoch_id"]) == (36, 0)

    restarted = rollout.AprilDataSource(base.make_args(tmp_path, prompts, rollout_shuffle=True, load=args.save))
    restarted.next_groups(3, 1)  # the fresh process's dataset is in epoch 0's order already
    restarted.load(0)
    again = [g.payload["prompt_sample"]["prompt"] for g in restarted.next_groups(8, 1)]
    assert again == taken_by_1


@pytest.mark.parametrize("point", ["tmp_synced"])  # "renamed" and later: the restart tests above
def test_sigkill_mid_save_on_real_slime(tmp_path, point):
    prompts = tmp_path / "prompts.jsonl"
    # few enough prompts that the restarted run wraps into a shuffled second epoch
    prompts.write_text("".join(json.dumps({"prompt": f"P{i:03d}"}) + "\n" for i in range(14)))
    test_save_kill.kill_and_restart(tmp_path, str(prompts), "train_async", point, slime="real", shuffle=True)


def test_no_slime_argument_is_taken_for_a_misspelled_setting():
    """Keys of the custom YAML that are slime's own arguments override them (slime's documented
    use); none may be mistaken for a near miss of a plugin setting."""
    arguments = importlib.import_module("slime.utils.arguments")
    parser = argparse.ArgumentParser()
    arguments.get_slime_extra_args_provider()(parser)
    dests = sorted({a.dest for a in parser._actions} - {"help"})
    assert len(dests) > 100
    refused = []
    for dest in dests:
        try:
            check_keys([], [dest])
        except AprilConfigError as e:
            refused.append(str(e))
    assert refused == []
