"""A reply's output tokens: the whole-list checks against the item-by-item reference, the ids a
request sends, and the JSON decoding of reply bodies.

The whole-list checks may only ever be faster: on every reply below, well formed or broken in one
way, they return exactly what the reference returns (the same lists, the same types, the same bits)
or raise exactly its error.
"""

from __future__ import annotations

import copy
import gc
import json
import re

import numpy as np
import pytest

from april_slime.core.sglang_protocol import (
    EngineReplyError,
    LogprobArrays,
    _checked_lists,
    check_token_ids,
    output_token_arrays,
    output_tokens,
    output_tokens_reference,
)
from april_slime.core.transport import decode_generate_reply, decode_json
from april_workbench.bench import decode
from tests.support.reply_tokens import MUTATIONS, VOCAB, WHERE, base_reply, mutated, outcome


@pytest.mark.parametrize("output_ids", ["sent", "left out"])
@pytest.mark.parametrize("vocab", [VOCAB, None])
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_whole_list_checks_return_what_the_reference_returns(name, vocab, output_ids):
    ids, triples = mutated(name)
    if output_ids == "left out":
        ids = None  # the ids come from the triples alone
    expected = outcome(output_tokens_reference, copy.deepcopy(ids), copy.deepcopy(triples), vocab, WHERE)
    assert outcome(output_tokens, ids, triples, vocab, WHERE) == expected
    fast = _checked_lists(ids, triples, vocab)
    if fast is not None:  # what the fast path vouches for, the reference accepts, with the same lists
        assert outcome(lambda: fast[:2]) == expected
        if fast[2] is not None:  # and the arrays a trajectory stores hold the same values, bit for bit
            arrays = fast[2]
            assert arrays[0].tolist() == fast[0]
            assert arrays[1].tobytes() == np.array(fast[1], dtype=np.float64).tobytes()
    # the usual reply never reaches the reference (else the fast path would be dead code)
    if name in ("well formed", "log-prob 0.0 and -0.0", "output_ids absent", "no tokens"):
        assert fast is not None
    if name == "token id beyond int64" and vocab is None:
        assert expected[0] == "ok"  # any integer >= 0 is a token id of an unknown vocabulary


@pytest.mark.parametrize("vocab", [VOCAB, None])
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_the_arrays_a_reply_result_holds_are_the_lists_the_checks_return(name, vocab):
    """``output_token_arrays`` (what ``parse_generate_reply`` keeps) holds the values ``output_tokens``
    returns, as int64 ids and float64 log-probs bit for bit, or raises its error; an id beyond 64
    bits, which an unknown vocabulary allows, is refused by name (no token column can hold it)."""
    ids, triples = mutated(name)
    expected = outcome(output_tokens, copy.deepcopy(ids), copy.deepcopy(triples), vocab, WHERE)
    try:
        got_ids, got_logprobs = output_token_arrays(ids, triples, vocab, WHERE)
    except EngineReplyError as exc:
        if name == "token id beyond int64" and vocab is None:
            assert expected[0] == "ok" and "token id beyond 64 bits" in str(exc)
        else:
            assert ("error", str(exc)) == expected
        return
    assert got_ids.dtype == np.int64 and got_logprobs.dtype == np.float64
    assert outcome(lambda: (got_ids.tolist(), got_logprobs.tolist())) == expected


@pytest.mark.parametrize("output_ids", ["sent", "left out"])
@pytest.mark.parametrize("vocab", [VOCAB, None])
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_generate_reply_decoded_compact_checks_as_its_lists_check(name, vocab, output_ids):
    """``decode_generate_reply`` (what the HTTP transport gives the client) hands a well-formed
    reply's tokens over as arrays, and the checks then keep or refuse exactly what they keep or
    refuse of the lists ``decode_json`` makes of the same body."""
    ids, triples = mutated(name)
    reply = {"meta_info": {"output_token_logprobs": triples}}
    if output_ids == "sent":
        reply["output_ids"] = ids
    try:
        body = json.dumps(reply).encode()
    except (TypeError, ValueError):
        pytest.skip("no JSON body says this")

    def checked(decoded):
        return outcome(output_token_arrays, decoded.get("output_ids"), decoded["meta_info"]["output_token_logprobs"],
                       vocab, WHERE)

    compact = decode_generate_reply(body)
    assert checked(compact) == checked(decode_json(body))
    if name in ("well formed", "log-prob 0.0 and -0.0", "no tokens"):
        assert isinstance(compact["meta_info"]["output_token_logprobs"], LogprobArrays)


