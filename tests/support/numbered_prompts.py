"""A prompt source for a scheduler driven by hand: group ``i`` is ``f"{prefix}{i}"``, with ``n``
samples of prompt ``numbered_prompt(i)``. The emulator keys a prompt's response lengths on its
first four tokens, so these differ for every ``i``."""

from __future__ import annotations

from collections.abc import Sequence

from april_slime.core.types import Group, Trajectory


def numbered_prompt(i: int, tail: Sequence[int] = ()) -> list[int]:
    return [10 + i, 20 + 3 * i, 30 + 7 * i, 40 + 11 * i, *tail]


class NumberedPrompts:
    """``next_groups`` for ``RolloutScheduler.run_step``. Sample ``j`` of a group has sampling
    seed ``first_seed + j``; ``stamp_version``: a group's ``created_version`` is the version it is
    handed out at (else 0); ``handed_out``: a set (a ledger's) every group's uid is added to."""

    def __init__(self, prefix: str, n: int, max_new_tokens: int, *, first_seed: int = 0,
                 tail: Sequence[int] = (), stamp_version: bool = False, handed_out: set[str] | None = None):
        self.prefix, self.n, self.max_new_tokens = prefix, n, max_new_tokens
        self.first_seed, self.tail, self.stamp_version = first_seed, tuple(tail), stamp_version
        self.handed_out = handed_out
        self.made: list[str] = []  # uids handed out, in order

    def next_groups(self, k: int, current_version: int) -> list[Group]:
        out = []
        for _ in range(k):
            i = len(self.made)
            uid = f"{self.prefix}{i}"
            prompt = numbered_prompt(i, self.tail)
            out.append(Group(uid=uid, prompt_ids=prompt, created_version=current_version if self.stamp_version else 0,
                             trajectories=[Trajectory(uid=f"{uid}/{j}", group_uid=uid, index_in_group=j,
                                                      prompt_ids=list(prompt), max_new_tokens=self.max_new_tokens,
                                                      sampling_seed=self.first_seed + j) for j in range(self.n)]))
            self.made.append(uid)
            if self.handed_out is not None:
                self.handed_out.add(uid)
        return out
