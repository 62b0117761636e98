"""A slime job's plugin settings, built once per job.

slime hands the same ``args`` object to the rollout function, the data source, the loss hooks and
the train-step hook. Each of them asks ``for_job(args)`` and gets the one ``AprilConfig`` built
from it: parsed from the ``april_*`` attributes (misspelled keys refused), cross-checked against
slime's own arguments, and then left alone. What a single entry point refuses on top (the rollout
side's unsupported slime features, VCPO's unsupported setups) stays with that entry point, which
checks it against these same settings.
"""

from __future__ import annotations

import threading
from typing import Any

from april_slime.core.config import AprilConfig

_JOBS: dict[int, tuple[Any, AprilConfig]] = {}
_MAX_JOBS = 16  # tests build many jobs in one process; a real job has one args object
_LOCK = threading.Lock()


def for_job(args: Any) -> AprilConfig:
    """The validated settings of the job whose arguments are ``args``; an ``AprilConfigError``
    naming the key when they are wrong."""
    with _LOCK:
        hit = _JOBS.get(id(args))
        if hit is not None and hit[0] is args:
            return hit[1]
    config = AprilConfig.from_args(args)
    config.check_against_slime(args)
    with _LOCK:
        if len(_JOBS) >= _MAX_JOBS:
            _JOBS.pop(next(iter(_JOBS)))
        _JOBS[id(args)] = (args, config)
    return config
