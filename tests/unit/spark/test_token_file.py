"""The run's job token as a Spark file (`spillway.spark._token`): shipped once per session and
token from a private file, read once per worker process and checked against the plan's digest;
a `JobToken` never pickles, and a `Job` pickled into a closure carries no token."""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import stat

import pytest

from spillway.client.runs import JobToken, Registration
from spillway.spark import _token
from spillway.spark.job import Job
from support.spark_files import LocalSparkFiles, as_executor_files

TOKEN = "s3cret-token-value"


def test_a_token_is_shipped_once_per_session_and_token_from_a_private_file(tmp_path):
    seen_modes = []

    class Files(LocalSparkFiles):
        def add(self, path):
            seen_modes.append(stat.S_IMODE(os.stat(path).st_mode))
            super().add(path)

    files = Files(tmp_path, key="connect:s1")
    ref = _token.ship(files, "orders", "run-1", JobToken(TOKEN))
    assert _token.ship(files, "orders", "run-1", JobToken(TOKEN)) is ref   # a cell run again
    assert files.added == [ref.name] and seen_modes == [0o600]
    assert ref.name.startswith(_token.PREFIX) and TOKEN not in ref.name + ref.digest
    assert (tmp_path / ref.name).read_text() == TOKEN
    assert not os.path.exists(os.path.join(_token._private_dir(), ref.name))  # uploaded: gone
    other = _token.ship(files, "orders", "run-1", JobToken("another-token"))
    elsewhere = _token.ship(Files(tmp_path, key="connect:s2"), "orders", "run-1",
                            JobToken(TOKEN))
    assert len({ref.name, other.name, elsewhere.name}) == 3   # never one name, two contents
    assert TOKEN not in repr(ref) and TOKEN.encode() not in pickle.dumps(ref)


def test_an_executor_reads_the_file_once_and_checks_its_digest(tmp_path, monkeypatch):
    files = LocalSparkFiles(tmp_path)
    ref = _token.ship(files, "orders", "run-2", JobToken(TOKEN))
    with pytest.raises(_token.TokenFileError, match="runs no Spark task"):
        _token.TokenFile(ref.name, ref.digest).load()      # not a Python worker
    as_executor_files(monkeypatch, tmp_path)
    assert ref.load().reveal() == TOKEN
    (tmp_path / ref.name).unlink()
    assert ref.load().reveal() == TOKEN                     # from memory, not per task
    forged = _token.TokenFile(f"{ref.name}-forged", ref.digest)
    (tmp_path / forged.name).write_text("someone-elses-token")
    with pytest.raises(_token.TokenFileError, match="does not hold this run's job token"):
        forged.load()
    with pytest.raises(_token.TokenFileError, match="not among this task's Spark files"):
        _token.TokenFile(f"{_token.PREFIX}missing", ref.digest).load()


def test_a_job_token_never_pickles_but_copies():
    token = JobToken(TOKEN)
    assert copy.copy(token) is token and copy.deepcopy(token) is token
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        with pytest.raises(TypeError, match="cannot be pickled.*Spark file"):
            pickle.dumps(token, protocol)


def test_a_job_pickled_into_a_closure_carries_no_token():
    job = Job("orders", {"errors.tolerance": "all"}, sidecar="127.0.0.1:50051", run_id="r")
    job.spec = dataclasses.replace(job.spec, run_id="r", job_token=JobToken(TOKEN))
    job.registration = Registration("orders", "r", JobToken(TOKEN))
    shipped = pickle.dumps(job)
    assert TOKEN.encode() not in shipped
    again = pickle.loads(shipped)
    assert again.spec.job_token is None and again.registration.job_token is None
    assert again.run_id == "r" and job.spec.job_token.reveal() == TOKEN  # the driver's stays