def test_a_long_reply_is_decoded_without_a_collection_and_keeps_no_list_per_token():
    """A 16K-token reply decoded as plain JSON is 16K lists, and the young collections its
    allocations set off promote the half-built reply to the oldest generation; decoded for the
    client, no collection runs meanwhile and what it returns holds a few objects, not one per token."""
    n = 16384
    triples = [[-0.25 - i / n, 1000 + i % 5000, None] for i in range(n)]
    body = json.dumps({"text": "", "output_ids": [t[1] for t in triples],
                       "meta_info": {"id": "r", "output_token_logprobs": triples}}).encode()
    del triples
    collections: list[int] = []

    def seen(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.collect()
    before = len(gc.get_objects())
    gc.callbacks.append(seen)
    try:
        reply = decode_generate_reply(body)
    finally:
        gc.callbacks.remove(seen)
    assert collections == [] and gc.isenabled()
    assert len(gc.get_objects()) - before < 20
    assert reply["meta_info"]["output_token_logprobs"].token_ids.tolist() == reply["output_ids"].tolist()
    plain = decode_json(body)
    assert len(gc.get_objects()) - before > n  # the same body as lists: one per token
    del plain


# ---------------------------------------------------------------------------------- token ids sent
@pytest.mark.parametrize("ids", [
    [1, 2, 3], [0, VOCAB - 1], [5, True], [5, 2.0], [5, np.int64(2)], [5, -1], [5, VOCAB], [2 ** 70], [-(2 ** 70)],
    (4, 5), [], [7] * 5000 + ["7"],
])
@pytest.mark.parametrize("vocab", [VOCAB, None])
def test_check_token_ids_keeps_its_rule(ids, vocab):
    """Every id an exact int in [0, vocab) (>= 0 for an unknown vocabulary); the first bad one named."""
    bad = next((pos for pos, t in enumerate(ids)
                if type(t) is not int or t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is None:
        check_token_ids(ids, vocab, "input_ids")
    else:
        with pytest.raises(ValueError, match=re.escape(f"input_ids: token id {ids[bad]!r} at position {bad} is not")):
            check_token_ids(ids, vocab, "input_ids")


# ---------------------------------------------------------------------------------- reply bodies
@pytest.mark.parametrize("body", [
    b'{"a": [1, 2.5, null, true, "x\\u00e9"], "b": {"c": -0.0}, "u64": 18446744073709551615}',
    b'[[NaN, 5, null], [-Infinity, 6, null], [Infinity, 7, null], [-1e400, 8, null]]',  # Python's json writes these
    b'{"text": "\\ud800 lone surrogate"}',
])
def test_reply_bodies_decode_as_the_standard_library_decodes_them(body):
    got, expected = decode_json(body), json.loads(body)
    assert json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True)


def test_an_integer_beyond_64_bits_is_refused_where_an_integer_is_wanted():
    ids, triples = base_reply()
    triples[1][1] = ids[1] = 2 ** 70
    body = json.dumps({"output_ids": ids, "meta_info": {"output_token_logprobs": triples}}).encode()
    reply = decode_json(body)
    assert type(reply["output_ids"][1]) is float  # orjson's reading of it
    with pytest.raises(EngineReplyError, match=re.escape(f"token id at position 1 is {float(2 ** 70)}")):
        output_tokens(reply["output_ids"], reply["meta_info"]["output_token_logprobs"], None, WHERE)


@pytest.mark.parametrize("body", [b"<html>gateway</html>", b'{"a": 1', b"\xff\xfe{}"])
def test_a_body_that_is_not_json_raises_value_error(body):
    with pytest.raises(ValueError):
        decode_json(body)


def test_the_decode_benchmark_runs_and_reports_its_ratios(tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert decode.main(["--tokens", "512", "--rounds", "3", "--calls", "1", "--json", str(out)]) == 0
    report = capsys.readouterr().out
    assert "client: decode_generate_reply + parse_generate_reply" in report and "time / orjson.loads" in report
    figures = json.loads(out.read_text())
    assert figures["tokens"] == 512 and set(figures["paths"]) == {"orjson.loads", "client", "reference"}
    assert figures["paths"]["orjson.loads"]["ratio_median"] == 1.0
    assert all(p["tokens_per_s_median"] > 0 for p in figures["paths"].values())
