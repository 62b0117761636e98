"""``april-slime demo``: a real partial-rollout RL loop on a CPU (see docs/demo.md).

task       the verifiable reverse-digits task and its slime reward function
tool_task  the multi-turn task (--task tool): a calculator between model calls, its generate function
policy     the tiny Qwen3 and its supervised warm start (built once, cached)
trainer    a torch copy of the policy trained with april_slime.loss.policy_loss
loop       engines + router, slime's rollout path, training, weight pushes, per policy
plot       the figure; cli the command
"""
