"""The stop's share of shutdown.grace.ms leaves room for leaving the process (shutdown.py); the
behaviour itself is tested against `spillway serve` in tests/e2e/test_health_truth.py."""

from __future__ import annotations

from spillway.sidecar.runtime import shutdown


def test_the_stop_leaves_room_in_the_grace_for_leaving_the_process():
    assert shutdown.stop_budget_s(10_000) == 10.0 - shutdown.EXIT_RESERVE_S
    assert shutdown.EXIT_RESERVE_S > shutdown.EXIT_WAIT_S  # the watchdog fires inside the grace
    assert shutdown.stop_budget_s(500) == 0.0              # a grace shorter than the reserve
