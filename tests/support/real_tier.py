"""The real tier's shared pieces (``tests/real``): whether the tier can run, the shared stack of
engines behind the router (``RealStack``; ``tests/real/conftest.py`` owns the session fixture that
starts it), slime job arguments for the plugin against it, probes of the engines' progress and
events placed inside running requests (``Placement``), and slime's sample contract as the trainer
relies on it (``check_slime_contract``, ``check_multi_turn_contract``).

Nothing here starts engines or needs them at import: where the tier cannot run,
``tests/real/conftest.py`` still imports this module to say why.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from april_slime.core.keys import TOKEN_VERSIONS_KEY
from april_workbench.localstack import LocalStack, local_stack, real_stack_missing  # noqa: F401  (for the tests)
from april_workbench.rollout_manager import SlimeRolloutManager, slime_args  # noqa: F401  (for the tests)
from april_workbench.tiny_qwen3 import build_tiny_qwen3  # noqa: F401  (for the tests)

# The tiny model's shape: long-tailed lengths at temperature 1 (EOS with probability ~1/24 per
# token), so budgets of a few dozen tokens mix finished and truncated samples.
EOS_RATE = 1 / 24
MAX_RUNNING_REQUESTS = 16
MAX_TOTAL_TOKENS = 32768
_WORKER_OUTCOMES = re.compile(r'^smg_worker_cb_outcomes_total\{[^}]*worker="(?P<worker>[^"]+)"[^}]*\}\s+(?P<count>\S+)')


def why_skipped() -> str | None:
    missing = real_stack_missing()
    if missing:
        return missing
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return "megatron-core is not installed; run `bash scripts/real-stack/setup.sh` and use its .venv"
    if importlib.util.find_spec("slime") is None:
        return ("slime is not installed: put THUDM/slime@624b824a8 in SLIME_DIR (or its tarball in "
                "../shared/third_party/) and rerun `bash scripts/real-stack/setup.sh`")
    return None


def real_tier_required() -> bool:
    """True in CI, where a real tier that cannot run is a failure rather than a skip."""
    return (os.environ.get("APRIL_REQUIRE_REAL", "") == "1"
            or os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"))


WHY_SKIPPED = why_skipped()
REQUIRED = real_tier_required()


# ------------------------------------------------------------------ the shared stack
def http_json(method: str, url: str, body: Any = None, timeout: float = 120.0) -> tuple[int, Any]:
    """One blocking HTTP call; the reply parsed as JSON (None for an empty body)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            status, raw = reply.status, reply.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    return status, (json.loads(raw) if raw.strip() else None)


@dataclass
class RealStack:
    """The session's engines and router, with the two models their weights can be."""

    stack: LocalStack
    model_path: Path  # the weights the engines start with
    other_model_path: Path  # same shape and tokenizer, other random weights (seed 1)
    _tokenizer: Any = field(default=None, repr=False)

    @property
    def router_url(self) -> str:
        return self.stack.router_url

    @property
    def engine_urls(self) -> list[str]:
        return list(self.stack.engine_urls)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    def weight_versions(self) -> list[int]:
        return [int(http_json("GET", f"{u}/model_info")[1]["weight_version"]) for u in self.engine_urls]

    def weight_version(self) -> int:
        """The engines' current weight version; they must agree (``restore_weights`` re-aligns
        them after a test that updated one engine only)."""
        versions = self.weight_versions()
        assert len(set(versions)) == 1, f"engines disagree on the weight version: {versions}"
        return versions[0]

    def push_weights(self, model_path: str | os.PathLike, version: int) -> None:
        """What slime's disk-based weight update does: once the engines are idle (SGLang refuses to
        flush its cache while a request is on an engine; slime's abort likewise polls the engines
        until idle), every engine loads ``model_path`` and reports ``version`` from then on."""
        self.wait_idle()
        for url in self.engine_urls:
            status, reply = http_json("POST", f"{url}/update_weights_from_disk",
                                      {"model_path": str(model_path), "weight_version": str(version)})
            assert status == 200 and reply["success"], reply

    def restore_weights(self) -> int:
        """Every engine back to the starting weights, under one fresh version; returns it."""
        version = max(self.weight_versions()) + 1
        self.push_weights(self.model_path, version)
        return version

    def router_answered(self) -> Counter:
        """How many requests each engine has answered through the router since it started (its
        Prometheus counter ``smg_worker_cb_outcomes_total``, by worker, every outcome)."""
        if self.stack.router is None:
            raise RuntimeError("the stack's router is not this session's own (APRIL_REAL_REUSE): no metrics to read")
        with urllib.request.urlopen(self.stack.router.metrics_url, timeout=30) as reply:
            text = reply.read().decode()
        answered: Counter = Counter({url: 0 for url in self.engine_urls})
        for line in text.splitlines():
            match = _WORKER_OUTCOMES.match(line)
            if match:
                answered[match["worker"].rstrip("/")] += int(float(match["count"]))
        return answered

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            loads = [http_json("GET", f"{u}/v1/loads")[1]["loads"] for u in self.engine_urls]
            busy = sum(load["num_running_reqs"] + load["num_waiting_reqs"] for per in loads for load in per)
            if busy == 0:
                return
            assert time.monotonic() < deadline, f"engines still busy after {timeout_s} s: {loads}"
            time.sleep(0.2)


