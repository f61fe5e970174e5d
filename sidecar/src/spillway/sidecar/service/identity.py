"""Who this sidecar is and where it is reached: known once it is bound (bootstrap binds its
listeners first, then builds the service with this value), never changed afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spillway.sidecar.federation import siblings as siblings_
from spillway.sidecar.federation.peers import LocalSidecar
from spillway.sidecar.transport.security import SecurityConfig


@dataclass(frozen=True)
class Identity:
    sidecar_id: str          # sidecar.id (the host name by default): on summaries and DLQ records
    instance_id: str         # this start of it (a restart is another instance)
    listen_address: str = ""     # what it is bound to (port 0 resolved)
    # advertised.address, else listen_address: RegisterJobResponse.home, the `peer` it names
    advertised_address: str = ""
    # one of several processes behind listen.address (processes.py): its own port, and every
    # process's advertised address, in process order (they may dial each other as a run's home)
    process_port: int = 0
    siblings: tuple[str, ...] = ()
    security: SecurityConfig | None = None
    local: LocalSidecar = field(init=False, repr=False)

    def __post_init__(self) -> None:
        mine = frozenset(a for a in (self.advertised_address, self.listen_address) if a)
        # what dialling another sidecar needs of this one (peers.py)
        object.__setattr__(self, "local", LocalSidecar(
            self.instance_id, mine, self.security, frozenset(self.siblings) - mine))

    def owner_elsewhere(self, job: str, run_id: str) -> str:
        """The process of this sidecar that homes (job, run_id) when it is not this one, else
        '' (siblings.py)."""
        return siblings_.elsewhere(self.siblings, self.advertised_address, job, run_id)


__all__ = ["Identity"]
