"""Whether the suite runs under CI (`.ci/run` sets CI=true): there nothing skips silently."""

from __future__ import annotations

import os


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")
