"""Fresh venvs for the compat tier: one per combination, from a wheelhouse reused across runs.

A venv is always new (what a user's `pip install` of our wheels gets); the third-party wheels
come from a wheelhouse (``$SPILLWAY_COMPAT_WHEELHOUSE``, default
``~/.cache/spillway/compat-wheelhouse``) that is filled from PyPI only when an offline install
from it fails. Only a missing network may turn into a skip, and never under ``CI=true`` (CI
fails instead, as it does for a combination whose Python is missing).

Unpacking PySpark, pandas and pyarrow is most of a venv's cost, so the third-party part is
cached (``$SPILLWAY_COMPAT_VENV_CACHE``, default ``~/.cache/spillway/compat-venvs``): a template
venv per combination, keyed by everything that decides what pip installs there (interpreter,
pins, constraints, our wheels' declared dependencies, the wheelhouse's wheels). Each run clones
the template (hard links) and runs the same `pip install` of the pins and our freshly built
wheels into the clone, so pip still resolves our wheels' ranges against the pins, and
`pip check` still has the last word.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import urllib.request
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.ci import in_ci

ROOT = Path(__file__).resolve().parents[2]
PINS = ROOT / "requirements" / "compat"
DISTS = ("client", "sidecar", "spark_integration")


@dataclass(frozen=True)
class Combo:
    name: str
    python: tuple[str, ...]  # preferred interpreters, "3.10" etc.; the first one found is used
    pins: Path
    with_sidecar: bool = False  # also install the spillway-sidecar wheel (Python >= 3.11)


MATRIX = (
    Combo("oldest", ("3.10",), PINS / "oldest.txt"),
    Combo("spark35-newest", ("3.11",), PINS / "spark35-newest.txt"),
    Combo("newest", ("3.13", "3.12", "3.11"), PINS / "newest.txt", with_sidecar=True),
)


def wheelhouse() -> Path:
    path = Path(os.environ.get("SPILLWAY_COMPAT_WHEELHOUSE")
                or Path.home() / ".cache" / "spillway" / "compat-wheelhouse")
    path.mkdir(parents=True, exist_ok=True)
    return path


def find_python(versions: tuple[str, ...]) -> str:
    """The first of ``versions`` found on PATH or under pyenv; else, outside CI, this
    interpreter (with a warning: the combination then runs on a newer Python than it names).
    Under ``CI=true`` a missing Python fails the combination: CI must test what it names."""
    pyenv = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    for v in versions:
        if f"{sys.version_info[0]}.{sys.version_info[1]}" == v:
            return sys.executable
        candidates = [*sorted(glob.glob(f"{pyenv}/versions/{v}.*/bin/python{v}")),
                      shutil.which(f"python{v}")]
        for found in filter(None, candidates):  # pyenv's shims exist but may refuse to run
            if _run([found, "-c", "import venv"]).returncode == 0:
                return found
    missing = f"compat: no Python {' / '.join(versions)} on this machine"
    if in_ci():
        pytest.fail(f"{missing} (CI=true: a combination never runs on another interpreter; "
                    f"install one, e.g. `pyenv install {versions[0]}`)")
    warnings.warn(f"{missing}; running the combination on {sys.version.split()[0]}",
                  stacklevel=2)
    return sys.executable


def pypi_unreachable() -> str | None:
    """Why the package index cannot be reached, or None when it can."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    try:
        urllib.request.urlopen(f"{index}/pip/", timeout=10).close()
    except OSError as exc:
        return f"{index} unreachable ({exc})"
    return None


