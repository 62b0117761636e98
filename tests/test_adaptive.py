"""The adaptive concurrency controller on synthetic load sequences."""

import pytest

from april_slime.core.adaptive import AdaptiveConcurrencyController
from april_slime.core.config import AprilConfig
from april_slime.core.sglang_protocol import EngineLoad

CAPACITY = 100_000


def loads(running, used, *, waiting=0, retractions=0, engines=2, capacity=CAPACITY):
    """`engines` identical engines sharing the totals evenly; `retractions` is each engine's
    cumulative counter."""
    return [
        EngineLoad(url=f"http://e{i}", num_running=running // engines, num_waiting=waiting // engines,
                   used_tokens=used // engines, capacity_tokens=capacity // engines,
                   retractions=retractions)
        for i in range(engines)
    ]


def make(**kw):
    args = dict(initial_concurrency=64, min_concurrency=8, max_concurrency=512, cooldown_s=10.0,
                min_step=8, settle_s=0.0)
    args.update(kw)
    return AdaptiveConcurrencyController(**args)


def test_initial_is_clamped_configured_value():
    assert make().initial() == 64
    assert make(initial_concurrency=4).initial() == 8
    assert make(initial_concurrency=1000).initial() == 512


def test_grows_gradually_while_kv_is_low_and_stops_at_what_fills_the_pool():
    c = make(initial_concurrency=100)
    n = c.initial()
    for t in range(1, 200):
        # every request holds 400 KV tokens: the pool fits 0.9 * 100000 / 400 = 225 at the target
        new = c.observe(loads(n, n * 400), now=float(t))
        assert new >= n
        assert new - n <= max(8, int(n * 0.03)), "growth per observation is bounded"
        n = new
    assert n == 225  # capped by what today's requests need to fill the pool to the target
    assert c.observe(loads(225, 225 * 400), now=300.0) == 225


def test_no_growth_when_scheduler_is_not_using_its_concurrency():
    c = make(initial_concurrency=200)
    for t in range(10):  # only 40 requests busy (end of a step): low KV must not wind N' up
        assert c.observe(loads(40, 10_000), now=float(t)) == 200


def test_queue_at_full_pool_shrinks_to_what_runs_then_holds():
    c = make(initial_concurrency=300)
    c.observe(loads(200, 80_000), now=0.0)
    assert c.observe(loads(200, 95_000, waiting=100), now=1.0) == 210  # ceil(200 * 1.05)
    # echoes inside the cool-down change nothing, in either direction
    assert c.observe(loads(150, 99_000, waiting=120), now=5.0) == 210
    assert c.observe(loads(210, 30_000), now=9.0) == 210
    # after the cool-down it may grow again
    assert c.observe(loads(210, 30_000), now=12.0) > 210


def test_small_queue_or_queue_below_target_is_tolerated():
    c = make(initial_concurrency=300)
    assert c.observe(loads(290, 95_000, waiting=10), now=1.0) == 300  # < 10% of running
    c2 = make(initial_concurrency=300)
    # a queue while the pool is still filling (re-prefill at the start of a step) is no signal
    assert c2.observe(loads(100, 50_000, waiting=200), now=1.0) == 300


def test_retraction_burst_at_full_pool_decreases_multiplicatively():
    c = make(initial_concurrency=300)
    c.observe(loads(250, 95_000, retractions=5), now=0.0)  # baseline
    # 2 engines x 20 new retractions in 1 s with 250 running: far above 3% per request per second
    assert c.observe(loads(250, 99_000, retractions=25), now=1.0) == 225  # floor(250 * 0.9)


def test_few_retractions_at_a_full_pool_are_tolerated():
    c = make(initial_concurrency=300)
    c.observe(loads(250, 95_000, retractions=5), now=0.0)
    # 2 new in 1 s with 250 running: 0.8% per request per second, the price of a full pool
    assert c.observe(loads(250, 99_000, retractions=6), now=1.0) == 300


