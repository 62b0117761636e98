"""The compact token columns and the binary data-source state file: what a save writes (raw bytes,
routed experts as uint8 when they fit, a group's prompt once), what a load accepts (truncated and
corrupt files refused naming the file; an earlier version's JSON still read), and that a snapshot
shares the buffer's tokens instead of copying them, yet never sees what the buffer does later."""

from __future__ import annotations

import gc
import json
import tracemalloc

import numpy as np
import pytest

from april_slime.core import checkpoint, state_file
from april_slime.core.buffer import TRAJECTORY_COLUMNS, PartialBuffer
from april_slime.core.columns import ByteChunks, Column, logprob_column, token_column
from april_slime.core.jsonfile import StateFileError
from april_slime.core.replay import SegmentReplay, int32_bytes
from april_slime.core.types import Group, Trajectory, TrajectoryStatus
from tests.test_buffer import Prompts, checkpoints, make_group

WIDTH = 6  # routed experts per position: 3 layers x top-2


def routed_group(uid: str, *, prompt_len: int = 5, tokens: int = 7, experts: int = 128) -> Group:
    """A group of two partial trajectories carrying routed experts (ids below ``experts``) over
    two calls, sharing one prompt column."""
    prompt = token_column(range(100, 100 + prompt_len))
    rng = np.random.default_rng(len(uid))
    trajectories = []
    for i in range(2):
        t = Trajectory(uid=f"{uid}/{i}", group_uid=uid, index_in_group=i, prompt_ids=prompt,
                       max_new_tokens=100, sampling_seed=i)
        first = tokens // 2
        for start, count, version in ((0, first, 0), (first, tokens - first, 1)):
            input_len = prompt_len + start
            rows = rng.integers(0, experts, size=(input_len + count - 1 - max(input_len - 1, 0)) * WIDTH)
            seg = SegmentReplay(routed_start=max(input_len - 1, 0) if start else 0,
                                routed=int32_bytes(rows.tolist()), routed_width=WIDTH)
            if not start:  # the first call returns the prompt's rows as well
                rows = rng.integers(0, experts, size=(input_len + count - 1) * WIDTH)
                seg = SegmentReplay(routed_start=0, routed=int32_bytes(rows.tolist()), routed_width=WIDTH)
            t.append(list(range(start, start + count)), [-0.125 * (k + 1) for k in range(count)], version,
                     replay=seg)
        t.status, t.finish_reason = TrajectoryStatus.ABORTED, "abort"
        trajectories.append(t)
    return Group(uid=uid, prompt_ids=prompt, trajectories=trajectories, payload={"label": uid})


def saved_file(tmp_path, buffer: PartialBuffer, rollout_id: int = 0):
    checkpoints(tmp_path, buffer).save(rollout_id, policy_version=1)
    return tmp_path / "ckpt" / "rollout" / f"april_state_{rollout_id}.bin"


# ------------------------------------------------------------------ columns
def test_a_column_reads_like_the_list_it_replaced_and_refuses_what_does_not_fit():
    ids = token_column([5, 6, 7]).extended([8, 9])
    assert ids == [5, 6, 7, 8, 9] and [5, 6, 7, 8, 9] == ids and ids != [5, 6, 7, 8]  # noqa: SIM300 (reflected)
    assert ids[-1] == 9 and type(ids[-1]) is int and ids[1:4] == [6, 7, 8] and list(ids[3:]) == [8, 9]
    assert ids.tolist() == [5, 6, 7, 8, 9] and ids + [1] == [5, 6, 7, 8, 9, 1] and [0] + ids[:1] == [0, 5]
    assert len(ids.chunks) == 2 and ids.array().dtype == np.int32 and not ids.array().flags.writeable
    lps = logprob_column([-0.1, -1.5e-8])
    assert lps.tolist() == [-0.1, -1.5e-8] and type(lps[0]) is float  # float64: bit for bit
    with pytest.raises(ValueError, match="do not fit int32"):
        token_column([2 ** 40], "output ids")
    with pytest.raises(ValueError, match="integers are expected"):
        token_column([1.5])
    with pytest.raises(ValueError, match="read-only|not writeable|assignment destination"):
        ids.chunks[0][0] = 1


