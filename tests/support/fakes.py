"""Fakes for the pure core's ports (Clock, RandomSource) and the caller of an RPC: unit tests
build state, then assert."""

from __future__ import annotations


from spillway.sidecar.transport import security


class FakeClock:
    """A clock the test moves by hand: `ms` is monotonic time; wall time moves with it."""

    def __init__(self, start_ms: float = 1_000_000.0,
                 wall_start_ms: int = 1_700_000_000_000 + 1_000_000) -> None:
        self.ms = start_ms
        self._wall_offset = wall_start_ms - start_ms

    def monotonic(self) -> float:
        return self.ms / 1000.0

    def wall_ms(self) -> int:
        return int(self._wall_offset + self.ms)

    def advance(self, ms: float) -> None:
        self.ms += ms


class FakeRng:
    """A random source that always answers `value`."""

    def __init__(self, value: float = 0.5) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


def Caller(*, admin: bool = False, peer: bool = False, authenticated: bool = True,  # noqa: N802
           identity: str = "test") -> security.Caller:
    """Who calls (`transport.security.Caller`, as the registry's access rules read it), with a
    test's defaults: an authenticated application."""
    return security.Caller(authenticated=authenticated, peer=peer, admin=admin,
                           identity=identity)
