"""Training tier with tensor parallelism 2 (two gloo processes): a vocab-parallel lm head
(Megatron's ColumnParallelLinear), so slime's vocab-parallel log-prob and entropy code runs inside
loss_function, with the plugin's custom loss against slime's policy_loss on each rank."""

import copy
import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

pytestmark = pytest.mark.real

SETTINGS = dict(eps_clip_high=0.28, entropy_coef=0.01)
PLUGIN = dict(loss_type="custom_loss", custom_loss_function_path="april_slime.loss.policy_loss",
              april_is_mode="on_policy", april_is_correction="none")


def worker(rank, port, queue):
    try:
        queue.put((rank, *_worker(rank, port)))
    except BaseException:
        import traceback
        queue.put((rank, None, traceback.format_exc()))
        raise


def _worker(rank, port):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from tests.support.training import megatron_cpu
    from tests.support.training import slime_cpu as sc

    with sc.gloo_world(tp=2, rank=rank, world_size=2, port=port), megatron_cpu.megatron_on_cpu():
        full = sc.TokenwiseLM(seed=0)
        model = sc.TokenwiseLM(seed=0)
        # the lm head as Megatron shards it: this rank's rows of the vocabulary
        shard = sc.VOCAB // 2 + 1  # VOCAB is odd: pad to an even vocabulary as Megatron does
        model.head = ColumnParallelLinear(16, 2 * shard, config=model.config, init_method=nn.init.zeros_,
                                          bias=False, gather_output=False)
        padded = torch.cat([full.head.weight.detach(), torch.zeros(2 * shard - sc.VOCAB, 16)])
        with torch.no_grad():
            model.head.weight.copy_(padded[rank * shard:(rank + 1) * shard])
        def forward(tokens):
            logits, _ = model.head(torch.tanh(model.embed(tokens)).transpose(0, 1))
            # the full model's head bias lives in the first shard's columns (padding: -inf-like)
            bias = torch.cat([full.head.bias.detach(), torch.full((2 * shard - sc.VOCAB,), -30.0)])
            return (logits + bias[rank * shard:(rank + 1) * shard]).transpose(0, 1)

        model.forward = forward
        base = sc.make_args(**SETTINGS)
        plugin = sc.make_args(**SETTINGS, **PLUGIN)
        samples = sc.make_samples(seed=0, model=full)
        data = sc.rollout_to_trainer(base, samples)
        sc.recompute_log_probs(base, model, data, perturb=0.5)
        ref_m, ref_g = sc.train_step(base, model, copy.copy(data))
        got_m, got_g = sc.train_step(plugin, model, copy.copy(data))
    # plain lists: tensors sent through a queue share memory with a process that is exiting
    return ref_m, {k: v.tolist() for k, v in ref_g.items()}, got_m, {k: v.tolist() for k, v in got_g.items()}


def test_on_policy_custom_loss_equals_slimes_policy_loss_with_vocab_parallel_head():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=400) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    for rank, ref_m, *rest in results:
        assert ref_m is not None, f"rank {rank} failed:\n{rest[0]}"
        ref_g, got_m, got_g = rest
        for key in ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl"):
            assert got_m[key] == pytest.approx(ref_m[key], rel=1e-5, abs=1e-7), (rank, key)
        assert 0 < ref_m["pg_clipfrac"] < 1
        for name, g in ref_g.items():
            torch.testing.assert_close(torch.tensor(got_g[name]), torch.tensor(g), rtol=1e-5, atol=1e-7,
                                       msg=f"rank {rank} {name}")