def test_a_trajectory_converts_whatever_is_assigned_and_refuses_a_nan_reply_whole():
    t = Trajectory(uid="g/0", group_uid="g", index_in_group=0, prompt_ids=[1, 2], max_new_tokens=10,
                   sampling_seed=0)
    t.response_ids, t.logprobs = [3, 4], [-0.5, -0.25]
    assert isinstance(t.response_ids, Column) and isinstance(t.logprobs, Column)
    assert t.input_ids() == [1, 2, 3, 4] and all(type(i) is int for i in t.input_ids())
    with pytest.raises(ValueError, match="non-finite"):
        t.append([5, 6], [-0.1, float("nan")], 1)
    assert t.response_ids == [3, 4] and t.logprobs == [-0.5, -0.25]  # nothing half-applied
    with pytest.raises(ValueError, match="g/0: output ids"):
        t.append([2 ** 33], [-0.1], 1)


def test_byte_chunks_keep_what_a_frozen_view_saw():
    raw = ByteChunks(b"abcd")
    seen = raw.frozen()
    raw += b"efgh"
    del raw[6:]
    assert bytes(raw) == b"abcdef" and raw[2:5] == b"cde" and seen == (b"abcd",)
    del raw[2:]
    assert bytes(raw) == b"ab" and b"".join(seen) == b"abcd"


# ------------------------------------------------------------------ the file
def test_the_binary_state_round_trips_every_field_and_holds_the_raw_bytes(tmp_path):
    buf = PartialBuffer(priority="fifo")
    groups = [routed_group(f"g{k}", tokens=40 + k) for k in range(3)]
    for g in groups:
        buf.put(g)
    buf.put(make_group("plain", finished_lengths=(3,), partial=((0, 2),), payload={"x": 1}))
    path = saved_file(tmp_path, buf)
    loaded = PartialBuffer(priority="fifo")
    assert checkpoints(tmp_path, loaded).load(0).policy_version == 1
    assert loaded.state_dict() == buf.state_dict()
    back = loaded.groups()[0].trajectories[1]
    assert back.replay == groups[0].trajectories[1].replay and back.replay.routed_rows == 5 + 40 - 1
    # a group's prompt is written once and read back shared by its trajectories
    assert all(t.prompt_ids.array() is loaded.groups()[0].trajectories[0].prompt_ids.array()
               for t in loaded.groups()[0].trajectories)
    # the file is the raw bytes (ids 4, log-probs 8, routed experts 1 each) and a small index
    raw = sum(len(g.prompt_ids) * 4 + sum(t.response_length * 12 + t.replay.routed_rows * WIDTH
                                          for t in g.trajectories) for g in groups)
    tokens_bytes = raw + (4 + 3 + 2) * 4 + 5 * 12  # the plain group: prompt, two responses
    size = path.stat().st_size
    assert tokens_bytes <= size < tokens_bytes + 16_384


