"""Acceptance: slime's own multi-turn example functions, unedited, run as episodes of the plugin.

slime ships two agent functions for ``--custom-generate-function-path``: ``examples/search-r1``
(``generate_with_search.generate``: text prompts, retrieval between turns) and ``examples/retool``
(``generate_with_retool.generate``: token-id prompts, a code sandbox between turns). They are what a
slime user points the plugin at, so they must run under partial rollout exactly as they are: here
they are extracted from slime's examples tarball (pinned commit, ``../shared/third_party/``; the
``APRIL_SLIME_EXAMPLES_TARBALL`` variable overrides the path), put on ``sys.path`` so that their
sibling imports work, and loaded by slime's path, with only their module-level configuration set:
search-r1's retrieval URL points at a stub server answering as ``local_search_server`` expects,
retool's ``max_turns`` is cut to keep the test short.

The emulated engines emit random token ids, so the functions never see their tags: every turn takes
the "invalid action" branch, whose observation the function appends as non-trainable tokens before
the next call. That is the point: multi-turn samples with observation tokens between model calls,
through slime's own ``post`` (httpx), ``GenerateState`` and ``Sample.append_response_tokens``, while
the plugin aborts calls at a step's target and resumes them in the next step under the function.
Two things of the emulated engines are set for it (``agent_cluster``): responses stop at a constant
per-token rate, so calls often end inside their short budget and the functions take further turns,
and search-r1's stop strings, which no emulated token can match, are taken out before the emulator
(which refuses ``stop``) parses the request.

Needs the real slime (the functions import ``slime.rollout.sglang_rollout.GenerateState`` and
``slime.utils.http_utils.post``), and jinja2 and psutil for retool.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from april_slime import rollout
from april_slime.core.keys import TOKEN_VERSIONS_KEY
from tests.support.slime_examples import (
    AGENT_MODULES,
    AGENTS_TARBALL,
    EXAMPLE_MODULES,
    MULTI_AGENT,
    TARBALL,
    RetrievalStub,
    extract_agent_examples,
    extract_examples,
    mask_runs,
)
from tests.support.slime_jobs import Cluster, loop_run, make_args, point_at
from tests.support.slime_standin import real_slime_importable

pytestmark = pytest.mark.skipif(not real_slime_importable(),
                                reason="slime's example functions import the real slime "
                                       "(slime.rollout.sglang_rollout.GenerateState, slime.utils.http_utils.post)")

MAX_RESPONSE_LEN = 24  # per model call: the functions pass rollout_max_response_len on as max_new_tokens
RETOOL_MAX_TURNS = 3
DECODED_CHARS = set("0123456789 ")  # what the toy tokenizer decodes any token ids to
STEPS, MAX_STEPS = 3, 12  # steps run; more (bounded) only if no call was aborted and resumed in the first ones


def fresh_imports(monkeypatch, root: Path, modules):
    """A fixture's body: yields ``add(folder, module)``, which puts ``root / folder`` on
    ``sys.path`` and imports ``module`` fresh; ``modules`` are dropped from ``sys.modules`` before
    and after."""

    def add(folder: str, module: str):
        monkeypatch.syspath_prepend(str(root / folder))
        return importlib.import_module(module)

    for name in modules:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield add
    for name in modules:
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> Path:
    """slime's ``examples/`` folder (search-r1 and retool), extracted unedited from the tarball."""
    if not TARBALL.is_file():
        pytest.skip(f"slime's examples tarball is not at {TARBALL} (set APRIL_SLIME_EXAMPLES_TARBALL)")
    return extract_examples(tmp_path_factory.mktemp("slime-examples"))


@pytest.fixture
def example_path(examples, monkeypatch):
    """Puts an example's folder on ``sys.path`` and imports its module fresh (its module-level
    configuration and semaphores are per test); the modules are dropped again afterwards."""
    yield from fresh_imports(monkeypatch, examples, EXAMPLE_MODULES)


@pytest.fixture
def slime_client(slime_mode):
    """What slime's ``RolloutManager`` sets up for generate functions: its HTTP client
    (``init_http_client``, which ``post`` uses) and no ``GenerateState`` left from another job (it is a
    process-wide singleton built from the first caller's arguments). Both are restored afterwards."""
    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils import http_utils

    saved_state = GenerateState._instances.pop(GenerateState, None)
    saved = (http_utils._http_client, http_utils._client_concurrency)
    http_utils._http_client = None

    def init(args) -> None:
        http_utils.init_http_client(args)

    yield init
    rollout.shutdown()  # the episodes' pending requests end before the client closes
    client = http_utils._http_client
    if client is not None:
        loop_run(client.aclose())
    http_utils._http_client, http_utils._client_concurrency = saved
    GenerateState._instances.pop(GenerateState, None)
    if saved_state is not None:
        GenerateState._instances[GenerateState] = saved_state


