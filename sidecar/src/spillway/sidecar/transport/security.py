"""Who is calling: transport security (TLS, mTLS) and caller authentication, at the edge.

Every call passes `Authenticating` before any servicer code runs. It checks the credentials the
call carries (gRPC metadata) and the mTLS identity of the connection, then publishes the result
as a `Caller` through a context variable (`current_caller()`), which the servicer reads and
hands to the service with each call (the service never reads it, nor the metadata).

Credentials (docs/SECURITY.md):
- ``spillway-node-token`` (``auth.token.file``): the node's API token, application -> sidecar.
  When it is configured, every call needs a valid node, peer or admin token or a peer mTLS
  identity (grpc.health.v1 Check stays open for probes).
- ``spillway-peer-token`` (``auth.peer.token.file``), or an mTLS identity listed in
  ``auth.peer.identities``: another sidecar. Only peers may set the sidecar-only request fields.
- ``spillway-admin-token`` (``auth.admin.token.file``): the operator (`spillway status`, `job`).

With no credential configured at all and only loopback / Unix-socket listeners (the default),
the sidecar makes its own admin and peer token, the local credential (`localcred`): a file
only its OS user can read. Callers without a credential are anonymous: they act only on the
runs whose job token they hold. A wrong token is UNAUTHENTICATED; an authenticated caller
asking for what it may not do is PERMISSION_DENIED.

Token files hold one token per line: the first is the one clients send, every line is accepted
(so a token is rotated by adding the new one, rolling clients, then removing the old one). They
are re-read when they change, without a restart. Tokens are `Secret`s: never logged, compared in
constant time.

What the transport needs (TLS material, listen addresses, the Unix socket, which sidecars may be
dialled) is in listeners.py.
"""

from __future__ import annotations

import contextvars
import hmac
import logging
import os
import stat
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc
from spillway.sidecar.errors import ConfigError
from spillway.sidecar.transport import listeners
from spillway.sidecar.transport.listeners import TlsFiles

log = logging.getLogger("spillway.sidecar.transport.security")

NODE_TOKEN_KEY = "spillway-node-token"
PEER_TOKEN_KEY = "spillway-peer-token"
ADMIN_TOKEN_KEY = "spillway-admin-token"
JOB_TOKEN_KEY = "spillway-job-token"

# Probes (kubelet, docker healthcheck, load balancers) carry no credential.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})

# Request fields only another sidecar may set: message name -> fields.
SIDECAR_ONLY_FIELDS: Mapping[str, tuple[str, ...]] = {
    "RegisterJobRequest": ("peer",),
    "ReportFailuresRequest": ("decide_only", "undo_dead_letter_record_ids"),
    "FlushTaskRequest": ("progress_only",),
    "EndJobRequest": ("local_only",),
}


