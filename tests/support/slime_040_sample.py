"""slime 0.4.0's sampler-capture fields on the installed slime's ``Sample``.

The project pins an older slime whose ``Sample`` has no field for score centering. slime 0.4.0 adds
three (named in its ``slime/data/codec.py``, which stores them as tensors, and filled by
``slime/utils/score_centering.py``): ``rollout_top_p_log_probs`` (float32, one per top-p kept id)
and ``rollout_topk_token_ids`` / ``rollout_topk_log_probs`` (int32 / float32, ``[response, k]``).
``with_040_fields`` declares them on a subclass of the installed ``Sample`` and puts it where the
plugin looks (``slime.utils.types.Sample``) for one test, so the plugin sees a slime whose
``Sample`` has them; every other field and method is the installed slime's own.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

FIELDS_040 = ("rollout_top_p_log_probs", "rollout_topk_token_ids", "rollout_topk_log_probs")


def require_real_slime() -> None:
    """Skip the calling test, saying why, unless slime itself imports (the fast tier runs without it)."""
    import sys

    import pytest

    from tests.support.slime_standin import real_slime_importable

    # a test that installed the stand-in (``slime_mode`` without slime) sees it as ``slime``: it has no file
    if not real_slime_importable() or getattr(sys.modules.get("slime"), "__file__", None) is None:
        pytest.skip("needs slime's own Sample (slime is not installed; scripts/real-stack/setup.sh installs it)")


@functools.cache
def sample_with_040_fields() -> type:
    """One subclass per process: a slime module that imports ``Sample`` while it is installed keeps
    that class, so a later test must install the same one (slime checks ``isinstance`` against it)."""
    from slime.utils.types import Sample

    return dataclasses.make_dataclass("Sample", [(name, Any, dataclasses.field(default=None)) for name in FIELDS_040],
                                      bases=(Sample,), namespace={"__module__": Sample.__module__})


def with_040_fields(monkeypatch) -> type:
    """Install the subclass as ``slime.utils.types.Sample`` for the test (``monkeypatch`` undoes it).
    The test is skipped where slime is not installed: 0.4.0's fields extend slime's own ``Sample``."""
    require_real_slime()
    import slime.utils.types

    cls = sample_with_040_fields()
    monkeypatch.setattr(slime.utils.types, "Sample", cls)
    return cls
