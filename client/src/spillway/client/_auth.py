"""Client credentials: TLS material and tokens, sent as gRPC call credentials.

- TLS (``tls_ca_file`` / ``$SPILLWAY_TLS_CA_FILE``; a client certificate for mutual TLS with
  ``tls_cert_file`` + ``tls_key_file`` / ``$SPILLWAY_TLS_CERT_FILE`` + ``$SPILLWAY_TLS_KEY_FILE``)
  applies to ``host:port`` targets. A Unix socket is plaintext: its file permissions guard it.
- The node token (``token_file`` / ``$SPILLWAY_TOKEN_FILE``: the first line is sent) travels as
  ``spillway-node-token`` metadata: as call credentials composed onto the TLS channel
  credentials, or added by a client interceptor on plaintext loopback / Unix channels (gRPC
  refuses call credentials on insecure channels). The file is re-read when it changes.
- ``call_metadata`` builds the metadata list for one call; per-call credentials (the job token)
  are added by the caller with it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from .errors import SpillwayClientError

NODE_TOKEN_KEY = "spillway-node-token"
PEER_TOKEN_KEY = "spillway-peer-token"
ADMIN_TOKEN_KEY = "spillway-admin-token"
JOB_TOKEN_KEY = "spillway-job-token"

TLS_CA_ENV = "SPILLWAY_TLS_CA_FILE"
TLS_CERT_ENV = "SPILLWAY_TLS_CERT_FILE"
TLS_KEY_ENV = "SPILLWAY_TLS_KEY_FILE"
TOKEN_FILE_ENV = "SPILLWAY_TOKEN_FILE"
ADMIN_TOKEN_FILE_ENV = "SPILLWAY_ADMIN_TOKEN_FILE"


class CredentialFileError(SpillwayClientError, ValueError):
    """A configured credential file is missing, unreadable or empty (names it)."""


class _TokenCache:
    """The first token line of a file, re-read when the file's mtime, size or inode changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple | None = None
        self._value = ""
        self._lock = threading.Lock()

    def value(self) -> str:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if self._value:  # mid-rotation: keep sending the last good token
                return self._value
            raise CredentialFileError(
                f"token file {self.path}: {exc.strerror or exc}") from None
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp != self._stamp:
            with self._lock:
                try:
                    with open(self.path, encoding="utf-8") as fh:
                        lines = [ln.strip() for ln in fh.read().splitlines()]
                except (OSError, UnicodeDecodeError) as exc:
                    if self._value:
                        return self._value
                    raise CredentialFileError(f"token file {self.path}: {exc}") from None
                token = next((ln for ln in lines if ln and not ln.startswith("#")), "")
                if not token:
                    if self._value:
                        return self._value
                    raise CredentialFileError(f"token file {self.path} holds no token")
                self._value, self._stamp = token, stamp
        return self._value


_tokens: dict[str, _TokenCache] = {}
_tokens_lock = threading.Lock()


def read_token(path: str) -> str:
    """The token to send from ``path`` (cached; re-read when the file changes)."""
    with _tokens_lock:
        cache = _tokens.get(path)
        if cache is None:
            cache = _tokens[path] = _TokenCache(path)
    return cache.value()


def _read_pem(what: str, path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise CredentialFileError(f"{what} {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class ChannelSecurity:
    """How to reach a sidecar: TLS material and the token file (all paths; hashable, so one
    channel is cached per target and security)."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    token_file: str = ""
    token_key: str = NODE_TOKEN_KEY
    server_name: str = ""  # TLS name to verify instead of the target's host (tests, IPs)

    @classmethod
    def resolve(cls, *, ca_file: str | None = None, cert_file: str | None = None,
                key_file: str | None = None, token_file: str | None = None,
                token_key: str = NODE_TOKEN_KEY, token_env: str = TOKEN_FILE_ENV,
                server_name: str = "") -> ChannelSecurity:
        """Explicit arguments first, then the environment (``SPILLWAY_TLS_*``,
        ``SPILLWAY_TOKEN_FILE``); ``""`` explicitly turns one off."""
        env = os.environ

        def pick(value: str | None, name: str) -> str:
            return (env.get(name, "") if value is None else value).strip()

        sec = cls(pick(ca_file, TLS_CA_ENV), pick(cert_file, TLS_CERT_ENV),
                  pick(key_file, TLS_KEY_ENV), pick(token_file, token_env), token_key,
                  server_name)
        if bool(sec.cert_file) != bool(sec.key_file):
            raise CredentialFileError(
                f"a client certificate needs both {TLS_CERT_ENV} (tls_cert_file) and "
                f"{TLS_KEY_ENV} (tls_key_file)")
        return sec

    @property
    def tls(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    def uses_tls(self, target: str) -> bool:
        return self.tls and not target.startswith(("unix:", "unix-abstract:"))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read_pem("CA bundle", self.ca_file) if self.ca_file else None,
            private_key=_read_pem("client key", self.key_file) if self.key_file else None,
            certificate_chain=_read_pem("client certificate", self.cert_file)
            if self.cert_file else None)
        if self.token_file:
            read_token(self.token_file)  # a missing file fails now, naming it
            creds = grpc.composite_channel_credentials(
                creds, grpc.metadata_call_credentials(TokenPlugin(self),
                                                      name="spillway-token"))
        return creds

    def metadata(self) -> list[tuple[str, str]]:
        return call_metadata(self)


def call_metadata(security: ChannelSecurity | None = None, *,
                  job_token: str = "") -> list[tuple[str, str]]:
    """The credential metadata for one call: the token of ``security`` and a job token."""
    out: list[tuple[str, str]] = []
    if security is not None and security.token_file:
        out.append((security.token_key, read_token(security.token_file)))
    if job_token:
        out.append((JOB_TOKEN_KEY, job_token))
    return out


class TokenPlugin(grpc.AuthMetadataPlugin):
    """Call credentials for TLS channels: the token, read (and re-read) from its file."""

    def __init__(self, security: ChannelSecurity) -> None:
        self._security = security

    def __call__(self, context, callback) -> None:
        try:
            callback(tuple(call_metadata(self._security)), None)
        except Exception as exc:  # noqa: BLE001 - fails this call with the reason, not silently
            callback((), exc)


class _ClientCallDetails(grpc.ClientCallDetails):
    def __init__(self, details, metadata: Sequence[tuple[str, str]]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class MetadataInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """The token as plain metadata, for plaintext (loopback / Unix socket) channels."""

    def __init__(self, security: ChannelSecurity) -> None:
        self._security = security

    def _details(self, details):
        md = list(details.metadata or ()) + call_metadata(self._security)
        return _ClientCallDetails(details, md)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


__all__ = ["ChannelSecurity", "call_metadata", "read_token", "CredentialFileError",
           "NODE_TOKEN_KEY", "PEER_TOKEN_KEY", "ADMIN_TOKEN_KEY", "JOB_TOKEN_KEY"]
