"""Which credential an operator command sends (cli/operator.py) and what it tells a caller that
may not see the runs: the credential that would let it, and never a local file for a sidecar
on another host."""

from __future__ import annotations

import argparse
import os

import pytest

from spillway.sidecar.cli.operator import cannot_see, credential

ENV = ("SPILLWAY_ADMIN_TOKEN_FILE", "SPILLWAY_TOKEN_FILE", "SPILLWAY_LOCAL_TOKEN_FILE",
       "SPILLWAY_AUTH_LOCAL_TOKEN_FILE", "SPILLWAY_SIDECAR_ADDRESS")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


def _args(sidecar="127.0.0.1:50051", token_file=None, admin_token_file=None):
    return argparse.Namespace(sidecar=sidecar, token_file=token_file,
                              admin_token_file=admin_token_file)


def _local_token(tmp_path) -> str:
    path = tmp_path / "state" / "spillway" / "local.token"
    path.parent.mkdir(parents=True, mode=0o700)
    path.write_text("secret\n")
    os.chmod(path, 0o600)
    return str(path)


def test_the_admin_token_first_then_the_local_credential_then_the_node_token(tmp_path,
                                                                             monkeypatch):
    local = _local_token(tmp_path)
    assert credential(_args(admin_token_file="/a")).kind == "admin"
    assert (credential(_args()).kind, credential(_args()).path) == ("local", local)
    assert credential(_args(token_file="/n")).kind == "node"   # a node token: not the local one
    monkeypatch.setenv("SPILLWAY_TOKEN_FILE", "/n")
    assert credential(_args()).kind == "node"
    assert credential(_args(token_file="")).kind == "local"    # '' turns the environment's off
    # a sidecar on another host never gets the local credential
    assert credential(_args(sidecar="10.1.2.3:50051", token_file="")).kind == ""


def test_without_a_credential_on_this_host_it_names_both_and_where_it_looked(tmp_path):
    text = cannot_see(_args())
    looked = str(tmp_path / "state" / "spillway" / "local.token")
    assert "it sent no operator credential" in text and looked in text
    assert "--admin-token-file" in text and "$SPILLWAY_ADMIN_TOKEN_FILE" in text
    assert "auth.local.token.file" in text and "$SPILLWAY_LOCAL_TOKEN_FILE" in text


def test_for_another_host_only_the_admin_token_is_named():
    text = cannot_see(_args(sidecar="10.1.2.3:50051"))
    assert "--admin-token-file" in text and "auth.admin.token.file" in text
    assert "local.token" not in text and "LOCAL_TOKEN" not in text


def test_a_node_token_is_said_to_list_no_other_run():
    text = cannot_see(_args(sidecar="10.1.2.3:50051", token_file="/n"))
    assert "node token" in text and "--admin-token-file" in text


def test_the_cli_reads_the_sidecars_own_variable_for_the_local_credential(tmp_path,
                                                                          monkeypatch):
    from spillway.sidecar.core.config import unknown_environment
    from spillway.sidecar.transport import localcred

    default = str(tmp_path / "state" / "spillway" / "local.token")
    assert localcred.client_path() == default
    monkeypatch.setenv("SPILLWAY_AUTH_LOCAL_TOKEN_FILE", "/srv/sidecar/local.token")
    assert localcred.client_path() == "/srv/sidecar/local.token"   # as the sidecar reads it
    monkeypatch.setenv("SPILLWAY_LOCAL_TOKEN_FILE", "/home/op/local.token")
    assert localcred.client_path() == "/home/op/local.token"       # the CLI's own wins
    # both are known to `spillway serve`: no "unknown environment variable" warning
    assert unknown_environment({"SPILLWAY_LOCAL_TOKEN_FILE": "x",
                                "SPILLWAY_AUTH_LOCAL_TOKEN_FILE": "y"}) == []
