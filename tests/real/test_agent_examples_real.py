"""Acceptance on the real stack: slime's own ``search-r1`` and ``retool`` generate functions, unedited,
under april and copris on real SGLang CPU engines, with weights pushed between steps and a restart
in the middle of the run.

The session's engines serve a tiny Qwen3 warm-started to write the functions' tags
(``tests.support.tag_policy``), so their tools really run: search-r1 retrieves from a stub retrieval
server on loopback (``RetrievalStub``, counted), retool runs ``<code>`` in its own ``tool_sandbox``
(a Python subprocess; its output is read back from the observations). Every step pushes the other of
two weight sets under a new version. Per function and policy, one run of at least six steps:

* job 1 runs steps 0-2 and saves; it dies (``rollout.shutdown``) with its live episodes; job 2
  loads the checkpoint and runs on: each unfinished episode restarted from its prompt is counted
  once, every group is trained exactly once or still buffered at the end, none is lost;
* every trained sample passes slime's contract (``check_multi_turn_contract``); every model token's
  rollout log-prob is the one transformers computes under the weights of the version recorded
  for it, in the context the engine was given (search-r1 re-sends its conversation as text, which
  the engine tokenizes afresh); tool and observation tokens are masked and each observation is the
  one the function makes of its tool's real answer; a turn never runs past a stop string, also when
  it was resumed across steps (search-r1's ``</search>`` / ``</answer>``);
* the run steps on (at most twelve steps) until some model turn was suspended at a step's end and
  resumed in the middle, under the next step's weights: its tokens carry two versions.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from april_slime import rollout
from april_slime.core.keys import TOKEN_VERSIONS_KEY
from april_slime.generate_functions import GenerateFunctions
from tests.support import tag_policy
from tests.support.real_tier import (
    LOGPROB_TOLERANCE,
    SlimeRolloutManager,
    check_multi_turn_contract,
    plugin_args,
    token_logprobs,
)
from tests.support.slime_examples import RetrievalStub, extract_examples, forget_examples, import_examples, mask_runs

PER_CALL = 48  # rollout_max_response_len: the budget of each model call
RESTART_AFTER = 2  # job 1 runs steps 0..2, saves and dies; job 2 loads and runs on
MIN_STEPS, MAX_STEPS = 6, 12
SEARCH, RETOOL = "generate_with_search", "generate_with_retool"


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    folder = extract_examples(tmp_path_factory.mktemp("slime-examples"))
    modules = import_examples(folder)
    yield modules
    forget_examples(folder)


@pytest.fixture(scope="module")
def retrieval(examples):
    """The stub for search-r1's ``search_url``; one passage per search keeps observations short."""
    stub = RetrievalStub()
    config = examples[SEARCH].SEARCH_R1_CONFIGS
    config["local"]["search_url"], config["topk"] = stub.url, 1
    examples[RETOOL].TOOL_CONFIGS["max_turns"] = 3
    yield stub
    stub.close()


@pytest.fixture(scope="module")
def tag_weights(real_stack, examples, retrieval, tmp_path_factory):
    """The warm-started weights (``A``) and their perturbed copy (``B``), built once."""
    import torch

    torch.set_num_threads(1)  # a second thread only contends with the engines on a loaded machine
    return tag_policy.build_tag_policies(tmp_path_factory.mktemp("tag-policy"), real_stack.tokenizer,
                                         examples[SEARCH], examples[RETOOL], log=print)


