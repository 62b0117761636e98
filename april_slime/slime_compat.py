"""Which slime the plugin runs in, and what it cannot serve there: checked once, at job start.

The plugin is built and tested against slime at the pinned commit (624b824a8, version 0.3.1). slime
0.4.0 (read in its public source) changed what the plugin meets:

* the data source module moved from ``slime.rollout.data_source`` to ``slime.data.data_source``
  (same ``RolloutDataSource``: the same position attributes, ``save`` / ``load``, and a
  ``state_dict`` that now also saves slime's own buffer): resolved here, both work;
* ``train_async.py``, ``--update-weights-interval`` and ``--disable-rollout-global-dataset`` are
  gone: the plugin reads none of them;
* ``--rollout-data-transport straw``: slime's durable queue (``slime/data/queue_data_source.py``,
  ``RolloutQueueController``) hands prompts and partial continuations out as leased tasks, takes
  each group back as the completion of the lease it was generated under
  (``slime/data/transport.py``, ``pack_rollout_group``: one lease across a group's samples) and
  checkpoints the pending continuations itself. The plugin's data source keeps partial groups
  across steps in its own buffer and checkpoint, and returns a group in whatever later step it
  finishes: a partial would be owned, saved and resumed by both, and a late group would complete
  a lease long expired. The samples are not the obstacle: everything the plugin puts on them
  passes straw's codec (``slime/data/codec.py``; ``tests/test_straw_codec_rules.py``). Refused at
  start;
* ``--buffer-sort-by-staleness`` orders slime's in-memory buffer, which the plugin's data source
  replaces: it would be ignored. Refused at start, naming the plugin's equivalent
  (``april_resume_priority: stalest``);
* ``--flush-cache-interval`` other than 1 keeps the radix cache across weight updates (in-place
  pausing): a partial resumed after an update then continues on keys and values the old weights
  wrote, while its new tokens are recorded under the new version (docs/real-stack.md measures what
  such tokens are). It works; ``notes`` says so at start.

``check_job(slime)`` raises ``AprilConfigError`` with one line naming the slime version and what is
missing; ``notes(slime)`` are the warnings; ``describe()`` is what ``scripts/check_env.py`` prints.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from typing import TYPE_CHECKING

from april_slime.core.config import AprilConfigError

if TYPE_CHECKING:
    from april_slime.slime_args import SlimeArgs

PINNED_VERSION = "0.3.1"  # slime's setup.py at the pinned commit 624b824a8
# where slime keeps RolloutDataSource: the pinned commit's module first, then 0.4.0's
DATA_SOURCE_MODULES = ("slime.rollout.data_source", "slime.data.data_source")


def slime_version() -> str | None:
    """slime's installed version (its setup.py's), or None when slime is not installed as a package."""
    try:
        return importlib.metadata.version("slime")
    except importlib.metadata.PackageNotFoundError:
        return None


def _has_module(name: str) -> bool:
    if sys.modules.get(name) is not None:  # imported already (or put there by a stand-in)
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is missing, or a half-installed one
        return False


def data_source_module() -> str:
    """The module holding slime's ``RolloutDataSource`` in the slime on the path."""
    for name in DATA_SOURCE_MODULES:
        if _has_module(name):
            return name
    raise ImportError(f"slime has no RolloutDataSource module (looked for {' and '.join(DATA_SOURCE_MODULES)})")


def layout() -> str:
    """``"0.3"`` (the pinned commit's modules), ``"0.4"`` (0.4.0's) or ``"unknown"``."""
    if _has_module(DATA_SOURCE_MODULES[0]):
        return "0.3"
    if _has_module(DATA_SOURCE_MODULES[1]):
        return "0.4"
    return "unknown"


def _label() -> str:
    version = slime_version()
    return f"slime {version}" if version else f"slime ({layout()} layout, version unknown)"


def check_job(slime: SlimeArgs) -> None:
    """Stop the job at start, with one line, where this slime asks for what the plugin cannot serve."""
    if slime.rollout_data_transport == "straw":
        raise AprilConfigError(
            f"rollout_data_transport: {_label()} with --rollout-data-transport straw is not supported by "
            "april_slime: straw's durable queue hands prompts and partial continuations out as leased tasks, "
            "takes each group back as the completion of its lease and checkpoints pending continuations "
            "itself, while the plugin's data source keeps partial groups across steps in its own buffer and "
            "checkpoint, so a partial would be saved and resumed by both and a group finished steps later "
            "would complete an expired lease; use the default object-store transport")
    if slime.buffer_sort_by_staleness:
        raise AprilConfigError(
            f"buffer_sort_by_staleness: {_label()}'s --buffer-sort-by-staleness sorts slime's own buffer, "
            "which april_slime's data source replaces; drop it and set april_resume_priority: stalest")


def notes(slime: SlimeArgs) -> list[str]:
    """What works on this slime but differs from the pinned one (logged at start)."""
    out = []
    interval = slime.flush_cache_interval
    if interval is not None and interval != 1:
        out.append(f"{_label()}: --flush-cache-interval {interval} keeps the KV cache across weight updates; a "
                   "partial resumed after an update continues on the old weights' cache, its new tokens are "
                   "recorded under the new version")
    if layout() == "0.4":
        out.append(f"{_label()}: built and tested against slime {PINNED_VERSION} (624b824a8); the plugin's "
                   "slime patch targets that commit")
    return out


def describe() -> tuple[str, str]:
    """(level, line) for scripts/check_env.py: ok on the pinned layout, warn on 0.4.0's, fail when
    neither module is there."""
    where = layout()
    if where == "unknown":
        return "FAIL", f"{_label()}: no RolloutDataSource module ({' or '.join(DATA_SOURCE_MODULES)})"
    if where == "0.3":
        return "ok", f"{_label()}: data source in {DATA_SOURCE_MODULES[0]} (the layout tested, {PINNED_VERSION})"
    return "warn", (f"{_label()}: data source in {DATA_SOURCE_MODULES[1]} (0.4.0's layout): runs, except "
                    "--rollout-data-transport straw and --buffer-sort-by-staleness, which stop the job at start; "
                    f"tested against {PINNED_VERSION}")