def test_retractions_seen_below_target_or_across_a_gap_are_stale():
    c = make(initial_concurrency=300)
    c.observe(loads(250, 95_000, retractions=0), now=0.0)
    c.observe(loads(250, 95_000, retractions=0), now=2.0)  # learns the 2 s polling interval
    # retractions counted while the pool is at 30%: they happened before (previous step)
    assert c.observe(loads(100, 30_000, retractions=50), now=4.0) == 300
    # a 30 s gap (training phase): the counter moved while nobody steered
    assert c.observe(loads(250, 99_000, retractions=200), now=34.0) == 300
    # the next burst after that is news again
    assert c.observe(loads(250, 99_000, retractions=260), now=36.0) == 225


def test_engine_restart_does_not_count_as_retractions():
    c = make(initial_concurrency=100)
    c.observe(loads(100, 95_000, retractions=50), now=0.0)
    # the counter went down (engine restarted): new baseline, no decrease
    assert c.observe(loads(100, 95_000, retractions=0), now=1.0) == 100
    assert c.observe(loads(100, 95_000, retractions=30), now=2.0) == 90


def test_bounds_are_respected():
    c = make(initial_concurrency=500, max_concurrency=512)
    for t in range(5):
        n = c.observe(loads(c.current, c.current * 10), now=float(t))
    assert n == 512
    c = make(initial_concurrency=16, min_concurrency=8, cooldown_s=0.0)
    for t in range(10):
        n = c.observe(loads(16, 99_000, retractions=10 * (t + 1)), now=float(t))
    assert n == 8


def test_empty_or_zero_capacity_loads_keep_current():
    c = make()
    assert c.observe([], now=1.0) == 64
    assert c.observe(loads(64, 0, capacity=0), now=2.0) == 64


def test_from_config_uses_plugin_bounds():
    config = AprilConfig.from_dict({"policy": "copris", "concurrency": 128, "min_concurrency": 16,
                                    "max_concurrency": 1024, "adaptive_concurrency": True})
    c = AdaptiveConcurrencyController.from_config(config, rollout_batch_size=32,
                                                  n_samples_per_prompt=8)
    assert (c.initial(), c.min_concurrency, c.max_concurrency, c.min_step) == (128, 16, 1024, 8)
    default = AdaptiveConcurrencyController.from_config(AprilConfig(), 32, 8)
    assert (default.initial(), default.max_concurrency) == (256, 1024)


@pytest.mark.parametrize("bad", [dict(decrease_factor=1.0), dict(max_growth=1.0), dict(gain=0.0),
                                 dict(target_kv_utilization=0.0), dict(min_concurrency=0),
                                 dict(min_concurrency=600, max_concurrency=512), dict(min_step=0)])
def test_invalid_settings_are_rejected(bad):
    with pytest.raises(ValueError):
        make(**bad)


def test_settles_below_the_kv_limit_of_a_toy_engine_from_any_start():
    """A toy engine pair: 400 KV tokens per request, so 250 requests fill the pool. Demand beyond
    that queues (and a tenth of the excess is retracted per second). Whatever the start, the
    controller must settle just below the pool size without oscillating through decreases."""
    for start in (16, 250, 1000):
        c = make(initial_concurrency=start, max_concurrency=2048, cooldown_s=5.0)
        retractions = 0
        n = c.initial()
        seen = []
        for t in range(400):
            running = min(n, 250)
            waiting = n - running
            retractions += waiting // 10
            n = c.observe(loads(running, running * 400, waiting=waiting, retractions=retractions),
                          now=float(t))
            seen.append(n)
        tail = seen[-100:]
        assert all(215 <= x <= 275 for x in tail), (start, tail[-10:])  # queue tolerance 10%
        assert max(tail) - min(tail) <= 20, (start, tail[-10:])


def test_no_growth_while_the_pool_is_still_filling():
    """At a fixed N' young requests keep growing: KV rising means today's KV per request
    understates what N' needs, so the controller waits until the pool stops filling."""
    c = make(initial_concurrency=100, settle_s=10.0)
    kv = 10_000
    for t in range(30):  # KV grows 1000 tokens a second at a constant 100 requests
        assert c.observe(loads(100, kv), now=float(t)) == 100
        kv += 1000
    for t in range(30, 45):  # flat for a full window, still below the target: grow
        n = c.observe(loads(100, kv), now=float(t))
    assert n > 100