def test_a_load_keeps_what_it_read_as_the_snapshot_of_its_rollout_whatever_the_buffer_does_next(tmp_path):
    """The state a load decodes is the snapshot of its rollout (no second pass over the buffer): it
    writes the very file it was read from, and the live buffer's later replies (tokens, call
    versions, a loss mask, a payload) leave it as it was."""
    buf = PartialBuffer(priority="fifo")
    for k in range(2):
        buf.put(routed_group(f"g{k}", tokens=30 + k))
    plain = make_group("plain", finished_lengths=(3,), partial=((0, 2),), payload={"x": [1]})
    plain.trajectories[1].loss_mask = [1, 0]
    buf.put(plain)
    path = saved_file(tmp_path, buf, rollout_id=3)
    written = path.read_bytes()
    loaded = PartialBuffer(priority="fifo")
    restored = checkpoints(tmp_path, loaded)
    snapshot = restored.load(3)
    # the same state a fresh snapshot of the restored buffer holds, to the byte
    assert b"".join(map(bytes, snapshot.blocks()[0])) == written
    assert b"".join(map(bytes, restored._take(3, 1).blocks()[0])) == written
    # the buffer moves on: a resumed partial gets a reply, a mask grows, a payload changes
    for group in loaded.groups():
        for t in group.unfinished():
            t.append([7, 7], [-0.5, -0.5], 9)
            if t.loss_mask is not None:
                t.loss_mask.extend([1, 1])
        if isinstance(group.payload, dict) and "x" in group.payload:
            group.payload["x"].append(2)
    path.unlink()
    restored.save(3, policy_version=1)
    assert path.read_bytes() == written


def file_index(path) -> dict:
    data = path.read_bytes()
    return json.loads(data[16:16 + int.from_bytes(data[8:16], "little")])


def test_routed_experts_beyond_a_byte_are_kept_as_int32(tmp_path):
    buf = PartialBuffer()
    buf.put(routed_group("wide", experts=1000))
    held = buf.groups()[0].trajectories[0].replay
    assert held.routed_itemsize == 4 and len(held.routed) == held.routed_rows * WIDTH * 4
    path = saved_file(tmp_path, buf)
    index = file_index(path)
    k = index["trajectories"]["replay"][0]["routed"]
    assert index["array_dtypes"][k] == "i" and index["array_counts"][k] == (5 + 7 - 1) * WIDTH
    assert "b" not in index["array_dtypes"]
    loaded = PartialBuffer()
    checkpoints(tmp_path, loaded).load(0)
    back = loaded.groups()[0].trajectories[0].replay
    assert back == held and back.routed_itemsize == 4 and back.routed_int32() == bytes(held.routed)


@pytest.mark.parametrize("damage", ["truncated", "extended", "magic", "index", "empty"])
def test_a_damaged_binary_file_is_refused_naming_it_and_the_buffer_is_kept(tmp_path, damage):
    buf = PartialBuffer()
    buf.put(routed_group("g"))
    path = saved_file(tmp_path, buf)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[:-3], "extended": data + b"\0", "magic": b"NOTAPRIL" + data[8:],
                      "index": data[:20] + b"}" + data[21:], "empty": b""}[damage])
    kept = PartialBuffer()
    kept.put(make_group("kept"))
    with pytest.raises(StateFileError) as err:
        checkpoints(tmp_path, kept).load(0)
    assert str(err.value).startswith(f"{path}:") and "\n" not in str(err.value)
    assert [g.uid for g in kept.groups()] == ["kept"]


def test_an_earlier_versions_json_checkpoint_still_loads_and_a_new_save_replaces_it(tmp_path):
    buf = PartialBuffer()
    buf.put(routed_group("g"))
    folder = tmp_path / "ckpt" / "rollout"
    folder.mkdir(parents=True)
    state = {"format": 2, "rollout_id": 0, "policy_version": 4, "prompt_state": {"sample_offset": 3},
             "buffer": buf.state_dict()}
    (folder / "april_state_0.json").write_text(json.dumps(state, default=lambda b: __import__(
        "base64").b64encode(b).decode("ascii")))
    loaded = PartialBuffer()
    prompts = Prompts()
    assert checkpoints(tmp_path, loaded, prompts).load(0).policy_version == 4
    assert loaded.state_dict() == buf.state_dict() and prompts.sample_offset == 3
    checkpoints(tmp_path, loaded).save(0, policy_version=4)
    assert sorted(p.name for p in folder.iterdir()) == ["april_state_0.bin"]
    assert checkpoint.complete_checkpoints(folder) == [0]


