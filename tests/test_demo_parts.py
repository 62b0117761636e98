"""The demo's pieces that need no SGLang: task, reward, advantages, the sample-mean reducer, the
supervised loss, settings and command-line checks. The whole loop runs in tests/real/test_demo.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from april_workbench.demo import cli, task
from april_workbench.demo.loop import QUICK, DemoSettings
from april_workbench.demo.policy import PolicySpec, demonstration
from april_workbench.demo.trainer import group_advantages, sample_mean_reducer


def test_score_needs_exact_answer_and_stop():
    assert task.score("54321" + task.EOS, "54321") == 1.0
    assert task.score("54321", "54321") == 0.0  # no stop: truncated
    assert task.score("543210" + task.EOS, "54321") == 0.0  # a ramble before the stop
    assert task.score("54320" + task.EOS, "54321") == 0.0
    assert task.score("54321" + task.EOS + "7", "54321") == 0.0


def test_reward_is_a_slime_reward_function():
    sample = SimpleNamespace(index=3, label="21", response="21" + task.EOS)
    assert asyncio.run(task.reward(None, sample)) == 1.0
    sample.label = None
    with pytest.raises(ValueError, match="sample 3"):
        asyncio.run(task.reward(None, sample))


def test_prompt_file_is_distinct_and_labelled(tmp_path):
    path = task.write_prompts(tmp_path / "p.jsonl", 50, 4, seed=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 50 and len({r["prompt"] for r in rows}) == 50
    for r in rows:
        digits = r["prompt"].removesuffix(task.SEPARATOR)
        assert len(digits) == 4 and r["label"] == digits[::-1]


def test_demonstrations_have_a_long_tail_within_the_budget():
    import random

    spec = PolicySpec(ramble_prob=0.5, max_response_len=20)
    lengths = [len(demonstration(random.Random(i), spec)[1].removesuffix(task.EOS)) for i in range(400)]
    assert min(lengths) == spec.num_digits
    assert max(lengths) == spec.max_response_len - 1  # answer + stop fit the budget
    assert 0.3 < sum(n > spec.num_digits for n in lengths) / len(lengths) < 0.7


def test_group_advantages_are_normalised_per_group():
    adv = group_advantages([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert adv[0] == pytest.approx([0.866, -0.866, -0.866, 0.866], abs=1e-3)
    assert adv[1] == [0.0] * 4  # no signal in a uniform group


def test_sample_mean_reducer_weights_samples_not_tokens():
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0])]
    reduce = sample_mean_reducer(masks)
    # sample 0: mean of (2, 4) = 3 (the masked 100 is left out); sample 1: 10; mean over samples 6.5
    assert float(reduce(torch.tensor([2.0, 4.0, 100.0, 10.0]))) == pytest.approx(6.5)


def test_settings_refuse_impossible_values():
    with pytest.raises(ValueError, match="policies"):
        DemoSettings(policies=("sync", "fast"))
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        DemoSettings(n_samples_per_prompt=1)
    with pytest.raises(ValueError, match="steps"):
        dataclasses.replace(QUICK, steps=0)
    with pytest.raises(ValueError, match="sft_steps"):
        PolicySpec(sft_steps=-1)


def test_cli_rejects_unknown_policy_before_starting_anything(capsys):
    assert cli.main(["--quick", "--policies", "sync,fast"]) == 2
    assert "policies" in capsys.readouterr().err


def test_cli_refuses_a_condition_without_enough_steps_to_wait_for_it(capsys):
    assert cli.main(["--quick", "--steps", "3"], until=lambda policy, series: True) == 2
    assert cli.main(["--quick", "--steps", "3"], until=lambda policy, series: True, max_steps=2) == 2
    assert "until needs max_steps >= steps (3)" in capsys.readouterr().err


def test_cli_settings_follow_the_flags():
    ns = cli._parser().parse_args(["--quick", "--steps", "3", "--policies", "copris", "--sft-steps", "50"])
    s = cli.settings_from(ns)
    assert (s.steps, s.policies, s.policy.sft_steps) == (3, ("copris",), 50)
    assert s.rollout_batch_size == QUICK.rollout_batch_size
    assert s.policy.key() != QUICK.policy.key()  # a different warm start is a different cached policy


def test_time_to_reward_is_the_first_evaluation_at_target():
    series = {"eval_wall_s": [0.0, 10.0, 20.0, 30.0], "eval_reward": [0.2, 0.6, 0.5, 0.7], "eval_step": [0, 5, 10, 15]}
    assert cli.time_to_reward(series, 0.55) == 10.0
    assert cli.time_to_reward(series, 0.7) == 30.0
    assert cli.time_to_reward(series, 0.9) is None


def test_cli_says_what_is_missing_without_the_real_stack(monkeypatch, capsys):
    monkeypatch.setattr("april_workbench.localstack.real_stack_missing", lambda: "SGLang is not installed (here)")
    assert cli.main(["--quick"]) == 2
    assert "needs the real-stack environment: SGLang is not installed (here)" in capsys.readouterr().err


def test_a_shared_prompt_prefix_runs_once_with_the_same_loss_and_gradients():
    """``sft_loss`` runs a prefix every demonstration shares (a system prompt) once and the rest on
    its cache: loss and gradients are those of the plain padded batch."""
    transformers = pytest.importorskip("transformers")
    import random

    from april_workbench.demo.policy import SHARED_PREFIX_MIN, _padded, sft_loss, shared_prefix

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = transformers.Qwen3ForCausalLM(config).float()
    rng = random.Random(0)
    prefix = [rng.randrange(1, 50) for _ in range(SHARED_PREFIX_MIN + 8)]
    rows, prompt_lengths, trained = [], [], []
    for k in range(4):
        prompt = prefix + [rng.randrange(1, 50) for _ in range(k % 3)]
        response = [rng.randrange(1, 50) for _ in range(3 + 2 * k)]
        rows.append(prompt + response)
        prompt_lengths.append(len(prompt))
        # a tool output inside the response is not trained on
        trained.append([False] * len(prompt) + [j not in (1, 2) for j in range(len(response))])
    assert shared_prefix(rows, prompt_lengths) == len(prefix) - 1  # the shortest prompt is the prefix itself

    grads = []
    for shared in (True, False):
        model.zero_grad()
        if shared:
            loss = sft_loss(model, rows, prompt_lengths, trained, pad=0)
        else:
            ids, mask, target = _padded(rows, trained, pad=0)
            loss = model(input_ids=ids, attention_mask=mask, labels=target).loss
        loss.backward()
        grads.append((float(loss), [p.grad.clone() for p in model.parameters()]))
    (a, ga), (b, gb) = grads
    assert a == pytest.approx(b, rel=1e-5)
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(ga, gb))


# ------------------------------------------------------------------ the tool task
def test_tool_task_scores_the_last_answer_and_calculates_products_only():
    from april_workbench.demo import tool_task

    assert tool_task.score("<calc>12*3</calc><result>36</result><answer>36</answer>", "36") == 1.0
    assert tool_task.score("<answer>35</answer><answer>36</answer>", "36") == 1.0
    assert tool_task.score("<answer>36</answer><answer>35</answer>", "36") == 0.0
    assert tool_task.score("<calc>12*3</calc><result>36</result>", "36") == 0.0  # no answer
    assert tool_task.calculate("12*3") == "36" and tool_task.calculate("7") == "7"
    assert tool_task.calculate("12**3") == "error" and tool_task.calculate("*") == "error"
    sample = SimpleNamespace(index=0, label="36", response="<answer>36</answer>")
    assert asyncio.run(tool_task.reward(None, sample)) == 1.0


def test_tool_task_demonstrations_call_the_tool_or_guess_within_the_budget():
    import random

    from april_workbench.demo import tool_task

    # the demo's character tokenizer is a transformers tokenizer (the real-stack environment has it)
    for module in ("tokenizers", "transformers"):
        pytest.importorskip(module, reason=f"the demo's tokenizer needs {module} (bash scripts/real-stack/setup.sh)")
    spec = tool_task.ToolPolicySpec()
    tokenizer = tool_task.build_tokenizer()
    kinds = {"call": 0, "guess": 0}
    for i in range(300):
        prompt, segments = tool_task.demonstration(random.Random(i), spec)
        assert prompt.endswith("=") and len(prompt) == 2 * spec.num_digits + 2
        for text, trained in segments:
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert tokenizer.decode(ids) == text  # tags are one token each and decode back
            if trained:
                assert len(ids) <= spec.max_response_len
        if len(segments) == 3:
            call = tool_task.CALL.search(segments[0][0]).group(1)
            assert segments[1] == (tool_task.observation(tool_task.calculate(call)), False)
            kinds["call"] += 1
        else:
            assert len(segments) == 1 and "<answer>" in segments[0][0]
            kinds["guess"] += 1
    assert 0.3 < kinds["guess"] / 300 < 0.5  # skip_prob 0.4


def test_tool_task_prompt_file_and_settings(tmp_path):
    from april_workbench.demo import tool_task
    from april_workbench.demo.loop import TOOL_QUICK

    spec = tool_task.ToolPolicySpec()
    rows = [json.loads(line) for line in tool_task.write_prompts(tmp_path / "p.jsonl", 40, spec, 1).read_text()
            .splitlines()]
    assert len({r["prompt"] for r in rows}) == 40
    for r in rows:
        a, b = r["prompt"].removesuffix("=").split("*")
        assert r["label"] == str(int(a) * int(b))
    assert TOOL_QUICK.task == "tool"
    with pytest.raises(ValueError, match="ToolPolicySpec"):
        DemoSettings(task="tool")
    with pytest.raises(ValueError, match="task"):
        DemoSettings(task="chat")
    with pytest.raises(ValueError, match="max_response_len"):
        tool_task.ToolPolicySpec(max_response_len=6)
    ns = cli._parser().parse_args(["--task", "tool", "--quick", "--sft-steps", "10"])
    settings = cli.settings_from(ns)
    assert settings.task == "tool" and settings.policy.sft_steps == 10 and settings.policies == ("sync", "copris")
