"""Per-token policy versions, run-length encoded: ``[[version, count], ...]``.

Every generated token carries the version of the weights that sampled it. A response holds few
distinct versions in long runs (one per segment, two where the weights changed mid-call), so the
versions travel as runs from the engine's reply (SGLang's ``meta_info.weight_versions`` spans) through
the trajectory, the buffer and its checkpoints, a generate function's reply, to slime's
``Sample.train_metadata`` and the loss. ``VersionRuns`` is that encoding and every operation on it:
adding a run (merged with the last when the version repeats), truncating, expanding to one version
per token, shifting, and converting to and from SGLang's spans.

The runs are this class's own: it is no ``list``, so nothing but its methods changes them, and it
keeps two invariants: no run has a count of zero or less, and no two adjacent runs share a version.
Whatever stores the runs (a checkpoint's JSON, a sample's metadata, an engine's reply) takes the plain
pairs of ``plain()`` and reads them back with ``VersionRuns.of``, which checks them. Reading is
iteration over ``(version, count)`` pairs, ``runs()`` (the same pairs as a tuple) and the named
readings below (``newest``, ``oldest``, ``total``, ...).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any


class VersionRuns:
    """``[[version, count], ...]``: the policy version of each of ``total`` tokens, in order."""

    __slots__ = ("_runs", "_total")

    def __init__(self) -> None:
        """No tokens; the builders below make runs from pairs, versions or SGLang's spans."""
        self._runs: list[list[int]] = []
        self._total = 0  # tokens in all runs, kept as runs are added (checked for every restored trajectory)

    # ------------------------------------------------------------------ building
    @classmethod
    def of(cls, pairs: Iterable[Sequence[int]], total: int | None = None) -> VersionRuns:
        """Runs from plain ``[version, count]`` pairs (merged, empty runs skipped); ``ValueError``
        when a count is negative or, given ``total``, the counts do not add up to it."""
        pairs, runs = list(pairs), cls()
        for version, count in pairs:
            if int(count) < 0:
                raise ValueError(f"per-token versions {pairs!r}: negative count {count}")
            runs.add(version, count)
        if total is not None and runs.total != total:
            raise ValueError(f"per-token versions {runs!r} cover {runs.total} tokens, not {total}")
        return runs

    @classmethod
    def each(cls, many: Iterable[Any]) -> list[VersionRuns]:
        """``of`` of each of ``many`` (lists of pairs; a ``VersionRuns`` is kept as it is), in one
        loop: a restore reads thousands. Pairs already as ``add`` keeps them (ints, counts > 0,
        no version twice in a row: what ``plain`` wrote) are taken as they are."""
        out, new = [], cls.__new__
        for pairs in many:
            if type(pairs) is list:
                held, total, last = [], 0, None
                for version, count in pairs:
                    if type(count) is not int or type(version) is not int or count <= 0 or version == last:
                        break
                    held.append([version, count])
                    total += count
                    last = version
                else:
                    runs = new(cls)
                    runs._runs, runs._total = held, total
                    out.append(runs)
                    continue
            out.append(pairs if isinstance(pairs, VersionRuns) else cls.of(pairs))
        return out

    @classmethod
    def single(cls, version: int, count: int) -> VersionRuns:
        """``count`` tokens of one version (none when ``count`` is 0)."""
        return cls().add(version, count)

    @classmethod
    def from_versions(cls, versions: Iterable[int]) -> VersionRuns:
        """Runs of a per-token version list."""
        runs = cls()
        for version in versions:
            runs.add(version, 1)
        return runs

    @classmethod
    def from_spans(cls, spans: Iterable[tuple[int, int, int]], total: int) -> VersionRuns:
        """Runs of SGLang's ``weight_versions`` spans, given as ``(version, start, end)``; they must
        tile ``[0, total)`` in order (empty spans allowed), else ``ValueError`` saying where not."""
        runs, pos = cls(), 0
        for i, (version, start, end) in enumerate(spans):
            if start != pos or end < start or end > total:
                raise ValueError(f"span {i} [{start}, {end}) does not continue the spans at token {pos} "
                                 f"within {total} tokens")
            runs.add(version, end - start)
            pos = end
        if pos != total:
            raise ValueError(f"the spans cover {pos} of {total} tokens")
        return runs

    # ------------------------------------------------------------------ changing
    def add(self, version: int, count: int) -> VersionRuns:
        """Append ``count`` tokens of ``version`` (merged into the last run when it is the same)."""
        if count > 0:
            if self._runs and self._runs[-1][0] == version:
                self._runs[-1][1] += int(count)
            else:
                self._runs.append([int(version), int(count)])
            self._total += int(count)
        return self

    def extend_runs(self, other: Iterable[Sequence[int]]) -> VersionRuns:
        """Append another segment's runs."""
        for version, count in other:
            self.add(version, count)
        return self

    # ------------------------------------------------------------------ reading
    def __iter__(self) -> Iterator[tuple[int, int]]:
        """The runs as ``(version, count)`` pairs, oldest first."""
        return ((version, count) for version, count in self._runs)

    def __len__(self) -> int:
        """The number of runs (not of tokens: that is ``total``)."""
        return len(self._runs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, VersionRuns):
            return NotImplemented  # a plain list compares through ``plain()``
        return self._runs == other._runs

    __hash__ = None  # type: ignore[assignment]  # changes in place

    def __repr__(self) -> str:
        return f"VersionRuns({self._runs!r})"

    def runs(self) -> tuple[tuple[int, int], ...]:
        """The runs as a tuple of ``(version, count)`` pairs (a copy: changing it changes nothing here)."""
        return tuple(self)

    @property
    def total(self) -> int:
        return self._total

    def truncated(self, length: int) -> VersionRuns:
        """The runs of the first ``length`` tokens."""
        out, left = VersionRuns(), length
        for version, count in self:
            if left <= 0:
                break
            out.add(version, min(count, left))
            left -= count
        return out

    def shifted(self, offset: int) -> VersionRuns:
        """Every version moved by ``offset`` (a restored job's numbering)."""
        out = VersionRuns()
        out._runs = [[version + offset, count] for version, count in self._runs]
        out._total = self._total
        return out

    def expand(self) -> list[int]:
        """One version per token."""
        out: list[int] = []
        for version, count in self:
            out.extend([version] * count)
        return out

    def oldest(self) -> int | None:
        """The oldest version of any token (None without tokens)."""
        return min((version for version, _ in self._runs), default=None)

    def newest(self) -> int | None:
        """The version of the last token (None without tokens)."""
        return self._runs[-1][0] if self._runs else None

    def count_other_than(self, version: int) -> int:
        """Tokens of any other version than ``version``."""
        return sum(count for v, count in self if v != version)

    def to_spans(self) -> list[dict]:
        """SGLang's ``weight_versions`` spans (``{"version": "<v>", "start", "end"}``) of the runs."""
        spans, start = [], 0
        for version, count in self:
            spans.append({"version": str(version), "start": start, "end": start + count})
            start += count
        return spans

    def plain(self) -> list[list[int]]:
        """A copy as plain lists (what JSON and slime's metadata hold)."""
        return [[int(version), int(count)] for version, count in self._runs]
