"""A multi-turn custom generate function on real SGLang engines, inside slime: its model calls are
scheduled, aborted at each step's target and resumed next step under new weights, and what trains
is exact: every model token's rollout log-prob is the one transformers computes under the weights of
the version recorded for it, observation tokens are masked, and group counts hold.

The function (``tests.support.agent_functions.text_then_ids``) calls the front through slime's own
``post``: the first call with the prompt as ``text``, later ones with ``input_ids``."""

from __future__ import annotations

import pytest

from april_slime import rollout
from april_slime.core.keys import TOKEN_VERSIONS_KEY
from tests.support import agent_functions as af
from tests.support.real_tier import LOGPROB_TOLERANCE, SlimeRolloutManager, plugin_args, token_logprobs


@pytest.mark.parametrize("policy", ["april", "copris"])
def test_a_multi_turn_function_trains_exact_tokens_across_aborts_and_weight_pushes(real_stack, hf_models,
                                                                                  tmp_path, policy):
    v0 = real_stack.weight_version()
    # six steps at least; on a starved machine every call of a step can end before its target
    # aborts it, so steps go on (at most twelve) until a call was resumed across steps
    weights_of = {v0 + k: "AB"[k % 2] for k in range(12)}
    settings = {"april_policy": policy, "april_concurrency": 12, "april_over_sampling_factor": 2.0}
    m = SlimeRolloutManager(plugin_args(
        real_stack, tmp_path, settings=settings, batch=2, n=2, max_len=af.TURNS * af.REAL_PER_TURN,
        extra_argv=["--custom-generate-function-path", "tests.support.agent_functions.text_then_ids"]))
    trained, resumed_calls, spanning = [], 0, 0
    real_stack.wait_idle()  # requests an earlier test left on the shared engines end first
    try:
        for step, version in enumerate(weights_of):
            if version != v0:
                model = real_stack.other_model_path if weights_of[version] == "B" else real_stack.model_path
                real_stack.push_weights(model, version)
            samples, metrics, _ = m.generate(step)
            assert metrics["april/policy_version"] == version
            resumed_calls += metrics["april/episodes/resumed_calls"]
            trained += [s.group_index for s in samples[::2]]
            for s in samples:
                versions = [v for v, c in s.train_metadata[TOKEN_VERSIONS_KEY] for _ in range(c)]
                assert len(versions) == s.response_length == len(s.loss_mask) == len(s.rollout_log_probs)
                assert set(versions) <= set(weights_of) and max(versions) <= version
                observed = [k for k, keep in enumerate(s.loss_mask) if not keep]
                assert len(observed) >= af.TURNS - 1, "observation tokens are not masked"
                spanning += len({versions[k] for k, keep in enumerate(s.loss_mask) if keep}) > 1
                for v in set(versions):
                    expected = token_logprobs(hf_models[weights_of[v]], s.tokens, s.response_length)
                    for k, (got, want, tv, keep) in enumerate(zip(s.rollout_log_probs, expected, versions,
                                                                  s.loss_mask)):
                        if keep and tv == v:
                            assert abs(got - want) < LOGPROB_TOLERANCE, (
                                f"sample {s.index} token {k} (version {v}): rollout {got} vs transformers {want}")
            if step >= 5 and resumed_calls and spanning:
                break
    finally:
        rollout.shutdown()
        real_stack.restore_weights()
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert resumed_calls > 0, "no model call was aborted at a target and resumed in a later step"
    assert spanning > 0, "no sample's model tokens span two policy versions"
