"""Acceptance on the real stack: slime's own ``examples/multi_agent`` and ``examples/tau-bench``,
unedited, under april and copris on real SGLang CPU engines, inside real slime, weights pushed
between steps.

multi_agent: five solver agents call the model at once in one episode (``asyncio.gather``), each
call a sample of the episode. The jobs run on the ``long_weights`` (a response never ends before its
budget), and the prompts give the calls two budgets (the function cuts ``max_new_tokens`` to
``--rollout-max-context-len`` minus the prompt): group 0's calls are short (``SHORT`` tokens), every
other group's long (``PER_CALL``). Under april (groups 0 and 1 open) the step's target is met by
group 0 while group 1's calls still run: they are aborted with their tokens and resumed in the next
step under the next weights, where they end first (they have fewer tokens left than the fresh long
calls beside them). Under copris the step opens more groups, whose calls arrive in any order, and
refills N' as calls end: at the target, calls submitted later than the finishing group's are still
running and are cut with tokens. Per step:

* every episode returns all five of its agents' samples (the solvers wrote no ``</think>``, so
  the function's code ends the episode after them), each trained once, no group lost;
* each sample is its call's prompt and output, the output as long as the call's budget whatever
  its segments; every token's rollout log-prob is the one transformers computes under the weights
  of the version recorded for it;
* between steps, a pause: the episodes stay suspended with their calls pending (no call is
  refused: the front answers every call, however long the pause, so slime's ``post`` never gives
  up on one) while the next weights are pushed.

The run steps on (at most ``MAX_STEPS``) until an episode was trained whose concurrent calls were
cut at a step's end and resumed under new weights: at least two of its samples carry two versions.

tau-bench (the ``tau_bench`` package is ``tests.support.tau_bench_standin``'s): its first sample
stops the first step, before anything is trained, with one line saying why (no rollout log-probs:
it trains its conversation re-tokenized); every group is back in the buffer.
"""

from __future__ import annotations

import importlib
import json
import sys

import pytest

from april_slime import rollout
from april_slime.core import front
from april_slime.core.keys import TOKEN_VERSIONS_KEY
from tests.support.real_tier import LOGPROB_TOLERANCE, SlimeRolloutManager, plugin_args, token_logprobs
from tests.support.slime_examples import AGENT_MODULES, MULTI_AGENT, extract_agent_examples

PER_CALL = 96  # rollout_max_response_len: the long calls' budget
SHORT = 24  # the short calls' budget (group 0)
CONTEXT = 160  # rollout_max_context_len: multi_agent cuts each call's budget to it
MIN_STEPS, MAX_STEPS = 2, 6
AGENTS = 5  # multi_agent's num_parallel


@pytest.fixture(scope="module")
def agent_examples(tmp_path_factory):
    """The folder holding slime's ``examples/multi_agent`` and ``examples/tau-bench``, unedited."""
    return extract_agent_examples(tmp_path_factory.mktemp("slime-agent-examples"))


@pytest.fixture
def agent_example(agent_examples, monkeypatch):
    """Puts a folder on ``sys.path`` and imports ``module`` fresh; the modules are dropped again
    afterwards (slime's ``load_function`` caches by path what it loaded: cleared too)."""
    from slime.utils.misc import load_function

    def add(path, module: str):
        monkeypatch.syspath_prepend(str(path))
        return importlib.import_module(module)

    for name in AGENT_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    load_function.cache_clear()
    yield add
    for name in AGENT_MODULES:
        sys.modules.pop(name, None)
    load_function.cache_clear()


@pytest.fixture
def refusals(monkeypatch):
    """Every error reply of the plugin's front (status, message)."""
    seen: list[tuple[int, str]] = []
    error_response = front.error_response

    def recording(status: int, message: str):
        seen.append((status, message))
        return error_response(status, message)

    monkeypatch.setattr(front, "error_response", recording)
    return seen


