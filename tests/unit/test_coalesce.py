"""GroupCall: calls that arrive while one is in flight go together as the next one."""

from __future__ import annotations

import threading
import time

import pytest

from spillway.sidecar.coalesce import GroupCall


def test_one_caller_is_sent_at_once_alone():
    sent = []
    g = GroupCall(lambda items, t: sent.append((list(items), t)) or [i * 2 for i in items],
                  max_items=8, max_weight=100)
    assert g.call(3, timeout_s=5.0) == 6
    assert sent[0][0] == [3] and 4.9 < sent[0][1] <= 5.0 and (g.calls, g.items) == (1, 1)


def test_callers_arriving_during_a_call_go_together_in_the_next_one():
    started, release = threading.Event(), threading.Event()
    batches = []

    def send(items, timeout_s):
        batches.append(list(items))
        if len(batches) == 1:
            started.set()
            assert release.wait(5)
        return [f"answer {i}" for i in items]

    g = GroupCall(send, max_items=64, max_weight=10_000)
    answers = {}

    def caller(i):
        answers[i] = g.call(i, weight=10, timeout_s=5.0)

    first = threading.Thread(target=caller, args=(0,))
    first.start()
    assert started.wait(5)
    rest = [threading.Thread(target=caller, args=(i,)) for i in range(1, 6)]
    for t in rest:
        t.start()
    deadline = time.monotonic() + 5
    while len(g._queue) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    for t in [first, *rest]:
        t.join(5)
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
    from spillway.sidecar.coalesce import _Waiter

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
    started, release = threading.Event(), threading.Event()
    timeouts = []

    def send(items, timeout_s):
        timeouts.append(timeout_s)
        if len(timeouts) == 1:
            started.set()
            release.wait(5)
        return list(items)

    g = GroupCall(send, max_items=8, max_weight=100)
    t0 = threading.Thread(target=g.call, args=("x",), kwargs={"timeout_s": 9.0})
    t0.start()
    assert started.wait(5)
    others = [threading.Thread(target=g.call, args=(i,), kwargs={"timeout_s": s})
              for i, s in ((1, 7.0), (2, 3.0))]
    for t in others:
        t.start()
    while len(g._queue) < 2:
        time.sleep(0.01)
    release.set()
    for t in [t0, *others]:
        t.join(5)
    assert 8.9 < timeouts[0] <= 9.0 and 2.0 < timeouts[1] <= 3.0   # less what it waited


def test_a_caller_whose_deadline_passes_while_waiting_gives_up_unsent():
    from spillway.sidecar.coalesce import GroupCallTimeout

    started, release = threading.Event(), threading.Event()
    sent = []

    def send(items, timeout_s):
        sent.append(list(items))
        started.set()
        release.wait(5)
        return list(items)

    g = GroupCall(send, max_items=8, max_weight=100)
    first = threading.Thread(target=g.call, args=("slow",), kwargs={"timeout_s": 9.0})
    first.start()
    assert started.wait(5)
    with pytest.raises(GroupCallTimeout, match="not sent"):
        g.call("late", timeout_s=0.2)
    release.set()
    first.join(5)
    assert sent == [["slow"]] and not g._queue