def ignore_unmatchable_stop_strings(monkeypatch) -> None:
    """Let the emulated engines take the stop strings search-r1 sets (``</search>``, ``</answer>``).

    The emulator refuses ``sampling_params.stop`` (it stops on EOS only, and does not know the
    tokenizer). Its token ids decode, with the jobs' toy tokenizer, to digits and spaces only, so a
    stop string holding any other character can never match: SGLang would generate exactly what it
    generates without it. Such strings are taken out before the emulator parses the request; any
    other stop string is still refused."""
    from april_workbench.emulator import server

    parse = server.parse_generate

    def parse_generate(payload, vocab_size):
        params = payload.get("sampling_params") if isinstance(payload, dict) else None
        stop = params.get("stop") if isinstance(params, dict) else None
        stops = [stop] if isinstance(stop, str) else stop
        if stops and isinstance(stops, list) and all(isinstance(s, str) and set(s) - DECODED_CHARS for s in stops):
            payload = {**payload, "sampling_params": {k: v for k, v in params.items() if k != "stop"}}
        return parse(payload, vocab_size)

    monkeypatch.setattr(server, "parse_generate", parse_generate)


def _agent_cluster(monkeypatch, replay=None) -> Cluster:
    """Emulated engines whose responses stop at a constant per-token rate (Weibull shape 1): a model
    call often stops (EOS) inside its short budget, whatever its prompt's length, so the functions go on
    to their next turn; the default length model measures from position 0 and would end the long
    multi-turn prompts at once or never."""
    from april_workbench.emulator.model import LengthModel

    ignore_unmatchable_stop_strings(monkeypatch)

    c = Cluster(length=LengthModel(median_tokens=20.0, prompt_sigma=0.3, sample_sigma=0.2, shape=1.0,
                                   truncation_fraction=0.0), replay=replay)
    c.bump(1)
    return c


@pytest.fixture
def agent_cluster(slime_mode, monkeypatch):
    c = _agent_cluster(monkeypatch)
    yield c
    rollout.shutdown()
    c.stop()


@pytest.fixture
def top_p_agent_cluster(slime_mode, monkeypatch):
    """The same engines, also returning top-p kept ids as SGLang with slime's top-p patch does."""
    from april_workbench.emulator.replay import EmulatedReplay

    c = _agent_cluster(monkeypatch, EmulatedReplay(top_p_ids=True))
    yield c
    rollout.shutdown()
    c.stop()


@pytest.fixture
def retrieval():
    """The stub retrieval server for search-r1's ``search_url`` (not its default port 8000): a search
    action, were one decoded, would get passages as from the real server."""
    stub = RetrievalStub()
    yield stub
    stub.close()


def write_prompts(tmp_path: Path, label) -> Path:
    """64 short questions (a step takes a few), each with ``label(i)`` in the example's label format."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Question {i}: who wrote book {i}?", "label": label(i)}) + "\n"
                            for i in range(64)))
    return path


def job_args(tmp_path, prompts, cluster, policy: str, **settings):
    """slime's arguments for a job of the example function, with what ``GenerateState`` and the
    functions read from a real slime job's arguments (engines, server concurrency, context budget)."""
    settings.setdefault("rollout_max_context_len", None)
    args = make_args(
        tmp_path, prompts, april_policy=policy, april_concurrency=8, rollout_batch_size=2, n_samples_per_prompt=2,
        over_sampling_batch_size=2, rollout_max_response_len=MAX_RESPONSE_LEN,
        rollout_num_engines=2, sglang_server_concurrency=64, sglang_dp_size=None, use_distributed_post=False,
        context_parallel_size=1, max_tokens_per_gpu=16384, **settings)
    return point_at(args, cluster)


def expand(runs) -> list[int]:
    return [v for v, c in runs for _ in range(c)]


