"""The buffer behind ``tests/data/april_state_format3.bin``: a state file written by the binary
format 3 (routed experts narrowed to uint8 on disk, int32 in memory), kept to prove that later
formats still read it. The file was written from ``fixture_buffer()`` by that version; this
builder must stay as it is (seeded), or the file no longer describes the same buffer."""

from __future__ import annotations

import numpy as np

from april_slime.core.buffer import PartialBuffer
from april_slime.core.replay import SegmentReplay, float32_bytes, int32_bytes
from april_slime.core.types import Group, Trajectory, TrajectoryStatus

FIXTURE_WIDTH = 6  # routed experts per position: 3 layers x top-2
FIXTURE_ROLLOUT = 7
FIXTURE_POLICY_VERSION = 3


def _routed(uid: str, experts: int, seed: int) -> Group:
    """Two partial trajectories over two calls each, every position's routed experts below ``experts``."""
    rng = np.random.default_rng(seed)
    prompt = list(range(100, 105))
    trajectories = []
    for i in range(2):
        t = Trajectory(uid=f"{uid}/{i}", group_uid=uid, index_in_group=i, prompt_ids=prompt,
                       max_new_tokens=100, sampling_seed=i)
        for start, count, version in ((0, 4, 0), (4, 5 + i, 1)):
            input_len = len(prompt) + start
            first_row = input_len - 1 if start else 0
            rows = rng.integers(0, experts, size=(input_len + count - 1 - first_row) * FIXTURE_WIDTH)
            seg = SegmentReplay(routed_start=first_row, routed=int32_bytes(rows.tolist()), routed_width=FIXTURE_WIDTH)
            t.append(rng.integers(0, 150_000, count).tolist(), (-rng.random(count)).tolist(), version, replay=seg)
        t.status, t.finish_reason, t.num_calls = TrajectoryStatus.ABORTED, "abort", 2
        trajectories.append(t)
    return Group(uid=uid, prompt_ids=prompt, trajectories=trajectories, payload={"label": uid})


def _sampled(uid: str, seed: int) -> Group:
    """A finished and a partial trajectory with top-p kept ids (and log-probs) and top-3 rows."""
    rng = np.random.default_rng(seed)
    trajectories = []
    for i, count in enumerate((6, 3)):
        t = Trajectory(uid=f"{uid}/{i}", group_uid=uid, index_in_group=i, prompt_ids=[7, 8, 9],
                       max_new_tokens=50, sampling_seed=10 + i)
        kept = rng.integers(1, 4, count).tolist()
        seg = SegmentReplay(top_p_ids=int32_bytes(rng.integers(0, 1000, sum(kept)).tolist()),
                            top_p_counts=int32_bytes(kept),
                            top_p_log_probs=float32_bytes((-rng.random(sum(kept))).tolist()),
                            topk=3, topk_ids=int32_bytes(rng.integers(0, 1000, 3 * count).tolist()),
                            topk_log_probs=float32_bytes((-rng.random(3 * count)).tolist()))
        t.append(rng.integers(0, 1000, count).tolist(), (-rng.random(count)).tolist(), 2, replay=seg)
        if i == 0:
            t.status, t.finish_reason, t.reward = TrajectoryStatus.COMPLETED, "stop", 0.75
        else:
            t.status, t.finish_reason, t.num_aborts = TrajectoryStatus.ABORTED, "abort", 1
        trajectories.append(t)
    return Group(uid=uid, prompt_ids=[7, 8, 9], trajectories=trajectories, created_version=1, restarts=1)


def _episode(uid: str) -> Group:
    """An episode's finished member (its sample keeps replay rows as bytes) and a pending one."""
    done = Trajectory(uid=f"{uid}/0", group_uid=uid, index_in_group=0, prompt_ids=[1, 2],
                      max_new_tokens=20, sampling_seed=0, sampling_params={"temperature": 0.5})
    done.append([3, 4, 5], [-0.5, -0.25, -0.125], 4)
    done.status, done.finish_reason, done.loss_mask = TrajectoryStatus.COMPLETED, "stop", [1, 0, 1]
    done.episode_sample = {"sample": {"tokens": [1, 2, 3, 4, 5]}, "rows": bytes(range(24))}
    pending = Trajectory(uid=f"{uid}/1", group_uid=uid, index_in_group=1, prompt_ids=[1, 2],
                         max_new_tokens=20, sampling_seed=1)
    return Group(uid=uid, prompt_ids=[1, 2], trajectories=[done, pending], interruptions=2)


def fixture_buffer() -> PartialBuffer:
    buffer = PartialBuffer(priority="fifo")
    buffer.put(_routed("narrow", experts=128, seed=1))
    buffer.put(_routed("wide", experts=1000, seed=2))
    buffer.put(_sampled("sampled", seed=3))
    buffer.put(_episode("episode"))
    buffer.restarted_groups, buffer.dropped_tokens = 2, 17
    return buffer
