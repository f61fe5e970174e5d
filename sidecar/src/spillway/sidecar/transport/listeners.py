"""Where the sidecar listens and whom it dials: TLS material (reloaded when the files change),
listen addresses (plaintext refused on a routable one unless asked for), the Unix socket (a
stale one cleared, a live one never taken over; mode and owner set), and the home allow-list
(``home.allowed.addresses``: which sidecars may be dialled as a job's home).

Pure string and IP-literal matching: nothing is resolved before a decision. The settings these
read come from `security.load_config` (`SecurityConfig`, which this module names only as
the `ListenPolicy` it reads: security imports listeners, never the other way).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import grpc
from spillway.sidecar.errors import ConfigError

log = logging.getLogger("spillway.sidecar.transport.security")


# --- TLS -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    """The TLS material a sidecar serves and dials with (PEM files; ``tls.*`` properties)."""

    cert: str
    key: str
    ca: str
    client_auth: str  # "none" | "require"


class ListenPolicy(Protocol):
    """What listening and dialling read of the security settings (`security.SecurityConfig`)."""

    tls: TlsFiles | None
    plaintext_allowed: bool
    home_allowed: tuple[str, ...]


def _read_bytes(prop: str, path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ConfigError(prop, f"cannot read {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(prop, f"{path} is not PEM (no -----BEGIN line)")
    return data


def tls_stamps(files: TlsFiles) -> tuple:
    """What tells a rewritten TLS file (time, size, inode of each): a renewed certificate."""
    out = []
    for p in (files.cert, files.key, files.ca):
        if not p:
            out.append(None)
            continue
        st = os.stat(p)
        out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


class TlsReloader:
    """Server certificate material, re-read when any of its files changes: gRPC asks
    `fetch()` before each new connection's handshake (rotation without restart)."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._stamp: tuple | None = None
        self._lock = threading.Lock()

    def _stamps(self) -> tuple:
        return tls_stamps(self.files)

    def _config(self) -> grpc.ServerCertificateConfiguration:
        cert = _read_bytes("tls.cert.file", self.files.cert)
        key = _read_bytes("tls.key.file", self.files.key)
        ca = _read_bytes("tls.ca.file", self.files.ca) if self.files.ca else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def initial(self) -> grpc.ServerCertificateConfiguration:
        self._stamp = self._stamps()
        return self._config()

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """None: unchanged (or unreadable mid-rotation: the previous material stays)."""
        try:
            stamp = self._stamps()
            if stamp == self._stamp:
                return None
            with self._lock:
                cfg = self._config()
                self._stamp = stamp
        except (OSError, ConfigError) as exc:
            log.warning("TLS files changed but cannot be read (%s); keeping the previous "
                        "certificate", exc)
            return None
        log.info("TLS certificate files changed: reloaded for new connections")
        return cfg

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.initial(), self.fetch,
            require_client_authentication=self.files.client_auth == "require")


def client_channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """This sidecar as a TLS client of another sidecar (its home): the CA bundle verifies the
    home; its own certificate is the client certificate."""
    ca = _read_bytes("tls.ca.file", files.ca) if files.ca else None
    return grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=_read_bytes("tls.key.file", files.key),
        certificate_chain=_read_bytes("tls.cert.file", files.cert))


# --- listen addresses ----------------------------------------------------------------------


def split_host_port(address: str) -> tuple[str, str]:
    host, sep, port = address.rpartition(":")
    if not sep:
        return address, ""
    return host.strip("[]"), port


def is_loopback_host(host: str) -> bool:
    """Loopback by literal or by name ("localhost"); other names resolve to decide (this is
    our own listen address, never a caller's)."""
    host = host.strip("[]")
    if host in ("localhost", "localhost.localdomain"):
        return True
    if host in ("", "*", "0.0.0.0", "::"):
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback
                               for i in infos)


def default_advertised(address: str) -> str:
    """advertised.address when unset: the listen address, with a wildcard host (0.0.0.0, ::)
    replaced by this host's name (as Kafka's advertised listeners do)."""
    host, port = split_host_port(address)
    if address.startswith("unix:") or host not in ("", "0.0.0.0", "::"):
        return address
    return f"{socket.gethostname()}:{port}"


def check_plaintext_listen(address: str, cfg: ListenPolicy) -> None:
    """Plaintext on a routable address is refused unless the operator asked for it."""
    host, _ = split_host_port(address)
    if cfg.tls is not None or is_loopback_host(host):
        return
    if cfg.plaintext_allowed:
        log.warning("serving plaintext on %s (listen.plaintext.allow=true): reports, record "
                    "payloads and tokens cross the network unencrypted", address)
        return
    raise ConfigError(
        "listen.address",
        f"refusing to serve plaintext on {address}: it is reachable from other hosts, which "
        "could then read DLQ payloads and act on every job. Set tls.cert.file and "
        "tls.key.file (and tls.ca.file for mutual TLS), or listen on loopback / "
        "listen.unix.socket, or set listen.plaintext.allow=true if the network itself is "
        "trusted")


