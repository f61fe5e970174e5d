"""GroupCall: calls that arrive while one is in flight go together as the next one."""

from __future__ import annotations

import threading
import time

import pytest
from spillway.sidecar.federation.coalesce import GroupCall


class _Held:
    """A send function whose first call blocks until ``release`` is set (``started`` says it
    is in flight); every call's (items, timeout) is kept in ``calls``."""

    def __init__(self, answer=lambda item: item) -> None:
        self.answer = answer
        self.calls: list[tuple[list, float]] = []
        self.sent_at: list[float] = []   # when each call was made (time.monotonic)
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, items, timeout_s):
        self.sent_at.append(time.monotonic())
        self.calls.append((list(items), timeout_s))
        if len(self.calls) == 1:
            self.started.set()
            assert self.release.wait(5)
        return [self.answer(i) for i in items]

    def first_call(self, target, *args, **kwargs) -> threading.Thread:
        """Start ``target`` in a thread and return once its call is in flight."""
        t = threading.Thread(target=target, args=args, kwargs=kwargs)
        t.start()
        assert self.started.wait(5)
        return t


def test_one_caller_is_sent_at_once_alone():
    sent = []
    g = GroupCall(lambda items, t: sent.append((list(items), t, time.monotonic()))
                  or [i * 2 for i in items], max_items=8, max_weight=100)
    before = time.monotonic()
    assert g.call(3, timeout_s=5.0) == 6
    (items, timeout, at), = sent
    # the caller's 5 s less what passed before the call went out (however busy the machine)
    assert items == [3] and 5.0 - (at - before) <= timeout <= 5.0
    assert (g.calls, g.items) == (1, 1)


def test_callers_arriving_during_a_call_go_together_in_the_next_one():
    send = _Held(lambda i: f"answer {i}")
    g = GroupCall(send, max_items=64, max_weight=10_000)
    answers = {}

    def caller(i):
        answers[i] = g.call(i, weight=10, timeout_s=5.0)

    first = send.first_call(caller, 0)
    rest = [threading.Thread(target=caller, args=(i,)) for i in range(1, 6)]
    for t in rest:
        t.start()
    deadline = time.monotonic() + 5
    while len(g._queue) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    send.release.set()
    for t in [first, *rest]:
        t.join(5)
    batches = [items for items, _ in send.calls]
    assert answers == {i: f"answer {i}" for i in range(6)}
    assert batches[0] == [0] and sorted(batches[1]) == [1, 2, 3, 4, 5]
    assert (g.calls, g.items) == (2, 6)


def test_a_call_carries_at_most_its_bounds_and_the_rest_wait_for_the_next():
    g = GroupCall(lambda items, t: list(items), max_items=2, max_weight=25)
    for i in range(5):
        g._queue.append(_waiter(i, 10))
    assert [w.item for w in g._take()] == [0, 1]          # 2 items
    g = GroupCall(lambda items, t: list(items), max_items=10, max_weight=25)
    for i in range(5):
        g._queue.append(_waiter(i, 10))
    assert [w.item for w in g._take()] == [0, 1]          # 20 of 25 weight; a third is 30
    g._queue.clear()
    g._queue.append(_waiter("heavy", 1_000))
    assert [w.item for w in g._take()] == ["heavy"]       # the first goes however heavy


def _waiter(item, weight):
    from spillway.sidecar.federation.coalesce import _Waiter

    return _Waiter(item, weight, 1.0)


def test_every_caller_of_a_failed_call_gets_its_error_and_the_next_call_goes_on():
    calls = []

    def send(items, timeout_s):
        calls.append(list(items))
        if len(calls) == 1:
            raise ConnectionError("home unreachable")
        return list(items)

    g = GroupCall(send, max_items=8, max_weight=100)
    with pytest.raises(ConnectionError, match="home unreachable"):
        g.call("a", timeout_s=1.0)
    assert g.call("b", timeout_s=1.0) == "b"


def test_a_call_answering_the_wrong_number_of_items_fails_each_caller():
    g = GroupCall(lambda items, t: [], max_items=8, max_weight=100)
    with pytest.raises(RuntimeError, match="answered 0 of 1"):
        g.call("a", timeout_s=1.0)


def test_the_shortest_deadline_of_a_call_is_its_deadline():
    send = _Held()
    g = GroupCall(send, max_items=8, max_weight=100)
    first_at = time.monotonic()
    t0 = send.first_call(g.call, "x", timeout_s=9.0)
    others = [threading.Thread(target=g.call, args=(i,), kwargs={"timeout_s": s})
              for i, s in ((1, 7.0), (2, 3.0))]
    others_at = time.monotonic()
    for t in others:
        t.start()
    while len(g._queue) < 2:
        time.sleep(0.01)
    send.release.set()
    for t in [t0, *others]:
        t.join(5)
    timeouts = [t for _, t in send.calls]
    # each call's deadline is its callers' shortest, less what they waited (measured, so a
    # busy machine's delays count on both sides)
    waited = [send.sent_at[0] - first_at, send.sent_at[1] - others_at]
    assert 9.0 - waited[0] <= timeouts[0] <= 9.0 and 3.0 - waited[1] <= timeouts[1] <= 3.0


def test_a_caller_whose_deadline_passes_while_waiting_gives_up_unsent():
    from spillway.sidecar.federation.coalesce import GroupCallTimeout

    send = _Held()
    g = GroupCall(send, max_items=8, max_weight=100)
    first = send.first_call(g.call, "slow", timeout_s=9.0)
    with pytest.raises(GroupCallTimeout, match="not sent"):
        g.call("late", timeout_s=0.2)
    send.release.set()
    first.join(5)
    assert [items for items, _ in send.calls] == [["slow"]] and not g._queue
