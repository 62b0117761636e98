"""The staleness pacing's rules on hand-made groups (the scheduler's runs are in test_scheduler)."""

from april_slime.core.pacing import StalenessPacing
from april_slime.core.types import Group, Trajectory, TrajectoryStatus


def group(uid, oldest=None, interruptions=0, finished=False):
    t = Trajectory(uid=f"{uid}/0", group_uid=uid, index_in_group=0, prompt_ids=[1, 2], max_new_tokens=50,
                   sampling_seed=0)
    if oldest is not None:
        t.append([5, 6], [-1.0, -1.0], oldest)
        t.status = TrajectoryStatus.COMPLETED if finished else TrajectoryStatus.ABORTED
    return Group(uid=uid, prompt_ids=[1, 2], trajectories=[t], interruptions=interruptions)


def pacing(k=2, m=None, version=10, target=2, live=()):
    p = StalenessPacing(max_staleness=k, max_interruptions=m, current_version=version, target=target)
    for g in live:  # what the step's groups report as they change place
        p.track(g, live=True)
    return p


def test_groups_resume_tightest_slack_first_and_protected_ones_with_the_due():
    p = pacing(k=2, m=2)
    fresh, young, due, suspended = group("a"), group("b", oldest=9), group("c", oldest=8), group("d", 10, 2)
    order = p.protect([fresh, young, due, suspended], [young, due, suspended])
    assert [g.uid for g in order] == ["c", "d", "b", "a"]
    assert p.protected == {"d"} and p.slack(suspended) == 0 and p.must_finish(due)


def test_protection_never_crowds_out_a_due_group():
    p = pacing(k=2, m=1, target=2)
    due = [group("x", oldest=8), group("y", oldest=8)]
    suspended = group("s", oldest=10, interruptions=5)
    p.protect([*due, suspended], [*due, suspended])
    assert p.protected == set()  # two due groups fill both slots of this step


def test_a_new_group_opens_only_if_every_group_can_still_be_trained_in_time():
    live = [group("a", oldest=9), group("b", oldest=10), group("c", oldest=10)]
    p = pacing(k=1, target=2, live=live)
    # slack 0: 1 group <= 2 slots now; slack <= 1: 3 groups + the new one <= 2 + 2
    assert p.may_open(group("new"), accepted=0)
    assert not p.may_open(group("new"), accepted=1)
    assert p.may_open(live[1], accepted=1)  # already counted: opening it changes nothing


def test_a_passing_group_waits_while_the_due_ones_need_the_slots():
    due, young = group("d", oldest=9), group("y", oldest=10, finished=True)
    p = pacing(k=1, target=2, live=[due, young])
    assert not p.may_accept(young, accepted=1)  # the last slot is the due group's
    assert p.may_accept(young, accepted=0)
    assert p.may_accept(due, accepted=1)  # a due group is always accepted


def test_unbounded_and_unprotected_means_no_pacing():
    p = StalenessPacing(max_staleness=None, max_interruptions=None, current_version=3, target=1)
    assert not p.active and p.slack(group("a", oldest=0)) is None
