"""Caller authentication decisions, secrets, token rotation and the home allow-list."""

from __future__ import annotations

import os
import stat
import threading

import grpc
import pytest
from spillway.sidecar.errors import ConfigError
from spillway.sidecar.transport import listeners, localcred, security
from spillway.v1 import sidecar_pb2 as pb
from support.tls import write_token


def _cfg(tmp_path, **props):
    return security.load_config(props)


def _tokens(tmp_path):
    return {"auth.token.file": str(write_token(tmp_path / "node", "node-secret")),
            "auth.peer.token.file": str(write_token(tmp_path / "peer", "peer-secret")),
            "auth.admin.token.file": str(write_token(tmp_path / "admin", "admin-secret"))}


def test_secret_repr_hides_the_value_and_compares_exactly():
    s = security.Secret("hunter2")
    assert "hunter2" not in repr(s) and "hunter2" not in str(s) and "hunter2" not in f"{s!r}"
    assert s.matches("hunter2") and s.matches(b"hunter2")
    assert not s.matches("hunter") and not s.matches("hunter22") and not s.matches("")


def test_token_file_is_reread_when_it_changes_and_keeps_old_tokens_when_emptied(tmp_path):
    path = write_token(tmp_path / "t", "old")
    tf = security.TokenFile("auth.token.file", str(path))
    assert tf.matches("old") and not tf.matches("new")
    write_token(path, "new", "old")  # rotation: both accepted, the first is the one sent
    os.utime(path, ns=(1, 1))
    assert tf.matches("new") and tf.matches("old") and tf.current().reveal() == "new"
    write_token(path, "new")
    os.utime(path, ns=(2, 2))
    assert not tf.matches("old")
    path.write_text("")  # half-written rotation: the previous tokens stay valid
    assert tf.matches("new")


