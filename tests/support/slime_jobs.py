"""The plugin inside a slime job on emulated engines: slime's arguments, the emulated cluster and
the fixtures that pick slime (the real one where importable, else ``slime_standin``), plus the
scenarios run both here and against real slime (``tests/real/test_checkpoint_real.py``).

``slime_mode`` and ``cluster`` are re-exported by ``tests/conftest.py``, so every test sees them; a
module may override ``slime_mode`` (``cluster`` then starts on top of that override).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import aiohttp
import pytest

from april_slime import rollout
from tests.support import slime_standin

RBS, N, MAX_LEN = 4, 3, 48


async def parity_reward(args, sample, **kwargs):
    """The jobs' reward (``--custom-rm-path``, loaded by slime from this module's path)."""
    return float(sample.response_length % 2)


@pytest.fixture
def slime_mode(monkeypatch):
    mode = slime_standin.install(monkeypatch)
    if mode == "real":
        slime_standin.patch_real_tokenizer(monkeypatch)
    yield mode
    rollout.shutdown()


def make_args(tmp_path, prompts, **overrides):
    """The slime arguments the plugin reads, with slime's defaults for the rest."""
    args = SimpleNamespace(
        # slime data-source arguments
        rollout_global_dataset=True, prompt_data=str(prompts), input_key="prompt", label_key="label",
        metadata_key="metadata", tool_key=None, multimodal_keys=None, apply_chat_template=False,
        apply_chat_template_kwargs={}, rollout_max_prompt_len=None, rollout_shuffle=False, rollout_seed=42,
        dump_details=None, hf_checkpoint=str(tmp_path / "tokenizer"), buffer_filter_path=None,
        save=str(tmp_path / "ckpt"), load=None,
        # slime rollout arguments
        rollout_batch_size=RBS, n_samples_per_prompt=N, over_sampling_batch_size=RBS,
        rollout_max_response_len=MAX_LEN, rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1,
        rollout_stop=None, rollout_stop_token_ids=None, rollout_skip_special_tokens=False,
        partial_rollout=False, mask_offpolicy_in_partial_rollout=False, custom_generate_function_path=None,
        use_rollout_routing_replay=False, dynamic_sampling_filter_path=None, rollout_sample_hook_path=None,
        group_rm=False, custom_rm_path=f"{__name__}.parity_reward", rm_type=None, reward_key=None,
        sglang_router_ip="127.0.0.1", sglang_router_port=0,
        # plugin settings, as --custom-config-path sets them
        april_policy="april", april_over_sampling_factor=2.0,
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def rollout_until_partial(args, source, most: int = 4) -> int:
    """Rollouts 0, 1, ... of an over-sampled job until the buffer holds a partial trajectory; the
    id of the rollout after which it did. One step almost always leaves some, but a starved test
    process can see every request finish before it sees the target, so a test that needs a partial
    repeats the step until there is one (and fails saying so if there never is)."""
    for rollout_id in range(most):
        rollout.generate_rollout(args, rollout_id, source)
        if source.buffer.num_partial_trajectories() > 0:
            return rollout_id
    raise AssertionError(f"no partial trajectory after {most} over-sampled rollouts; the test needs one")


def run_steps(args, source, cluster, rollout_ids, versions=None, *, check=None, samples=None, totals=None):
    """One ``generate_rollout`` per rollout id, the engines at the given weight version (by default
    the rollout id + 1); each batch must hold ``rollout_batch_size`` groups of ``n_samples_per_prompt``
    samples, none trained before. ``check(sample)``: run on every trained sample. Returns the trained
    samples by index and every metric summed (``samples`` / ``totals``: added to, across calls)."""
    samples = {} if samples is None else samples
    totals = {} if totals is None else totals
    for rollout_id, version in zip(rollout_ids, versions or [i + 1 for i in rollout_ids]):
        cluster.bump(version)
        out = rollout.generate_rollout(args, rollout_id, source)
        assert len(out.samples) == args.rollout_batch_size
        for group in out.samples:
            assert len(group) == args.n_samples_per_prompt
            for s in group:
                assert s.index not in samples, f"sample {s.index} trained twice"
                if check is not None:
                    check(s)
                samples[s.index] = s
        for k, v in out.metrics.items():
            totals[k] = totals.get(k, 0) + v
    return samples, totals


def loop_run(coro):
    """Run on the loop the rollout function uses (slime's persistent loop)."""
    return importlib.import_module("slime.utils.async_utils").run(coro)


class Cluster:
    """Emulated SGLang engines + router over loopback HTTP, started on slime's persistent loop."""

    def __init__(self, num_engines: int = 2, seed: int = 7, length=None, replay=None):
        from april_workbench.emulator.cluster import EmulatorCluster
        from april_workbench.emulator.config import EngineConfig
        from april_workbench.emulator.model import LengthModel, SyntheticLM

        # short, long-tailed responses (some run to the budget), emulated 20x faster than real time;
        # ``length`` (a ``LengthModel``) replaces that response-length model
        if length is None:
            length = LengthModel(median_tokens=24.0, prompt_sigma=0.6, truncation_fraction=0.1)
        model = SyntheticLM(seed=seed, length=length)
        # a starved test process pauses the engines with it (max_lag_s), so a loaded machine does not
        # turn the time it lost into a burst of finished requests that leaves no partial to resume;
        # ``replay`` (an ``EmulatedReplay``): engines that return routed experts / top-p kept ids
        self.emulator = EmulatorCluster(num_engines, model=model,
                                        engine_config=EngineConfig(time_scale=20.0, max_lag_s=0.25), replay=replay)

        async def start():
            await self.emulator.start()
            await self.emulator.serve_http()

        loop_run(start())
        self.router_url = self.emulator.router_url

    def bump(self, version: int) -> None:
        """What slime's weight update does to the engines' version (through the router)."""

        async def post():
            async with aiohttp.ClientSession() as session, session.post(
                    f"{self.router_url}/update_weight_version", json={"new_version": str(version)}) as resp:
                resp.raise_for_status()

        loop_run(post())

    def stop(self) -> None:
        loop_run(self.emulator.close())


@pytest.fixture
def cluster(slime_mode):
    c = Cluster()
    c.bump(1)  # slime pushes the first weights (version 1) before rollout 0
    yield c
    rollout.shutdown()
    c.stop()


def point_at(args, cluster):
    host_port = cluster.router_url.removeprefix("http://")
    args.sglang_router_ip, port = host_port.rsplit(":", 1)
    args.sglang_router_port = int(port)
    return args


# ------------------------------------------------------------------ scenarios
def _trained_indices(output) -> list[int]:
    return [g[0].group_index for g in output.samples]


def restart_from_n_loses_and_repeats_nothing(cluster, tmp_path, prompts, loop: str) -> None:
    """slime's train.py: generate N, save N, generate N+1. train_async.py: generate N, generate N+1
    (queued first on the rollout actor), save N. Either way the job dies before N+1 is trained;
    restarted from checkpoint N, every group is trained exactly once or still buffered."""
    args = point_at(make_args(tmp_path, prompts, april_over_sampling_factor=3.0), cluster)
    source = rollout.AprilDataSource(args)
    trained = _trained_indices(rollout.generate_rollout(args, 0, source))
    assert len(source.buffer) > 0, "over-sampling left nothing buffered; the test needs some"
    if loop == "train":
        source.save(0)
        taken_by_1 = rollout.generate_rollout(args, 1, source)
    else:
        taken_by_1 = rollout.generate_rollout(args, 1, source)
        source.save(0)
    handed_out_by_1 = {g[0].group_index for g in taken_by_1.samples}
    rollout.shutdown()  # the job dies here: step 1 was generated but never trained

    restarted = point_at(make_args(tmp_path, prompts, april_over_sampling_factor=3.0, load=args.save), cluster)
    cluster.bump(1)
    source2 = rollout.AprilDataSource(restarted)
    source2.load(0)
    for rollout_id in (1, 2):
        trained += _trained_indices(rollout.generate_rollout(restarted, rollout_id, source2))
    buffered = [int(g.uid) for g in source2.buffer.groups()]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert not set(trained) & set(buffered), "a trained group is still buffered"
    handed_out = set(range(source2._prompts.sample_group_index))
    assert handed_out == set(trained) | set(buffered), "a group handed out was lost"
    assert handed_out_by_1 <= set(trained) | set(buffered)
