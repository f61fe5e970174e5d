"""Injected produce errors: librdkafka's mock cluster (a Kafka-protocol server inside librdkafka),
driven through its C API with ctypes since confluent-kafka does not wrap it.

Each injected error answers one Produce request; the counts asserted are exact.
"""

from __future__ import annotations

import ctypes
import glob
import io
import os
import time
from collections import Counter

import confluent_kafka
import pytest
from spillway.sidecar.core.model import DlqRecord
from spillway.sidecar.dlq import DlqPipeline
from spillway.sidecar.dlq.redrive import redrive
from support.kafka import read_all

pytestmark = pytest.mark.integration

PRODUCE = 0  # ApiKey
NOT_ENOUGH_REPLICAS = 19
MSG_SIZE_TOO_LARGE = 10
OUT_OF_ORDER_SEQUENCE_NUMBER = 45
TOPIC = "dlq.mock"


def _librdkafka() -> ctypes.CDLL:
    libdir = os.path.join(os.path.dirname(confluent_kafka.__file__), "..", "confluent_kafka.libs")
    found = glob.glob(os.path.join(libdir, "librdkafka*.so*"))
    if not found:
        pytest.skip("this confluent-kafka wheel has no bundled librdkafka to drive the mock")
    lib = ctypes.CDLL(found[0])  # the very library confluent-kafka loaded
    lib.rd_kafka_conf_new.restype = ctypes.c_void_p
    lib.rd_kafka_conf_set.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                                      ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_cluster_new.restype = ctypes.c_void_p
    lib.rd_kafka_mock_cluster_new.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.rd_kafka_mock_cluster_destroy.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
    lib.rd_kafka_mock_cluster_bootstraps.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_topic_create.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int,
                                               ctypes.c_int]
    lib.rd_kafka_mock_push_request_errors_array.argtypes = [
        ctypes.c_void_p, ctypes.c_int16, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int)]
    return lib


class MockCluster:
    def __init__(self) -> None:
        self.lib = _librdkafka()
        err = ctypes.create_string_buffer(512)
        conf = self.lib.rd_kafka_conf_new()
        self.lib.rd_kafka_conf_set(conf, b"log_level", b"0", err, 512)
        self.rk = self.lib.rd_kafka_new(1, conf, err, 512)  # a consumer handle hosts the mock
        assert self.rk, err.value
        self.mc = self.lib.rd_kafka_mock_cluster_new(self.rk, 1)
        self.bootstrap = self.lib.rd_kafka_mock_cluster_bootstraps(self.mc).decode()
        self.create_topic(TOPIC)

    def create_topic(self, name: str) -> None:
        assert self.lib.rd_kafka_mock_topic_create(self.mc, name.encode(), 1, 1) == 0

    def fail_produce(self, *codes: int) -> None:
        """The next len(codes) Produce requests get these errors, in order."""
        arr = (ctypes.c_int * len(codes))(*codes)
        self.lib.rd_kafka_mock_push_request_errors_array(self.mc, PRODUCE, len(codes), arr)

    def close(self) -> None:
        self.lib.rd_kafka_mock_cluster_destroy(self.mc)
        self.lib.rd_kafka_destroy(self.rk)


class Steady:
    """Backoff without jitter: records that failed together are retried together."""

    def random(self) -> float:
        return 1.0


@pytest.fixture
def mock():
    m = MockCluster()
    yield m
    m.close()


@pytest.fixture
def pipeline(mock, tmp_path):
    made = []

    def make(**kw) -> DlqPipeline:
        # a generous linger keeps each round of N records in one produce request even on a
        # loaded machine: the injected errors count requests
        overrides = {"linger.ms": "500", "message.send.max.retries": "1",
                     "retry.backoff.ms": "10", "log_level": "0"}
        overrides.update(kw.pop("overrides", {}))
        p = DlqPipeline(mock.bootstrap, spool_dir=str(tmp_path), producer_overrides=overrides,
                        rng=Steady(), retry_backoff_ms=50, **kw).start()
        # a first record settles metadata and the producer id: injected errors then hit data
        p.submit([rec(-1)])
        assert p.wait_task("job/warm", 10) == 1
        made.append(p)
        return p

    yield make
    for p in made:
        p.shutdown(2.0)


def rec(i: int, tk: str = "job/0.0.0/1") -> DlqRecord:
    return DlqRecord(topic=TOPIC, key=None, value=f"v{i}".encode(),
                     headers=(("spillway.record.id", f"r{i}".encode()),), record_id=f"r{i}",
                     job="job", task_key=tk if i >= 0 else "job/warm")


def delivered(mock) -> Counter:
    msgs = read_all(mock.bootstrap, TOPIC, idle_s=0.5)
    return Counter(dict(m.headers())["spillway.record.id"].decode() for m in msgs)