# ------------------------------------------------------------------ snapshots share, and stay as they were
def test_a_snapshot_shares_the_tokens_and_keeps_its_state_when_the_buffer_moves_on(tmp_path):
    buf = PartialBuffer()
    buf.put(routed_group("g", tokens=2000))
    live = buf.groups()[0].trajectories[0]
    saver = checkpoints(tmp_path, buf)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        saver.snapshot(0, policy_version=1)
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    held = sum(t.response_ids.nbytes + t.logprobs.nbytes + len(t.replay.routed) for t in buf.groups()[0].trajectories)
    assert taken < held / 10, f"a snapshot of {held} token bytes allocated {taken}"
    saved = saver._snapshots[0].state["buffer"]["groups"][0]["trajectories"][0]
    assert saved["response_ids"] is live.response_ids  # the same immutable column

    # the buffer resumes the trajectory after the snapshot: the snapshot still writes what it saw
    expected = buf.state_dict()
    [group] = buf.take(1, 1)
    t = group.trajectories[0]
    t.append([7, 7, 7], [-1.0] * 3, 1, replay=SegmentReplay(
        routed_start=t.replay.routed_rows, routed=int32_bytes([3] * 3 * WIDTH), routed_width=WIDTH))
    t.truncate(10)
    saver.save(0, policy_version=1)
    loaded = PartialBuffer()
    checkpoints(tmp_path, loaded).load(0)
    assert loaded.state_dict() == expected


def test_buffered_tokens_hold_no_python_object_per_token():
    buf = PartialBuffer()
    gc.collect()
    tracked = len(gc.get_objects())
    for k in range(4):
        buf.put(routed_group(f"g{k}", tokens=5000))
    # a few objects per trajectory (its columns, their pieces, the replay), none per token
    assert len(gc.get_objects()) - tracked < 200
    stored = sum(t.response_ids.nbytes + t.logprobs.nbytes for g in buf.groups() for t in g.trajectories)
    assert stored == 8 * 5000 * 12


def test_the_index_refers_to_every_array_once_and_a_state_is_plain_json_otherwise(tmp_path):
    buf = PartialBuffer()
    buf.put(routed_group("g"))
    blocks, size = checkpoint.Snapshot.take(0, Prompts(), buf.state_dict(shared=True), 1).blocks()
    data = b"".join(bytes(memoryview(b).cast("B")) for b in blocks)
    assert len(data) == size
    path = tmp_path / "april_state_0.bin"
    path.write_bytes(data)
    state = state_file.decode(path)
    assert state["format"] == checkpoint.STATE_FORMAT and "arrays" not in state
    # read in the columnar form: a group counts its trajectories, the columns hold their arrays
    assert state["buffer"]["groups"][0]["trajectories"] == 2 and "trajectories" not in state
    assert isinstance(state["buffer"][TRAJECTORY_COLUMNS]["response_ids"][0], Column)


# ------------------------------------------------------------------ routed rows as held, and older files
def test_uint8_routed_rows_round_trip_as_uint8_without_a_copy(tmp_path):
    buf = PartialBuffer()
    buf.put(routed_group("g"))  # expert ids below 128
    held = buf.groups()[0].trajectories[0].replay
    assert held.routed_itemsize == 1 and len(held.routed) == held.routed_rows * WIDTH  # a byte per id
    path = saved_file(tmp_path, buf)
    index = file_index(path)
    assert index["format"] == checkpoint.STATE_FORMAT == 4
    k = index["trajectories"]["replay"][0]["routed"]
    assert index["array_dtypes"][k] == "b" and index["array_counts"][k] == held.routed_rows * WIDTH
    loaded = PartialBuffer()
    checkpoints(tmp_path, loaded).load(0)
    back = loaded.groups()[0].trajectories[0].replay
    assert back == held and back.routed_itemsize == 1 and back.routed_int32() == held.routed_int32()
    [piece] = back.routed.frozen()
    assert isinstance(piece, memoryview) and piece.readonly  # a view of the block read: not widened