@contextlib.contextmanager
def _locked(wh: Path, how: int, name: str = ".lock"):
    """The wheelhouse is shared by concurrent builds (threads and test runs): filling it is
    exclusive, installing from it shared. (Also the venv cache's per-combination lock.)"""
    with open(wh / name, "a") as fh:
        fcntl.flock(fh, how)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def build_wheels(out: Path) -> list[Path]:
    """`pip wheel` of each distribution (the installable-distributions check)."""
    try:  # the build backends pinned in requirements/dev.txt: no isolated build env to set up
        import hatchling  # noqa: F401
        import setuptools

        if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (74, 1):
            raise ImportError("setuptools older than the sidecar's build needs")

        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []
    proc = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation,
                 "--wheel-dir", str(out), *(str(ROOT / d) for d in DISTS)])
    if proc.returncode != 0:
        why = pypi_unreachable()  # the build backends come from the index
        if why and not in_ci():
            pytest.skip(f"compat: cannot build the wheels: {why}")
        pytest.fail(f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}")
    wheels = sorted(out.glob("spillway_*.whl"))
    assert [w.name.split("-")[0] for w in wheels] == [
        "spillway_client", "spillway_sidecar", "spillway_spark"], wheels
    return wheels


def venv_cache() -> Path:
    path = Path(os.environ.get("SPILLWAY_COMPAT_VENV_CACHE")
                or Path.home() / ".cache" / "spillway" / "compat-venvs")
    path.mkdir(parents=True, exist_ok=True)
    return path


_CACHE_FORMAT = "2"   # bump when what a template holds changes
_KEEP_PER_COMBO = 2   # templates kept per combination (the newest used)
_WARM_IMPORTS = ("pyspark.sql", "pyspark.sql.pandas.functions", "pyspark.worker", "pyspark.daemon",
                 "pandas", "pyarrow", "grpc", "google.protobuf.message", "opentelemetry.sdk.trace")


