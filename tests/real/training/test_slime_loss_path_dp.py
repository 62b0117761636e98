"""Training tier with data parallelism 2 (two gloo processes, TP 1): slime's rollout-side DP split
hands each rank its share of one rollout batch, each rank runs slime's loss_function with the
plugin's custom loss (copris, truncated weights, VCPO's ESS learning-rate statistics), and the
data-parallel result must be the single-process result over the whole batch:

* the split delivers every sample exactly once, with its own per-token ``train_metadata``;
* the gradient averaged over the DP ranks (Megatron's DDP: sum, divided by the DP size; slime's
  loss_function scales each rank's loss by ``dp_size / step_global_batch_size``) is the
  single-process gradient;
* slime's DP-reduced step metrics (``reduce_train_step_metrics``), the plugin's ``april/``
  statistics among them, and the ESS ratio the plugin reduces over the ranks at the optimizer
  step are the single-process values.
"""

import copy
import socket

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.real

DP = 2
BATCH = dict(rollout_batch_size=4, n_samples_per_prompt=3, global_batch_size=12)
PLUGIN = dict(loss_type="custom_loss", custom_loss_function_path="april_slime.loss.policy_loss",
              april_is_mode="copris", april_is_level="token", april_is_correction="truncate", april_is_low=0.0,
              april_is_high=1.2, april_loss_level="token", april_vcpo_lr_scaling=True,
              custom_megatron_before_train_step_hook_path="april_slime.vcpo.before_train_step")
# ESS of one micro-batch: depends on how the batch is cut into micro-batches, not additive
NOT_ADDITIVE = {"april/ess_ratio_microbatch"}


def ess_tolerance(max_response_tokens: int) -> float:
    """Relative tolerance of the step's ESS ratio between the DP ranks and one process.

    The ratio is formed in float64 from float32 sequence log-weights s_i = sum_t m_t (log pi_t -
    log mu_t). The DP ranks cut the batch into other micro-batches, so the logits (and their
    log-softmax) come from matmuls of other shapes and may round differently: allow each token's
    log-prob 16 eps of absolute error (a few roundings at |logit|, |log-prob| <= 16), so
    |ds_i| <= max_response_tokens * 16 eps. ESS / N = (sum w)^2 / (N sum w^2) with w = exp(s):
    the numerator moves by at most 2 max|ds_i| relative, the denominator by 2 max|ds_i|.
    With 8 tokens that is 6e-5, while a sample lost, duplicated or paired with another's
    log-probs on a rank moves the ratio by O(1/N) ~ 1e-2."""
    return 4 * max_response_tokens * 16 * torch.finfo(torch.float32).eps


def samples_and_model():
    from tests.support.training import slime_cpu as sc

    model = sc.TokenwiseLM(seed=0)
    samples = sc.make_samples(seed=0, num_prompts=4, per_prompt=3, model=model)
    for s in samples:
        # per-sample versions, so that a sample paired with another's metadata changes the metrics
        n, k = s.response_length, 1 + s.index % 2
        s.train_metadata = {"april_token_versions_rle": [[1 + s.index % 3, n - k], [4, k]],
                            "april_policy_version": 4, "sample": s.index}
    return model, samples


