"""`convert`: the service's plain answers to protobuf and back, as a node relays what another
sidecar answered (its run's home, a node, a sibling process): nothing is lost on the way."""

from __future__ import annotations

from spillway.sidecar.core import model as m
from spillway.sidecar.service.values import Ended, Registered, RunSummary
from spillway.sidecar.transport import convert


def _summary() -> m.JobSummary:
    return m.JobSummary(
        job="orders", run_id="app-1", failed=True, failure_reason="errors.tolerance=none",
        records_processed=1_000,
        counts=m.Counts(total_record_failures=7, total_record_errors=5,
                        total_records_skipped=4, total_retries=2, total_errors_logged=3,
                        dropped_records=1, last_error_timestamp_ms=1_700_000_000_000),
        dlq_records_written=4, by_stage={"TRANSFORMATION": 5, "SINK": 2},
        by_category={"DATA": 7}, by_exception_class={"builtins.ValueError": 7},
        retry_budget_exhausted=6, records_refused=8, record_id_collisions=9)


def test_a_summary_survives_the_wire_with_its_sidecar():
    relayed = convert.summary_from_pb(convert.summary_to_pb(_summary(), "node-a"))
    assert relayed == RunSummary(_summary(), "node-a")
    assert convert.run_summary_pb(relayed) == convert.summary_to_pb(_summary(), "node-a")


def test_an_end_keeps_its_summaries_in_order_and_the_unreachable_nodes():
    ended = Ended([RunSummary(_summary(), "home"), RunSummary(m.JobSummary("orders"), "n1")],
                  ["n2:50051"])
    assert convert.ended_from_pb(convert.ended_pb(ended)) == ended


def test_a_registration_answer_survives_the_wire():
    answer = Registered(job="orders", run_id="app-1", job_token="t" * 43,
                        effective_properties={"errors.tolerance": "all"}, home="h:50051",
                        home_instance_id="abc", process_port=50053, report_columns=True)
    assert convert.registered_from_pb(convert.registered_pb(answer)) == answer