class Secret:
    """A credential's value: hidden from repr/str, compared in constant time."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value.encode("utf-8")

    def __repr__(self) -> str:
        return "Secret('********')"

    __str__ = __repr__

    def matches(self, presented: str | bytes) -> bool:
        if isinstance(presented, str):
            presented = presented.encode("utf-8", "surrogateescape")
        return hmac.compare_digest(self._value, presented)

    def reveal(self) -> str:
        """The value itself, for sending it (never for logging)."""
        return self._value.decode("utf-8")


class TokenFile:
    """Tokens read from a file (one per line; the first is the one to send), re-read when the
    file's mtime, size or inode changes. A file that turns unreadable or empty keeps the last
    good tokens (logged once): a rotation caught half-written never locks every caller out."""

    def __init__(self, prop: str, path: str) -> None:
        self.prop = prop
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._tokens: tuple[Secret, ...] = ()
        self._warned = False
        self._load(initial=True)

    def _read(self) -> tuple[tuple, tuple[Secret, ...]]:
        st = os.stat(self.path)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(self.prop, f"{self.path} is not a regular file")
        with open(self.path, encoding="utf-8") as fh:
            lines = [ln.strip() for ln in fh.read().splitlines()]
        tokens = tuple(Secret(ln) for ln in lines if ln and not ln.startswith("#"))
        if not tokens:
            raise ConfigError(self.prop, f"{self.path} holds no token")
        return (st.st_mtime_ns, st.st_size, st.st_ino), tokens

    def _load(self, *, initial: bool = False) -> None:
        try:
            stamp, tokens = self._read()
        except (OSError, UnicodeDecodeError, ConfigError) as exc:
            if initial:
                if isinstance(exc, ConfigError):
                    raise
                raise ConfigError(self.prop, f"cannot read token file {self.path}: "
                                             f"{exc.__class__.__name__}: "
                                             f"{getattr(exc, 'strerror', None) or exc}") from None
            if not self._warned:
                log.warning("%s: cannot re-read %s (%s); keeping the previous token(s)",
                            self.prop, self.path, exc.__class__.__name__)
                self._warned = True
            return
        if initial:
            mode = os.stat(self.path).st_mode
            if mode & stat.S_IROTH:
                log.warning("%s: %s is readable by every local user (mode %o); chmod 600 it",
                            self.prop, self.path, stat.S_IMODE(mode))
        elif stamp != self._stamp:
            log.info("%s: %s changed; tokens reloaded", self.prop, self.path)
        self._stamp, self._tokens, self._warned = stamp, tokens, False

    def tokens(self) -> tuple[Secret, ...]:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = None
        if stamp != self._stamp:
            with self._lock:
                if stamp != self._stamp:
                    self._load()
        return self._tokens

    def matches(self, presented: str) -> bool:
        # every configured token is compared (no early exit on the first match)
        ok = False
        for t in self.tokens():
            ok |= t.matches(presented)
        return ok

    def current(self) -> Secret:
        return self.tokens()[0]

    def __repr__(self) -> str:
        return f"TokenFile({self.prop}={self.path!r})"


@dataclass(frozen=True, slots=True)
class Caller:
    """The authenticated view of one call. `identity` names the caller for logs and spans; it
    is never a secret."""

    authenticated: bool = False
    peer: bool = False
    admin: bool = False
    identity: str = "anonymous"


ANONYMOUS = Caller()
_caller: contextvars.ContextVar[Caller] = contextvars.ContextVar("spillway_caller",
                                                                 default=ANONYMOUS)


def current_caller() -> Caller:
    """The caller of the call being served (outside a call: anonymous, with no rights)."""
    return _caller.get()


# --- configuration -------------------------------------------------------------------------


@dataclass
class SecurityConfig:
    node_token: TokenFile | None
    peer_token: TokenFile | None
    admin_token: TokenFile | None
    peer_identities: frozenset[str]
    tls: TlsFiles | None
    plaintext_allowed: bool
    advertised_address: str
    home_allowed: tuple[str, ...]
    # the default configuration's own admin and peer token (`localcred.apply`)
    local_token: TokenFile | None = None

    @property
    def any_auth(self) -> bool:
        return bool(self.node_token or self.peer_token or self.admin_token
                    or self.peer_identities
                    or (self.tls is not None and self.tls.client_auth == "require"))


def _existing_file(prop: str, path: str) -> str:
    if not path:
        return ""
    if not os.path.isfile(path):
        raise ConfigError(prop, f"file not found: {path}")
    if not os.access(path, os.R_OK):
        raise ConfigError(prop, f"file not readable by this process: {path}")
    return path


def load_config(props: Mapping[str, object]) -> SecurityConfig:
    """The security settings from parsed sidecar properties; every file is checked now, so a
    typo stops start-up with the property's name."""

    def token(prop: str) -> TokenFile | None:
        path = str(props.get(prop) or "")
        return TokenFile(prop, path) if path else None

    cert = _existing_file("tls.cert.file", str(props.get("tls.cert.file") or ""))
    key = _existing_file("tls.key.file", str(props.get("tls.key.file") or ""))
    ca = _existing_file("tls.ca.file", str(props.get("tls.ca.file") or ""))
    client_auth = str(props.get("tls.client.auth") or "auto")
    if bool(cert) != bool(key):
        missing = "tls.key.file" if cert else "tls.cert.file"
        raise ConfigError(missing, "tls.cert.file and tls.key.file are set together "
                                   "(the certificate chain and its private key, PEM)")
    tls = None
    if cert:
        if client_auth == "auto":
            client_auth = "require" if ca else "none"
        if client_auth == "require" and not ca:
            raise ConfigError("tls.client.auth", "require needs tls.ca.file (the CA bundle "
                                                 "that signs client certificates)")
        tls = TlsFiles(cert, key, ca, client_auth)
        listeners.TlsReloader(tls).initial()  # parse now: a bad PEM stops start-up, naming the file
    elif client_auth == "require":
        raise ConfigError("tls.client.auth", "require needs TLS: set tls.cert.file and "
                                             "tls.key.file")
    ids = frozenset(i.strip() for i in str(props.get("auth.peer.identities") or "").split(",")
                    if i.strip())
    if ids and (tls is None or tls.client_auth != "require"):
        raise ConfigError("auth.peer.identities", "peer identities come from client "
                                                  "certificates: set tls.cert.file, "
                                                  "tls.key.file and tls.ca.file (mTLS)")
    allowed = tuple(a.strip() for a in str(props.get("home.allowed.addresses") or "").split(",")
                    if a.strip())
    for a in allowed:
        listeners.parse_home_pattern(a)  # a malformed entry stops start-up
    return SecurityConfig(
        node_token=token("auth.token.file"), peer_token=token("auth.peer.token.file"),
        admin_token=token("auth.admin.token.file"), peer_identities=ids, tls=tls,
        plaintext_allowed=bool(props.get("listen.plaintext.allow")),
        advertised_address=str(props.get("advertised.address") or ""),
        home_allowed=allowed)


