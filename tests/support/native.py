"""Whether this machine can build spillway's optional C extensions."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest


def skip_without_a_c_compiler() -> None:
    """Skip when no C compiler or no Python headers are here (the Python fallbacks are then
    expected); otherwise `make test` built the extensions, and a test may say so."""
    headers = Path(sysconfig.get_paths()["include"], "Python.h")
    if not (shutil.which("cc") or shutil.which("gcc")) or not headers.is_file():
        pytest.skip("no C compiler or no Python headers here: the fallback is expected")