@pytest.fixture(scope="module")
def hf_models(tag_weights, real_stack):
    """Both weight sets in transformers; they give a demonstration's tokens log-probs far apart, so
    a token checked against the wrong version's model fails."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    models = {str(p): AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in tag_weights}
    ids = real_stack.tokenizer(tag_policy.search_prompt(7) + "<search> book 7 </search>")["input_ids"]
    a, b = (token_logprobs(m, ids, 10) for m in models.values())
    assert max(abs(x - y) for x, y in zip(a, b)) > 100 * LOGPROB_TOLERANCE
    return models


class Function:
    """What the test knows of one example function: its job arguments, its prompts, the prompt and
    engine context it builds, and its observations."""

    def __init__(self, name: str, module, tokenizer, tmp_path):
        self.name, self.module, self.tokenizer = name, module, tokenizer
        # its observation of a turn without a tool call (the function's own code says it)
        self.invalid_observation = asyncio.run(module.execute_predictions(""))[0]
        # how a call's output ids become its reply's text: slime's sampling parameters (set_job)
        self.reply_decoding: dict = {}
        if name == SEARCH:
            self.prompts = tag_policy.write_search_prompts(tmp_path / "search.jsonl", 64)
            self.extra = []
            self.stops = ("</search>", "</answer>")
        else:
            self.prompts = tag_policy.write_retool_prompts(tmp_path / "retool.jsonl", 64)
            # retool's context budget (rollout_max_context_len, else cp size x max_tokens_per_gpu)
            self.extra = ["--reward-key", "score", "--rollout-max-context-len", "2048"]
            self.stops = ()

    def set_job(self, args) -> None:
        """The job's sampling parameters, as slime hands them to a generate function."""
        from slime.rollout.sglang_rollout import GenerateState

        params = GenerateState(args).sampling_params
        self.reply_decoding = {k: params[k] for k in ("skip_special_tokens", "spaces_between_special_tokens")}

    def argv(self) -> list[str]:
        return ["--custom-generate-function-path", f"{self.name}.generate", "--custom-rm-path",
                f"{self.name}.reward_func", "--prompt-data", str(self.prompts), *self.extra]

    def prompt_text(self, s) -> str:
        return s.prompt if self.name == SEARCH else tag_policy.retool_prompt(self.module, s.prompt)

    def prompt_ids(self, s) -> list[int]:
        return self.tokenizer(self.prompt_text(s), add_special_tokens=False)["input_ids"]

    def engine_context(self, s, segments, turn: int) -> list[int]:
        """The input ids the function's call for model segment ``turn`` asks for: retool sends its
        token ids; search-r1 sends prompt and response as text, which SGLang tokenizes: the prompt,
        the text of each call's reply (decoded as slime's sampling parameters ask: with
        ``--rollout-skip-special-tokens`` off, a turn that ended at EOS carries EOS's text into the
        next call's prompt), the observations."""
        prompt_len = len(s.tokens) - s.response_length
        start = segments[turn][1]
        if self.name == RETOOL:
            return s.tokens[:prompt_len + start]
        response = s.tokens[prompt_len:]
        text = "".join(self.reply_text(response[a:b]) if keep else self.tokenizer.decode(response[a:b])
                       for keep, a, b in segments if a < start)
        return self.tokenizer(self.prompt_text(s) + text)["input_ids"]

    def reply_text(self, ids: list[int]) -> str:
        """A model turn's text as SGLang replies it (slime sets ``no_stop_trim``): the text ends
        with the stop string that ended the turn, even where its last token carries more."""
        text = self.tokenizer.decode(ids, **self.reply_decoding)
        found = [(text.find(stop), stop) for stop in self.stops if stop in text]
        if found:
            at, stop = min(found)
            return text[:at + len(stop)]
        return text

    def expected_observation(self, turn_text: str, observation: str, cut: bool = False) -> tuple[bool, bool]:
        """Whether ``observation`` is what the function makes of ``turn_text`` (a beginning of it,
        when ``cut``), and whether it is a tool's real answer (a retrieval, a sandbox run) rather
        than the invalid-action notice."""
        def same(expected: str) -> bool:
            return expected.startswith(observation) if cut else observation == expected

        action, content = self.module.postprocess_predictions(turn_text)
        if self.name == SEARCH:
            if action == "search":
                return same(tag_policy.information(self.module, content)), True
        elif action == "code":
            sums = re.fullmatch(r"print\((\d+(?:\+\d+)*)\)", content.strip())
            if sums:  # plain arithmetic: the sandbox's output is known
                total = sum(int(x) for x in sums.group(1).split("+"))
                return same(tag_policy.interpreter(f"Output:\n{total}")), True
            ran = observation.startswith("\n\n<interpreter>\n") and (cut or observation.endswith("</interpreter>\n\n"))
            return ran, True
        return same(self.invalid_observation), False


