"""Crash-safe JSON files, for state saved with slime checkpoints."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | os.PathLike, value: Any) -> None:
    """Write ``value`` as JSON so that a crash leaves either the old or the new file, never a torn
    one (temporary file in the same folder, fsync, rename). Raises ``ValueError`` naming the file
    when the value is not plain JSON (NaN included); nothing is written then."""
    path = Path(path)
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: state is not plain JSON ({e})") from e
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