def check_sample(s, observations: list[list[int]], max_turns: int) -> int:
    """slime's contract and the plugin's data on one trained sample; returns its observation count.

    * status COMPLETED or TRUNCATED; loss mask, response and rollout log-probs of one length;
    * every span the mask leaves out is exactly one of the function's observations (as its tokenizer
      encodes it), between two model calls: observation tokens are never trained on;
    * at most ``max_turns`` model calls;
    * per-token policy versions (``train_metadata[TOKEN_VERSIONS_KEY]``) cover the response, none newer
      than the step's policy."""
    assert s.status.name in ("COMPLETED", "TRUNCATED"), s.status
    assert len(s.loss_mask) == s.response_length == len(s.rollout_log_probs)
    assert s.response_length > 0
    response = s.tokens[len(s.tokens) - s.response_length:]
    runs = mask_runs(s.loss_mask)
    model_runs = [r for r in runs if r[0] == 1]
    obs_runs = [r for r in runs if r[0] == 0]
    assert runs[0][0] == 1, "the response must begin with the model's tokens"
    assert 1 <= len(model_runs) <= max_turns
    for _, start, end in obs_runs:
        assert response[start:end] in observations, f"masked span {start}:{end} is no observation of the function"
        assert all(lp == 0.0 for lp in s.rollout_log_probs[start:end])
    versions = expand(s.train_metadata[TOKEN_VERSIONS_KEY])
    assert len(versions) == s.response_length
    assert all(1 <= v <= s.train_metadata["april_policy_version"] for v in versions)
    assert s.reward is not None
    return len(obs_runs)


def run_job(args, cluster, observations: list[list[int]], max_turns: int, check=None) -> dict:
    """``STEPS`` rollout steps (up to ``MAX_STEPS`` until a call was aborted and resumed), checking
    every trained sample (also with ``check``, when given); returns what the run saw."""
    source = rollout.AprilDataSource(args)
    trained: list[int] = []
    indices: set[int] = set()
    seen = {"resumed_calls": 0, "aborted_samples": 0, "observations": 0, "calls": 0, "samples": 0}
    for step in range(MAX_STEPS):
        if step >= STEPS and seen["resumed_calls"] + seen["aborted_samples"] > 0:
            break
        cluster.bump(step + 1)  # slime's weight update before each rollout
        out = rollout.generate_rollout(args, step, source)
        assert len(out.samples) == args.rollout_batch_size
        for group in out.samples:
            assert len(group) == args.n_samples_per_prompt
            trained.append(group[0].group_index)
            for s in group:
                assert s.index not in indices, f"sample {s.index} trained twice"
                indices.add(s.index)
                seen["observations"] += check_sample(s, observations, max_turns)
                if check is not None:
                    check(s)
                seen["aborted_samples"] += s.metadata["april_num_aborts"] > 0
                seen["samples"] += 1
        seen["resumed_calls"] += out.metrics["april/episodes/resumed_calls"]
        seen["calls"] += out.metrics["april/episodes/calls"]
        assert out.metrics["april/episodes/failures"] == 0, "the example function raised or its sample was unusable"
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert seen["observations"] > 0, "no sample went past its first model call"
    assert seen["resumed_calls"] + seen["aborted_samples"] > 0, "no call was aborted and resumed"
    return seen


def observation_tokens(args, texts: list[str]) -> list[list[int]]:
    """``texts`` as the functions tokenize their observations: ``GenerateState(args).tokenizer`` is
    what ``slime.rollout.sglang_rollout.load_tokenizer`` loads from ``args.hf_checkpoint``."""
    from slime.rollout import sglang_rollout

    tokenizer = sglang_rollout.load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
    return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]


async def _invalid_observation(module) -> str:
    """The observation the example appends after a turn without an action (its own code says it)."""
    obs, done = await module.execute_predictions("")
    assert not done and obs
    return obs


@pytest.mark.parametrize("policy", ["april", "copris"])
def test_search_r1_runs_unchanged(agent_cluster, retrieval, slime_client, example_path, tmp_path, policy):
    """search-r1 (text prompts, ``output["text"]``, its own stop strings) over 3+ steps: two turns
    with the "invalid action" observation between them, calls aborted at the target and resumed."""
    search = example_path("search-r1", "generate_with_search")
    search.SEARCH_R1_CONFIGS["local"]["search_url"] = retrieval.url
    prompts = write_prompts(tmp_path, lambda i: {"ground_truth": {"target": [f"author {i}"]}})
    args = job_args(tmp_path, prompts, agent_cluster, policy,
                    custom_generate_function_path="generate_with_search.generate",
                    custom_rm_path="generate_with_search.reward_func")
    slime_client(args)
    # the stub answers the example's own search() as its local_search_server expects
    assert "Doc 1(Title: \"Doc 0\")" in loop_run(search.search("who wrote book 1"))
    invalid = loop_run(_invalid_observation(search))
    observations = observation_tokens(args, [invalid])
    seen = run_job(args, agent_cluster, observations, search.SEARCH_R1_CONFIGS["max_turns"])
    assert seen["calls"] > seen["samples"]


