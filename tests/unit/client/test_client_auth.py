"""Client credentials: where TLS material and tokens come from, and how they travel."""

from __future__ import annotations

import os

import pytest

from spillway.client import _auth
from spillway.client.errors import SpillwayClientError
from support.tls import write_token


def test_explicit_arguments_win_over_the_environment_and_empty_turns_one_off(monkeypatch):
    monkeypatch.setenv("SPILLWAY_TLS_CA_FILE", "/env/ca.pem")
    monkeypatch.setenv("SPILLWAY_TOKEN_FILE", "/env/token")
    sec = _auth.ChannelSecurity.resolve()
    assert (sec.ca_file, sec.token_file) == ("/env/ca.pem", "/env/token")
    assert sec.uses_tls("sidecar:50051") and not sec.uses_tls("unix:///run/s.sock")
    sec = _auth.ChannelSecurity.resolve(ca_file="/arg/ca.pem", token_file="")
    assert (sec.ca_file, sec.token_file) == ("/arg/ca.pem", "")
    with pytest.raises(_auth.CredentialFileError, match="SPILLWAY_TLS_KEY_FILE"):
        _auth.ChannelSecurity.resolve(cert_file="/c.crt", key_file="")


def test_call_metadata_carries_the_token_of_the_file_and_the_job_token(tmp_path):
    path = write_token(tmp_path / "t", "first", "second")
    sec = _auth.ChannelSecurity(token_file=str(path))
    assert _auth.call_metadata(sec, job_token="jt") == [
        ("spillway-node-token", "first"), ("spillway-job-token", "jt")]
    admin = _auth.ChannelSecurity(token_file=str(path), token_key=_auth.ADMIN_TOKEN_KEY)
    assert _auth.call_metadata(admin) == [("spillway-admin-token", "first")]
    assert _auth.call_metadata(None) == []


def test_a_rotated_token_file_is_reread_and_a_vanished_one_keeps_the_last(tmp_path):
    path = write_token(tmp_path / "t", "old")
    assert _auth.read_token(str(path)) == "old"
    write_token(path, "new-and-longer")
    os.utime(path, ns=(10**18, 10**18))
    assert _auth.read_token(str(path)) == "new-and-longer"
    path.unlink()  # mid-rotation (rename dance): keep sending the last good token
    assert _auth.read_token(str(path)) == "new-and-longer"


def test_missing_or_empty_token_file_is_a_client_error_naming_it(tmp_path):
    with pytest.raises(SpillwayClientError, match="token file .*nope"):
        _auth.read_token(str(tmp_path / "nope"))
    (tmp_path / "empty").write_text("# only a comment\n")
    with pytest.raises(_auth.CredentialFileError, match="holds no token"):
        _auth.read_token(str(tmp_path / "empty"))
