"""Routing replay and top-p on real SGLang 0.5.23 (CPU): a tiny Qwen3-MoE (hidden 64, 2 layers, 8
experts, top-2) on one engine of its own started with ``--enable-return-routed-experts`` (the CPU
workaround in ``scripts/real-stack/sglang_cpu_site`` reaches its scheduler process through
``PYTHONPATH``), behind sglang-router, under slime's rollout manager.

* Routing replay: copris over three steps, other weights pushed between steps, so partials aborted
  under one version resume under another (after the push flushed the engine's cache, the engine's
  own rows for their old positions are recomputed under the new weights). Every position of every
  trained sample must hold the experts transformers' router picks there under the weights of the
  version that generated the next token, and slime's own conversion to train data must accept them.
* Routing replay through an agent function (``agent_functions.text_then_ids``: three model calls
  with a loss-masked observation between two): copris with other weights pushed before every step,
  so calls are resumed under other weights and later turns run under other weights than earlier
  ones. Every position must hold transformers' router choice under the version of the call that
  ran it first: the call that sampled the next token, or for an observation (and the model token
  it follows) the next call, whose prefill read it, under that call's first token's version.
* top-p: SGLang 0.5.23 does not return the top-p kept ids slime's trainer replays (its top-p patch
  is not upstream), and its log-probs are those of the whole distribution, not of the nucleus.
  slime's own rollout generates a whole step and then fails in its conversion to train data (an
  assertion on ``rollout_top_p_token_ids``); the plugin's job stops at its first step with one line
  saying so, before any prompt is taken.
"""

from __future__ import annotations

import pytest

from april_slime import rollout
from april_slime.core.config import AprilConfigError
from april_slime.core.keys import TOKEN_VERSIONS_KEY
from tests.support import agent_functions as af
from tests.support.real_tier import (
    EOS_RATE,
    LOGPROB_TOLERANCE,
    RealStack,
    SlimeRolloutManager,
    build_tiny_qwen3,
    http_json,
    local_stack,
    plugin_args,
    token_logprobs,
)

LAYERS, EXPERTS, TOPK = 2, 8, 2
MOE = dict(num_layers=LAYERS, moe_router_topk=TOPK)  # slime's Megatron model arguments


