"""A slime job's plugin settings: the ``april_*`` keys, parsed and checked each in its own wing.

``JobSettings`` holds the rollout's settings (``rollout``: ``april_slime.core.config.AprilConfig``)
and the loss's (``loss``: ``april_slime.training.settings.LossSettings``), each defined in its own
wing and parsed here from the ``april_*`` attributes that slime set on ``args`` (the seam,
``april_slime.job``, reads them and builds this once per job).

Misspelled keys. slime sets every key of the custom YAML as an attribute of ``args`` (no check:
the file also carries arguments of users' own functions), so a misspelled setting would silently
keep its default. ``from_attributes`` therefore refuses every ``april_*`` attribute that is not a
setting, and, for the keys it can tell came from the custom YAML (``custom_config_keys`` reads the
file slime applied again), every key that names a setting without its prefix (``policy``) or nearly
names one (``aprl_policy``, ``april-policy``). Only the YAML's keys are compared this loosely: every
other attribute of ``args`` is slime's or Megatron's own, and none of those is a near miss of a
setting (checked against slime's parser by ``tests/real``). Each refusal names the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, fields
from typing import Any

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
    def from_attributes(cls, attributes: dict[str, Any], yaml_keys: set[str] | list[str] = ()) -> JobSettings:
        """Build from slime's ``april_*`` attributes (``attributes``: every attribute of ``args`` that
        looks prefixed, by name) and validate the result.

        Refuses ``april_*`` attributes that are not settings, near misses of a setting among the
        custom YAML's keys (``yaml_keys``), and settings the YAML leaves empty (``april_policy:``).
        """
        check_keys(list(attributes), yaml_keys)
        values = {}
        for name, f in _fields().items():
            key = SETTING_PREFIX + name
            value = attributes.get(key)
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


# ---------------------------------------------------------------------------- misspelled keys
def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for cls in (AprilConfig, LossSettings) for f in fields(cls)}


def setting_keys() -> list[str]:
    return [SETTING_PREFIX + name for name in _fields()]


def _normalized(key: str) -> str:
    return key.strip().lower().replace("-", "_")


def looks_prefixed(key: str) -> bool:
    return _normalized(key).startswith(SETTING_PREFIX)


def _closest(key: str) -> str:
    match = difflib.get_close_matches(_normalized(key), setting_keys(), n=1, cutoff=0.5)
    if match:
        return f"closest valid name: {match[0]}"
    return "no setting is close; `april-slime settings` lists them all"


def custom_config_keys(path: str | None) -> set[str]:
    """The keys of the YAML slime applied from ``--custom-config-path`` (empty when there is none,
    or when the file is not readable from this process: then only ``april_*`` keys are checked)."""
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