def run(dp_size=1, dp_rank=0):
    """Data path, the proximal log-probs, one train step and the optimizer step on this rank."""
    from megatron.core import parallel_state

    from april_slime import vcpo
    from tests.support.training import slime_cpu as sc

    model, samples = samples_and_model()
    args = sc.make_args(**BATCH, **PLUGIN)
    data = sc.rollout_to_trainer(args, samples, dp_size=dp_size, dp_rank=dp_rank)
    sc.recompute_log_probs(args, model, data)
    for i, index in enumerate(data["sample_indices"]):
        # pi_old one step behind, the same per sample however the batch is split
        g = torch.Generator().manual_seed(1000 + int(index))
        data["log_probs"][i] = data["log_probs"][i] + 0.4 * torch.randn(data["log_probs"][i].shape, generator=g)
    split = {int(index): (meta, len(tokens)) for index, meta, tokens in
             zip(data["sample_indices"], data["metadata"], data["tokens"])}

    vcpo.reset_runtime()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    vcpo.before_train_step(args, 0, 0, [model], optimizer, None)
    dp_group = parallel_state.get_data_parallel_group()
    metrics, grads = sc.train_step(args, model, copy.copy(data), dp_group=dp_group)
    for g in grads.values():  # Megatron's DDP: all-reduce, then average over the DP ranks
        torch.distributed.all_reduce(g, group=dp_group)
        g /= torch.distributed.get_world_size(dp_group)
    optimizer.step()  # the plugin reduces the step's ESS statistics over the ranks here
    ess = vcpo.runtime().lr_scaler.last_ess_ratio
    vcpo.reset_runtime()
    return split, metrics, {k: v.tolist() for k, v in grads.items()}, ess


def worker(rank, port, queue):
    try:
        from tests.support.training import slime_cpu as sc

        with sc.gloo_world(tp=1, rank=rank, world_size=DP, port=port):
            queue.put((rank, run(DP, rank), None))
    except BaseException:
        import traceback
        queue.put((rank, None, traceback.format_exc()))
        raise


@pytest.fixture(scope="module")
def reference():
    from tests.support.training import slime_cpu as sc

    with sc.gloo_world():
        return run()


@pytest.fixture(scope="module")
def ranks(reference):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(r, port, queue)) for r in range(DP)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    out = {}
    for rank, result, error in results:
        assert result is not None, f"rank {rank} failed:\n{error}"
        out[rank] = result
    return [out[r] for r in range(DP)]


def test_split_delivers_every_sample_once_with_its_metadata(reference, ranks):
    ref_split = reference[0]
    assert sorted(ref_split) == list(range(12))
    seen = [index for split, *_ in ranks for index in split]
    assert sorted(seen) == sorted(ref_split) and len(seen) == len(set(seen))
    assert all(len(split) == 6 for split, *_ in ranks)
    for split, *_ in ranks:
        for index, (meta, n_tokens) in split.items():
            assert meta["sample"] == index and (meta, n_tokens) == ref_split[index]


def test_dp_averaged_gradient_equals_single_process(reference, ranks):
    _, _, ref_grads, _ = reference
    for rank, (_, _, grads, _) in enumerate(ranks):
        for name, g in ref_grads.items():
            torch.testing.assert_close(torch.tensor(grads[name]), torch.tensor(g), rtol=1e-5, atol=1e-6,
                                       msg=f"rank {rank} {name}")


def test_dp_reduced_metrics_and_ess_equal_single_process(reference, ranks):
    _, ref_metrics, _, ref_ess = reference
    assert 0 < ref_metrics["pg_clipfrac"] < 1 and ref_metrics["april/truncated_frac"] > 0
    assert ref_metrics["april/stale1/tokens"] > 0 and ref_metrics["april/stale3+/tokens"] > 0
    assert 0 < ref_ess < 1
    max_response_tokens = max(s.response_length for s in samples_and_model()[1])
    for rank, (_, metrics, _, ess) in enumerate(ranks):
        assert set(metrics) == set(ref_metrics)
        for key in set(ref_metrics) - NOT_ADDITIVE:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), (rank, key)
        assert ess == pytest.approx(ref_ess, rel=ess_tolerance(max_response_tokens)), rank
        # the step's ESS ratio from the additive metrics (april_slime.loss docstring), DP-reduced
        ratio = metrics["april/seq_weight"] ** 2 / (metrics["april/trained_frac"] * metrics["april/seq_weight_sq"])
        ref_ratio = ref_metrics["april/seq_weight"] ** 2 / (
            ref_metrics["april/trained_frac"] * ref_metrics["april/seq_weight_sq"])
        assert ratio == pytest.approx(ref_ratio, rel=1e-5), rank