def one_trajectory_group(uid: str) -> tuple[Group, Trajectory]:
    t = Trajectory(uid=f"{uid}/0", group_uid=uid, index_in_group=0, prompt_ids=[1, 2, 3], max_new_tokens=50,
                   sampling_seed=0)
    return Group(uid=uid, prompt_ids=[1, 2, 3], trajectories=[t]), t


def test_a_trajectory_that_went_wide_after_a_snapshot_saves_what_each_snapshot_saw(tmp_path):
    group, t = one_trajectory_group("g")
    narrow = list(range(4 * WIDTH))  # the first reply: ids below 256, rows of positions 0..3
    t.append([5, 6], [-0.5, -0.25], 0, replay=SegmentReplay(routed_start=0, routed=int32_bytes(narrow),
                                                           routed_width=WIDTH))
    t.status = TrajectoryStatus.ABORTED
    buf = PartialBuffer()
    buf.put(group)
    saver = checkpoints(tmp_path, buf)
    saver.snapshot(0, policy_version=0)
    wide = [300 + v for v in range(2 * WIDTH)]  # the next reply: positions 4..5, an expert beyond a byte
    [taken] = buf.take(1, 1)
    t = taken.trajectories[0]
    t.append([7, 8], [-0.1, -0.2], 1, replay=SegmentReplay(routed_start=4, routed=int32_bytes(wide),
                                                          routed_width=WIDTH))
    assert t.replay.routed_itemsize == 4
    buf.put(taken)
    saver.snapshot(1, policy_version=1)
    saver.save(0, policy_version=0)
    saver.save(1, policy_version=1)
    for rollout_id, itemsize, values in ((0, 1, narrow), (1, 4, narrow + wide)):
        loaded = PartialBuffer()
        checkpoints(tmp_path, loaded).load(rollout_id)
        back = loaded.groups()[0].trajectories[0].replay
        assert back.routed_itemsize == itemsize and back.routed_int32() == int32_bytes(values)


def test_a_format_3_file_still_loads(tmp_path):
    from pathlib import Path

    from tests.support.state_fixture import FIXTURE_POLICY_VERSION, FIXTURE_ROLLOUT, fixture_buffer

    folder = tmp_path / "ckpt" / "rollout"
    folder.mkdir(parents=True)
    fixture = Path(__file__).parent / "data" / "april_state_format3.bin"
    (folder / f"april_state_{FIXTURE_ROLLOUT}.bin").write_bytes(fixture.read_bytes())
    assert file_index(folder / f"april_state_{FIXTURE_ROLLOUT}.bin")["format"] == 3
    loaded, prompts = PartialBuffer(priority="fifo"), Prompts()
    assert checkpoints(tmp_path, loaded, prompts).load(FIXTURE_ROLLOUT).policy_version == FIXTURE_POLICY_VERSION
    expected = fixture_buffer()
    assert loaded.state_dict() == expected.state_dict() and prompts.sample_offset == 11
    narrow, wide = (loaded.groups()[k].trajectories[1].replay for k in (0, 1))
    assert (narrow.routed_itemsize, wide.routed_itemsize) == (1, 4)  # uint8 on disk is uint8 in memory
    assert narrow.routed_int32() == expected.groups()[0].trajectories[1].replay.routed_int32()
    assert loaded.groups()[3].trajectories[0].episode_sample["rows"] == bytes(range(24))
    # saved again, it is written in the current format and reads back the same
    checkpoints(tmp_path, loaded).save(FIXTURE_ROLLOUT, FIXTURE_POLICY_VERSION)
    assert file_index(folder / f"april_state_{FIXTURE_ROLLOUT}.bin")["format"] == checkpoint.STATE_FORMAT
    again = PartialBuffer(priority="fifo")
    checkpoints(tmp_path, again).load(FIXTURE_ROLLOUT)
    assert again.state_dict() == expected.state_dict()


