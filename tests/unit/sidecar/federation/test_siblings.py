"""`siblings`: a run's home among the processes of one sidecar is decided by its name."""

from __future__ import annotations

from collections import Counter

from spillway.sidecar.federation import siblings

PROCS = ("10.0.0.5:50052", "10.0.0.5:50053", "10.0.0.5:50054")


def test_the_owner_is_a_stable_function_of_job_and_run():
    # the same in every process and after a restart: no hash() seed, no state
    assert siblings.owner(PROCS, "orders", "app-1") == siblings.owner(PROCS, "orders", "app-1")
    assert siblings.owner(PROCS, "orders", "app-1") == "10.0.0.5:50054"
    # job and run id are kept apart ("a"+"bc" is not "ab"+"c")
    assert {siblings.owner(PROCS, "a", "bc"), siblings.owner(PROCS, "ab", "c")} <= set(PROCS)


def test_runs_spread_over_the_processes():
    counts = Counter(siblings.owner(PROCS, "job", f"run-{i}") for i in range(3000))
    assert set(counts) == set(PROCS) and min(counts.values()) > 800


def test_elsewhere_is_empty_for_this_process_and_a_single_one():
    me = siblings.owner(PROCS, "j", "r")
    assert siblings.elsewhere(PROCS, me, "j", "r") == ""
    other = next(p for p in PROCS if p != me)
    assert siblings.elsewhere(PROCS, other, "j", "r") == me
    assert siblings.elsewhere((), "x:1", "j", "r") == ""


def test_not_found_names_the_process_to_ask():
    assert "homed at process 10.0.0.5:50053" in str(siblings.unknown_here("10.0.0.5:50053",
                                                                          "j", "r"))
    assert "several processes" not in str(siblings.unknown_here("", "j", "r"))
