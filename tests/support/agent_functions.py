"""Custom generate functions with slime's contract, for the episode tests: each is what a user's
multi-turn function does (model call, tool, model call), loaded by slime from this module's path.

They talk to ``http://{args.sglang_router_ip}:{args.sglang_router_port}/generate`` with plain aiohttp
(not slime's ``post``), send ``input_ids`` and build the sample's lists themselves, as slime's
retool example does. ``CONTROL`` lets a test make a function fail or hang on purpose, per sample.
``check_sample`` is what every test checks of a sample ``multi_turn`` made and the plugin trained.
"""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from types import SimpleNamespace

import aiohttp

from april_slime.core.keys import TOKEN_VERSIONS_KEY
from april_slime.core.types import Trajectory
from tests.support.slime_standin import ToyTokenizer

TURNS = 3
PER_TURN = 12
TOOL_TOKENS = [7, 8, 9]
TOKENIZER = ToyTokenizer()

# test knobs: sample index -> how many more runs raise / hang in a tool / alter a token
CONTROL: dict[str, Counter] = {"raise": Counter(), "hang": Counter(), "corrupt": Counter(),
                               "split_rollout_id": Counter(), "drop_turn": Counter()}
CALLS: Counter = Counter()  # model calls made, per sample index
TOOL_RUNS: list[int] = []  # sample index of every tool run


async def _call(session: aiohttp.ClientSession, url: str, ids: list[int], params: dict) -> dict:
    async with session.post(url, json={"input_ids": ids, "sampling_params": params, "return_logprob": True}) as r:
        body = await r.json()
        assert r.status == 200, body
        return body


async def multi_turn(args, sample, sampling_params):
    """TURNS model calls of at most PER_TURN tokens, with a tool between two calls."""
    return (await _episode(args, sample, sampling_params))[0]


async def _episode(args, sample, sampling_params):
    """``multi_turn``'s episode: the sample, and where each model turn lies in its response."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    assert not args.partial_rollout, "the plugin resumes calls under the function"
    index = sample.index
    if CONTROL["raise"][index] > 0:
        CONTROL["raise"][index] -= 1
        raise RuntimeError(f"sandbox of sample {index} lost")
    corrupt = CONTROL["corrupt"][index] > 0  # this run alters a token of its first call
    if corrupt:
        CONTROL["corrupt"][index] -= 1
    prompt = TOKENIZER.encode(sample.prompt)
    response, mask, logprobs, turns = [], [], [], []
    async with aiohttp.ClientSession() as session:
        for turn in range(TURNS):
            out = await _call(session, url, prompt + response, {**sampling_params, "max_new_tokens": PER_TURN})
            CALLS[index] += 1
            finish = out["meta_info"]["finish_reason"]["type"]
            assert finish in ("stop", "length"), f"the function saw finish_reason {finish}"
            ids = [int(t[1]) for t in out["meta_info"]["output_token_logprobs"]]
            assert ids == out["output_ids"]
            if corrupt and turn == 0:
                ids = ids[:-1] + [(ids[-1] + 1) % 200 + 10] if ids else [11]
            turns.append((len(response), len(response) + len(ids)))
            response += ids
            mask += [1] * len(ids)
            logprobs += [float(t[0]) for t in out["meta_info"]["output_token_logprobs"]][:len(ids)]
            if turn == TURNS - 1:
                break
            TOOL_RUNS.append(index)
            if CONTROL["hang"][index] > 0:
                CONTROL["hang"][index] -= 1
                await asyncio.Event().wait()  # a tool that never returns
            await asyncio.sleep(0)  # the tool
            response += TOOL_TOKENS
            mask += [0] * len(TOOL_TOKENS)
            logprobs += [0.0] * len(TOOL_TOKENS)
    completed(sample, prompt, response, mask, logprobs, TOKENIZER)
    return sample, turns


async def with_evaluation(args, sample, sampling_params, evaluation=False):
    """The same, for slime's signature with ``evaluation``."""
    assert evaluation is False
    return await multi_turn(args, sample, sampling_params)


async def fan_out(args, sample, sampling_params):
    """slime's compact shape: the same episode as ``multi_turn``, returned as one sample per model
    turn, each with the conversation before it as its prompt (tool tokens included) and the turn's
    output as its response; the siblings share one ``rollout_id``, as slime requires. Sample 1 of
    every group instead returns its turns as ``multi_turn`` does (one sample)."""
    whole, turns = await _episode(args, sample, sampling_params)
    if sample.index % 2 == 1:
        return whole
    prompt_len = len(whole.tokens) - whole.response_length
    out = []
    for n, (a, b) in enumerate(turns):
        s = copy.deepcopy(whole)
        s.tokens = whole.tokens[:prompt_len + b]
        s.response_length = b - a
        s.response = TOKENIZER.decode(s.tokens[prompt_len + a:])
        s.loss_mask = [1] * (b - a)
        s.rollout_log_probs = whole.rollout_log_probs[a:b]
        s.rollout_id = 1000 * sample.index + (n if CONTROL["split_rollout_id"][sample.index] > 0 else 0)
        out.append(s)
    if CONTROL["split_rollout_id"][sample.index] > 0:
        CONTROL["split_rollout_id"][sample.index] -= 1
    if CONTROL["drop_turn"][sample.index] > 0:
        CONTROL["drop_turn"][sample.index] -= 1
        out.pop(1)
    return out