def describe(cfg: SecurityConfig, *, local_only: bool) -> str:
    """One log line of the security posture (names of settings, never secrets)."""
    if cfg.local_token is not None:
        who = (f"no credentials configured: the local credential ({cfg.local_token.path}, "
               "this OS user only) is the admin and peer token; other local callers act only "
               "on the runs whose job token they hold")
    elif local_only and not cfg.any_auth:
        who = "no credentials: every caller is anonymous (job tokens only, no admin, no peer)"
    else:
        parts = [name for name, on in (("node token", cfg.node_token),
                                       ("peer token", cfg.peer_token),
                                       ("admin token", cfg.admin_token)) if on]
        if cfg.peer_identities:
            parts.append(f"peer identities {', '.join(sorted(cfg.peer_identities))}")
        who = "credentials: " + (", ".join(parts) or "none")
    if cfg.tls is None:
        tls = "TLS off"
    elif cfg.tls.client_auth == "require":
        tls = "TLS on, client certificates required"
    else:
        tls = "TLS on, client certificates not requested"
    homes = ", ".join(cfg.home_allowed) or "this sidecar's own addresses only"
    return f"{tls}; {who}; homes dialled: {homes}"


def weaknesses(cfg: SecurityConfig, *, local_only: bool) -> list[str]:
    """What an operator should hear at start-up about a routable listener's configuration."""
    if local_only:
        return []
    out = []
    if cfg.node_token is None and (cfg.tls is None or cfg.tls.client_auth != "require"):
        out.append("any process that reaches the port may register jobs and report records: "
                   "set auth.token.file (and/or tls.ca.file for client certificates)")
    if cfg.peer_token is None and not cfg.peer_identities:
        out.append("no peer credential (auth.peer.token.file or auth.peer.identities): "
                   "other sidecars cannot forward to jobs homed here")
    return out


# --- the server side: authenticate each call -----------------------------------------------


def _metadata(value: Sequence[tuple[str, str | bytes]] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in value or ():
        if isinstance(v, bytes):
            v = v.decode("latin-1")
        out.setdefault(k.lower(), v)
    return out


def tls_identities(context: grpc.ServicerContext) -> list[str]:
    """The verified client certificate's names (SAN DNS/URI and CN); empty without mTLS."""
    try:
        ac = context.auth_context() or {}
    except Exception:  # noqa: BLE001 - no transport security on this connection
        return []
    out: list[str] = []
    for key in ("x509_subject_alternative_name", "peer_dns", "x509_common_name"):
        for v in ac.get(key, ()):
            s = v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
            if s and s not in out:
                out.append(s)
    return out


class Authenticator:
    """Decides a call's `Caller` from its metadata and connection; raises `Refused`."""

    def __init__(self, cfg: SecurityConfig, *, local_only: bool) -> None:
        # local_only is kept for callers; nobody is trusted for where they call from: the
        # default's admin and peer credential is the local one (`localcred`)
        self.cfg = cfg
        self.local_only = local_only

    def authenticate(self, method: str, metadata: Mapping[str, str],
                     identities: Sequence[str], peer_addr: str) -> Caller:
        cfg = self.cfg
        peer = admin = node = False
        names = []
        for key, tf in ((PEER_TOKEN_KEY, cfg.peer_token), (ADMIN_TOKEN_KEY, cfg.admin_token),
                        (NODE_TOKEN_KEY, cfg.node_token)):
            presented = metadata.get(key)
            if presented is None or tf is None:
                continue  # a credential this sidecar does not use is ignored
            if not tf.matches(presented):
                raise Refused(grpc.StatusCode.UNAUTHENTICATED,
                              f"metadata {key} does not match this sidecar's {tf.prop}")
            names.append(key.removeprefix("spillway-").removesuffix("-token"))
            peer |= key == PEER_TOKEN_KEY
            admin |= key == ADMIN_TOKEN_KEY
            node |= key == NODE_TOKEN_KEY
        mtls = next((i for i in identities if i in cfg.peer_identities), None)
        if mtls is not None:
            peer = True
            names.append(f"mtls:{mtls}")
        elif identities:
            names.append(f"cert:{identities[0]}")
        authenticated = peer or admin or node
        if cfg.node_token is not None and not authenticated and method not in OPEN_METHODS:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED,
                          f"missing credential: send metadata {NODE_TOKEN_KEY} (the node token, "
                          f"auth.token.file on the sidecar; SPILLWAY_TOKEN_FILE for clients)"
                          + (f" or {PEER_TOKEN_KEY}" if cfg.peer_token else "")
                          + (f" or {ADMIN_TOKEN_KEY}" if cfg.admin_token else ""))
        who = "+".join(names) if names else "anonymous"
        return Caller(authenticated=authenticated or bool(identities), peer=peer, admin=admin,
                      identity=f"{who}@{peer_addr}")


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        super().__init__(message)