def diagnosis(s, models: dict[int, object], context: list[int], own: bool, a: int, b: int,
              k: int) -> str:
    """What a mismatched log-prob is: its value under every version's weights, in the context the
    engine was given and in the sample's own, and the sample's version runs and call versions."""
    prompt_len = len(s.tokens) - s.response_length
    response = s.tokens[prompt_len:]
    given = {v: token_logprobs(m, context + response[a:b], b - a)[k] for v, m in models.items()}
    sample = {v: token_logprobs(m, s.tokens[:prompt_len + a] + response[a:b], b - a)[k] for v, m in models.items()}
    return (f"rollout {s.rollout_log_probs[a + k]}, in the engine's context {given}, in the sample's own "
            f"{sample} (same context: {own}); segment {a}:{b}, runs {s.train_metadata[TOKEN_VERSIONS_KEY]}, "
            f"calls {s.weight_versions}")


def first_difference(a: list[int], b: list[int]) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"lengths {len(a)} and {len(b)}, first difference at {at}: {a[at:at + 4]} vs {b[at:at + 4]}"


def sent_context(fn: Function, s, segments, turn: int, served: dict[str, list]) -> list[int]:
    """The input ids the engine was given for model segment ``turn`` (``served``: the plugin's
    calls, per member, as it replied to them), checked to be what the function's call asks for."""
    prompt_len = len(s.tokens) - s.response_length
    _, a, b = segments[turn]
    output = tuple(s.tokens[prompt_len + a:prompt_len + b])
    given = {inputs for uid, calls in served.items() if uid.split("/")[0] == str(s.group_index)
             for inputs, outputs in calls if outputs == output}
    assert given, f"sample {s.index} turn {turn}: no call of its group replied with the turn's tokens"
    asked = fn.engine_context(s, segments, turn)
    assert tuple(asked) in given, (
        f"sample {s.index} turn {turn}: the engine was not given what the function asked for; "
        + "; ".join(first_difference(list(g), asked) for g in given))
    return asked


def check_episode(fn: Function, s, models: dict[int, object], seen: dict, served: dict[str, list]) -> None:
    """One trained sample: observations, stops, exact log-probs and versions per model turn."""
    prompt_len = len(s.tokens) - s.response_length
    response = s.tokens[prompt_len:]
    versions = [v for v, c in s.train_metadata[TOKEN_VERSIONS_KEY] for _ in range(c)]
    segments = mask_runs(s.loss_mask)
    full = {v: token_logprobs(models[v], s.tokens, s.response_length) for v in set(versions)}
    for turn, (keep, a, b) in enumerate(segments):
        text = fn.tokenizer.decode(response[a:b], skip_special_tokens=bool(keep))
        if not keep:
            previous = fn.tokenizer.decode(response[segments[turn - 1][1]:segments[turn - 1][2]])
            # retool cuts the observation that would pass its context budget, and ends the sample there
            cut = fn.name == RETOOL and b == len(response) and s.status.name == "TRUNCATED"
            matches, real = fn.expected_observation(previous, text, cut=cut)
            assert matches, f"sample {s.index}: masked span {a}:{b} {text!r} is not the function's observation"
            seen["tool_runs"] += real
            continue
        turn_versions = set(versions[a:b])
        seen["model_turns"] += 1
        seen["mid_turn_resumes"] += len(turn_versions) > 1
        for stop in fn.stops:  # a stop string ends the turn, also one that spans a resumed call's segments
            at = text.find(stop)
            assert at < 0 or at + len(stop) == len(text), f"sample {s.index}: turn {text!r} runs past {stop!r}"
            seen["resumed_turns_stopped"] += at >= 0 and len(turn_versions) > 1
        context = sent_context(fn, s, segments, turn, served)
        own = context == s.tokens[:prompt_len + a]
        seen["retokenized_turns"] += not own
        for v in turn_versions:
            expected = full[v][a:b] if own else token_logprobs(models[v], context + response[a:b], b - a)
            for k, (got, want) in enumerate(zip(s.rollout_log_probs[a:b], expected)):
                if versions[a + k] == v:
                    assert abs(got - want) < LOGPROB_TOLERANCE, (
                        f"sample {s.index} token {a + k} (version {v}): rollout {got} vs transformers {want}; "
                        + diagnosis(s, models, context, own, a, b, k))