@pytest.fixture(scope="module")
def moe_stack(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("moe-stack")
    shape = dict(num_experts=EXPERTS, experts_per_token=TOPK, num_layers=LAYERS, eos_rate=EOS_RATE)
    a = build_tiny_qwen3(root / "moe-a", seed=0, **shape)
    b = build_tiny_qwen3(root / "moe-b", tokenizer=AutoTokenizer.from_pretrained(a), seed=1, **shape)
    with local_stack(a, n_engines=1, max_running_requests=16, max_total_tokens=16384, log_dir=root / "logs",
                     extra_args=["--enable-return-routed-experts"]) as stack:
        yield RealStack(stack, a, b)


@pytest.fixture(scope="module")
def hf_moe(moe_stack):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    return {"A": load(moe_stack.model_path), "B": load(moe_stack.other_model_path)}


def router_topk(model, tokens: list[int]):
    """transformers' router choice at every position but the last: ``[positions, layers, topk]``
    expert ids (sorted within a layer), and the gap between the k-th and (k+1)-th router logit."""
    import torch

    picked, gaps = [], []

    def capture(module, inputs, output):
        logits, _, indices = output
        picked.append(indices.sort(dim=-1).values)
        top = logits.topk(TOPK + 1, dim=-1).values
        gaps.append(top[:, TOPK - 1] - top[:, TOPK])

    hooks = [layer.mlp.gate.register_forward_hook(capture) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens[:-1]]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(picked, dim=1), torch.stack(gaps, dim=1)


def token_versions(sample) -> list[int]:
    return [int(v) for v, c in sample.train_metadata[TOKEN_VERSIONS_KEY] for _ in range(int(c))]


def test_routing_replay_holds_the_router_choice_of_each_tokens_version(moe_stack, hf_moe, tmp_path):
    v0 = moe_stack.weight_version()
    # weights A and B in turn; at least three versions, and more (up to six) until a partial sample
    # resumed under other weights has been seen: which groups finish first depends on the machine
    weights_of = {v0 + k: "AB"[k % 2] for k in range(6)}
    m = SlimeRolloutManager(plugin_args(moe_stack, tmp_path, settings={"april_policy": "copris",
                                                                       "april_concurrency": 16},
                                        batch=4, n=2, max_len=160, extra_argv=["--use-rollout-routing-replay"],
                                        **MOE))
    mixed = positions = near_ties = 0
    try:
        for step, version in enumerate(weights_of):
            if version != v0:
                model = moe_stack.other_model_path if weights_of[version] == "B" else moe_stack.model_path
                moe_stack.push_weights(model, version)
            samples, _, train = m.generate(step)  # slime's conversion checks the rows' shape too
            assert len(train["rollout_routed_experts"]) == len(samples)
            for s, experts in zip(samples, train["rollout_routed_experts"]):
                assert tuple(experts.shape) == (len(s.tokens) - 1, LAYERS, TOPK)
                prompt_len = len(s.tokens) - s.response_length
                versions = token_versions(s)
                mixed += len(set(versions)) > 1
                # position i was run by the call that sampled token i + 1 (the prompt, by the first call)
                row_version = [versions[max(0, i + 1 - prompt_len)] for i in range(len(s.tokens) - 1)]
                got = experts.sort(dim=-1).values
                for v in set(row_version):
                    want, gap = router_topk(hf_moe[weights_of[v]], s.tokens)
                    for i in (i for i, rv in enumerate(row_version) if rv == v):
                        positions += 1
                        if not bool((got[i] == want[i]).all()):
                            # float32 CPU kernels against transformers: only a near tie may flip
                            assert float(gap[i].min()) < 1e-4, (
                                f"sample {s.index} position {i} (version {v}, weights {weights_of[v]}): "
                                f"replayed experts {got[i].tolist()}, transformers' router {want[i].tolist()}")
                            near_ties += 1
            if step >= 2 and mixed:
                break
    finally:
        rollout.shutdown()
        moe_stack.wait_idle()
    assert mixed > 0, "no sample was resumed under other weights; the stitched rows were not checked"
    assert near_ties <= positions // 1000, f"{near_ties} near ties in {positions} positions"


def test_sglang_returns_no_top_p_kept_ids_and_the_job_stops_at_its_first_step(moe_stack, hf_moe, tmp_path):
    import torch

    url = moe_stack.engine_urls[0]
    prompt = moe_stack.tokenizer.encode("Question: what is 12 + 30? Answer:", add_special_tokens=False)
    status, reply = http_json("POST", f"{url}/generate", {
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 24, "temperature": 1.0, "top_p": 0.5, "ignore_eos": True,
                            "custom_params": {"return_top_p_token_ids": True}}})
    assert status == 200, reply
    meta = reply["meta_info"]
    assert not [k for k in meta if k.startswith("top_p")], "this SGLang returns top-p kept ids after all"
    tokens = prompt + reply["output_ids"]
    n = len(reply["output_ids"])
    got = [lp for lp, _, _ in meta["output_token_logprobs"]]
    # the log-probs are of the whole temperature-scaled distribution ...
    weights = hf_moe["A"] if int(meta["weight_version"]) == moe_stack.weight_version() else None
    assert weights is not None
    full = token_logprobs(weights, tokens, n)
    assert max(abs(a - b) for a, b in zip(got, full)) < LOGPROB_TOLERANCE
    # ... not of the nucleus slime's trainer renormalises over (what its patched SGLang returns)
    with torch.no_grad():
        probs = torch.softmax(weights(input_ids=torch.tensor([tokens[:-1]])).logits[0, len(prompt) - 1:], dim=-1)
    sorted_p, _ = probs.sort(dim=-1, descending=True)
    mass = torch.where(sorted_p.cumsum(-1) - sorted_p <= 0.5, sorted_p, 0.0).sum(-1)
    assert float((-mass.log()).min()) > 0.1, "the nucleus renormalisation would not show here"

    # slime's own rollout on this engine generates a whole step, then its train-data conversion fails
    own = SlimeRolloutManager(plugin_args(moe_stack, tmp_path / "slime", extra_argv=[
        "--rollout-function-path", "slime.rollout.sglang_rollout.generate_rollout",
        "--data-source-path", "slime.rollout.data_source.RolloutDataSourceWithBuffer", "--rollout-top-p", "0.9"]))
    try:
        with pytest.raises(AssertionError):
            own.generate(0)
    finally:
        moe_stack.wait_idle()
    assert own.data_source.sample_group_index > 0  # the step's prompts were used up

    args = plugin_args(moe_stack, tmp_path / "ours", settings={"april_policy": "copris"},
                       extra_argv=["--rollout-top-p", "0.9"])
    m = SlimeRolloutManager(args)
    try:
        with pytest.raises(AprilConfigError) as err:
            m.generate(0)
    finally:
        rollout.shutdown()
    message = str(err.value)
    assert message.startswith("rollout_top_p: the rollout engines do not return what training replays")
    assert "sglang-top_p.patch" in message and "\n" not in message
    assert len(m.data_source.buffer) == 0 and m.data_source._prompts.sample_group_index == 0


