"""RegisterJob: a new run (its token issued), the same run again (its token needed), a run
homed at another sidecar (registered there first), or one whose home is another process of this
sidecar (registered there, siblings.py). A new run's policy and DLQ topic are checked before
anything is created; a run this sidecar decided before it restarted resumes from its kept state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from spillway.sidecar.core.guardrails import check_topic_name
from spillway.sidecar.core.policy import PolicyEngine, run_key
from spillway.sidecar.core.settings import JobSettings, job_settings
from spillway.sidecar.core.tolerance import run_secret
from spillway.sidecar.errors import ConfigError, JobAccessError, JobConflictError
from spillway.sidecar.federation import siblings
from spillway.sidecar.federation.confirm import Confirmations
from spillway.sidecar.federation.peers import Home, resolve_home
from spillway.sidecar.service.identity import Identity
from spillway.sidecar.service.registry import (
    MAX_TOKEN_CHARS,
    Caller,
    Registry,
    Run,
    access_error,
    check_run_id,
    may_use,
    new_token,
    token_digest,
)
from spillway.sidecar.service.runstate import RunStore
from spillway.sidecar.service.topic_checks import TopicChecks
from spillway.sidecar.service.values import Registered, Registration

log = logging.getLogger("spillway.sidecar")


@dataclass(frozen=True)
class TopicRules:
    """What a new run's policy is checked against: the sidecar's job defaults and the
    operator's DLQ topic guardrails (a job may only narrow them), and whether this sidecar can
    write a DLQ at all (bootstrap.servers)."""

    job_defaults: Mapping[str, str] | None
    required_prefix: str
    auto_create_allow: bool
    dlq_writable: bool


@dataclass
class _Registered:
    settings: JobSettings
    run: Run
    token: str


class Registrar:
    """RegisterJob, over the live runs, the engine (a run's policy), the runs' durable state,
    the DLQ topic checks and a node's confirmations (rows it held before a restart)."""

    def __init__(self, *, identity: Identity, engine: PolicyEngine, registry: Registry,
                 runstate: RunStore | None, topics: TopicChecks, rules: TopicRules,
                 confirmations: Confirmations | None) -> None:
        self._me = identity
        self._engine = engine
        self._registry = registry
        self._runstate = runstate
        self._topics = topics
        self._rules = rules
        self._confirmations = confirmations

    def register(self, request: Registration, *, token: str | None, caller: Caller,
                 timeout_s: float = 15.0) -> Registered:
        """A new run (issues its token), the same run again (its token needed), or, with
        ``home``, a run homed at another sidecar (registered there first)."""
        job = request.job  # validated by transport/validate.py: used exactly as given
        run_id = check_run_id(request.run_id)
        properties = dict(request.properties)
        if request.peer and not caller.peer:
            raise JobAccessError(
                "RegisterJob.peer is for sidecar-to-sidecar calls only (an authenticated peer)")
        if request.claim_token and not token:
            check_claimant(job, run_id, caller)   # before any forwarding
        me = self._me
        home_addr = request.home.strip()
        existing = self._registry.get(job, run_id)
        owner = "" if existing or home_addr else me.owner_elsewhere(job, run_id)
        if owner:  # one home per run, whichever process this reached (siblings.py)
            return siblings.register_at_owner(me.local, owner, request, token, timeout_s)
        if request.claim_token and not token:
            token = self._claim(existing, request, timeout_s)
        if existing is not None:
            if not may_use(existing.digest, token):
                raise access_error(job, run_id, token)
            reg = self._again(existing, properties, request, token=token, timeout_s=timeout_s)
        elif home_addr:
            reg = self._homed_elsewhere(job, run_id, properties, request, token=token,
                                        timeout_s=timeout_s)
        else:
            reg = self._new(job, run_id, properties, token, timeout_s)
        if reg.run.home is None and request.peer:
            self._registry.add_node(reg.run, request.peer)
        run = reg.run
        if request.token_escrow:
            self._escrow(run, reg.token, properties, timeout_s)
        if run.home is not None and self._confirmations is not None:
            self._confirmations.adopt(run, reg.token)   # rows held before a restart
        return Registered(
            job=job, run_id=run_id, job_token=reg.token,
            effective_properties=dict(reg.settings.raw),
            home=run.home_address if run.home is not None else me.advertised_address,
            home_instance_id=run.home_instance_id if run.home is not None else me.instance_id,
            process_port=me.process_port, report_columns=True)

    def _again(self, run: Run, properties, request: Registration, *, token: str,
               timeout_s: float) -> _Registered:
        """The caller holds the run's token: idempotent, but never a new policy or home."""
        home_addr = request.home.strip()
        if home_addr and run.home is not None and home_addr != run.home.address:
            raise JobConflictError(
                f"job {run.job!r} run {run.run_id!r} is homed at {run.home.address}; "
                f"RegisterJob names home {home_addr}: one run has one home")
        if home_addr and run.home is None and not self._names_me(home_addr, request):
            raise JobConflictError(
                f"job {run.job!r} run {run.run_id!r} is homed at this sidecar "
                f"({self._me.advertised_address or self._me.instance_id}); RegisterJob names "
                f"home {home_addr}: one run has one home")
        # idempotent for the run's own policy; JobConflictError for another one
        settings = self._engine.register_job(run.job, properties, run_id=run.run_id)
        if run.home is not None:
            # an executor registers again when a call answered NOT_FOUND: the home may have
            # lost the run (restart, idle expiry), so it hears of it again (its token adopted)
            run.home.register(run.job, run.run_id, properties, token=token,
                              peer=self._me.advertised_address, timeout_s=timeout_s)
        self._registry.touch(run)
        return _Registered(settings, run, token)

    def _claim(self, run: Run | None, request: Registration, timeout_s: float) -> str:
        """The run's escrowed token for an executor that has none (`check_claimant` passed):
        this sidecar's when it is the run's home, else the home's (asked as a peer)."""
        job, run_id, me = request.job, request.run_id, self._me
        if run is not None and run.home is not None:
            answer = run.home.register(job, run_id, request.properties, claim_token=True,
                                       peer=me.advertised_address, timeout_s=timeout_s)
            return answer.job_token
        if run is None and request.home.strip():
            remote = resolve_home(me.local, request.home.strip(), request.home_instance_id,
                                  timeout_s)
            if remote is not None:
                try:
                    return remote.register(job, run_id, request.properties, claim_token=True,
                                           peer=me.advertised_address,
                                           timeout_s=timeout_s).job_token
                finally:
                    remote.close()
        if run is None or run.escrow is None:
            raise JobAccessError(
                f"job {job!r} run {run_id!r} has no escrowed job token at its home: a driver "
                f"escrows it (RegisterJob.token_escrow) only for a streaming query over Spark "
                f"Connect; other executors read it from a Spark file")
        return run.escrow

    def _escrow(self, run: Run, token: str, properties, timeout_s: float) -> None:
        """Keep the run's token for its executors to claim: here at its home, or at the home
        it is registered with (asked as a peer)."""
        if run.home is None:
            if run.escrow is None:
                log.info("job %r run %r: its job token is escrowed for its executors",
                         run.job, run.run_id)
            run.escrow = token
            return
        run.home.register(run.job, run.run_id, properties, token=token, token_escrow=True,
                          peer=self._me.advertised_address, timeout_s=timeout_s)

    def _names_me(self, home_addr: str, request: Registration) -> bool:
        if request.home_instance_id:
            return request.home_instance_id == self._me.instance_id
        return home_addr == self._me.advertised_address

    def _prepare(self, job: str, properties, timeout_s: float) -> JobSettings:
        """Validate a new run's policy and its DLQ topic before anything is created."""
        rules = self._rules
        settings = job_settings(job, properties, rules.job_defaults)
        self._engine.handler_rules.check(settings.handler_class)  # before any side effect
        # the operator's topic guardrails (a job may only narrow them), before any side effect
        check_topic_name(settings.dlq, rules.required_prefix, rules.auto_create_allow)
        if settings.dlq.enabled:
            if not rules.dlq_writable:
                raise ConfigError(
                    "errors.deadletterqueue.topic.name",
                    f"job {job!r} names DLQ topic {settings.dlq.topic!r} but this sidecar has "
                    "no bootstrap.servers to write it to",
                )
            self._topics.ensure(settings, timeout_s)
        return settings

    def _create(self, job: str, run_id: str, properties, token: str, *,
                home: Home | None = None, home_instance_id: str = ""
                ) -> tuple[JobSettings, Run]:
        reg, engine = self._registry, self._engine
        key = run_key(job, run_id)
        with reg.create_lock:
            run = reg.get(job, run_id)
            if run is not None:  # created meanwhile by another caller
                if not may_use(run.digest, token):
                    raise access_error(job, run_id, token)
                return engine.register_job(job, properties, run_id=run_id), run
            reg.check_room()
            store = self._runstate if home is None else None  # kept where the run is decided
            kept = store.load(key, job, run_id) if store is not None else None
            if kept is not None and not may_use(kept[0], token):
                # a run this sidecar was deciding before it restarted: its token only
                raise access_error(job, run_id, token)
            settings = engine.register_job(job, properties, run_id=run_id,
                                           tag_secret=run_secret(token))
            digest = token_digest(token)
            if store is not None:
                store.attach(engine, key, job, run_id, digest, kept)
            run = reg.add(Run(job=job, run_id=run_id, key=key, digest=digest, home=home,
                              home_instance_id=home_instance_id))
        log.info("job %r run %r %s%s", job, run_id,
                 "resumed from its kept state" if kept is not None else "registered",
                 f" (homed at {home.address})" if home is not None else "")
        return settings, run

    def _new(self, job: str, run_id: str, properties, token: str | None,
             timeout_s: float) -> _Registered:
        """A run homed here. A token the caller already holds is adopted (an executor whose
        sidecar restarted, or a run registered again after it ended); else one is issued."""
        self._prepare(job, properties, timeout_s)
        token = token if token and len(token) <= MAX_TOKEN_CHARS else new_token()
        settings, run = self._create(job, run_id, properties, token)
        return _Registered(settings, run, token)

    def _homed_elsewhere(self, job: str, run_id: str, properties, request: Registration, *,
                         token: str | None, timeout_s: float) -> _Registered:
        """An executor's registration of a run homed at another sidecar: the home must accept
        it (with the run's token) before this sidecar records anything."""
        if not token:
            raise access_error(job, run_id, None)
        me = self._me
        remote = resolve_home(me.local, request.home.strip(), request.home_instance_id,
                              timeout_s)
        if remote is None:  # the named home is this sidecar
            return self._new(job, run_id, properties, token, timeout_s)
        try:
            self._prepare(job, properties, timeout_s)
            answer = remote.register(job, run_id, properties, token=token,
                                     peer=me.advertised_address, timeout_s=timeout_s)
            settings, run = self._create(
                job, run_id, properties, token, home=remote,
                home_instance_id=answer.home_instance_id or request.home_instance_id)
        except BaseException:
            remote.close()
            raise
        if run.home is not remote:
            remote.close()
        return _Registered(settings, run, token)


def check_claimant(job: str, run_id: str, caller: Caller) -> None:
    """Only an authenticated caller may claim a run's escrowed token: one of the node's
    executors (node token, or on this host the local credential) or a peer sidecar; anyone
    else is refused before any state is read or forwarded."""
    if not (caller.authenticated or caller.peer or caller.admin):
        raise JobAccessError(
            f"claiming the job token of job {job!r} run {run_id!r} needs an authenticated "
            f"caller: the node token (auth.token.file) or, on this host, the sidecar's local "
            f"credential (auth.local.token.file); this call presented neither")


__all__ = ["Registrar", "TopicRules", "check_claimant"]
