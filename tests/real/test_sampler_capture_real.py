"""slime 0.4.0's sampler top-k (score centering, ``--use-score-centering --score-centering-top-k``)
on real SGLang 0.5.23 (CPU): the engines are asked ``top_logprobs_num`` and every trained token's
``rollout_topk_token_ids`` / ``rollout_topk_log_probs`` must be transformers' top-k under the
weights of the version that sampled that token, across steps with other weights pushed between
them, so partials aborted under one version resume under another. The installed slime is the
pinned one, whose ``Sample`` lacks the fields: they are declared on it as slime 0.4.0 has them
(``tests.support.slime_040_sample``). The same trained batch then goes through slime 0.4.0's
durable codec rules (``tests.support.straw_codec``)."""

from __future__ import annotations

from april_slime.core.keys import TOKEN_VERSIONS_KEY
from tests.support.real_tier import LOGPROB_TOLERANCE, SlimeRolloutManager, plugin_args, steps_across_weight_pushes
from tests.support.slime_040_sample import with_040_fields
from tests.support.straw_codec import check_samples

K = 4


def transformers_log_probs(model, tokens: list[int], response_length: int):
    """log p(. | tokens_<t) over the vocabulary at every response position: ``[response, vocab]``."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(tokens) - 1 - response_length:]


def check_top_k(s, positions, versions, hf_models, weights_of, seen) -> None:
    """Each response token at ``positions``: every id of its top-k row has transformers' log-prob
    under the token's version, and the ids are its top-k (only a near tie at the k-th place may swap
    one; counted in ``seen["ties"]``, the tokens checked in ``seen["tokens"]``)."""
    ids, log_probs = s.rollout_topk_token_ids, s.rollout_topk_log_probs
    for v in {versions[i] for i in positions}:
        full = transformers_log_probs(hf_models[weights_of[v]], s.tokens, s.response_length)
        top = full.topk(K + 1, dim=-1)
        for i in (i for i in positions if versions[i] == v):
            seen["tokens"] += 1
            got = [int(x) for x in ids[i]]
            for j, token in enumerate(got):
                assert abs(float(log_probs[i, j]) - float(full[i, token])) < LOGPROB_TOLERANCE, (
                    f"sample {s.index} token {i} (version {v}, weights {weights_of[v]}): top-{K} "
                    f"log-prob of id {token} {float(log_probs[i, j])} vs transformers {float(full[i, token])}")
            if sorted(got) != sorted(int(x) for x in top.indices[i, :K]):
                assert float(top.values[i, K - 1] - top.values[i, K]) < LOGPROB_TOLERANCE, (
                    f"sample {s.index} token {i} (version {v}): top-{K} ids {got}, transformers "
                    f"{top.indices[i, :K].tolist()}")
                seen["ties"] += 1


def test_top_k_of_every_token_is_transformers_top_k_under_its_version(real_stack, hf_models, tmp_path,
                                                                       monkeypatch):
    with_040_fields(monkeypatch)
    m = SlimeRolloutManager(plugin_args(real_stack, tmp_path, settings={"april_policy": "copris",
                                                                        "april_concurrency": 16},
                                        batch=4, n=2, max_len=200, use_score_centering=True,
                                        score_centering_top_k=K))
    v0 = real_stack.weight_version()
    weights_of = {v0 + k: "AB"[k % 2] for k in range(8)}  # as steps_across_weight_pushes pushes them
    seen = {"tokens": 0, "ties": 0, "resumed": 0, "samples": 0}

    def check_step(samples, train):
        seen["samples"] += check_samples(samples)
        for s in samples:
            ids, log_probs = s.rollout_topk_token_ids, s.rollout_topk_log_probs
            assert tuple(ids.shape) == tuple(log_probs.shape) == (s.response_length, K)
            versions = [int(v) for v, c in s.train_metadata[TOKEN_VERSIONS_KEY] for _ in range(int(c))]
            seen["resumed"] += s.metadata["april_num_aborts"] > 0 and len(set(versions)) > 1
            check_top_k(s, range(s.response_length), versions, hf_models, weights_of, seen)

    steps, mixed = steps_across_weight_pushes(real_stack, m, hf_models, check_step=check_step)
    assert mixed > 0 and seen["resumed"] > 0, (
        f"no sample was resumed under other weights in {steps} steps; the stitched rows were not checked")
    assert seen["samples"] >= steps * 4 * 2 and seen["ties"] <= seen["tokens"] // 1000, seen


def test_an_agents_trained_tokens_carry_the_top_k_of_the_call_that_sampled_them(real_stack, hf_models, tmp_path,
                                                                                 monkeypatch):
    """Through a generate function's turns (``text_then_ids``: text prompt, then ``input_ids`` with a
    masked observation between calls), under copris with other weights pushed before every step:
    each trained token's top-k is transformers' under its own version, across calls resumed in a
    later step; the observation tokens hold the placeholder rows (ids 0..k-1) no loss reads."""
    from april_slime import rollout
    from tests.support import agent_functions as af

    with_040_fields(monkeypatch)
    v0 = real_stack.weight_version()
    weights_of = {v0 + k: "AB"[k % 2] for k in range(10)}
    m = SlimeRolloutManager(plugin_args(
        real_stack, tmp_path, settings={"april_policy": "copris", "april_concurrency": 12}, batch=2, n=2,
        max_len=af.TURNS * af.REAL_PER_TURN, use_score_centering=True, score_centering_top_k=K,
        extra_argv=["--custom-generate-function-path", "tests.support.agent_functions.text_then_ids"]))
    seen = {"tokens": 0, "ties": 0, "resumed_calls": 0, "spanning": 0, "observations": 0}
    af.reset()
    try:
        for step, version in enumerate(weights_of):
            if version != v0:
                real_stack.push_weights(real_stack.other_model_path if weights_of[version] == "B"
                                        else real_stack.model_path, version)
            samples, metrics, _ = m.generate(step)
            af.STEPS_RUN[0] += 1
            seen["resumed_calls"] += metrics["april/episodes/resumed_calls"]
            check_samples(samples)
            for s in samples:
                ids, log_probs = s.rollout_topk_token_ids, s.rollout_topk_log_probs
                assert tuple(ids.shape) == tuple(log_probs.shape) == (s.response_length, K)
                versions = [int(v) for v, c in s.train_metadata[TOKEN_VERSIONS_KEY] for _ in range(int(c))]
                trained = [i for i, keep in enumerate(s.loss_mask) if keep]
                seen["spanning"] += len({versions[i] for i in trained}) > 1
                for i in (i for i, keep in enumerate(s.loss_mask) if not keep):
                    seen["observations"] += 1
                    assert [int(x) for x in ids[i]] == list(range(K))
                check_top_k(s, trained, versions, hf_models, weights_of, seen)
            if step >= 2 and seen["resumed_calls"] and seen["spanning"]:
                break
    finally:
        rollout.shutdown()
        af.reset()
        real_stack.restore_weights()
    assert seen["resumed_calls"] > 0, f"no model call was aborted at a target and resumed later: {seen}"
    assert seen["spanning"] > 0 and seen["observations"] > 0, seen
    assert seen["ties"] <= seen["tokens"] // 1000, seen