@pytest.mark.parametrize("policy", ["april", "copris"])
def test_retool_runs_unchanged(agent_cluster, slime_client, example_path, tmp_path, policy):
    """retool (token-id prompts built with its jinja2 template, ``append_response_tokens`` with the
    engine's meta_info) over 3+ steps: up to ``RETOOL_MAX_TURNS`` turns with observations between."""
    pytest.importorskip("jinja2", reason="slime's retool example needs jinja2 (its prompt template)")
    pytest.importorskip("psutil", reason="slime's retool example needs psutil (its tool_sandbox)")
    retool = example_path("retool", "generate_with_retool")
    retool.TOOL_CONFIGS["max_turns"] = RETOOL_MAX_TURNS
    prompts = write_prompts(tmp_path, lambda i: str(i))
    args = job_args(tmp_path, prompts, agent_cluster, policy,
                    custom_generate_function_path="generate_with_retool.generate",
                    custom_rm_path="generate_with_retool.reward_func", reward_key="score")
    slime_client(args)
    invalid = loop_run(_invalid_observation(retool))
    observations = observation_tokens(args, [invalid])
    seen = run_job(args, agent_cluster, observations, RETOOL_MAX_TURNS)
    assert seen["calls"] > seen["samples"]


def check_top_p_kept_ids(s) -> None:
    """slime's top-p replay fields over a multi-turn sample: one kept set per response token, the
    model's tokens each in theirs (the emulated engine keeps the sampled token first), none for an
    observation's tokens (slime's own padding)."""
    offsets, ids = s.rollout_top_p_token_offsets.tolist(), s.rollout_top_p_token_ids.tolist()
    assert len(offsets) == s.response_length + 1 and offsets[0] == 0 and offsets[-1] == len(ids)
    response = s.tokens[len(s.tokens) - s.response_length:]
    for k, (m, token) in enumerate(zip(s.loss_mask, response)):
        kept = ids[offsets[k]:offsets[k + 1]]
        assert (kept[:1] == [token]) if m else kept == [], f"token {k} (mask {m}): kept ids {kept}"


def test_retool_keeps_every_calls_top_p_kept_ids(top_p_agent_cluster, slime_client, example_path, tmp_path):
    """retool with --rollout-top-p 0.9 under copris: its calls are aborted and resumed, and every trained
    sample carries the kept ids of each of its model tokens, stitched over the segments of each call."""
    pytest.importorskip("jinja2", reason="slime's retool example needs jinja2 (its prompt template)")
    pytest.importorskip("psutil", reason="slime's retool example needs psutil (its tool_sandbox)")
    retool = example_path("retool", "generate_with_retool")
    retool.TOOL_CONFIGS["max_turns"] = RETOOL_MAX_TURNS
    prompts = write_prompts(tmp_path, lambda i: str(i))
    args = job_args(tmp_path, prompts, top_p_agent_cluster, "copris", rollout_top_p=0.9,
                    custom_generate_function_path="generate_with_retool.generate",
                    custom_rm_path="generate_with_retool.reward_func", reward_key="score")
    slime_client(args)
    observations = observation_tokens(args, [loop_run(_invalid_observation(retool))])
    run_job(args, top_p_agent_cluster, observations, RETOOL_MAX_TURNS, check=check_top_p_kept_ids)


# ------------------------------------------------------------------ multi_agent and tau-bench
@pytest.fixture(scope="module")
def agent_examples(tmp_path_factory) -> Path:
    """The folder holding slime's ``examples/multi_agent`` and ``examples/tau-bench``, unedited."""
    if not AGENTS_TARBALL.is_file():
        pytest.skip(f"slime's agent examples tarball is not at {AGENTS_TARBALL}")
    return extract_agent_examples(tmp_path_factory.mktemp("slime-agent-examples"))


@pytest.fixture
def agent_example(agent_examples, monkeypatch):
    """Puts ``<folder>`` of the agent examples (``.``: the folder holding ``examples/``) on
    ``sys.path`` and imports ``module`` fresh; the modules are dropped again afterwards."""
    from slime.utils.misc import load_function

    load_function.cache_clear()  # slime caches by path the functions of modules imported before
    yield from fresh_imports(monkeypatch, agent_examples, AGENT_MODULES)
    load_function.cache_clear()


def pause_between_rollouts(max_s: float = 60.0) -> None:
    """slime's training step between two rollouts: the episodes go on and make their next calls,
    which wait for the next step. It ends once no live episode is between two model calls."""
    import time

    runner = rollout._RUNTIME.episodes
    deadline = time.monotonic() + max_s
    while any(e.live and not e.pending for e in runner.episodes.values()):
        assert time.monotonic() < deadline, "an episode never made its next call"
        time.sleep(0.01)


