"""slime 0.4.0's sampler capture for score centering, carried across a trajectory's segments
(``april_slime.core.replay``): the top-p kept ids' log-probs and the sampler top-k of every token
asked of the engine, read from its reply, stitched over aborts and resumes, saved and loaded with
the buffer, and handed to slime's ``Sample`` only when the installed ``Sample`` has the fields."""

from __future__ import annotations

import base64
import json
import struct
from types import SimpleNamespace

import pytest

from april_slime.core import state_file
from april_slime.core.buffer import PartialBuffer
from april_slime.core.checkpoint import Snapshot
from april_slime.core.replay import ReplaySpec, TokenReplay, float32_values, int32_values
from april_slime.core.sglang_protocol import EngineReplyError, ask_for_replay, parse_generate_reply
from april_slime.core.types import Group, Trajectory
from april_slime.samples import put_replay, replay_spec, take_replay
from april_slime.slime_args import SlimeArgs
from tests.support.slime_040_sample import with_040_fields

K = 3
TOPK = ReplaySpec(topk=K)
TOP_P = ReplaySpec(top_p=True, top_p_log_probs=True)


def head(version: int, token: int) -> list[tuple[int, float]]:
    """A call's top-k of a token: ids and log-probs that name the version and the token."""
    return [(token + j, -0.1 * (j + 1) - version) for j in range(K)]


def reply(out: list[int], version: int, *, binary: bool = False, abort: bool = False, **meta) -> dict:
    info = {"id": "r", "finish_reason": {"type": "abort" if abort else "length"},
            "output_token_logprobs": [[-0.5, t, None] for t in out], "completion_tokens": len(out),
            "prompt_tokens": 4, "weight_version": str(version)}
    rows = [head(version, t) for t in out]
    if binary:  # slime's patched SGLang
        info.update(output_topk_shape=[len(out), K],
                    output_topk_token_ids=base64.b64encode(struct.pack(f"<{len(out) * K}i", *[
                        i for row in rows for i, _ in row])).decode(),
                    output_topk_log_probs=base64.b64encode(struct.pack(f"<{len(out) * K}f", *[
                        lp for row in rows for _, lp in row])).decode())
    else:  # stock SGLang's top_logprobs_num
        info["output_top_logprobs"] = [[[lp, i, None] for i, lp in row] for row in rows]
    info.update(meta)
    return {"output_ids": out, "meta_info": info}


def parse(body: dict, spec: ReplaySpec = TOPK):
    return parse_generate_reply(body, engine_url="http://e", rid="r", max_new_tokens=64, vocab_size=1000,
                                replay=spec, input_len=4)


def trajectory() -> Trajectory:
    return Trajectory(uid="g/0", group_uid="g", index_in_group=0, prompt_ids=[1, 2, 3, 4], max_new_tokens=64,
                      sampling_seed=3)


def step(t: Trajectory, out: list[int], version: int, **kwargs) -> None:
    result = parse(reply(out, version, **kwargs))
    t.append(result.output_ids, result.logprobs, version, None, result.replay)


