"""The driver refuses exactly the job names the sidecar refuses, with the same message."""

from __future__ import annotations

import pytest
from spillway.client import check_job_name as client_rule
from spillway.sidecar.core.names import check_job_name as sidecar_rule
from spillway.spark._runtime import JobSpec

NAMES = ["orders", "My ETL job", " orders", "orders ", "\torders", "", "   ", "a" * 200,
         "a" * 201, "é" * 127, "é" * 128, "or\x00ders", "or\u202eders", "a\u2028b",
         "ünïcødé", "日本語のジョブ", "job\x7f", "emoji 🙂 job", "a\ud800b"]


@pytest.mark.parametrize("name", NAMES)
def test_client_and_sidecar_agree(name):
    outcomes = []
    for rule in (client_rule, sidecar_rule):
        try:
            outcomes.append(("ok", rule(name)))
        except ValueError as exc:
            outcomes.append(("refused", str(exc)))
    assert outcomes[0] == outcomes[1]


def test_job_spec_refuses_on_the_driver_with_the_sidecars_message():
    with pytest.raises(ValueError) as e:
        JobSpec(name=" orders ")
    with pytest.raises(ValueError) as s:
        sidecar_rule(" orders ")
    assert str(e.value) == str(s.value)
    assert JobSpec(name="orders").name == "orders"


def test_the_client_cuts_exception_texts_to_what_the_sidecar_accepts():
    from spillway.client.report import failed_record
    from spillway.sidecar.transport import validate
    from spillway.v1 import sidecar_pb2 as pb

    def deep(n):
        if n == 0:
            raise ValueError("v" * 200_000)
        return deep(n - 1)

    try:
        try:
            deep(50)
        except ValueError as inner:
            raise RuntimeError("w" * 100_000) from inner
    except RuntimeError as exc:
        rec = failed_record("r1", "TRANSFORMATION", exc)
    e = rec.exception
    assert e.message.endswith("[cut by spillway]") and e.stack_trace.endswith("\n")
    assert len(e.causes) == 1 and e.causes[0].startswith("builtins.ValueError: vvv")
    validate.check("ReportFailures", pb.ReportFailuresRequest(
        job="j", records=[rec]))  # raises if any text is over the sidecar's bound