@pytest.mark.parametrize("policy", ["sync", "april", "copris"])
def test_multi_agent_returns_every_agents_sample(agent_cluster, slime_client, agent_example, monkeypatch,
                                                 tmp_path, policy):
    """slime's multi_agent: five solver agents call the model at once (``asyncio.gather``) in one
    episode; each agent's call is scheduled like a sequential one (aborted and resumed too: the
    episodes test, with a function of the same shape), also across the pause between rollouts, and
    every episode returns all five samples, each with its call's exact per-token versions. (The
    emulated engines never write ``</think>``, so no solver answer is parsed and the episode ends
    after its solvers, as slime's code does then.)"""
    from april_slime.core.episodes import EpisodeRunner
    from tests.support.slime_standin import ToyTokenizer

    concurrent = []  # calls of its episode open when each call finished, itself included
    call_finished = EpisodeRunner.call_finished

    def recording(self, t):
        concurrent.append(len(self.calls[t.uid].episode.pending))
        call_finished(self, t)

    monkeypatch.setattr(EpisodeRunner, "call_finished", recording)
    module = agent_example(".", "examples.multi_agent.rollout_with_multi_agents")
    # it loads its tokenizer with transformers from hf_checkpoint: here the jobs' toy tokenizer
    monkeypatch.setattr(module, "AutoTokenizer", type("Toy", (), {"from_pretrained": staticmethod(
        lambda *a, **k: ToyTokenizer())}))
    agents = module.MULTI_AGENT_CONFIGS["num_parallel"]
    prompts = write_prompts(tmp_path, lambda i: str(i))
    args = job_args(tmp_path, prompts, agent_cluster, policy, custom_generate_function_path=MULTI_AGENT,
                    custom_rm_path="tests.support.slime_examples.batch_reward", rollout_max_context_len=4096)
    slime_client(args)
    source = rollout.AprilDataSource(args)
    trained = 0
    for step in range(STEPS):
        agent_cluster.bump(step + 1)
        out = rollout.generate_rollout(args, step, source)
        assert out.metrics["april/episodes/failures"] == 0
        for group in out.samples:
            assert len(group) == args.n_samples_per_prompt
            for episode in group:
                assert len(episode) == agents, f"an episode returned {len(episode)} of its {agents} samples"
                assert len({s.rollout_id for s in episode}) == 1
                for s in episode:
                    assert s.loss_mask == [1] * s.response_length == [1] * len(s.rollout_log_probs)
                    versions = expand(s.train_metadata[TOKEN_VERSIONS_KEY])
                    assert len(versions) == s.response_length
                    assert all(1 <= v <= s.train_metadata["april_policy_version"] for v in versions)
                    trained += 1
        pause_between_rollouts()
    assert trained == STEPS * args.rollout_batch_size * args.n_samples_per_prompt * agents
    assert max(concurrent) > 1, "the agents' calls were never open at once"


@pytest.mark.parametrize("policy", ["april", "copris"])
def test_tau_bench_is_refused_at_its_first_sample(agent_cluster, slime_client, agent_example, monkeypatch,
                                                  tmp_path, policy):
    """slime's tau-bench runs under the plugin (string statuses taken as slime takes them) and its
    first sample stops the job with one line saying why: it carries no rollout_log_probs, and its
    trainable tokens are its conversation re-tokenized, not the tokens the engine served, so no
    per-token log-prob or policy version can be given to them. The ``tau_bench`` package is the
    stand-in's; its environment saw the function's actions."""
    from slime.rollout import sglang_rollout

    from tests.support import tau_bench_standin

    pytest.importorskip("sglang.srt.function_call.function_call_parser",
                        reason="tau-bench parses tool calls with SGLang's parser")
    tau_bench_standin.install(monkeypatch)
    monkeypatch.setattr(sglang_rollout, "load_tokenizer", lambda *a, **k: tau_bench_standin.ChatToyTokenizer())
    agent_example("examples/tau-bench", "generate_with_tau")
    prompts = tmp_path / "tasks.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": str(i), "label": ""}) + "\n" for i in range(64)))
    args = job_args(tmp_path, prompts, agent_cluster, policy,
                    custom_generate_function_path="generate_with_tau.generate")
    slime_client(args)
    with pytest.raises(Exception) as refused:
        rollout.generate_rollout(args, 0, rollout.AprilDataSource(args))
    message = str(refused.value)
    assert "generate_with_tau.generate cannot run under the plugin" in message and "\n" not in message, message
    assert "no rollout_log_probs" in message
    assert sum(len(steps) for steps in tau_bench_standin.STEPS.values()) > 0, "the environment never stepped"
