"""The reply a generate function gets for one model call, and how its sample is matched to the calls
it was served (``april_slime.generate_functions``), on a character tokenizer."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from april_slime.core.episodes import CallRequest, Episode, EpisodeError, ModelCall
from april_slime.core.served import match_served
from april_slime.core.types import Trajectory, TrajectoryStatus
from april_slime.generate_functions import GenerateFunctions
from tests.support.agent_functions import served_calls

MERGED, EOS = 0xE000, 0xE001  # a token whose text runs past a stop string's end; a special token
PIECES = {MERGED: ">\n\n", EOS: "<eos>"}


class CharTokenizer:
    """One token per character: id = code point; ``MERGED`` and ``EOS`` decode to several."""

    def __call__(self, text, **kwargs):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False, **kwargs):
        return "".join("" if i == EOS and skip_special_tokens else PIECES.get(i, chr(i)) for i in ids)


def functions() -> GenerateFunctions:
    g = GenerateFunctions.__new__(GenerateFunctions)
    g.codec = SimpleNamespace(tokenizer=CharTokenizer())
    g.top_p_replay = False
    g.routed_width = 0
    return g


def call_of(segments: list[tuple[str, int]], finish: str, stop=("</search>",), **params) -> ModelCall:
    """A call whose response came in ``segments`` (text, policy version), one engine call each."""
    t = Trajectory(uid="0/0@0.0", group_uid="0", index_in_group=0, prompt_ids=[ord("Q")], max_new_tokens=100,
                   sampling_seed=1)
    for text, version in segments:
        t.append([ord(c) for c in text], [-0.5] * len(text), version)
        t.num_calls += 1
    t.finish_reason = finish
    t.status = TrajectoryStatus.TRUNCATED if finish == "length" else TrajectoryStatus.COMPLETED
    request = CallRequest(input_ids=[ord("Q")], max_new_tokens=100, sampling_params={"stop": list(stop), **params},
                          stop=tuple(stop))
    loop = asyncio.new_event_loop()
    try:
        return ModelCall(Episode(t), request, t, loop.create_future())
    finally:
        loop.close()


def test_a_stop_string_split_by_the_resume_ends_the_reply_where_one_call_would_have_stopped():
    # the abort fell inside "</search>": the engine could not see it, and ran on after it
    call = call_of([("ab </sea", 3), ("rch> tail", 4)], finish="length", no_stop_trim=True)
    reply = functions().reply(call)
    assert reply["text"] == "ab </search>"
    assert reply["output_ids"] == [ord(c) for c in "ab </search>"]
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": "</search>"}
    assert [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]] == [-0.5] * 12
    assert reply["meta_info"]["weight_versions"] == [{"version": "3", "start": 0, "end": 8},
                                                     {"version": "4", "start": 8, "end": 12}]
    assert reply["meta_info"]["completion_tokens"] == 12 and reply["meta_info"]["weight_version"] == "4"


# SGLang's detokenizer (trim_matched_stop): the text ends at the matched stop string, which it keeps
# only with no_stop_trim; a stop token's text is kept only with no_stop_trim; output ids are not cut
@pytest.mark.parametrize("no_stop_trim, text", [(True, "ab </search>"), (False, "ab ")],
                         ids=["no_stop_trim", "stop_trimmed"])
def test_the_token_that_completes_a_stop_string_gives_no_text_past_it(no_stop_trim, text):
    call = call_of([("ab </search\ue000", 3)], finish="stop", no_stop_trim=no_stop_trim)
    reply = functions().reply(call)
    assert reply["text"] == text
    assert reply["output_ids"] == [ord(c) for c in "ab </search"] + [MERGED]
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": "</search>"}


@pytest.mark.parametrize("no_stop_trim, skip_special_tokens, text", [
    (True, False, "ab<eos>"), (True, True, "ab"), (False, False, "ab")],
    ids=["no_stop_trim", "no_stop_trim-skip_special_tokens", "stop_trimmed"])
def test_a_call_ended_by_a_stop_token_keeps_its_text_only_with_no_stop_trim(no_stop_trim, skip_special_tokens,
                                                                              text):
    call = call_of([("ab\ue001", 3)], finish="stop", no_stop_trim=no_stop_trim,
                   skip_special_tokens=skip_special_tokens)
    reply = functions().reply(call)
    assert reply["text"] == text and reply["output_ids"] == [ord("a"), ord("b"), EOS]
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}


def test_a_resumed_call_without_a_stop_string_keeps_every_segment():
    call = call_of([("ab", 3), ("cd", 4)], finish="length")
    reply = functions().reply(call)
    assert reply["text"] == "abcd"
    assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_the_returned_tokens_get_the_versions_of_the_calls_that_made_them():
    response = [5, 6, 90, 91, 7]  # call 0, a tool's two tokens, call 1
    mask = [1, 1, 0, 0, 1]
    versions = match_served("s", response, mask, [-0.1, -0.1, 0.0, 0.0, -0.2], served_calls([5, 6], [7]))
    assert versions == [10, 10, 10, 10, 11]


@pytest.mark.parametrize("response, mask, logprobs, what", [
    ([5, 9, 7], [1, 1, 1], [-0.1, -0.1, -0.2], "first difference at trainable token 1"),
    ([5, 6], [1, 1], [-0.1, -0.1], "are not the 3 tokens"),
    ([5, 6, 7], [1, 1, 1], [-0.1, -0.3, -0.2], "rollout log-prob"),
])
def test_a_sample_that_does_not_match_its_calls_fails_loudly(response, mask, logprobs, what):
    with pytest.raises(EpisodeError, match=what):
        match_served("s", response, mask, logprobs, served_calls([5, 6], [7]))