async def concurrent_turns(args, sample, sampling_params):
    """Two model calls awaited together (``asyncio.gather``, as slime's multi_agent runs its agents),
    then a tool and a third call that continues the first two: one sample whose trainable tokens are
    the three calls' outputs in the order the function made them, whatever order they finished in."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt = TOKENIZER.encode(sample.prompt)
    async with aiohttp.ClientSession() as session:
        params = {**sampling_params, "max_new_tokens": PER_TURN}
        outs = await asyncio.gather(_call(session, url, prompt, params), _call(session, url, prompt + [5], params))
        CALLS[sample.index] += 2
        response, mask, logprobs = [], [], []
        for out in outs:
            assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
            response += out["output_ids"]
            mask += [1] * len(out["output_ids"])
            logprobs += [float(t[0]) for t in out["meta_info"]["output_token_logprobs"]]
        await asyncio.sleep(0)  # the tool
        response += TOOL_TOKENS
        mask += [0] * len(TOOL_TOKENS)
        logprobs += [0.0] * len(TOOL_TOKENS)
        out = await _call(session, url, prompt + response, params)
        CALLS[sample.index] += 1
        response += out["output_ids"]
        mask += [1] * len(out["output_ids"])
        logprobs += [float(t[0]) for t in out["meta_info"]["output_token_logprobs"]]
    completed(sample, prompt, response, mask, logprobs, TOKENIZER)
    return sample


async def always_raises(args, sample, sampling_params):
    """A function whose tool is down for good: every run raises."""
    raise ConnectionError(f"tool server unreachable for sample {sample.index}")


async def without_log_probs(args, sample, sampling_params):
    """``multi_turn``'s episode returned without ``rollout_log_probs``, as slime's tau-bench returns
    its samples."""
    whole, _ = await _episode(args, sample, sampling_params)
    whole.rollout_log_probs = None
    return whole


STRING_STATUSES = ("completed", "truncated", "aborted")


async def string_status(args, sample, sampling_params):
    """``multi_turn``'s episode with a string status, as slime's tau-bench sets it (one of
    ``STRING_STATUSES`` by sample index)."""
    whole, _ = await _episode(args, sample, sampling_params)
    whole.status = STRING_STATUSES[sample.index % len(STRING_STATUSES)]
    return whole


FILTERED: list[list[str]] = []  # what keep_all saw of each group: the type names of its samples


def keep_all(args, samples):
    """A dynamic sampling filter (slime's ``f(args, samples)``) that keeps every group."""
    FILTERED.append([type(s).__name__ for s in samples])
    return True


def served_calls(*outputs: list[int]) -> list[SimpleNamespace]:
    """Model calls as an episode holds them once served: call ``k`` returned ``outputs[k]`` under
    version ``10 + k``, each token with log-prob ``-0.1 * (k + 1)``."""
    calls = []
    for k, ids in enumerate(outputs):
        t = Trajectory(uid=f"c{k}", group_uid="0", index_in_group=0, prompt_ids=[1], max_new_tokens=50,
                       sampling_seed=1)
        t.append(ids, [-0.1 * (k + 1)] * len(ids), 10 + k)
        calls.append(SimpleNamespace(trajectory=t))
    return calls


def completed(sample, prompt: list[int], response: list[int], mask: list[int], logprobs: list[float],
              tokenizer) -> None:
    """Fill ``sample`` as a function leaves a finished conversation: its tokens, response (tool
    output included, loss-masked) and the log-prob of every response token."""
    sample.tokens = prompt + response
    sample.response_length = len(response)
    sample.response = tokenizer.decode(response)
    sample.loss_mask = mask
    sample.rollout_log_probs = logprobs
    sample.status = type(sample).Status.COMPLETED


def prompts_file(tmp_path, count: int = 200):
    """A fresh prompt set for an agent job (questions of a few lengths), with the functions'
    records cleared; a test's fixture yields it and calls ``reset`` after."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(f'{{"prompt": "question {i:02d} {"x" * (i % 5)}", "label": "{i}"}}\n'
                            for i in range(count)))
    reset()
    return path


def reset() -> None:
    for counter in CONTROL.values():
        counter.clear()
    CALLS.clear()
    TOOL_RUNS.clear()
    FILTERED.clear()
    TOOLS_ACROSS_STEPS.clear()
    STEPS_RUN[0] = 0
    KEPT_ROWS.clear()


# ------------------------------------------------------------------ the real tier's function
OBSERVATION = "\n<obs>tool says ok</obs>\n"
REAL_PER_TURN = 64
# groups whose every tool phase outlasts a rollout step: the test counts the steps it ran in
# STEPS_RUN, and such a tool returns once one more step has ended than when it began
TOOLS_ACROSS_STEPS: set[int] = set()
STEPS_RUN = [0]


async def _tool_across_a_step(sample) -> None:
    if sample.group_index in TOOLS_ACROSS_STEPS:
        began = STEPS_RUN[0]
        while STEPS_RUN[0] <= began:  # set by the test's thread once its step returned
            await asyncio.sleep(0.05)


async def text_then_ids(args, sample, sampling_params):
    """A search-r1-like function for real engines, through slime's own ``post`` (httpx): the first
    call sends the prompt as ``text``, later ones ``input_ids`` with the observation between them."""
    from slime.utils.http_utils import post
    from slime.utils.processing_utils import load_tokenizer

    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    tokenizer = load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
    prompt = tokenizer(sample.prompt)["input_ids"]  # what SGLang makes of the text prompt
    observation = tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"]
    response, mask, logprobs = [], [], []
    for turn in range(TURNS):
        params = {**sampling_params, "max_new_tokens": REAL_PER_TURN}
        body = ({"text": sample.prompt} if turn == 0 else {"input_ids": prompt + response})
        out = await post(url, {**body, "sampling_params": params, "return_logprob": True})
        assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length"), out["meta_info"]
        ids = [int(t[1]) for t in out["meta_info"]["output_token_logprobs"]]
        response += ids
        mask += [1] * len(ids)
        logprobs += [float(t[0]) for t in out["meta_info"]["output_token_logprobs"]]
        if turn < TURNS - 1:
            await _tool_across_a_step(sample)
            response += observation
            mask += [0] * len(observation)
            logprobs += [0.0] * len(observation)
    completed(sample, prompt, response, mask, logprobs, tokenizer)
    return sample


KEPT_ROWS: dict[int, object] = {}  # sample index -> the routed experts its own slime Sample kept


async def keeps_routed_experts(args, sample, sampling_params):
    """``text_then_ids``'s conversation (``input_ids`` throughout) kept with slime's own
    ``Sample.append_response_tokens``: each call asks for the routed experts after the rows the
    sample holds (``routed_experts_start_len``) and slime's code stitches them (it reads the start
    from ``meta_info``, where SGLang does not echo it, so the function puts it there)."""
    from slime.utils.http_utils import post
    from slime.utils.processing_utils import load_tokenizer

    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    tokenizer = load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
    observation = tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"]
    sample.tokens = list(tokenizer(sample.prompt)["input_ids"])
    for turn in range(TURNS):
        held = 0 if sample.rollout_routed_experts is None else len(sample.rollout_routed_experts)
        out = await post(url, {"input_ids": list(sample.tokens), "return_logprob": True,
                               "sampling_params": {**sampling_params, "max_new_tokens": REAL_PER_TURN},
                               "return_routed_experts": True, "routed_experts_start_len": held})
        meta = {**out["meta_info"], "routed_experts_start_len": held}
        sample.append_response_tokens(args, tokens=[int(t[1]) for t in meta["output_token_logprobs"]],
                                      log_probs=[float(t[0]) for t in meta["output_token_logprobs"]],
                                      trainable=True, meta_info=meta)
        if turn < TURNS - 1:
            await _tool_across_a_step(sample)
            sample.append_response_tokens(args, tokens=observation, trainable=False)
    KEPT_ROWS[sample.index] = sample.rollout_routed_experts.clone()
    sample.status = type(sample).Status.COMPLETED
    return sample


def expand(runs):
    return [v for v, c in runs for _ in range(c)]


def check_sample(s, version_floor: int) -> None:
    """A ``multi_turn`` sample, with the plugin's versions: tool tokens masked, every model token
    versioned, nothing generated by a policy newer than the step's."""
    mask = s.loss_mask
    assert len(mask) == s.response_length == len(s.rollout_log_probs)
    response = s.tokens[-s.response_length:]
    tools = [k for k, m in enumerate(mask) if not m]
    assert len(tools) == (TURNS - 1) * len(TOOL_TOKENS)
    assert [response[k] for k in tools] == TOOL_TOKENS * (TURNS - 1)
    versions = expand(s.train_metadata[TOKEN_VERSIONS_KEY])
    assert len(versions) == s.response_length
    assert all(version_floor <= v <= s.train_metadata["april_policy_version"] for v in versions)
    assert s.reward is not None