SGLANG_0515 = "0.5.15.post1"


def sglang_0515_python() -> str:
    """The interpreter serving SGLang 0.5.15.post1 (named in ``.venv/sglang-0.5.15.post1-python``);
    skips (fails in CI) saying how to build it."""
    import pytest

    from tests.support import ROOT

    pointer = ROOT / ".venv" / f"sglang-{SGLANG_0515}-python"
    fix = "run `bash scripts/real-stack/setup.sh`, which builds it"
    if not pointer.exists():
        pytest.skip(f"no SGLang {SGLANG_0515} layer ({pointer} is missing); {fix}")
    python = Path(pointer.read_text(encoding="utf-8").strip())
    if not python.exists():
        pytest.skip(f"the SGLang {SGLANG_0515} interpreter {python} named in {pointer} is gone; {fix}")
    return str(python)


def write_prompts(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` arithmetic prompts in slime's jsonl format (``prompt`` / ``label``)."""
    import random

    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            f.write(json.dumps({"prompt": f"Question: what is {a} + {b}? Answer:", "label": str(a + b)}) + "\n")
    return path


def plugin_args(stack: RealStack, tmp_path: Path, *, settings: dict[str, Any] | None = None,
                batch: int = 4, n: int = 2, max_len: int = 32, prompts: int = 64,
                reward: str = "length_parity_reward", extra_argv: list[str] = (), **overrides: Any):
    """slime arguments of a job using the plugin against ``stack``'s router: real slime parser,
    ``--custom-config-path`` YAML for the ``april_*`` settings, rewards from this module."""
    import yaml

    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "april.yaml"
    config.write_text(yaml.safe_dump(settings or {}), encoding="utf-8")
    host, port = stack.router_url.removeprefix("http://").rsplit(":", 1)
    argv = [
        "--rollout-function-path", "april_slime.rollout.generate_rollout",
        "--data-source-path", "april_slime.rollout.AprilDataSource",
        "--custom-config-path", str(config),
        "--hf-checkpoint", str(stack.model_path),
        "--prompt-data", str(write_prompts(tmp_path / "prompts.jsonl", prompts)),
        "--input-key", "prompt", "--label-key", "label",
        "--rollout-batch-size", str(batch), "--n-samples-per-prompt", str(n),
        "--rollout-max-response-len", str(max_len), "--rollout-temperature", "1.0",
        "--num-rollout", "1000", "--custom-rm-path", f"{__name__}.{reward}",
        "--sglang-router-ip", host, "--sglang-router-port", port,
        "--save", str(tmp_path / "ckpt"),
        # one GPU per engine in slime's accounting: how it counts the engines behind the router
        "--rollout-num-gpus", str(len(stack.engine_urls)), "--rollout-num-gpus-per-engine", "1",
        *extra_argv,
    ]
    return slime_args(argv, **overrides)


async def length_parity_reward(args, sample, **kwargs) -> float:
    """A reward that varies within a group, so GRPO-style normalization has something to do."""
    return float(sample.response_length % 2)


# ------------------------------------------------------------------ events placed inside requests
# Tests that need something to happen *while* requests run (an abort, a weight update) do not sleep
# and hope: they read the engines' progress from ``/v1/loads`` (requests running, KV tokens in
# use) until the requests provably hold tokens and are not finished, act then, and afterwards
# check from the samples' recorded versions that the event did land where it should. Requests are
# made long enough (a large budget, weights that almost never sample EOS) that "not finished yet"
# holds with a wide margin whatever the machine's speed.
PROGRESS_DEADLINE_S = 180.0


def engine_loads(urls: list[str]) -> list[dict]:
    return [http_json("GET", f"{u}/v1/loads")[1]["loads"][0] for u in urls]


def wait_for_progress(urls: list[str], *, running: int, tokens_each: int, prompt_tokens: int,
                      deadline_s: float = PROGRESS_DEADLINE_S, stop: Any = None) -> list[dict]:
    """Poll ``urls`` until at least ``running`` requests are running on them (none waiting) and
    their KV tokens in use show at least ``tokens_each`` generated tokens per request on average,
    counting ``prompt_tokens`` (an upper bound of one prompt's length) for each request's prompt
    even where prompts share a cached prefix: the estimate of generated tokens is low, but for the
    slot SGLang allocates for a request's next token before computing it (a token or two per
    request; callers keep a margin for it). Returns the loads seen.
    Fails naming the last loads at the deadline, or at once when ``stop`` (a ``threading.Event``)
    is set: the caller gave up, and an event placed later would land in the wrong place."""
    deadline = time.monotonic() + deadline_s
    while True:
        assert stop is None or not stop.is_set(), "stopped: the requests being waited for are gone"
        loads = engine_loads(urls)
        n_running = sum(load["num_running_reqs"] for load in loads)
        n_waiting = sum(load["num_waiting_reqs"] for load in loads)
        generated = sum(load["num_used_tokens"] for load in loads) - n_running * prompt_tokens
        if n_running >= running and n_waiting == 0 and generated >= n_running * tokens_each:
            return loads
        assert time.monotonic() < deadline, (
            f"no moment with {running} requests running and {tokens_each} tokens generated each within "
            f"{deadline_s:.0f} s; last loads: running {n_running}, waiting {n_waiting}, about {generated} "
            "generated tokens")
        time.sleep(0.01)


class Placement:
    """``act()`` run in a thread of its own at the first moment ``wait_for_progress(urls,
    **progress)`` sees, while the caller runs the requests; ``finish()`` once they are over says
    whether it acted. A lone tiny-model request decodes hundreds of tokens a second, so on a
    starved machine a poll can miss a step's requests whole: then nothing was done and ``finish()``
    returns False (the caller tries again with new requests, a bounded number of times). Any other
    failure, the deadline included, is raised by ``finish()``."""

    def __init__(self, urls: list[str], act, **progress: Any) -> None:
        import threading

        self.stop, self.placed, self.error = threading.Event(), False, None
        self.thread = threading.Thread(target=self._run, args=(urls, act, progress), daemon=True)
        self.thread.start()

    def _run(self, urls: list[str], act, progress: dict) -> None:
        try:
            wait_for_progress(urls, stop=self.stop, **progress)
        except AssertionError as e:
            if not self.stop.is_set():
                self.error = e
            return
        except BaseException as e:  # noqa: BLE001  (re-raised by finish)
            self.error = e
            return
        try:
            act()
            self.placed = True
        except BaseException as e:  # noqa: BLE001  (re-raised by finish)
            self.error = e

    def finish(self) -> bool:
        self.stop.set()
        self.thread.join()
        if self.error is not None:
            raise AssertionError(f"placing the event inside the requests failed: {self.error!r}") from self.error
        return self.placed


def prompt_token_bound(stack: RealStack, prompts_jsonl: Path) -> int:
    """The longest prompt of a jsonl prompt file, in tokens."""
    lines = Path(prompts_jsonl).read_text(encoding="utf-8").splitlines()
    return max(len(stack.tokenizer.encode(json.loads(line)["prompt"], add_special_tokens=False))
               for line in lines if line.strip())


def post_ok(url: str, body: Any) -> Any:
    status, reply = http_json("POST", url, body)
    assert status == 200, (url, reply)
    return reply


def pause_in_place(urls: list[str]) -> None:
    """SGLang's in-place pause: running requests stay where they are, no token is computed until
    ``continue_generation``, new requests wait."""
    for url in urls:
        post_ok(f"{url}/pause_generation", {"mode": "in_place"})


def continue_generation(urls: list[str]) -> None:
    for url in urls:
        post_ok(f"{url}/continue_generation", {})


def abort_and_hold(urls: list[str]) -> None:
    """SGLang's abort pause: every running request is aborted (its reply carries the tokens it
    has) and new requests wait until ``continue_generation``; returns once nothing runs."""
    for url in urls:
        post_ok(f"{url}/pause_generation", {"mode": "abort"})


def load_weights(urls: list[str], model_path: str | os.PathLike, version: int, flush_cache: bool = True) -> None:
    """``/update_weights_from_disk`` under ``version``; on a paused engine it applies at once."""
    for url in urls:
        reply = post_ok(f"{url}/update_weights_from_disk", {"model_path": str(model_path),
                                                            "weight_version": str(version),
                                                            "flush_cache": flush_cache})
        assert reply["success"], reply


def version_spans(sample) -> list[tuple[int, int]]:
    """The per-token version runs the plugin recorded for a slime sample."""
    return [(int(v), int(c)) for v, c in sample.train_metadata[TOKEN_VERSIONS_KEY]]


# ------------------------------------------------------------------ slime's sample contract
def check_slime_contract(samples, train, *, tokenizer, batch: int, n: int, max_len: int, prompt_of) -> None:
    """What slime's trainer relies on, checked sample by sample (rewards from ``length_parity_reward``;
    ``train``: slime's train data of ``samples``)."""
    from slime.utils.types import Sample

    eos = tokenizer.eos_token_id
    _check_groups(samples, batch, n)
    for s in samples:
        prompt_ids = tokenizer.encode(prompt_of(s), add_special_tokens=False)
        response = s.tokens[len(prompt_ids):]
        assert s.tokens[:len(prompt_ids)] == prompt_ids
        assert len(response) == s.response_length == len(s.rollout_log_probs) == len(s.loss_mask)
        assert 0 < s.response_length <= max_len
        assert s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED), s.status
        if s.status == Sample.Status.COMPLETED:
            assert response[-1] == eos, "COMPLETED ends with EOS (the model's only stop)"
            assert eos not in response[:-1], "a stop inside the response: two responses trained as one"
        else:
            assert s.response_length == max_len and eos not in response
        assert all(math.isfinite(lp) and lp <= 0 for lp in s.rollout_log_probs)
        assert s.response == tokenizer.decode(response)
        _check_versions(s)
        assert s.reward == float(s.response_length % 2)
    _check_train_data(samples, train, [[1] * s.response_length for s in samples])


def check_multi_turn_contract(samples, train, *, batch: int, n: int, prompt_ids_of) -> None:
    """What slime's trainer relies on, for samples a multi-turn generate function made
    (``prompt_ids_of(s)``: the prompt tokens the function built): the response begins with model
    tokens; the loss mask is 0/1, one per response token; model tokens have finite log-probs <= 0,
    masked (tool) tokens the function's 0.0; per-call and per-token versions; a reward."""
    from slime.utils.types import Sample

    _check_groups(samples, batch, n)
    for s in samples:
        prompt_ids = prompt_ids_of(s)
        assert s.tokens[:len(prompt_ids)] == prompt_ids, f"sample {s.index}: the tokens do not begin with its prompt"
        assert len(s.tokens) - len(prompt_ids) == s.response_length == len(s.rollout_log_probs) == len(s.loss_mask)
        assert s.response_length > 0 and s.loss_mask[0] == 1 and set(s.loss_mask) <= {0, 1}
        assert s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED), s.status
        for lp, keep in zip(s.rollout_log_probs, s.loss_mask):
            assert (math.isfinite(lp) and lp <= 0) if keep else lp == 0.0
        _check_versions(s)
        assert s.reward is not None
    _check_train_data(samples, train, [s.loss_mask for s in samples])


def _check_groups(samples, batch: int, n: int) -> None:
    assert len(samples) == batch * n
    groups = [samples[i:i + n] for i in range(0, len(samples), n)]
    assert len({g[0].group_index for g in groups}) == batch
    for group in groups:
        assert len({s.group_index for s in group}) == 1, "a group's samples are consecutive"
    assert [s.index for s in samples] == sorted(s.index for s in samples), "sorted by index as slime sorts"
    assert len({s.index for s in samples}) == len(samples)


def _check_versions(s) -> None:
    assert s.weight_versions and all(str(int(v)) == v for v in s.weight_versions)
    runs = s.train_metadata[TOKEN_VERSIONS_KEY]
    assert sum(c for _, c in runs) == s.response_length


def _check_train_data(samples, train, loss_masks: list[list[int]]) -> None:
    assert train["tokens"] == [s.tokens for s in samples]
    assert train["rollout_log_probs"] == [s.rollout_log_probs for s in samples]
    assert train["loss_masks"] == loss_masks
    assert train["metadata"] == [s.train_metadata for s in samples]


# float32 CPU engine vs float32 transformers; measured differences are ~3e-6
LOGPROB_TOLERANCE = 1e-4


def load_hf_models(stack: RealStack) -> dict[str, Any]:
    """The stack's two weight sets in transformers, "A" (what it starts with) and "B"."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    return {"A": load(stack.model_path), "B": load(stack.other_model_path)}


def steps_across_weight_pushes(stack: RealStack, manager, hf_models: dict[str, Any], *, check_step,
                               temperature: float = 1.0, least: int = 3, most: int = 8) -> tuple[int, int]:
    """Rollout steps of ``manager`` (a ``SlimeRolloutManager``) with weights B and A pushed in turn
    under new integer versions before every step but the first: ``least`` steps, and more (``most``
    in all) until a trained sample holds tokens of two versions, since a fast engine can end every
    request of a step before its target aborts one with tokens. ``check_step(samples, train)``
    checks each step's batch; here every token's version is one the step could have seen and its
    log-prob the one transformers computes under that version's weights. Returns (steps run,
    samples that span versions); the weights are put back either way."""
    v0 = stack.weight_version()
    weights_of = {v0 + k: "AB"[k % 2] for k in range(most)}
    steps = mixed = 0
    try:
        for step, version in enumerate(weights_of):
            if step >= least and mixed:
                break
            if version != v0:
                stack.push_weights(stack.other_model_path if weights_of[version] == "B" else stack.model_path,
                                   version)
            samples, metrics, train = manager.generate(step)
            steps += 1
            assert metrics["april/policy_version"] == version
            check_step(samples, train)
            for s in samples:
                versions = [v for v, c in s.train_metadata[TOKEN_VERSIONS_KEY] for _ in range(c)]
                assert set(versions) <= set(weights_of) and max(versions) <= version
                assert [int(v) for v in s.weight_versions] == sorted(int(v) for v in s.weight_versions)
                mixed += len(set(versions)) > 1
                for v in set(versions):
                    expected = token_logprobs(hf_models[weights_of[v]], s.tokens, s.response_length, temperature)
                    for i, (got, want, tv) in enumerate(zip(s.rollout_log_probs, expected, versions)):
                        if tv == v:
                            assert abs(got - want) < LOGPROB_TOLERANCE, (
                                f"sample {s.index} token {i} (version {v}, weights {weights_of[v]}): "
                                f"rollout log-prob {got} vs transformers {want}")
    finally:
        from april_slime import rollout

        rollout.shutdown()
        stack.restore_weights()
    return steps, mixed


def token_logprobs(model, tokens: list[int], response_length: int, temperature: float = 1.0) -> list[float]:
    """log p(token_t | tokens_<t) for the response tokens, from logits / temperature."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    start = len(tokens) - response_length
    return [float(logp[t - 1, tokens[t]]) for t in range(start, len(tokens))]