@pytest.mark.parametrize("policy", ["april", "copris"])
@pytest.mark.parametrize("name", [SEARCH, RETOOL])
def test_slime_example_function_on_real_engines(real_stack, examples, retrieval, tag_weights, hf_models, tmp_path,
                                                monkeypatch, name, policy):
    fn = Function(name, examples[name], real_stack.tokenizer, tmp_path)
    served: dict[str, list] = {}  # member uid -> (input ids, output ids) of each call the plugin replied to
    reply = GenerateFunctions.reply

    def recording(self, call):
        answer = reply(self, call)
        served.setdefault(call.episode.member.uid, []).append(
            (tuple(call.trajectory.prompt_ids), tuple(answer["output_ids"])))
        return answer

    monkeypatch.setattr(GenerateFunctions, "reply", recording)
    weights = [str(tag_weights[k % 2]) for k in range(MAX_STEPS)]
    v0 = real_stack.weight_version() + 1
    version_of = {k: v0 + k for k in range(MAX_STEPS)}
    models = {version_of[k]: hf_models[weights[k]] for k in range(MAX_STEPS)}
    settings = {"april_policy": policy, "april_concurrency": 8, "april_over_sampling_factor": 2.0}
    job = dict(settings=settings, batch=2, n=2, max_len=PER_CALL, extra_argv=fn.argv(),
               hf_checkpoint=str(tag_weights[0]))
    queries_before = len(retrieval.queries)
    seen = {"steps": 0, "model_turns": 0, "tool_runs": 0, "mid_turn_resumes": 0, "resumed_turns_stopped": 0,
            "retokenized_turns": 0, "restarted": 0, "resumed_calls": 0, "suspended_calls": 0}
    trained: list[int] = []
    indices: set[int] = set()
    m = SlimeRolloutManager(plugin_args(real_stack, tmp_path / "job", **job))
    fn.set_job(m.manager.args)
    ckpt = tmp_path / "job" / "ckpt"
    restored: set[str] = set()
    try:
        for step in range(MAX_STEPS):
            if step >= MIN_STEPS and seen["mid_turn_resumes"]:
                break
            if step == RESTART_AFTER + 1:  # the job dies after saving step 2; a new one loads it
                m.save(RESTART_AFTER)
                rollout.shutdown()
                real_stack.wait_idle()
                # the trainer's half of the checkpoint, which slime's --load needs to be kept
                (ckpt / "latest_checkpointed_iteration.txt").write_text(str(RESTART_AFTER + 1))
                m = SlimeRolloutManager(plugin_args(real_stack, tmp_path / "job", load=str(ckpt), **job))
                m.load(RESTART_AFTER)
                restored = set(m.data_source.restored_episodes)
            real_stack.push_weights(weights[step], version_of[step])
            samples, metrics, train = m.generate(step)
            seen["steps"] += 1
            seen["resumed_calls"] += metrics["april/episodes/resumed_calls"]
            seen["suspended_calls"] += metrics["april/episodes/suspended"]
            assert metrics["april/policy_version"] == version_of[step]
            assert metrics["april/episodes/failures"] == 0 and metrics["april/episodes/failed_groups"] == 0
            check_multi_turn_contract(samples, train, batch=2, n=2, prompt_ids_of=fn.prompt_ids)
            for s in samples:
                assert s.index not in indices, f"step {step}: sample {s.index} trained twice"
                indices.add(s.index)
                assert max(v for v, _ in s.train_metadata[TOKEN_VERSIONS_KEY]) <= version_of[step]
                check_episode(fn, s, models, seen, served)
            trained += [s.group_index for s in samples[::2]]
            if step > RESTART_AFTER:
                seen["restarted"] += metrics["april/episodes/restarted"]
        end_buffered = {int(g.uid) for g in m.data_source.buffer.groups()}
        pointer = m.data_source._prompts.sample_group_index
        not_reopened = set(rollout._RUNTIME.episodes.restored)
    finally:
        rollout.shutdown()
        real_stack.restore_weights()

    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert not set(trained) & end_buffered, "a trained group is still buffered"
    assert set(trained) | end_buffered == set(range(pointer)), "a prompt group was lost"
    assert seen["restarted"] == len(restored - not_reopened), "restored episodes restarted, counted once each"
    assert seen["mid_turn_resumes"] > 0, "no model turn was suspended at a step's end and resumed under new weights"
    assert seen["tool_runs"] > 0, "no tool ran"
    if name == SEARCH:
        assert len(retrieval.queries) - queries_before >= seen["tool_runs"], "fewer retrievals than observations"
    print(f"{name} {policy}: {seen}, restored {len(restored)} episodes")