def _requires(wheel: Path) -> list[str]:
    """What a wheel's METADATA says it needs (not its code: that is installed fresh)."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    return [ln for ln in lines
            if ln.startswith(("Name:", "Requires-Dist:", "Requires-Python:", "Provides-Extra:"))]


def _template_key(combo: Combo, python: str, wheels_dir: Path, wh: Path) -> str:
    h = hashlib.sha256(_CACHE_FORMAT.encode())
    version = _run([python, "-c", "import sys; print(sys.version, sys.platform)"]).stdout
    h.update(f"{os.path.realpath(python)}\0{version}\0{combo.with_sidecar}\0".encode())
    h.update(combo.pins.read_bytes())
    if combo.with_sidecar:
        h.update((ROOT / "requirements" / "sidecar.txt").read_bytes())
    for wheel in sorted(wheels_dir.glob("spillway_*.whl")):
        h.update("\n".join(_requires(wheel)).encode())
    h.update("\n".join(sorted(w.name for w in wh.glob("*.whl")
                               if not w.name.startswith("spillway_"))).encode())
    return h.hexdigest()[:20]


def _install(combo: Combo, vpy: str, wh: Path, wheels_dir: Path, targets: list[str]) -> None:
    """`pip install` of the pins and our wheels into ``vpy``'s venv, offline from the
    wheelhouse, filling it from the index first when it lacks something."""
    pip = [vpy, "-m", "pip", "--disable-pip-version-check"]
    # --no-compile: byte-compiling PySpark and pandas at install time is most of an install
    install = [*pip, "install", "-q", "--no-compile", "--no-index", "--find-links", str(wh),
               "--find-links", str(wheels_dir), *targets]
    with _locked(wh, fcntl.LOCK_SH):
        proc = _run(install)
    if proc.returncode != 0:  # the wheelhouse lacks something: fill it from the index
        with _locked(wh, fcntl.LOCK_EX):  # no reader sees a wheel half-copied
            fill = _run([*pip, "wheel", "-q", "--use-pep517", "--wheel-dir", str(wh),
                         "--find-links", str(wh), "--find-links", str(wheels_dir), *targets])
            for ours in wh.glob("spillway_*.whl"):  # ours are built fresh every run
                ours.unlink()
        if fill.returncode != 0:
            why = pypi_unreachable()
            if why and not in_ci():
                pytest.skip(f"compat {combo.name}: cannot build its venv: {why}, and the "
                            f"wheelhouse {wh} lacks wheels it needs")
            pytest.fail(f"compat {combo.name}: filling the wheelhouse failed:\n"
                        f"{fill.stdout}\n{fill.stderr}")
        with _locked(wh, fcntl.LOCK_SH):
            proc = _run(install)
    assert proc.returncode == 0, f"compat {combo.name}: install failed:\n{proc.stderr}"


def _template(combo: Combo, python: str, wh: Path, wheels_dir: Path,
              targets: list[str]) -> Path:
    """The combination's cached third-party venv: a venv where the whole install ran, with our
    three distributions uninstalled again. Built once per key, never changed afterwards."""
    cache = venv_cache()
    template = cache / f"{combo.name}-{_template_key(combo, python, wheels_dir, wh)}"
    if not template.is_dir():
        building = cache / f".{template.name}.{os.getpid()}"
        shutil.rmtree(building, ignore_errors=True)
        try:
            proc = _run([python, "-m", "venv", str(building)])
            assert proc.returncode == 0, proc.stderr
            vpy = str(building / "bin" / "python")
            _install(combo, vpy, wh, wheels_dir, targets)
            proc = _run([vpy, "-m", "pip", "--disable-pip-version-check", "uninstall", "-y",
                         "-q", "spillway-client", "spillway-sidecar", "spillway-spark"])
            assert proc.returncode == 0, proc.stderr
            # bytecode for what every Spark process of the job imports (an install is
            # --no-compile, and PYTHONDONTWRITEBYTECODE may be set): ~3 CPU s per process
            warm = "; ".join(f"importlib.import_module({m!r})" for m in _WARM_IMPORTS)
            env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
            proc = _run([vpy, "-c", f"import importlib; {warm}"], env=env)
            assert proc.returncode == 0, proc.stderr
            os.rename(building, template)   # complete or absent, never half-built
        finally:
            shutil.rmtree(building, ignore_errors=True)
    os.utime(template)
    stale = sorted((p for p in cache.glob(f"{combo.name}-*") if p.is_dir()),
                   key=lambda p: p.stat().st_mtime, reverse=True)[_KEEP_PER_COMBO:]
    for old in stale:
        shutil.rmtree(old, ignore_errors=True)
    return template


def _clone(template: Path, venv: Path) -> None:
    """A private copy of ``template`` at ``venv``: hard links where the file system allows
    (pip and Python replace files, never write into them), else a full copy."""
    if _run(["cp", "-al", str(template), str(venv)]).returncode != 0:
        shutil.rmtree(venv, ignore_errors=True)
        shutil.copytree(template, venv, symlinks=True)
    # sys.prefix follows the clone's location (pyvenv.cfg's `home` is the base interpreter);
    # console scripts installed into the clone get the clone's python.


def make_venv(combo: Combo, where: Path, wheels_dir: Path) -> Path:
    """A fresh venv with the combination's pins and our wheels (dependencies resolved by pip
    against the wheels' declared ranges); returns its python."""
    python = find_python(combo.python)
    venv = where / combo.name
    wh = wheelhouse()
    targets = ["-r", str(combo.pins), "spillway-spark[pandas]"]
    if combo.with_sidecar:
        targets += ["spillway-sidecar", "-c", str(ROOT / "requirements" / "sidecar.txt")]
    # per combination: one builder at a time (others wait, then reuse); no pruning mid-clone
    with _locked(venv_cache(), fcntl.LOCK_EX, f".{combo.name}.lock"):
        _clone(_template(combo, python, wh, wheels_dir, targets), venv)
    vpy = str(venv / "bin" / "python")
    _install(combo, vpy, wh, wheels_dir, targets)   # our wheels, the pins re-resolved
    # our modules' bytecode, as a default `pip install` (not --no-compile) leaves it: the job's
    # Spark workers would otherwise compile them in every process (tests/support/bytecode.py)
    proc = _run([vpy, "-c", "import compileall, sysconfig; compileall.compile_dir("
                 "sysconfig.get_paths()['purelib'] + '/spillway', quiet=2)"])
    assert proc.returncode == 0, proc.stderr
    check = _run([vpy, "-m", "pip", "--disable-pip-version-check", "check"])
    assert check.returncode == 0, f"compat {combo.name}: pip check:\n{check.stdout}"
    return venv / "bin" / "python"