def check_sidecar_only(request: object, caller: Caller | None = None) -> None:
    """Refuse (PERMISSION_DENIED) a request that sets a sidecar-only field unless it comes from
    an authenticated peer sidecar. Called for every request before the servicer sees it."""
    caller = caller or current_caller()
    if caller.peer:
        return
    descriptor = getattr(request, "DESCRIPTOR", None)
    for name in SIDECAR_ONLY_FIELDS.get(getattr(descriptor, "name", ""), ()):
        if getattr(request, name, None):
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"{descriptor.name}.{name} is honoured only from an authenticated "
                          f"peer sidecar (spillway-peer-token or an mTLS identity in "
                          f"auth.peer.identities); caller: {caller.identity}")


def _wrap(behavior: Callable, auth: Callable, *, unary_request: bool,
          streaming_response: bool) -> Callable:
    def call(request, context):
        caller = auth(context)
        if unary_request:
            try:
                check_sidecar_only(request, caller)
            except Refused as exc:
                log.info("refused: %s", exc)
                context.abort(exc.code, str(exc))
        return caller

    if streaming_response:
        def stream(request, context):
            token = _caller.set(call(request, context))
            try:
                yield from behavior(request, context)
            finally:
                _caller.reset(token)
        return stream

    def unary(request, context):
        token = _caller.set(call(request, context))
        try:
            return behavior(request, context)
        finally:
            _caller.reset(token)
    return unary


# Methods whose wrapped handler is kept (this server's few methods; past it, built per call).
_MAX_CACHED_METHODS = 256


class Authenticating(grpc.GenericRpcHandler):
    """The server's handlers (`inner`, grpc generic handlers), each method's wrapped so that
    every call is authenticated before any servicer code runs; the servicer reads the outcome
    with `current_caller()`. Registered in place of `inner` rather than as a grpc server
    interceptor: grpc runs even a no-op interceptor at about 100 µs of CPU a call (measured
    2026-11-27, 1-record calls), a tenth of a small call's whole cost.

    ``around(method, behavior, streaming_response)``, if given, wraps each method's behaviour
    inside the authentication (telemetry's server span: `telemetry.ServerSpans.wrap`), so a
    refused call reaches nothing, tracing included. A method's wrapped handler is built once
    and reused for every call of it: a call pays for its own checks, not for closures. A
    method no inner handler serves is left to grpc (UNIMPLEMENTED)."""

    def __init__(self, inner: Sequence[grpc.GenericRpcHandler], authenticator: Authenticator,
                 *, around: Callable[[str, Callable, bool], Callable] | None = None) -> None:
        self._inner = tuple(inner)
        self._auth = authenticator
        self._around = around
        self._handlers: dict[str, object] = {}

    def service(self, handler_call_details):
        method = handler_call_details.method
        wrapped = self._handlers.get(method)
        if wrapped is not None:
            return wrapped
        for inner in self._inner:
            handler = inner.service(handler_call_details)
            if handler is not None:
                break
        else:
            return None
        wrapped = _authenticated(method, handler, self._auth, self._around)
        if len(self._handlers) < _MAX_CACHED_METHODS:
            self._handlers[method] = wrapped
        return wrapped


def _authenticated(method: str, handler, authenticator: Authenticator, around=None):
    """`handler` (a grpc RpcMethodHandler of `method`) with every call authenticated first,
    and ``around`` (the server span) inside the authentication."""
    authenticate = authenticator.authenticate

    def auth(context) -> Caller:
        try:
            return authenticate(method, _metadata(context.invocation_metadata()),
                                tls_identities(context), context.peer())
        except Refused as exc:
            log.info("refused %s from %s: %s", method, context.peer(), exc)
            context.abort(exc.code, str(exc))

    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behavior = getattr(handler, kind)
        if behavior is not None:
            streaming = kind.endswith("stream")
            if around is not None:
                behavior = around(method, behavior, streaming)
            return handler._replace(**{kind: _wrap(
                behavior, auth, unary_request=kind.startswith("unary"),
                streaming_response=streaming)})
    return handler


__all__ = ["Caller", "current_caller", "Secret", "TokenFile", "TlsFiles", "SecurityConfig",
           "load_config",
           "Authenticating", "Authenticator", "check_sidecar_only",
           "NODE_TOKEN_KEY", "PEER_TOKEN_KEY", "ADMIN_TOKEN_KEY", "JOB_TOKEN_KEY"]
