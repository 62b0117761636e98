"""Replies' output tokens for the reply-check tests: a well-formed reply's ids and triples, the ways
one can be broken, and the outcome of a check in a form that compares exactly."""

from __future__ import annotations

import math

import numpy as np

from april_slime.core.sglang_protocol import EngineReplyError

VOCAB = 1000
WHERE = "engine http://e rid r"


def outcome(fn, *args):
    """What a call returns, or the error it raises, in a form that compares exactly: every value
    with its type, floats by their bits."""
    try:
        ids, logprobs = fn(*args)
    except EngineReplyError as exc:
        return ("error", str(exc))
    return ("ok", [(type(t), t) for t in ids], [(type(x), np.float64(x).tobytes()) for x in logprobs])


def base_reply(n: int = 6) -> tuple[list[int], list[list]]:
    ids = [(37 * i + 5) % VOCAB for i in range(n)]
    logprobs = [-0.25 * i - 1e-3 for i in range(n)]
    return ids, [[lp, t, None] for lp, t in zip(logprobs, ids)]


def _set(i: int, j: int, value):
    def mutate(ids, triples):
        triples[i][j] = value
        if j == 1:
            ids[i] = value if type(value) is int else ids[i]
    return mutate


def _ids(value):
    def mutate(ids, triples):
        ids[2] = value
    return mutate


MUTATIONS = {
    "well formed": lambda ids, triples: None,
    "log-prob 0.0 and -0.0": lambda ids, triples: (triples[0].__setitem__(0, 0.0), triples[1].__setitem__(0, -0.0)),
    "log-prob at the tolerance": _set(1, 0, 1e-4),
    "log-prob above the tolerance": _set(1, 0, 2e-4),
    "positive log-prob": _set(3, 0, 0.7),
    "nan log-prob": _set(2, 0, math.nan),
    "-inf log-prob": _set(4, 0, -math.inf),
    "inf log-prob": _set(0, 0, math.inf),
    "null log-prob": _set(1, 0, None),
    "string log-prob": _set(1, 0, "-0.5"),
    "int log-prob": _set(2, 0, -3),
    "int log-prob 0": _set(2, 0, 0),
    "bool log-prob": _set(2, 0, False),
    "numpy log-prob": _set(2, 0, np.float64(-0.5)),
    "huge int log-prob": _set(2, 0, -(10 ** 400)),
    "bool token id": _set(1, 1, True),
    "bool token id, output_ids 1": lambda ids, triples: (triples[1].__setitem__(1, True), ids.__setitem__(1, 1)),
    "float token id": _set(1, 1, 5.0),
    "float token id, output_ids 5": lambda ids, triples: (triples[1].__setitem__(1, 5.0), ids.__setitem__(1, 5)),
    "string token id": _set(1, 1, "5"),
    "null token id": _set(1, 1, None),
    "negative token id": _set(1, 1, -1),
    "token id at the vocabulary size": _set(1, 1, VOCAB),
    "token id beyond int64": _set(1, 1, 2 ** 70),
    "triple of one item": lambda ids, triples: triples.__setitem__(2, [-0.5]),
    "triple of four items": lambda ids, triples: triples[2].append("x"),
    "triple as a tuple": lambda ids, triples: triples.__setitem__(2, tuple(triples[2])),
    "triple as an object": lambda ids, triples: triples.__setitem__(2, {"logprob": -0.5, "id": ids[2]}),
    "triple as a string": lambda ids, triples: triples.__setitem__(2, "ab"),
    "triple as null": lambda ids, triples: triples.__setitem__(2, None),
    "output_ids float": _ids(5.0),
    "output_ids float of the same id": lambda ids, triples: ids.__setitem__(2, float(ids[2])),
    "output_ids bool": _ids(True),
    "output_ids bool for id 1": lambda ids, triples: (triples[2].__setitem__(1, 1), ids.__setitem__(2, True)),
    "output_ids numpy int": _ids(np.int64(5)),
    "output_ids other token": _ids(999),
    "output_ids one more": lambda ids, triples: ids.append(3),
    "output_ids one fewer": lambda ids, triples: ids.pop(),
    "output_ids a tuple": "tuple",
    "output_ids absent": "absent",
    "no tokens": "empty",
}


def mutated(name: str) -> tuple[object, list]:
    ids, triples = base_reply()
    mutate = MUTATIONS[name]
    if mutate == "tuple":
        return tuple(ids), triples
    if mutate == "absent":
        return None, triples
    if mutate == "empty":
        return [], []
    mutate(ids, triples)
    return ids, triples