def base(p: DlqPipeline) -> dict[str, float]:
    return dict(p.stats())


def delta(p: DlqPipeline, before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in p.stats().items()}


N = 20


def test_retriable_errors_are_retried_until_success(mock, pipeline):
    p = pipeline()
    before = base(p)
    # librdkafka tries twice (message.send.max.retries=1) before reporting; the pipeline then
    # produces again: 4 failed requests = 2 failed deliveries per record, the 3rd attempt lands
    mock.fail_produce(*[NOT_ENOUGH_REPLICAS] * 4)
    p.submit([rec(i) for i in range(N)])
    # no barrier until they are written: a waiting one has librdkafka send at once, and a
    # retry round's records (due a few µs apart) could then go in two requests
    deadline = time.monotonic() + 20
    while delta(p, before)["dlq-records-written"] < N and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.wait_task("job/0.0.0/1", 20) == N
    d = delta(p, before)
    assert d["deadletterqueue-produce-requests"] == 3 * N
    assert d["deadletterqueue-produce-failures"] == 2 * N
    assert d["write-retries"] == 2 * N
    assert d["dlq-records-written"] == N
    assert d["write-failures"] == 0 and d["rejected-records"] == 0
    got = delivered(mock)
    assert all(got[f"r{i}"] == 1 for i in range(N))


def test_a_batch_refused_as_too_large_is_probed_record_by_record(mock, pipeline):
    p = pipeline()
    before = base(p)
    # the batch is refused, then the first record probed alone too: only it is set aside
    mock.fail_produce(MSG_SIZE_TOO_LARGE, MSG_SIZE_TOO_LARGE)
    p.submit([rec(i) for i in range(N)])
    with pytest.raises(Exception, match="1 DLQ record\\(s\\) of task job/0.0.0/1 can never be "
                                        "written"):
        p.wait_task("job/0.0.0/1", 20)
    assert p.force_flush(10)
    d = delta(p, before)
    assert d["deadletterqueue-produce-requests"] == 2 * N  # the batch, then N probes
    assert d["deadletterqueue-produce-failures"] == N + 1
    assert d["dlq-records-written"] == N - 1
    assert d["write-failures"] == 1 and d["rejected-records"] == 1
    assert d["write-retries"] == 0
    assert [r.record.record_id for r in p.store.rejected()] == ["r0"]
    got = delivered(mock)
    assert "r0" not in got
    assert all(got[f"r{i}"] == 1 for i in range(1, N))


def test_innocent_records_of_a_refused_batch_all_land(mock, pipeline):
    p = pipeline()
    before = base(p)
    mock.fail_produce(MSG_SIZE_TOO_LARGE)
    p.submit([rec(i) for i in range(N)])
    assert p.wait_task("job/0.0.0/1", 20) == N
    d = delta(p, before)
    assert d["deadletterqueue-produce-failures"] == N
    assert d["dlq-records-written"] == N
    assert d["rejected-records"] == 0


def test_a_fatal_producer_error_rebuilds_the_producer_and_loses_nothing(mock, pipeline):
    p = pipeline()
    before = base(p)
    mock.fail_produce(OUT_OF_ORDER_SEQUENCE_NUMBER)  # idempotence desynchronised: fatal
    p.submit([rec(i) for i in range(N)])
    assert p.wait_task("job/0.0.0/1", 20) == N
    d = delta(p, before)
    assert d["producer-rebuilds"] == 1
    assert d["dlq-records-written"] == N
    assert d["rejected-records"] == 0
    got = delivered(mock)
    assert all(got[f"r{i}"] >= 1 for i in range(N))


def test_redrive_counts_the_records_its_target_refuses(mock, pipeline):
    p = pipeline()  # the DLQ topic holds the warm-up record
    p.submit([rec(i) for i in range(3)])
    assert p.wait_task("job/0.0.0/1", 20) == 3
    mock.create_topic("orders")
    mock.fail_produce(*[MSG_SIZE_TOO_LARGE] * 4)  # whatever the batching, every record fails
    out = io.StringIO()
    # these records' payload is unstated and "orders" is their source topic: sent all the same;
    # librdkafka's mock cluster does not answer CreateTopics, so no ledger here
    summary = redrive(mock.bootstrap, TOPIC, "orders", idle_s=0.5, out=out,
                      client_conf={"log_level": 0}, allow_stage_input=True, use_ledger=False)
    assert (summary.scanned, summary.matched, summary.redriven, summary.failed) == (4, 4, 0, 4)
    assert out.getvalue().strip().splitlines()[-1] == (
        "scanned=4 matched=4 redriven=0 skipped (loop protection)=0 skipped (context-only)=0 "
        "skipped (stage input)=0 skipped (already redriven)=0 skipped (resolved)=0 failed=4")
    assert "MSG_SIZE_TOO_LARGE" in out.getvalue()