@pytest.fixture(scope="module")
def long_models(long_weights):
    """The two long weights in transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return {str(p): AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in long_weights}


def write_prompts(path, tokenizer, n: int = 64) -> dict[str, int]:
    """``n`` problems; group 0's is long enough that the function leaves its calls ``SHORT`` tokens of
    ``CONTEXT``, the others short (their calls get ``PER_CALL``). Returns each prompt's budget."""
    budgets, lines = {}, []
    for i in range(n):
        prompt = f"Question {i}: what is {i} plus {i + 7}?"
        while i == 0 and len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) < CONTEXT - SHORT:
            prompt += " check again"
        budgets[prompt] = min(PER_CALL, CONTEXT - len(tokenizer(prompt, add_special_tokens=False)["input_ids"]))
        lines.append(json.dumps({"prompt": prompt, "label": str(2 * i + 7)}) + "\n")
    path.write_text("".join(lines))
    first = list(budgets.values())
    assert SHORT - 4 <= first[0] <= SHORT and set(first[1:]) == {PER_CALL}, first
    return budgets


def pause_between_rollouts(max_s: float = 60.0) -> None:
    """slime's training step between two rollouts, as the plugin sees it: the episodes go on and
    make their next calls, which wait for the next step. It ends once no live episode is between
    two model calls (here every suspended episode waits on its agents' calls)."""
    import time

    runner = rollout._RUNTIME.episodes
    deadline = time.monotonic() + max_s
    while any(e.live and not e.pending for e in runner.episodes.values()):
        assert time.monotonic() < deadline, "an episode never made its next call"
        time.sleep(0.01)


@pytest.mark.parametrize("policy", ["april", "copris"])
def test_multi_agent_concurrent_calls_resumed_across_steps(real_stack, long_weights, long_models, agent_examples,
                                                           agent_example, refusals, tmp_path, policy):
    tokenizer = real_stack.tokenizer
    eos = tokenizer.eos_token_id
    agent_example(agent_examples, "examples.multi_agent.rollout_with_multi_agents")
    budgets = write_prompts(tmp_path / "problems.jsonl", tokenizer)
    weights = [str(long_weights[k % 2]) for k in range(MAX_STEPS)]
    v0 = real_stack.weight_version() + 1
    version_of = {k: v0 + k for k in range(MAX_STEPS)}
    models = {version_of[k]: long_models[weights[k]] for k in range(MAX_STEPS)}
    settings = {"april_policy": policy, "april_concurrency": 20, "april_over_sampling_factor": 2.0}
    args = plugin_args(real_stack, tmp_path / "job", settings=settings, batch=1, n=2, max_len=PER_CALL,
                       extra_argv=["--custom-generate-function-path", MULTI_AGENT,
                                   "--custom-rm-path", "tests.support.slime_examples.batch_reward",
                                   "--prompt-data", str(tmp_path / "problems.jsonl"),
                                   "--rollout-max-context-len", str(CONTEXT)])
    seen = {"steps": 0, "samples": 0, "resumed_samples": 0, "resumed_calls": 0, "suspended_calls": 0,
            "episodes_resumed_together": 0, "short_budget_samples": 0}
    trained: list[int] = []
    indices: set[int] = set()
    m = SlimeRolloutManager(args)
    try:
        for step in range(MAX_STEPS):
            if step >= MIN_STEPS and seen["episodes_resumed_together"]:
                break
            if step:
                pause_between_rollouts()
            real_stack.push_weights(weights[step], version_of[step])
            samples, metrics, train = m.generate(step)
            seen["steps"] += 1
            seen["resumed_calls"] += metrics["april/episodes/resumed_calls"]
            seen["suspended_calls"] += metrics["april/episodes/suspended"]
            assert metrics["april/policy_version"] == version_of[step]
            assert metrics["april/episodes/failures"] == 0 and metrics["april/episodes/failed_groups"] == 0
            assert train["tokens"] == [s.tokens for s in samples]
            assert train["rollout_log_probs"] == [s.rollout_log_probs for s in samples]
            assert train["loss_masks"] == [s.loss_mask for s in samples]
            episodes: dict[int, list] = {}
            for s in samples:
                episodes.setdefault(s.rollout_id, []).append(s)
            assert len(episodes) == args.rollout_batch_size * args.n_samples_per_prompt
            assert len({s.group_index for s in samples}) == args.rollout_batch_size
            for episode in episodes.values():
                assert len(episode) == AGENTS, f"step {step}: an episode returned {len(episode)} of {AGENTS} samples"
                resumed = 0
                for s in episode:
                    resumed += check_agent_sample(s, budgets, models, version_of[step], tokenizer, eos)
                    seen["short_budget_samples"] += budgets[s.prompt] < PER_CALL
                seen["samples"] += len(episode)
                seen["resumed_samples"] += resumed
                seen["episodes_resumed_together"] += resumed >= 2
                assert episode[0].rollout_id not in indices, f"episode {episode[0].rollout_id} trained again"
                indices.add(episode[0].rollout_id)
            trained += sorted({s.group_index for s in samples})
        end_buffered = {int(g.uid) for g in m.data_source.buffer.groups()}
        pointer = m.data_source._prompts.sample_group_index
        refused = list(refusals)  # shutting the job down stops its live episodes: their calls get 503
    finally:
        rollout.shutdown()
        real_stack.restore_weights()

    assert not refused, f"the front refused calls: {refused[:3]}"
    assert seen["samples"] == seen["steps"] * args.rollout_batch_size * args.n_samples_per_prompt * AGENTS
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert not set(trained) & end_buffered, "a trained group is still buffered"
    assert set(trained) | end_buffered == set(range(pointer)), "a prompt group was lost"
    assert seen["suspended_calls"] > 0 and seen["resumed_calls"] > 0, seen
    assert seen["episodes_resumed_together"] > 0, (
        f"no episode's concurrent calls were cut at a step's end and resumed under new weights: {seen}")
    print(f"multi_agent {policy}: {seen}")


