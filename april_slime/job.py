"""One slime job as the plugin sees it, read from slime's ``args`` once, at start: the seam.

slime hands the same ``args`` object to the rollout function, the data source, the loss hooks, the
reward post-processing and the train-step hook. Each of them asks ``describe(args)`` and gets the
one ``SlimeJob`` built from it: every slime (and Megatron) argument the plugin reads
(``SlimeArgs``, under slime's own names), the plugin's settings (``JobSettings``, from the
``april_*`` attributes), and what is derived from them once per job (the sampling parameters, the
replay spec). Building it runs every start-time refusal (``april_slime.job_checks``), so a setting
the job cannot serve stops it before its first rollout, with one line naming the key.

Only ``april_slime.slime_args``, which this module calls, reads an attribute of ``args``
(``tests/test_structure.py`` holds that). The rest of the plugin takes the ``SlimeJob`` or narrower
values; the core and the training wing take plain values. ``SlimeJob.args`` is slime's own object,
kept only to hand back to slime's functions (its reward model, filters, sample hooks, log-prob
helper, logger) and to users' generate functions, which take it by contract.

slime sets ``args`` up before it builds the data source (its router address included), and a
process never changes the arguments the plugin reads afterwards, so one reading per process holds.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from april_slime import job_checks, slime_args
from april_slime.core.config import AprilConfig
from april_slime.core.replay import ReplaySpec
from april_slime.settings import JobSettings, custom_config_keys, looks_prefixed, setting_keys
from april_slime.slime_args import SlimeArgs
from april_slime.training.settings import LossSettings


@dataclass(frozen=True)
class SlimeJob:
    """What the plugin knows of one slime job, built once (``describe``) and then left alone."""

    slime: SlimeArgs
    settings: JobSettings
    # the rollout's sampling parameters, without max_new_tokens (read-only: copy to change)
    sampling_params: Mapping[str, Any]
    replay: ReplaySpec
    # slime's own object, handed back to slime's functions and users' generate functions only
    args: Any = field(repr=False, compare=False)

    @property
    def rollout(self) -> AprilConfig:
        return self.settings.rollout

    @property
    def loss(self) -> LossSettings:
        return self.settings.loss

    def args_for_functions(self, host: str, port: int) -> Any:
        """slime's arguments as a job's generate functions get them (``slime_args.args_for_functions``)."""
        return slime_args.args_for_functions(self.args, host, port)


# ---------------------------------------------------------------------------- one per job
_JOBS: dict[int, tuple[Any, SlimeJob]] = {}
_MAX_JOBS = 16  # tests build many jobs in one process; a real job has one args object
_LOCK = threading.Lock()


def describe(args: Any) -> SlimeJob:
    """The job whose arguments are ``args``, read and checked on its first call in this process;
    an ``AprilConfigError`` naming the key when a setting is wrong or the job combines it with what
    it cannot serve."""
    with _LOCK:
        hit = _JOBS.get(id(args))
        if hit is not None and hit[0] is args:
            return hit[1]
    job = _read(args)
    with _LOCK:
        if len(_JOBS) >= _MAX_JOBS:
            _JOBS.pop(next(iter(_JOBS)))
        _JOBS[id(args)] = (args, job)
    return job


def for_job(args: Any) -> JobSettings:
    """The validated plugin settings of the job whose arguments are ``args``."""
    return describe(args).settings


def read_settings(args: Any) -> JobSettings:
    """The plugin's settings in ``args``, each valid on its own (``describe`` adds the job's checks)."""
    return _settings(args, SlimeArgs.read(args))


def _settings(args: Any, slime: SlimeArgs) -> JobSettings:
    attributes = slime_args.prefixed_attributes(args, looks_prefixed, setting_keys())
    return JobSettings.from_attributes(attributes, custom_config_keys(slime.custom_config_path))


def _read(args: Any) -> SlimeJob:
    from april_slime.samples import replay_spec

    slime = SlimeArgs.read(args)
    settings = _settings(args, slime)
    job_checks.check_job(slime, settings.rollout, settings.loss)
    return SlimeJob(slime=slime, settings=settings, sampling_params=MappingProxyType(slime.sampling_params()),
                    replay=replay_spec(slime), args=args)


__all__ = ["SlimeArgs", "SlimeJob", "describe", "for_job", "read_settings"]
