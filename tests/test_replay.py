"""What training replays, carried across segments (``april_slime.core.replay``): routed experts
stitched from the calls that generated each position, top-p kept ids concatenated per token, the
reply fields that carry them checked, and the record saved and loaded whole."""

from __future__ import annotations

import base64
import struct

import pytest

from april_slime.core.replay import ReplaySpec, SegmentReplay, TokenReplay, int32_values, stitch_calls
from april_slime.core.replay_wire import ask_for_replay, parse_routed_experts, parse_top_p_token_ids
from april_slime.core.sglang_protocol import EngineReplyError, parse_generate_reply
from april_slime.core.types import Group, Trajectory

SPEC = ReplaySpec(routed_layers=2, routed_topk=2, top_p=True)
WIDTH = SPEC.routed_width


def b64(values) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode()


def rows(first: int, last: int, tag: int) -> list[int]:
    """Rows of positions [first, last): position p's row is [tag, p, tag, p]."""
    return [v for p in range(first, last) for v in (tag, p, tag, p)]


def row_tags(replay: TokenReplay) -> list[tuple[int, int]]:
    values = int32_values(replay.routed_int32())
    return [(values[i], values[i + 1]) for i in range(0, len(values), WIDTH)]


def reply(n_out: int, *, input_len: int, start: int, tag: int, **meta) -> dict:
    out = list(range(100, 100 + n_out))
    body = {"output_ids": out, "meta_info": {
        "id": "r", "finish_reason": {"type": "abort" if meta.pop("abort", False) else "length"},
        "output_token_logprobs": [[-0.5, t, None] for t in out], "completion_tokens": n_out,
        "prompt_tokens": input_len, "weight_version": str(tag),
        "routed_experts": b64(rows(start, input_len + n_out - 1, tag)),
        "top_p_token_ids": b64([t for t in out for _ in range(2)]),
        "top_p_token_offsets": b64(list(range(0, 2 * n_out + 1, 2))), **meta}}
    return body


def parse(body: dict, *, input_len: int, start: int, max_new_tokens: int = 64):
    return parse_generate_reply(body, engine_url="http://e", rid="r", max_new_tokens=max_new_tokens,
                                vocab_size=1000, replay=SPEC, input_len=input_len, routed_start=start)


def trajectory(prompt_len: int = 5) -> Trajectory:
    return Trajectory(uid="g/0", group_uid="g", index_in_group=0, prompt_ids=list(range(1, prompt_len + 1)),
                      max_new_tokens=64, sampling_seed=3)


def step(t: Trajectory, n_out: int, tag: int, *, engine_ignores_start: bool = False) -> None:
    """One call of ``t`` as the client makes it: input = prompt + partial, rows from ``replay_rows``."""
    start = t.replay_rows
    body = reply(n_out, input_len=len(t.input_ids()), start=0 if engine_ignores_start else start, tag=tag)
    result = parse(body, input_len=len(t.input_ids()), start=start)
    t.append(result.output_ids, result.logprobs, tag, None, result.replay)


# ------------------------------------------------------------------ stitching
@pytest.mark.parametrize("engine_ignores_start", [False, True])
def test_each_position_keeps_the_rows_of_the_call_that_generated_its_next_token(engine_ignores_start):
    t = trajectory(prompt_len=5)
    step(t, 3, tag=1)  # aborted: positions 0..6 (prompt + 2 of its 3 tokens) routed by call 1
    step(t, 4, tag=2, engine_ignores_start=engine_ignores_start)  # resumed under new weights
    step(t, 2, tag=3, engine_ignores_start=engine_ignores_start)
    assert t.replay.routed_rows == 5 + 9 - 1
    # position p predicts token p + 1: call 1 sampled tokens 5..7, call 2 tokens 8..11, call 3 12..13
    assert row_tags(t.replay) == [(1, p) for p in range(0, 7)] + [(2, p) for p in range(7, 11)] + [
        (3, p) for p in range(11, 13)]
    assert t.replay.top_p_tokens == 9
    assert t.replay.top_p_offsets() == list(range(0, 19, 2))


# ------------------------------------------------------------------ episodes: rows over model calls
TOOL = [7, 8, 9]


