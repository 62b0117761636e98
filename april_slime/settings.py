"""A slime job's plugin settings, built and checked once per job.

slime hands the same ``args`` object to the rollout function, the data source, the loss hooks and
the train-step hook. Each of them asks ``for_job(args)`` and gets the one ``JobSettings`` built from
it: the rollout's settings (``rollout``: ``april_slime.core.config.AprilConfig``) and the loss's
(``loss``: ``april_slime.training.settings.LossSettings``), each defined in its own wing, parsed
here from the ``april_*`` attributes and cross-checked against slime's own arguments, then left
alone.

Misspelled keys. slime sets every key of the custom YAML as an attribute of ``args`` (no check:
the file also carries arguments of users' own functions), so a misspelled setting would silently
keep its default. ``from_args`` therefore refuses every ``april_*`` attribute that is not a setting,
and, for the keys it can tell came from the custom YAML (it reads ``args.custom_config_path`` again),
every key that names a setting without its prefix (``policy``) or nearly names one (``aprl_policy``,
``april-policy``). Only the YAML's keys are compared this loosely: every other attribute of ``args``
is slime's or Megatron's own, and none of those is a near miss of a setting (checked against
slime's parser by ``tests/real``). Each refusal names the closest valid key.

Start-time refusals. ``for_job`` runs ``april_slime.job_checks.check_job`` once per job, wherever
the job first asks for its settings (the plugin's data source, when slime's rollout manager starts):
every refusal that needs only the settings and slime's arguments stops the job there, before its
first rollout, with one line naming the key. What needs the running job to decide is refused where
it is first known (``april_slime.job_checks`` says which).
"""

from __future__ import annotations

import dataclasses
import difflib
import threading
from dataclasses import dataclass, fields
from typing import Any

from april_slime import job_checks
from april_slime.core.config import AprilConfig, AprilConfigError, coerce
from april_slime.core.keys import SETTING_PREFIX
from april_slime.training.settings import LossSettings, LossSettingsError

# How close a custom-YAML key must be to a setting's name to be taken for a misspelling of it.
NEAR_MISS_CUTOFF = 0.85


@dataclass(frozen=True)
class JobSettings:
    """Every plugin setting of one job: the rollout's and the loss's."""

    rollout: AprilConfig
    loss: LossSettings

    @classmethod
    def from_args(cls, args: Any) -> JobSettings:
        """Read every ``args.april_<name>`` that is set (not None) and validate the result.

        Refuses ``april_*`` attributes that are not settings, near misses of a setting among the
        custom YAML's keys, and settings the YAML leaves empty (``april_policy:``).
        """
        yaml_keys = custom_config_keys(args)
        check_keys([k for k in _attributes(args) if _looks_prefixed(k)], yaml_keys)
        values = {}
        for name, f in _fields().items():
            key = SETTING_PREFIX + name
            value = getattr(args, key, None)
            if value is not None:
                values[name] = value
            elif key in yaml_keys:
                coerce(name, f, None, empty="must not be empty")
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> JobSettings:
        """Build from plain keys (with or without the ``april_`` prefix); unknown keys are an error."""
        known = _fields()
        rollout: dict[str, Any] = {}
        loss: dict[str, Any] = {}
        for key, value in values.items():
            name = key[len(SETTING_PREFIX):] if key.startswith(SETTING_PREFIX) else key
            if name not in known:
                raise AprilConfigError(f"{SETTING_PREFIX}{name}: unknown setting; {_closest(SETTING_PREFIX + name)}")
            (loss if name in LossSettings.names() else rollout)[name] = coerce(name, known[name], value)
        try:
            loss_settings = LossSettings.build(loss)
        except LossSettingsError as e:
            raise AprilConfigError(str(e)) from None
        return cls(rollout=AprilConfig.from_dict(rollout), loss=loss_settings)

    def to_dict(self, prefixed: bool = False) -> dict[str, Any]:
        out = {**self.rollout.to_dict(), **dataclasses.asdict(self.loss)}
        return {SETTING_PREFIX + k: v for k, v in out.items()} if prefixed else out