def test_an_earlier_versions_int32_rows_are_narrowed_on_load(tmp_path):
    buf = PartialBuffer()
    buf.put(routed_group("g"))
    state = buf.state_dict()
    for t in state["groups"][0]["trajectories"]:  # as a version that held int32 rows saved them
        t["replay"]["routed"] = np.frombuffer(t["replay"].pop("routed"), np.uint8).astype("<i4").tobytes()
        del t["replay"]["routed_itemsize"]
    folder = tmp_path / "ckpt" / "rollout"
    folder.mkdir(parents=True)
    (folder / "april_state_0.json").write_text(json.dumps(
        {"format": 2, "rollout_id": 0, "policy_version": 1, "prompt_state": {}, "buffer": state},
        default=lambda b: __import__("base64").b64encode(b).decode("ascii")))
    loaded = PartialBuffer()
    checkpoints(tmp_path, loaded).load(0)
    assert loaded.state_dict() == buf.state_dict()
    assert all(t.replay.routed_itemsize == 1 for t in loaded.groups()[0].trajectories)


def rewrite_index(path, change) -> None:
    """``path`` with its index changed by ``change`` (the arrays' bytes as they were)."""
    data = path.read_bytes()
    length = int.from_bytes(data[8:16], "little")
    index = json.loads(data[16:16 + length])
    change(index)
    start = 16 + length
    text = json.dumps(index).encode()
    head = data[:8] + len(text).to_bytes(8, "little") + text
    path.write_bytes(head + b"\0" * (-len(head) % 64) + data[start + -start % 64:])


@pytest.mark.parametrize("change, message", [
    (lambda ix: ix["trajectories"]["replay"][0].update(routed_itemsize=4),
     "routed experts of 1-byte values where the index says 4"),
    (lambda ix: ix["trajectories"]["response_ids"].__setitem__(1, 10 ** 6), "'g/1': response_ids refers to no array"),
    (lambda ix: ix["trajectories"]["uid"].pop(), "do not hold 2 values each"),
    (lambda ix: ix.update(array_dtypes="x" + ix["array_dtypes"][1:]), "array dtypes ['x']"),
    (lambda ix: ix["array_counts"].__setitem__(0, -1), "array counts are not all integers >= 0"),
    (lambda ix: ix.update(format=9), "state format 9"),
    (lambda ix: ix.update(trajectories=None), "do not hold 2 values each"),
])
def test_a_damaged_index_is_refused_naming_the_file(tmp_path, change, message):
    buf = PartialBuffer()
    buf.put(routed_group("g"))
    path = saved_file(tmp_path, buf)
    rewrite_index(path, lambda ix: None)
    loaded = PartialBuffer()
    checkpoints(tmp_path, loaded).load(0)  # the rewriting itself keeps the file whole
    assert loaded.state_dict() == buf.state_dict()
    rewrite_index(path, change)
    with pytest.raises(StateFileError) as err:
        checkpoints(tmp_path, PartialBuffer()).load(0)
    assert str(err.value).startswith(f"{path}:") and message in str(err.value)


def test_a_state_file_is_whole_however_few_bytes_each_write_takes(tmp_path, monkeypatch):
    import os

    calls = []

    def short_write(fd, views):  # at most 5 bytes of the first view that has any
        calls.append(fd)
        first = next((v for v in views if len(v)), b"")
        return os.write(fd, bytes(first[:5]))

    buf = PartialBuffer()
    buf.put(routed_group("g"))
    monkeypatch.setattr(os, "writev", short_write)
    path = saved_file(tmp_path, buf)
    monkeypatch.undo()
    assert len(calls) > path.stat().st_size // 5
    loaded = PartialBuffer()
    checkpoints(tmp_path, loaded).load(0)
    assert loaded.state_dict() == buf.state_dict()