def first_call_versions(s) -> list[int]:
    """The version each position ``i`` was run under by the first call that ran it: that of the first
    generated (loss-mask 1) token at or after token ``i + 1`` (``april_slime.core.replay``)."""
    prompt_len = len(s.tokens) - s.response_length
    versions, mask = token_versions(s), list(s.loss_mask)
    out, next_generated = [], None
    for k in range(s.response_length - 1, -1, -1):  # the version of the first generated token from k on
        next_generated = versions[k] if mask[k] else next_generated
        out.append(next_generated)
    from_token = out[::-1]
    return [from_token[max(0, i + 1 - prompt_len)] for i in range(len(s.tokens) - 1)]


@pytest.mark.parametrize("function", ["text_then_ids", "keeps_routed_experts"])
def test_agent_turns_replay_the_routing_of_the_call_that_ran_each_position(moe_stack, hf_moe, tmp_path, function):
    """``keeps_routed_experts`` also asks the front for routed experts and keeps them in its own
    sample with slime's ``Sample.append_response_tokens``: they must be the rows the plugin trains."""
    import torch

    v0 = moe_stack.weight_version()
    weights_of = {v0 + k: "AB"[k % 2] for k in range(12)}
    settings = {"april_policy": "copris", "april_concurrency": 12, "april_over_sampling_factor": 2.0}
    m = SlimeRolloutManager(plugin_args(
        moe_stack, tmp_path, settings=settings, batch=2, n=2, max_len=af.TURNS * af.REAL_PER_TURN,
        extra_argv=["--use-rollout-routing-replay",
                    "--custom-generate-function-path", f"tests.support.agent_functions.{function}"], **MOE))
    resumed_calls = spanning = turned = positions = near_ties = 0
    af.reset()
    af.TOOLS_ACROSS_STEPS.add(0)  # group 0's next turns run under the weights of later steps
    try:
        for step, version in enumerate(weights_of):
            if version != v0:
                model = moe_stack.other_model_path if weights_of[version] == "B" else moe_stack.model_path
                moe_stack.push_weights(model, version)
            samples, metrics, train = m.generate(step)  # slime's conversion checks the rows' shape too
            af.STEPS_RUN[0] += 1
            resumed_calls += metrics["april/episodes/resumed_calls"]
            assert len(train["rollout_routed_experts"]) == len(samples)
            for s, experts in zip(samples, train["rollout_routed_experts"]):
                assert tuple(experts.shape) == (len(s.tokens) - 1, LAYERS, TOPK)
                assert s.loss_mask.count(0) >= af.TURNS - 1, "no observation tokens"
                if function == "keeps_routed_experts":
                    assert torch.equal(torch.as_tensor(af.KEPT_ROWS[s.index]), torch.as_tensor(experts))
                versions, mask = token_versions(s), s.loss_mask
                spanning += len({v for v, keep in zip(versions, mask) if keep}) > 1
                row_version = first_call_versions(s)
                prompt_len = len(s.tokens) - s.response_length
                # observations run under another version than the model token before them
                turned += any(not mask[k] and row_version[prompt_len + k] != versions[k - 1]
                              for k in range(1, s.response_length))
                got = experts.sort(dim=-1).values
                for v in set(row_version):
                    want, gap = router_topk(hf_moe[weights_of[v]], s.tokens)
                    for i in (i for i, rv in enumerate(row_version) if rv == v):
                        positions += 1
                        if not bool((got[i] == want[i]).all()):
                            assert float(gap[i].min()) < 1e-4, (
                                f"sample {s.index} position {i} (version {v}, weights {weights_of[v]}): "
                                f"replayed experts {got[i].tolist()}, transformers' router {want[i].tolist()}")
                            near_ties += 1
            if step >= 2 and resumed_calls and spanning and turned:
                break
    finally:
        rollout.shutdown()
        af.reset()
        moe_stack.restore_weights()
    assert resumed_calls > 0, "no model call was aborted at a target and resumed in a later step"
    assert spanning > 0, "no sample's model tokens span two versions; the stitch over calls was not checked"
    assert turned > 0, "no observation was read under other weights than the turn before it ran under"
    assert near_ties <= positions // 1000, f"{near_ties} near ties in {positions} positions"