# ---------------------------------------------------------------------------- one per job
_JOBS: dict[int, tuple[Any, JobSettings]] = {}
_MAX_JOBS = 16  # tests build many jobs in one process; a real job has one args object
_LOCK = threading.Lock()


def for_job(args: Any) -> JobSettings:
    """The validated settings of the job whose arguments are ``args``; an ``AprilConfigError``
    naming the key when they are wrong or the job combines them with what they cannot serve."""
    with _LOCK:
        hit = _JOBS.get(id(args))
        if hit is not None and hit[0] is args:
            return hit[1]
    settings = JobSettings.from_args(args)
    job_checks.check_job(args, settings.rollout, settings.loss)
    with _LOCK:
        if len(_JOBS) >= _MAX_JOBS:
            _JOBS.pop(next(iter(_JOBS)))
        _JOBS[id(args)] = (args, settings)
    return settings


# ---------------------------------------------------------------------------- misspelled keys
def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for cls in (AprilConfig, LossSettings) for f in fields(cls)}


def setting_keys() -> list[str]:
    return [SETTING_PREFIX + name for name in _fields()]


def _attributes(args: Any) -> list[str]:
    try:
        return list(vars(args))
    except TypeError:  # an args object without __dict__
        return [k for k in dir(args) if not k.startswith("__")]


def _normalized(key: str) -> str:
    return key.strip().lower().replace("-", "_")


def _looks_prefixed(key: str) -> bool:
    return _normalized(key).startswith(SETTING_PREFIX)


def _closest(key: str) -> str:
    match = difflib.get_close_matches(_normalized(key), setting_keys(), n=1, cutoff=0.5)
    if match:
        return f"closest valid name: {match[0]}"
    return "no setting is close; `april-slime settings` lists them all"


def custom_config_keys(args: Any) -> set[str]:
    """The keys of the YAML slime applied from ``--custom-config-path`` (empty when there is none,
    or when the file is not readable from this process: then only ``april_*`` keys are checked)."""
    path = getattr(args, "custom_config_path", None)
    if not path:
        return set()
    try:
        import yaml

        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except Exception:  # unreadable here (another node's path), or changed since slime parsed it
        return set()
    return {str(k) for k in data} if isinstance(data, dict) else set()


def check_keys(prefixed_attributes: list[str], yaml_keys: set[str] | list[str] = ()) -> None:
    """Stop at the first key that looks meant for this plugin but is not one of its settings."""
    valid = set(setting_keys())
    unprefixed = {k[len(SETTING_PREFIX):] for k in valid}
    for key in sorted(prefixed_attributes):
        if key not in valid:
            raise AprilConfigError(f"{key}: unknown setting; {_closest(key)}")
    for key in sorted(yaml_keys):
        if key in valid:
            continue
        norm = _normalized(key)
        if norm in valid or norm.startswith(SETTING_PREFIX):
            raise AprilConfigError(f"{key}: unknown setting; {_closest(norm)}")
        if norm in unprefixed:
            raise AprilConfigError(f"{key}: plugin settings take the {SETTING_PREFIX} prefix; "
                                   f"closest valid name: {SETTING_PREFIX}{norm}")
        near = difflib.get_close_matches(norm, sorted(valid | unprefixed), n=1, cutoff=NEAR_MISS_CUTOFF)
        if near:
            name = near[0] if near[0].startswith(SETTING_PREFIX) else SETTING_PREFIX + near[0]
            raise AprilConfigError(f"{key}: not a setting, but close to one; closest valid name: {name}")


def settings_table_markdown() -> str:
    """The README's settings table, generated from the fields so the two cannot drift: the rollout's
    settings, then the loss's and VCPO's."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for f in _fields().values():
        default = f.default if f.default is not dataclasses.MISSING else None
        rows.append(f"| `{SETTING_PREFIX}{f.name}` | `{default}` | {f.metadata.get('help', '')} |")
    return "\n".join(rows)