def rows_of(replay: TokenReplay) -> list[list[tuple[int, float]]]:
    ids, lps = int32_values(replay.topk_ids), float32_values(replay.topk_log_probs)
    return [[(ids[r * K + j], pytest.approx(lps[r * K + j], abs=1e-6)) for j in range(K)]
            for r in range(len(ids) // K)]


def test_the_request_asks_for_top_k_and_for_top_p_log_probs():
    payload = {"input_ids": [1], "sampling_params": {"custom_params": {"other": 1}}}
    ask_for_replay(payload, TOPK, 0)
    assert payload["top_logprobs_num"] == K and payload["return_logprob"] is True
    assert payload["sampling_params"]["custom_params"] == {"other": 1}
    ask_for_replay(payload, TOP_P, 0)
    assert payload["sampling_params"]["custom_params"] == {
        "other": 1, "return_top_p_token_ids": True, "return_top_p_log_probs": True}


@pytest.mark.parametrize("binary", [False, True])
def test_rows_follow_their_tokens_across_an_abort_and_a_resume(binary):
    t = trajectory()
    step(t, [10, 11, 12], version=1, binary=binary, abort=True)
    step(t, [], version=2, binary=binary, abort=True)  # aborted while queued: nothing to stitch
    step(t, [13, 14], version=2, binary=binary)
    want = [head(1, tok) for tok in (10, 11, 12)] + [head(2, tok) for tok in (13, 14)]
    assert rows_of(t.replay) == want and t.replay.topk_tokens == t.response_length == 5
    assert t.replay.covers(TOPK, 4, 5) is None
    t.truncate(4)
    assert rows_of(t.replay) == want[:4]


def test_the_rows_survive_the_buffer_checkpoint(tmp_path):
    t = trajectory()
    step(t, [10, 11], version=1, abort=True)
    step(t, [12], version=3)
    buffer = PartialBuffer()
    buffer.put(Group(uid="g", prompt_ids=t.prompt_ids, trajectories=[t]))
    blocks, _ = Snapshot.take(0, SimpleNamespace(), buffer.state_dict(shared=True), 3).blocks()
    path = tmp_path / "april_state_0.bin"
    path.write_bytes(b"".join(bytes(memoryview(b).cast("B")) for b in blocks))
    loaded = PartialBuffer()
    loaded.load_state_dict(state_file.decode(path)["buffer"])
    [back] = loaded.groups()[0].trajectories
    assert back.replay == t.replay and rows_of(back.replay) == rows_of(t.replay)


@pytest.mark.parametrize("meta, message", [
    ({"output_top_logprobs": [[[-0.1, 5, None]] * K] * 2}, "not 3 rows of 3"),
    ({"output_top_logprobs": [[[-0.1, 5, None]] * K] * 3}, "not 3 distinct ids"),
    ({"output_top_logprobs": [[[-0.1, 5 + j, None] for j in range(K - 1)]] * 3}, "not 3 rows of 3"),
    ({"output_top_logprobs": [[[0.7, 5 + j, None] for j in range(K)]] * 3}, "> 0"),
    ({"output_top_logprobs": None}, "top_logprobs_num=3"),
])
def test_a_reply_whose_top_k_does_not_fit_is_refused(meta, message):
    with pytest.raises(EngineReplyError, match=message):
        parse(reply([10, 11, 12], 1, **meta))


def test_a_segment_without_rows_cannot_extend_a_trajectory_that_holds_them():
    t = trajectory()
    step(t, [10], version=1, abort=True)
    plain = parse(reply([11], 1), ReplaySpec(top_p=False, topk=0, routed_layers=0))
    t.append(plain.output_ids, plain.logprobs, 1, None, plain.replay)
    assert t.replay.covers(TOPK, 4, 2) == "sampler top-3 rows of 1 response tokens, not top-3 of 2"
    with pytest.raises(ValueError, match="held for 1 of the 2"):
        step(t, [12], version=1)


def test_top_p_log_probs_pair_with_the_kept_ids_across_segments():
    def top_p_reply(out, version):
        ids = [tok for tok in out for _ in range(2)]
        lps = [-0.2 - version, -1.5 - version] * len(out)
        return {"output_ids": out, "meta_info": {
            "id": "r", "finish_reason": {"type": "abort"}, "output_token_logprobs": [[-0.5, x, None] for x in out],
            "completion_tokens": len(out), "prompt_tokens": 4, "weight_version": str(version),
            "top_p_token_ids": base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode(),
            "top_p_token_offsets": base64.b64encode(struct.pack(f"<{len(out) + 1}i", *range(0, 2 * len(out) + 1,
                                                                                        2))).decode(),
            "top_p_log_probs": base64.b64encode(struct.pack(f"<{len(lps)}f", *lps)).decode()}}

    t = trajectory()
    for out, version in (([10, 11], 1), ([12], 2)):
        result = parse(top_p_reply(out, version), TOP_P)
        t.append(result.output_ids, result.logprobs, version, None, result.replay)
    assert list(float32_values(t.replay.top_p_log_probs)) == pytest.approx([-1.2, -2.5, -1.2, -2.5, -2.2, -3.5])
    loaded = Trajectory.from_dict(json.loads(json.dumps(t.to_dict(), default=lambda b: base64.b64encode(
        b).decode())))
    assert loaded.replay == t.replay
    t.truncate(2)
    assert list(float32_values(t.replay.top_p_log_probs)) == pytest.approx([-1.2, -2.5, -1.2, -2.5])
    assert t.replay.covers(TOP_P, 4, 2) is None
    bad = top_p_reply([13], 2)
    del bad["meta_info"]["top_p_log_probs"]
    with pytest.raises(EngineReplyError, match="top_p_log_probs"):
        parse(bad, TOP_P)


def args(**kw):
    base = dict(rollout_top_p=1.0, use_score_centering=True, score_centering_top_k=K)
    return SimpleNamespace(**{**base, **kw})


def test_the_pinned_sample_gets_no_field_and_the_engine_is_not_asked():
    assert replay_spec(SlimeArgs.read(args())) == ReplaySpec()
    assert replay_spec(SlimeArgs.read(args(rollout_top_p=0.9))) == ReplaySpec(top_p=True)


def test_a_040_sample_gets_the_rows_in_slimes_shapes_and_gives_them_back(monkeypatch):
    import torch

    sample_cls = with_040_fields(monkeypatch)
    spec = replay_spec(SlimeArgs.read(args()))
    assert spec == TOPK and replay_spec(SlimeArgs.read(args(use_score_centering=False))) == ReplaySpec()
    assert replay_spec(SlimeArgs.read(args(rollout_top_p=0.9))) == TOP_P
    t = trajectory()
    step(t, [10, 11], version=1, abort=True)
    step(t, [12], version=2)
    s = sample_cls(tokens=t.prompt_ids + t.response_ids, response_length=3)
    put_replay(s, t.replay, spec, t.uid)
    assert s.rollout_topk_token_ids.dtype == torch.int32 and tuple(s.rollout_topk_token_ids.shape) == (3, K)
    assert s.rollout_topk_log_probs.dtype == torch.float32
    assert s.rollout_topk_token_ids[2].tolist() == [i for i, _ in head(2, 12)]
    assert take_replay(s, spec) == t.replay
    with pytest.raises(RuntimeError, match="sampler top-3 rows of 2 response tokens"):
        put_replay(sample_cls(tokens=[1, 2, 3, 4, 10, 11, 12], response_length=3),
                   TokenReplay(topk=K, topk_ids=t.replay.topk_ids[:2 * K * 4],
                               topk_log_probs=t.replay.topk_log_probs[:2 * K * 4]), spec, t.uid)


def test_engines_without_the_sampler_top_k_stop_the_first_step(slime_mode, monkeypatch, tmp_path):
    """The emulated engines do not answer ``top_logprobs_num``: a score-centering job says so
    before any prompt is taken, naming the key."""
    from april_slime import rollout
    from april_slime.core.config import AprilConfigError
    from tests.support.slime_jobs import Cluster, make_args, point_at

    with_040_fields(monkeypatch)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Q{i}", "label": str(i)}) + "\n" for i in range(20)))
    cluster = Cluster()
    try:
        a = point_at(make_args(tmp_path, prompts, use_score_centering=True, score_centering_top_k=K), cluster)
        source = rollout.AprilDataSource(a)
        with pytest.raises(AprilConfigError, match=r"^use_score_centering: the rollout engines do not return .*"
                                                   r"top_logprobs_num=3"):
            rollout.generate_rollout(a, 0, source)
        assert len(source.buffer) == 0
    finally:
        rollout.shutdown()
        cluster.stop()


# ------------------------------------------------------------------ through an agent's turns
def test_an_episodes_sample_gets_each_tokens_sampler_rows_from_the_call_that_served_it():
    """A generate function's sample (two calls, a tool's two tokens between them): each trained
    token's top-k row and top-p kept ids come from its own call, in order, over that call's resumed
    segments; the tool tokens hold no kept id and a uniform placeholder row no loss reads."""
    import math

    from april_slime.core.replay import SegmentReplay, float32_bytes, int32_bytes
    from april_slime.core.served import served_sampler

    def call(uid: str, version: int, tokens: list[int], split: int) -> SimpleNamespace:
        t = Trajectory(uid=uid, group_uid="g", index_in_group=0, prompt_ids=[1], max_new_tokens=20, sampling_seed=0)
        for part, v in ((tokens[:split], version), (tokens[split:], version + 1)):  # aborted, resumed
            rows = [head(v, tok) for tok in part]
            kept = [[tok, tok + 50] for tok in part]
            t.append(part, [-0.5] * len(part), v, replay=SegmentReplay(
                topk=K, topk_ids=int32_bytes([i for r in rows for i, _ in r]),
                topk_log_probs=float32_bytes([lp for r in rows for _, lp in r]),
                top_p_ids=int32_bytes([i for k in kept for i in k]), top_p_counts=int32_bytes([2] * len(part)),
                top_p_log_probs=float32_bytes([-0.25] * 2 * len(part))))
        return SimpleNamespace(trajectory=t)

    calls = [call("c0", 3, [10, 11, 12], 1), call("c1", 5, [20, 21], 1)]
    mask = [1, 1, 1, 0, 0, 1, 1]
    spec = ReplaySpec(top_p=True, top_p_log_probs=True, topk=K)
    replay = served_sampler(mask, calls, spec)
    rows = [list(zip(int32_values(replay.topk_ids)[n * K:(n + 1) * K],
                     float32_values(replay.topk_log_probs)[n * K:(n + 1) * K])) for n in range(len(mask))]
    expected = [head(3, 10), head(4, 11), head(4, 12), None, None, head(5, 20), head(6, 21)]
    for n, want in enumerate(expected):
        if want is None:
            assert [i for i, _ in rows[n]] == list(range(K))
            assert all(lp == pytest.approx(-math.log(K)) for _, lp in rows[n])
        else:
            assert [i for i, _ in rows[n]] == [i for i, _ in want]
            assert [lp for _, lp in rows[n]] == pytest.approx([lp for _, lp in want])
    assert list(int32_values(replay.top_p_counts)) == [2, 2, 2, 0, 0, 2, 2]
    assert list(int32_values(replay.top_p_ids)) == [10, 60, 11, 61, 12, 62, 20, 70, 21, 71]
    assert replay.covers(spec, prompt_len=1, response_len=len(mask)) is None
