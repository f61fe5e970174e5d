"""The deadline a sidecar works to: what is left of the caller's, or the sidecar's default when
the caller set none. grpc reports "none" as ~9.2e18 seconds, not None; taken at its word, a
FlushTask without a deadline waited for ever instead of flush.timeout.ms."""

from __future__ import annotations

import pytest
from spillway.sidecar.transport.servicer import _timeout


class _Context:
    def __init__(self, remaining):
        self._remaining = remaining

    def time_remaining(self):
        return self._remaining


@pytest.mark.parametrize("remaining", [None, 9.223372035059013e18])
def test_no_deadline_of_the_callers_is_the_sidecars_default(remaining):
    assert _timeout(_Context(remaining), 60.0) == 60.0


def test_a_deadline_is_what_is_left_of_it_less_a_margin():
    assert _timeout(_Context(5.0), 60.0) == pytest.approx(4.95)
    assert _timeout(_Context(0.01), 60.0) == 0.0
