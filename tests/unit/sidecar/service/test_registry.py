"""Job runs: who may touch a run, the live-run bound, idle expiry and page tokens (no gRPC)."""

from __future__ import annotations

import threading

import pytest
from spillway.sidecar.errors import ConfigError, LiveRunsExhaustedError
from spillway.sidecar.service import registry as r
from support.fakes import Caller, FakeClock

APP, PEER, OPERATOR = Caller(), Caller(peer=True), Caller(admin=True)


def _run(job="j", run_id="app-1", token="tok"):
    return r.Run(job=job, run_id=run_id, key=f"{job}@{run_id}", digest=r.token_digest(token))


def test_only_the_runs_token_lets_a_caller_use_it():
    d = r.token_digest("secret-token")
    assert r.may_use(d, "secret-token")
    for wrong in (None, "", "secret-tokeN", "secret-token ", "x" * 10_000):
        assert not r.may_use(d, wrong)


def test_operators_and_peers_see_every_run_others_only_their_own():
    d = r.token_digest("t")
    assert r.may_see(OPERATOR, d, None) and r.may_see(PEER, d, None)
    assert r.may_see(APP, d, "t") and not r.may_see(APP, d, None) and not r.may_see(APP, d, "u")
    runs = [_run(run_id="a", token="t"), _run(run_id="b", token="u")]
    assert [x.run_id for x in r.visible(runs, APP, "u")] == ["b"]
    assert [x.run_id for x in r.visible(runs, OPERATOR, None)] == ["a", "b"]


def test_ending_a_run_needs_its_token_an_operator_or_a_peer_releasing_locally():
    d = r.token_digest("t")
    assert r.may_end(APP, d, "t", local_only=False)
    assert not r.may_end(APP, d, None, local_only=False)
    assert not r.may_end(APP, d, "u", local_only=True)
    assert r.may_end(OPERATOR, d, None, local_only=False)
    assert r.may_end(PEER, d, None, local_only=True)
    assert not r.may_end(PEER, d, None, local_only=False)


def test_refusals_say_what_is_missing_never_the_token():
    err = r.access_error("orders", "app-1", "a-wrong-token")
    assert "wrong" in str(err) and "a-wrong-token" not in str(err) and "orders" in str(err)
    assert "missing" in str(r.access_error("orders", "app-1", None))
    assert "tok" not in repr(_run())


@pytest.mark.parametrize("run_id", ["local-1700000000000", "app-20261123101112-0001",
                                    "application_1700000000000_0001", "0123abcdef", "a:b.c",
                                    "a@b"])
def test_spark_application_ids_are_run_ids(run_id):
    assert r.check_run_id(run_id) == run_id


@pytest.mark.parametrize("run_id", ["", " ", "a/b", "a b", "x" * 129, "é", "a\nb"])
def test_other_run_ids_are_refused_naming_the_field(run_id):
    with pytest.raises(ConfigError, match="run_id"):
        r.check_run_id(run_id)


def test_page_tokens_round_trip_and_garbage_is_a_clear_error():
    tok = r.encode_page_token("j/with \"odd\" name", "app-1")
    assert r.decode_page_token(tok) == ("j/with \"odd\" name", "app-1")
    for bad in ("%%%", "bm90IGpzb24", r.encode_page_token("a", "b")[:-3] + "!!"):
        with pytest.raises(ConfigError, match="page_token"):
            r.decode_page_token(bad)
    assert r.page_size(0) == r.DEFAULT_PAGE_SIZE and r.page_size(5) == 5
    assert r.page_size(10**6) == r.MAX_PAGE_SIZE
    with pytest.raises(ConfigError, match="page_size"):
        r.page_size(-1)


def test_the_live_run_bound_names_its_property():
    reg = r.Registry(max_live=2, idle_timeout_s=60)
    for i in range(2):
        reg.check_room()
        reg.add(_run(run_id=f"a{i}"))
    with pytest.raises(LiveRunsExhaustedError, match="jobs.max.live=2"):
        reg.check_room()
    assert reg.remove(reg.get("j", "a0")) and not reg.remove(_run(run_id="a1"))  # not that one
    reg.check_room()
    assert len(reg) == 1 and reg.ended == 1


def test_two_runs_of_one_name_are_independent_entries():
    reg = r.Registry(max_live=10, idle_timeout_s=60)
    a, b = reg.add(_run(run_id="app-1")), reg.add(_run(run_id="app-2"))
    assert reg.get("j", "app-1") is a and reg.get("j", "app-2") is b
    assert [x.run_id for x in reg.runs("j")] == ["app-1", "app-2"] and reg.runs("other") == []


def test_idle_runs_are_found_after_the_timeout_and_a_touch_keeps_one_alive():
    clock = FakeClock(start_ms=100_000.0)
    reg = r.Registry(max_live=10, idle_timeout_s=60, clock=clock.monotonic)
    quiet, busy = reg.add(_run(run_id="quiet")), reg.add(_run(run_id="busy"))
    clock.advance(59_000)
    assert reg.idle() == []
    reg.touch(busy)
    clock.advance(2_000)
    assert reg.idle() == [quiet]
    assert reg.remove(quiet, expired=True) and (reg.expired, reg.ended) == (1, 0)


def test_the_reaper_expires_idle_runs_and_stops():
    clock = FakeClock(start_ms=100_000.0)
    reg = r.Registry(max_live=10, idle_timeout_s=0.2, clock=clock.monotonic)
    run = reg.add(_run())
    done = threading.Event()

    def expire(x):
        assert reg.remove(x, expired=True)
        done.set()

    reg.start_reaper(expire)
    try:
        clock.advance(1_000)
        assert done.wait(10) and reg.get("j", "app-1") is None and reg.expired == 1
    finally:
        reg.stop()
    assert run.job == "j"


def test_nodes_of_a_run_are_remembered_once_and_bounded(monkeypatch):
    monkeypatch.setattr(r, "MAX_NODES_PER_RUN", 3)
    reg = r.Registry(max_live=10, idle_timeout_s=60)
    run = reg.add(_run())
    for node in ("n1:1", "n1:1", "n2:1", "n3:1", "n4:1"):
        reg.add_node(run, node)
    assert run.nodes == {"n1:1", "n2:1", "n3:1"}