# --- the Unix socket -----------------------------------------------------------------------


def clear_stale_socket(path: str) -> None:
    """Make room for our socket at `path`: only a stale socket (nobody accepting) is removed;
    a live one, a regular file, a directory or a symlink stops start-up, untouched."""
    prop = "listen.unix.socket"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ConfigError(prop, f"directory {parent} does not exist (create it, e.g. "
                                    "/run/spillway owned by the sidecar's user)") from None
        return
    kind = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else
            "a directory" if stat.S_ISDIR(st.st_mode) else
            "a regular file" if stat.S_ISREG(st.st_mode) else
            None if stat.S_ISSOCK(st.st_mode) else "not a socket")
    if kind is not None:
        raise ConfigError(prop, f"{path} exists and is {kind}: refusing to replace it "
                                "(choose another path or remove it yourself)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # a stale socket from a crashed run
        return
    except OSError as exc:
        raise ConfigError(prop, f"cannot check the socket at {path}: {exc.strerror}") from None
    finally:
        probe.close()
    raise ConfigError(prop, f"another process is serving on {path}; refusing to take it over")


def _uid(prop: str, owner: str) -> int:
    import pwd

    if owner.isdigit():
        return int(owner)
    try:
        return pwd.getpwnam(owner).pw_uid
    except KeyError:
        raise ConfigError(prop, f"no such user: {owner!r}") from None


def _gid(prop: str, group: str) -> int:
    import grp

    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(prop, f"no such group: {group!r}") from None


def secure_socket(path: str, mode: int, owner: str = "", group: str = "") -> None:
    """Owner, group and mode of our freshly bound socket (before the server accepts calls)."""
    uid = _uid("listen.unix.socket.owner", owner) if owner else -1
    gid = _gid("listen.unix.socket.group", group) if group else -1
    if uid != -1 or gid != -1:
        try:
            os.chown(path, uid, gid, follow_symlinks=False)
        except OSError as exc:
            prop = "listen.unix.socket.owner" if uid != -1 else "listen.unix.socket.group"
            raise ConfigError(prop, f"cannot chown {path}: {exc.strerror}") from None
    os.chmod(path, mode)


# --- the home allow-list -------------------------------------------------------------------


def parse_home_pattern(entry: str) -> tuple[str, str]:
    """host-pattern, port-pattern ('*' any). Forms: host, host:port, [v6]:port, CIDR[:port],
    *.domain[:port], *."""
    e = entry.strip()
    if e == "*":
        return "*", "*"
    if e.startswith("["):
        host, sep, rest = e[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ConfigError("home.allowed.addresses", f"malformed entry {entry!r}")
        port = rest[1:] if rest else "*"
    elif e.count(":") == 1:
        host, port = e.split(":")
    elif ":" in e:
        raise ConfigError("home.allowed.addresses",
                          f"malformed entry {entry!r}: write IPv6 as [addr]:port")
    else:
        host, port = e, "*"
    if not host or (port != "*" and not port.isdigit()):
        raise ConfigError("home.allowed.addresses",
                          f"malformed entry {entry!r}: expected host, host:port, CIDR[:port] "
                          "or *.domain[:port]")
    if "/" in host:
        try:
            ipaddress.ip_network(host, strict=False)
        except ValueError:
            raise ConfigError("home.allowed.addresses", f"bad CIDR in {entry!r}") from None
    return host.lower(), port


# Nothing but this sidecar's own addresses unless the operator lists more: a made-up home must
# never make the sidecar dial (and present its peer credential to) a port of someone's choosing,
# loopback included.
DEFAULT_HOME_ALLOWED: tuple[str, ...] = ()


def home_allowed(address: str, cfg: ListenPolicy, own: Iterable[str] = ()) -> bool:
    """Whether `address` may be dialled as a job's home: matched against the configured
    patterns (default: none) or one of this sidecar's own addresses. Pure string and
    IP-literal matching: nothing is resolved before the decision."""
    if address in set(own):
        return True
    host, port = split_host_port(address)
    host = host.lower()
    if not host or not port.isdigit():
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    for entry in cfg.home_allowed or DEFAULT_HOME_ALLOWED:
        h, p = parse_home_pattern(entry)
        if p != "*" and p != port:
            continue
        if h == "*":
            return True
        if "/" in h:
            if ip is not None and ip in ipaddress.ip_network(h, strict=False):
                return True
        elif h.startswith("*."):
            if ip is None and host.endswith(h[1:]):
                return True
        elif h == host:
            return True
        elif ip is not None:
            try:
                if ipaddress.ip_address(h) == ip:
                    return True
            except ValueError:
                pass
    return False


__all__ = ["DEFAULT_HOME_ALLOWED", "ListenPolicy", "TlsFiles", "TlsReloader",
           "check_plaintext_listen", "clear_stale_socket",
           "client_channel_credentials", "default_advertised", "home_allowed", "is_loopback_host",
           "parse_home_pattern", "secure_socket", "split_host_port"]