def episode_calls(trailing_tool: bool = False) -> tuple[list[int], list[Trajectory]]:
    """A sample of two model calls with a tool's tokens between them: call A resumed once (tags 1
    and 2), call B in one piece (tag 3) on the sample's tokens so far. Returns the sample's tokens."""
    a = trajectory(prompt_len=5)
    step(a, 3, tag=1)  # aborted
    step(a, 2, tag=2)  # resumed under other weights
    b = Trajectory(uid="g/0@0.1", group_uid="g", index_in_group=0, prompt_ids=a.input_ids() + TOOL,
                   max_new_tokens=64, sampling_seed=3)
    step(b, 4, tag=3)
    return b.input_ids() + (TOOL[:2] if trailing_tool else []), [a, b]


def test_an_episode_keeps_each_position_of_the_call_that_ran_it_first():
    tokens, (a, b) = episode_calls()
    assert len(tokens) == 5 + 5 + 3 + 4
    out = TokenReplay(routed_width=WIDTH, routed=stitch_calls(WIDTH, len(tokens) - 1, [a.replay, b.replay]))
    # positions 0..8 (prompt and call A's tokens but its last) are A's, as its segments left them;
    # position 9 (A's last token, which the tool follows) and the tool's 10..12 were first run by
    # call B, whose prefill read them as prompt; 13..15 are B's own
    assert row_tags(out) == [(1, p) for p in range(0, 7)] + [(2, p) for p in range(7, 9)] + [
        (3, p) for p in range(9, 16)]


def test_positions_no_call_ran_repeat_the_last_row_that_was_run():
    tokens, (a, b) = episode_calls(trailing_tool=True)
    out = TokenReplay(routed_width=WIDTH, routed=stitch_calls(WIDTH, len(tokens) - 1, [a.replay, b.replay]))
    assert out.routed_rows == len(tokens) - 1 == 18
    assert row_tags(out)[15:] == [(3, 15)] * 3


def test_an_episode_whose_call_holds_no_rows_or_too_many_is_refused():
    tokens, (a, b) = episode_calls()
    with pytest.raises(ValueError, match="model call 1 holds no routed experts of 4 int32"):
        stitch_calls(WIDTH, len(tokens) - 1, [a.replay, None])
    with pytest.raises(ValueError, match="model call 1 ran 16 positions of a sample of 15 tokens"):
        stitch_calls(WIDTH, 14, [a.replay, b.replay])
    with pytest.raises(ValueError, match="no model call ran"):
        stitch_calls(WIDTH, 3, [])


def test_a_call_that_continues_an_earlier_one_asks_only_for_the_positions_after_its_rows():
    from types import SimpleNamespace

    from april_slime.core.episodes import _rows_run_before

    tokens, (a, b) = episode_calls()
    episode = SimpleNamespace(served=[SimpleNamespace(trajectory=a)])
    t = Trajectory(uid="g/0@0.1", group_uid="g", index_in_group=0, prompt_ids=list(b.prompt_ids), max_new_tokens=64,
                   sampling_seed=3)
    t.replay = _rows_run_before(episode, t.prompt_ids)
    assert t.replay_rows == 9 and t.replay.top_p_counts is None
    step(t, 4, tag=3)  # the engine sends positions 9.. only
    assert row_tags(t.replay) == row_tags(a.replay) + [(3, p) for p in range(9, 16)]
    assert t.replay.top_p_tokens == 4
    assert _rows_run_before(episode, [99] + t.prompt_ids[1:]) is None  # another conversation
    assert _rows_run_before(episode, a.prompt_ids + a.response_ids[:-1]) is None  # not all of A's tokens


def test_a_call_asked_for_routed_experts_gets_them_from_the_position_it_named():
    import asyncio
    from types import SimpleNamespace

    from april_slime.core.episodes import CallRequest, EpisodeError, ModelCall
    from april_slime.generate_functions import GenerateFunctions

    _, (a, _) = episode_calls()
    g = GenerateFunctions.__new__(GenerateFunctions)
    g.codec = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids, **k: ""))
    g.top_p_replay, g.routed_width = False, WIDTH

    def reply(start: int | None, width: int = WIDTH) -> dict:
        g.routed_width = width
        request = CallRequest(input_ids=list(a.prompt_ids), max_new_tokens=64, sampling_params={},
                              routed_experts_from=start)
        return g.reply(ModelCall(None, request, a, asyncio.Future(loop=asyncio.new_event_loop())))["meta_info"]

    assert "routed_experts" not in reply(None)
    for start in (0, 4, 9):  # over both of the call's segments
        rows = TokenReplay(routed_width=WIDTH, routed=bytearray(base64.b64decode(reply(start)["routed_experts"])))
        assert row_tags(rows) == row_tags(a.replay)[start:]
    with pytest.raises(EpisodeError, match="routed_experts_start_len 10 is past the 9 positions"):
        reply(10)
    with pytest.raises(EpisodeError, match="use-rollout-routing-replay is off"):
        reply(0, width=0)