def check_agent_sample(s, budgets: dict[str, int], models: dict[int, object], policy_version: int, tokenizer,
                       eos: int) -> bool:
    """One agent's sample: its call's prompt and whole output, exact log-probs per recorded version;
    returns whether the call was resumed under new weights (its tokens carry two versions)."""
    prompt_ids = tokenizer(s.prompt, add_special_tokens=False)["input_ids"]
    assert s.tokens[:len(prompt_ids)] == prompt_ids and len(s.tokens) == len(prompt_ids) + s.response_length
    assert s.loss_mask == [1] * s.response_length and len(s.rollout_log_probs) == s.response_length
    assert s.response_length == budgets[s.prompt] or s.tokens[-1] == eos, (
        f"sample {s.index}: {s.response_length} tokens of a {budgets[s.prompt]}-token budget")
    assert "</think>" not in s.response, "a solver answered: the episode would go on to its rewriters"
    assert s.reward is not None
    versions = [v for v, c in s.train_metadata[TOKEN_VERSIONS_KEY] for _ in range(c)]
    assert len(versions) == s.response_length and set(versions) <= set(models) and max(versions) <= policy_version
    assert versions == sorted(versions)
    for v in set(versions):
        expected = token_logprobs(models[v], s.tokens, s.response_length)
        for k, (got, want, tv) in enumerate(zip(s.rollout_log_probs, expected, versions)):
            if tv == v:
                assert abs(got - want) < LOGPROB_TOLERANCE, (
                    f"sample {s.index} token {k} (version {v}): rollout {got} vs transformers {want}")
    return len(set(versions)) > 1


@pytest.mark.parametrize("policy", ["april", "copris"])
def test_tau_bench_is_refused_in_its_first_step(real_stack, agent_examples, agent_example, monkeypatch, tmp_path,
                                                policy):
    from tests.support import tau_bench_standin

    tau_bench_standin.install(monkeypatch)
    agent_example(agent_examples / "examples" / "tau-bench", "generate_with_tau")
    prompts = tmp_path / "tasks.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": str(i), "label": ""}) + "\n" for i in range(64)))
    settings = {"april_policy": policy, "april_concurrency": 8, "april_over_sampling_factor": 2.0}
    args = plugin_args(real_stack, tmp_path / "job", settings=settings, batch=2, n=2, max_len=32,
                       extra_argv=["--custom-generate-function-path", "generate_with_tau.generate",
                                   "--prompt-data", str(prompts)])
    m = SlimeRolloutManager(args)
    try:
        with pytest.raises(Exception) as refused:
            m.generate(0)  # slime's trainer gets nothing to train: the step raises
        buffered = {int(g.uid) for g in m.data_source.buffer.groups()}
        pointer = m.data_source._prompts.sample_group_index
    finally:
        rollout.shutdown()
        real_stack.wait_idle()
    message = str(refused.value)
    assert "generate_with_tau.generate cannot run under the plugin" in message and "\n" not in message, message
    assert "no rollout_log_probs" in message, message
    assert sum(len(steps) for steps in tau_bench_standin.STEPS.values()) > 0, "the environment never stepped"
    assert pointer > 0 and buffered == set(range(pointer)), "a prompt group was lost"