def test_token_file_missing_or_empty_stops_start_up_naming_the_property(tmp_path):
    with pytest.raises(ConfigError, match="auth.token.file: cannot read token file"):
        security.load_config({"auth.token.file": str(tmp_path / "nope")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="auth.peer.token.file: .* holds no token"):
        security.load_config({"auth.peer.token.file": str(tmp_path / "empty")})


def test_tls_settings_are_checked_at_start_up(tmp_path):
    with pytest.raises(ConfigError, match="tls.key.file"):
        security.load_config({"tls.cert.file": __file__})
    with pytest.raises(ConfigError, match="tls.cert.file: file not found"):
        security.load_config({"tls.cert.file": str(tmp_path / "x"), "tls.key.file": __file__})
    with pytest.raises(ConfigError, match="tls.client.auth: require needs TLS"):
        security.load_config({"tls.client.auth": "require"})
    with pytest.raises(ConfigError, match="auth.peer.identities"):
        security.load_config({"auth.peer.identities": "sidecar-1"})


def _auth(cfg, md=(), ids=(), method="/spillway.v1.ErrorSidecar/GetStatus", local=False):
    return security.Authenticator(cfg, local_only=local).authenticate(
        method, dict(md), list(ids), "ipv4:10.0.0.9:4242")


def test_no_credential_configured_trusts_nobody_for_calling_from_loopback(tmp_path):
    cfg = security.load_config({})
    for local in (True, False):       # loopback, or listen.plaintext.allow on a routable one
        c = _auth(cfg, local=local)
        assert not c.peer and not c.admin and not c.authenticated


def test_the_local_credential_is_the_defaults_admin_and_peer_token(tmp_path):
    path = tmp_path / "state" / "spillway" / "local.token"
    cfg = localcred.apply(security.load_config({}), str(path))
    token = path.read_text().strip()
    assert len(token) >= 40 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    admin = _auth(cfg, {"spillway-admin-token": token}, local=True)
    assert admin.admin and admin.peer is False and admin.authenticated
    peer = _auth(cfg, {"spillway-peer-token": token}, local=True)
    assert peer.peer and not peer.admin
    anonymous = _auth(cfg, local=True)       # another local process: job tokens only
    assert not anonymous.admin and not anonymous.peer and not anonymous.authenticated
    with pytest.raises(security.Refused) as wrong:
        _auth(cfg, {"spillway-admin-token": token[:-1] + "x"}, local=True)
    assert wrong.value.code == grpc.StatusCode.UNAUTHENTICATED
    # a second start (or another sidecar of this user) reuses it
    again = localcred.apply(security.load_config({}), str(path))
    assert again.admin_token.current().reveal() == token
    assert "local credential" in security.describe(again, local_only=True)


def test_two_first_starts_at_once_both_read_the_one_local_credential(tmp_path, monkeypatch):
    # the first start of two sidecars of this user (a fresh machine or CI home): the one that
    # loses the race to create the file must never read it before its token is in it
    path = tmp_path / "state" / "spillway" / "local.token"
    writing, go_on = threading.Event(), threading.Event()
    real_fdopen = os.fdopen
    got = {}
    slow = threading.Thread(target=lambda: got.setdefault(
        "slow", localcred.apply(security.load_config({}), str(path))))

    def slow_fdopen(fd, *a, **kw):
        if threading.current_thread() is slow:   # held before it writes its token
            writing.set()
            assert go_on.wait(10)
        return real_fdopen(fd, *a, **kw)

    monkeypatch.setattr(os, "fdopen", slow_fdopen)
    slow.start()
    assert writing.wait(10)           # the other start is writing its token: this one starts
    try:
        fast = localcred.apply(security.load_config({}), str(path))
    finally:
        go_on.set()
        slow.join(10)
    token = path.read_text().strip()
    assert len(token) >= 40 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert fast.admin_token.current().reveal() == token
    assert got["slow"].admin_token.current().reveal() == token
    assert [f.name for f in path.parent.iterdir()] == ["local.token"]   # nothing left behind


def test_a_local_credential_others_could_read_stops_start_up(tmp_path):
    path = tmp_path / "local.token"
    path.write_text("x" * 43 + "\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="auth.local.token.file: .* chmod 600"):
        localcred.apply(security.load_config({}), str(path))
    path.chmod(0o600)
    link = tmp_path / "link.token"
    link.symlink_to(path)
    with pytest.raises(ConfigError, match="not a regular file"):
        localcred.apply(security.load_config({}), str(link))


def test_the_cli_sends_the_local_credential_only_to_a_sidecar_on_this_host(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert localcred.for_client("127.0.0.1:50051") == ""      # none made yet
    localcred.ensure(localcred.default_path())
    for target in ("127.0.0.1:50051", "localhost:1", "[::1]:5", "unix:///tmp/s.sock"):
        assert localcred.for_client(target) == localcred.default_path()
    for target in ("10.0.0.5:50051", "sidecar.example.com:50051"):
        assert localcred.for_client(target) == ""


def test_node_token_required_when_configured(tmp_path):
    cfg = security.load_config(_tokens(tmp_path))
    with pytest.raises(security.Refused) as missing:
        _auth(cfg, local=True)
    assert missing.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "spillway-node-token" in str(missing.value)
    with pytest.raises(security.Refused) as wrong:
        _auth(cfg, {"spillway-node-token": "node-secreT"})
    assert wrong.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "does not match" in str(wrong.value) and "node-secre" not in str(wrong.value)
    node = _auth(cfg, {"spillway-node-token": "node-secret"})
    assert node.authenticated and not node.peer and not node.admin
    assert "secret" not in node.identity
    peer = _auth(cfg, {"spillway-peer-token": "peer-secret"})
    assert peer.authenticated and peer.peer and not peer.admin
    admin = _auth(cfg, {"spillway-admin-token": "admin-secret"})
    assert admin.admin and not admin.peer
    # a health probe needs nothing
    probe = _auth(cfg, method="/grpc.health.v1.Health/Check")
    assert not probe.authenticated
    # a valid node token does not excuse a wrong peer token
    with pytest.raises(security.Refused):
        _auth(cfg, {"spillway-node-token": "node-secret", "spillway-peer-token": "x"})


def test_mtls_identity_listed_as_peer_is_a_peer(tmp_path):
    from support.tls import Ca

    ca = Ca.create(tmp_path)
    leaf = ca.issue(tmp_path, "sidecar-a")
    cfg = security.load_config({"tls.cert.file": str(leaf.cert), "tls.key.file": str(leaf.key),
                                "tls.ca.file": str(ca.path),
                                "auth.peer.identities": "sidecar-a.spark.internal, sidecar-b"})
    assert cfg.tls.client_auth == "require"  # auto: a CA means mutual TLS
    assert _auth(cfg, ids=["sidecar-b"]).peer
    other = _auth(cfg, ids=["executor-7"])
    assert other.authenticated and not other.peer and "executor-7" in other.identity


def test_sidecar_only_fields_need_a_peer():
    non_peer = security.Caller(authenticated=True, identity="node@x")
    peer = security.Caller(authenticated=True, peer=True, identity="peer@x")
    for req, field in [(pb.ReportFailuresRequest(job="j", decide_only=True), "decide_only"),
                       (pb.FlushTaskRequest(job="j", progress_only=True), "progress_only"),
                       (pb.EndJobRequest(job="j", local_only=True), "local_only"),
                       (pb.RegisterJobRequest(job="j", peer="10.0.0.1:50051"), "peer"),
                       (pb.ReportFailuresRequest(job="j", undo_dead_letter_record_ids=["r"]),
                        "undo_dead_letter_record_ids")]:
        with pytest.raises(security.Refused, match=field) as exc:
            security.check_sidecar_only(req, non_peer)
        assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED
        security.check_sidecar_only(req, peer)
    security.check_sidecar_only(pb.ReportFailuresRequest(job="j"), non_peer)


@pytest.mark.parametrize("address,patterns,allowed", [
    # the default: no address but the sidecar's own, loopback included (a made-up home must
    # not make it dial a local port of someone's choosing)
    ("127.0.0.1:50051", "", False),
    ("localhost:1", "", False),
    ("[::1]:50051", "", False),
    ("127.0.0.2:50051", "127.0.0.0/8", True),
    ("[::1]:50051", "[::1]", True),
    ("10.0.0.5:50051", "", False),
    ("metadata.google.internal:80", "", False),
    ("10.0.0.5:50051", "10.0.0.0/8", True),
    ("10.0.0.5:50052", "10.0.0.0/8:50051", False),
    ("10.0.0.5:50051", "10.0.0.0/8:50051", True),
    ("node-1.spark.internal:50051", "*.spark.internal:50051", True),
    ("evil.internal:50051", "*.spark.internal:50051", False),
    ("spark.internal.evil.com:50051", "*.spark.internal", False),
    ("10.1.2.3:50051", "*.spark.internal", False),  # a name pattern never matches an IP
    ("node-1:50051", "node-1", True),
    ("node-1:50051", "node-2, node-1:50051", True),
    ("anything:1", "*", True),
    ("noport", "*", False),
])
def test_home_allow_list(address, patterns, allowed):
    cfg = security.load_config({"home.allowed.addresses": patterns})
    assert listeners.home_allowed(address, cfg) is allowed


def test_own_address_is_always_allowed_and_bad_patterns_stop_start_up():
    cfg = security.load_config({"home.allowed.addresses": "10.0.0.0/8"})
    assert listeners.home_allowed("node-a:50051", cfg, own=["node-a:50051"])
    with pytest.raises(ConfigError, match="home.allowed.addresses"):
        security.load_config({"home.allowed.addresses": "10.0.0.0/33"})
    with pytest.raises(ConfigError, match="home.allowed.addresses"):
        security.load_config({"home.allowed.addresses": "::1:50051"})


def test_plaintext_on_a_routable_address_is_refused_unless_allowed():
    cfg = security.load_config({})
    listeners.check_plaintext_listen("127.0.0.1:50051", cfg)
    listeners.check_plaintext_listen("localhost:50051", cfg)
    with pytest.raises(ConfigError, match="refusing to serve plaintext on 0.0.0.0:50051.*"
                                          "tls.cert.file"):
        listeners.check_plaintext_listen("0.0.0.0:50051", cfg)
    listeners.check_plaintext_listen(
        "0.0.0.0:50051", security.load_config({"listen.plaintext.allow": True}))


def test_weak_routable_configurations_are_named(tmp_path):
    bare = security.load_config({"listen.plaintext.allow": True})
    assert security.weaknesses(bare, local_only=True) == []
    said = " ".join(security.weaknesses(bare, local_only=False))
    assert "auth.token.file" in said and "auth.peer.token.file" in said
    strong = security.load_config(_tokens(tmp_path))
    assert security.weaknesses(strong, local_only=False) == []
    text = security.describe(strong, local_only=False)
    assert "node token" in text and "secret" not in text


def _bound_socket(path):
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    return s


def test_only_a_stale_socket_is_cleared(tmp_path):
    import stat as st

    stale = tmp_path / "stale.sock"
    _bound_socket(stale).close()  # bound, nobody listening: a crashed run's leftover
    listeners.clear_stale_socket(str(stale))
    assert not stale.exists()

    live = tmp_path / "live.sock"
    s = _bound_socket(live)
    s.listen(1)
    try:
        with pytest.raises(ConfigError, match="another process is serving"):
            listeners.clear_stale_socket(str(live))
        assert st.S_ISSOCK(os.lstat(live).st_mode)
    finally:
        s.close()

    (tmp_path / "dir").mkdir()
    target = tmp_path / "precious"
    target.write_text("keep")
    (tmp_path / "link").symlink_to(target)
    for name, kind in (("dir", "a directory"), ("link", "a symbolic link"),
                       ("precious", "a regular file")):
        with pytest.raises(ConfigError, match=f"listen.unix.socket: .* is {kind}"):
            listeners.clear_stale_socket(str(tmp_path / name))
    assert target.read_text() == "keep"
    with pytest.raises(ConfigError, match="directory .* does not exist"):
        listeners.clear_stale_socket(str(tmp_path / "no" / "such.sock"))


def test_socket_mode_and_group_are_applied(tmp_path):
    path = tmp_path / "s.sock"
    s = _bound_socket(path)
    try:
        listeners.secure_socket(str(path), 0o640, group=str(os.getgid()))
        info = os.stat(path)
        assert info.st_mode & 0o777 == 0o640 and info.st_gid == os.getgid()
        with pytest.raises(ConfigError, match="listen.unix.socket.owner: no such user"):
            listeners.secure_socket(str(path), 0o600, owner="no-such-user-spillway")
    finally:
        s.close()
