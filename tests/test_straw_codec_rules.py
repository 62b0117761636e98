"""The re-implementation of slime 0.4.0's durable ``Sample`` codec rules (``tests/support/straw_codec``)
refuses and alters what slime's ``slime/data/codec.py`` does, and the samples a plugin job hands
slime (emulated engines; real SGLang: ``tests/real/test_sampler_capture_real.py``) pass it whole."""

from __future__ import annotations

import enum
import json

import numpy as np
import pytest
import torch

from april_slime import rollout
from tests.support.slime_040_sample import require_real_slime
from tests.support.slime_jobs import Cluster, make_args, point_at
from tests.support.straw_codec import check_samples, differences, round_trip


@pytest.fixture(autouse=True)
def _needs_slime():
    """The rules name slime's own classes (its ``Sample`` and the types inside it)."""
    require_real_slime()


class Colour(str, enum.Enum):
    RED = "red"


class Tagged(int):
    pass


@pytest.mark.parametrize("value", [Colour.RED, Tagged(3), {1, 2}, object(), np.array([object()]),
                                   {"k": [1, {"deep": frozenset()}]}])
def test_what_slime_040_refuses_is_refused_naming_where(value):
    with pytest.raises(TypeError, match="value"):
        round_trip(value)


def test_a_cycle_is_refused():
    loop = []
    loop.append(loop)
    with pytest.raises(TypeError, match="cycle"):
        round_trip(loop)


def test_what_slime_040_keeps_comes_back_and_what_it_alters_is_named():
    from slime.utils.types import Sample

    value = {"t": torch.arange(6, dtype=torch.int32).reshape(2, 3), "a": np.ones(3, dtype=np.float32),
             "b": b"\x00\xff", "n": np.int64(7), "f": float("inf"), "tuple": (1, "x"), 3: None,
             "s": Sample(index=4, tokens=[1, 2], status=Sample.Status.ABORTED, metadata={"k": [1.5]})}
    back = round_trip(value)
    assert differences(value, back) == ["value['n']: int64 came back as int"]
    assert back["s"].status is Sample.Status.ABORTED and back["tuple"] == (1, "x")
    assert differences({"b": bytearray(b"x")}, round_trip({"b": bytearray(b"x")})) == [
        "value['b']: bytearray came back as bytes"]


def test_a_jobs_trained_samples_pass_slime_040s_codec(slime_mode, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Q{i:03d}", "label": str(i)}) + "\n" for i in range(40)))
    cluster = Cluster()
    try:
        cluster.bump(1)
        args = point_at(make_args(tmp_path, prompts, april_policy="copris", april_over_sampling_factor=3.0),
                        cluster)
        source = rollout.AprilDataSource(args)
        checked = 0
        for step in range(2):
            output = rollout.generate_rollout(args, step, source)
            checked += check_samples([s for g in output.samples for s in g])
            cluster.bump(step + 2)
        assert checked >= 2 * 4
    finally:
        rollout.shutdown()
        cluster.stop()