def test_a_sample_whose_calls_do_not_continue_its_tokens_is_refused():
    from types import SimpleNamespace

    from april_slime.core.episodes import EpisodeRefused
    from april_slime.core.served import served_routed

    tokens, trajectories = episode_calls()
    calls = [SimpleNamespace(trajectory=t) for t in trajectories]
    mask = [1] * 5 + [0] * 3 + [1] * 4
    assert served_routed("s", tokens, mask, calls, calls, WIDTH) == stitch_calls(
        WIDTH, len(tokens) - 1, [t.replay for t in trajectories])
    retokenized = tokens[:11] + [70] + tokens[12:]  # the tool's text tokenized otherwise
    with pytest.raises(EpisodeRefused, match="model call 1 of 2: its 13 input ids are not the sample's first 13"):
        served_routed("s", retokenized, mask, calls, calls, WIDTH)
    shifted = tokens[:13] + [9] + tokens[13:]
    with pytest.raises(EpisodeRefused, match="call 1 of 2: its 4 output ids are not the sample's tokens 13 to 17"):
        served_routed("s", shifted, mask + [0], calls, calls, WIDTH)


def test_a_row_short_or_over_fails_loudly_and_appends_nothing():
    t = trajectory()
    step(t, 3, tag=1)
    before = (list(t.response_ids), bytes(t.replay.routed), t.replay.top_p_tokens)
    for delta in (-1, 1):
        body = reply(4, input_len=8, start=7, tag=2)
        body["meta_info"]["routed_experts"] = b64(rows(7, 8 + 4 - 1 + delta, 2))
        with pytest.raises(EngineReplyError, match=r"routed_experts has \d+ rows, but 8 input ids \+ 4 output "
                                                   r"tokens from position 7 need 4"):
            parse(body, input_len=8, start=7)
    # a segment that does not continue what the trajectory holds is refused by the trajectory too
    with pytest.raises(ValueError, match="do not continue the 7 positions held"):
        t.append([9], [-0.1], 2, None, SegmentReplay(routed_start=8, routed=bytes(16), routed_width=WIDTH))
    assert (list(t.response_ids), bytes(t.replay.routed), t.replay.top_p_tokens) == before


def test_a_response_without_its_rows_cannot_be_extended():
    t = trajectory()
    t.append([7, 8], [-0.1, -0.2], 1)  # generated without replay (e.g. a checkpoint of another job)
    seg = SegmentReplay(routed_start=0, routed=bytes(4 * WIDTH * 7), routed_width=WIDTH)
    with pytest.raises(ValueError, match="held for 0 of the 6 positions before this call"):
        t.append([9], [-0.1], 2, None, seg)
    assert t.response_ids == [7, 8] and t.replay is None


def test_truncate_save_and_load_keep_the_replay_aligned():
    t = trajectory(prompt_len=4)
    step(t, 3, tag=1)
    step(t, 3, tag=2)
    group = Group(uid="g", prompt_ids=t.prompt_ids, trajectories=[t])
    loaded = Group.from_dict(group.to_dict()).trajectories[0]
    assert loaded.replay == t.replay and loaded == t
    t.truncate(4)
    assert t.replay.routed_rows == 4 + 4 - 1 and t.replay.top_p_tokens == 4
    assert row_tags(t.replay)[-1] == (2, 6)
    assert int32_values(t.replay.top_p_ids).tolist() == [100, 100, 101, 101, 102, 102, 100, 100]
    t.truncate(0)
    assert t.replay.routed_rows == 0 and t.replay.top_p_tokens == 0


@pytest.mark.parametrize("damage, message", [
    ({"routed": base64.b64encode(b"\0" * 12).decode(), "routed_itemsize": 4}, "not rows of 4 int32"),
    ({"routed": base64.b64encode(b"\0" * 6).decode()}, "not rows of 4 uint8"),
    ({"routed_itemsize": 2}, "routed_itemsize: 2, not 1"),
    ({"top_p_counts": None}, "without their counts"),
    ({"top_p_counts": b64([3])}, "do not add up"),
    ({"routed": "not base64!"}, "not base64"),
])
def test_a_damaged_saved_replay_is_refused(damage, message):
    t = trajectory()
    step(t, 1, tag=1)
    saved = t.to_dict()
    saved["replay"].update(damage)
    with pytest.raises(ValueError, match=message):
        Trajectory.from_dict(saved)


def test_covers_says_what_is_missing():
    t = trajectory(prompt_len=4)
    assert TokenReplay().covers(SPEC, 4, 0) is None  # nothing generated, nothing needed
    step(t, 2, tag=1)
    assert t.replay.covers(SPEC, 4, 2) is None
    assert t.replay.covers(SPEC, 4, 3) == "routed experts of 5 positions, not 6"
    assert t.replay.covers(ReplaySpec(routed_layers=3, routed_topk=2), 4, 2) == (
        "no routed experts of 3x2 per position")
    assert t.replay.covers(ReplaySpec(top_p=True), 4, 3) == "top-p kept ids of 2 response tokens, not 3"


# ------------------------------------------------------------------ the reply fields
def test_the_request_asks_for_rows_from_the_held_position_and_for_top_p_ids():
    payload = {"input_ids": [1, 2], "sampling_params": {"top_p": 0.9, "custom_params": {"mine": 1}}}
    ask_for_replay(payload, SPEC, 7)
    assert payload["return_routed_experts"] is True and payload["routed_experts_start_len"] == 7
    assert payload["sampling_params"]["custom_params"] == {"mine": 1, "return_top_p_token_ids": True}
    plain = {"sampling_params": {}}
    ask_for_replay(plain, ReplaySpec(), 0)
    assert plain == {"sampling_params": {}}


def test_missing_fields_name_what_the_engine_must_do():
    body = reply(2, input_len=3, start=0, tag=1)
    del body["meta_info"]["routed_experts"]
    with pytest.raises(EngineReplyError, match="--enable-return-routed-experts"):
        parse(body, input_len=3, start=0)
    body = reply(2, input_len=3, start=0, tag=1)
    del body["meta_info"]["top_p_token_offsets"]
    with pytest.raises(EngineReplyError, match="sglang-top_p.patch"):
        parse(body, input_len=3, start=0)


def test_an_abort_before_any_token_carries_nothing_to_replay():
    body = reply(0, input_len=3, start=0, tag=1, abort=True)
    del body["meta_info"]["routed_experts"], body["meta_info"]["top_p_token_ids"]
    assert parse(body, input_len=3, start=0).replay is None


@pytest.mark.parametrize("ids, offsets, message", [
    ([5, 6], [0, 1], "2 offsets"),  # one token short
    ([5, 6], [1, 2, 2], "first 1"),
    ([5, 6], [0, 1, 3], "last 3"),
    ([5, 6, 7], [0, 2, 1, 3], "decreases at token 1"),
    ([5, 1000], [0, 1, 2], "outside"),
])
def test_bad_top_p_fields_are_refused(ids, offsets, message):
    n = len(offsets) - 1 if message != "2 offsets" else 2
    meta = {"top_p_token_ids": b64(ids), "top_p_token_offsets": b64(offsets)}
    with pytest.raises(EngineReplyError, match=message):
        parse_top_p_token_ids(meta, "e", output_len=n, vocab_size=1000)


def test_top_p_fields_under_slimes_other_names_and_as_lists():
    meta = {"top_p_kept_token_ids": [4, 5, 6], "top_p_kept_token_offsets": [0, 2, 3]}
    ids, counts = parse_top_p_token_ids(meta, "e", output_len=2, vocab_size=None)
    assert int32_values(ids).tolist() == [4, 5, 6] and int32_values(counts).tolist() == [2, 1]


def test_routed_experts_that_are_not_whole_rows_are_refused():
    meta = {"routed_experts": b64([1, 2, 3])}
    with pytest.raises(EngineReplyError, match="not rows of 2 layers x top-2"):
        parse_routed_experts(meta, "e", SPEC, input_len=2, output_len=1, start=0)


# ------------------------------------------------------------------ routed rows held as uint8
def sent(*parts: tuple[int, int, int]) -> bytes:
    """The int32 bytes an engine sends for rows ``(first, last, tag)``, one part after another."""
    return struct.pack(f"<{4 * sum(last - first for first, last, _ in parts)}i",
                       *(v for part in parts for v in rows(*part)))


def test_routed_rows_whose_ids_fit_a_byte_are_held_as_uint8_and_handed_out_as_sent():
    t = trajectory(prompt_len=5)
    step(t, 3, tag=1)
    step(t, 4, tag=2)
    held = t.replay
    assert held.routed_itemsize == 1 and len(held.routed) == held.routed_rows * WIDTH == 11 * WIDTH
    assert held.routed_int32() == sent((0, 7, 1), (7, 11, 2))
    assert held.routed_int32(3, 9) == sent((3, 7, 1), (7, 9, 2))


def test_a_reply_with_an_id_beyond_a_byte_widens_what_the_trajectory_holds_once():
    t = trajectory(prompt_len=5)
    step(t, 3, tag=1)  # fits: uint8
    before = t.replay.to_dict(shared=True)  # a snapshot's view of it
    step(t, 4, tag=300)  # expert 300: what is held becomes int32, the earlier rows widened
    assert t.replay.routed_itemsize == 4 and t.replay.routed_int32() == sent((0, 7, 1), (7, 11, 300))
    assert bytes(t.replay.routed) == sent((0, 7, 1), (7, 11, 300))
    step(t, 2, tag=2)  # fits again: appended as int32, the trajectory stays wide
    assert t.replay.routed_itemsize == 4 and t.replay.routed_int32() == sent((0, 7, 1), (7, 11, 300), (11, 13, 2))
    # the snapshot taken before still holds the uint8 rows it saw
    assert TokenReplay.from_dict(before).routed_int32() == sent((0, 7, 1))
    t.truncate(3)
    assert t.replay.routed_rows == 7 and t.replay.routed_int32() == sent((0, 7, 1))
    t.truncate(0)  # nothing held: the next rows are narrowed again
    step(t, 2, tag=5)
    assert t.replay.routed_itemsize == 1 and t.replay.routed_int32() == sent((0, 6, 5))


def test_an_episode_stitches_calls_held_as_uint8_and_as_int32_into_int32_rows():
    a = trajectory(prompt_len=5)
    step(a, 3, tag=1)
    b = Trajectory(uid="g/0@0.1", group_uid="g", index_in_group=0, prompt_ids=a.input_ids() + TOOL,
                   max_new_tokens=64, sampling_seed=3)
    step(b, 4, tag=300)
    assert (a.replay.routed_itemsize, b.replay.routed_itemsize) == (1, 4)
    tokens = b.input_ids()
    out = stitch_calls(WIDTH, len(tokens) - 1, [a.replay, b.replay])
    assert bytes(out) == sent((0, 7, 1), (7, len(tokens) - 1, 300))


@pytest.mark.parametrize("tag", [2, 300])
def test_slime_gets_the_int32_rows_the_engines_sent_however_they_are_held(tag):
    import torch

    from april_slime.samples import put_replay

    t = trajectory(prompt_len=5)
    step(t, 3, tag=1)
    step(t, 4, tag=tag)
    assert t.replay.routed_itemsize == (1 if tag < 256 else 4)
    s = type("Sample", (), {})()  # any object takes slime's fields
    s.tokens, s.response_length = t.prompt_ids + t.response_ids, t.response_length
    put_replay(s, t.replay, ReplaySpec(routed_layers=2, routed_topk=2), t.uid)
    # what slime got before rows were held narrowed: the engines' int32 bytes as a tensor
    before = torch.frombuffer(bytearray(sent((0, 7, 1), (7, 11, tag))), dtype=torch.int32).reshape(-1, 2, 2)
    assert s.rollout_routed_experts.dtype == torch.int32 and torch.equal(s.rollout_routed_experts, before)
