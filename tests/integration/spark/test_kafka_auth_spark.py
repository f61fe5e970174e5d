"""`read_dlq` and reprocess's ledger writes against a Kafka that requires TLS client
certificates (Tansu behind `support.kafka_tls`'s proxy), the key's password given as a
``${directory:...}`` reference: read on the driver and on Spark's executors, and what travels to
the executors is the reference, never the password."""

from __future__ import annotations

import sys
import uuid

import pytest
from pyspark import cloudpickle
from spillway.client.kafka_auth import resolve
from spillway.spark import read_dlq
from support.kafka_tls import TlsKafka, client_pki, client_tls

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

KEY_PASSWORD = "Kp-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return client_pki(tmp_path_factory.mktemp("pki"), KEY_PASSWORD)


@pytest.fixture(scope="module")
def tls_kafka(pki):
    k = TlsKafka(pki["ca"], pki["server"], pki["dir"] / "tansu.log").start()
    yield k
    k.stop()


@pytest.fixture(scope="module")
def tls_dlq(tls_kafka, pki, tmp_path_factory):
    """A DLQ topic with 6 records over 2 partitions, written by the sidecar's DLQ pipeline with
    the same settings given as producer.kafka.*."""
    from confluent_kafka.admin import AdminClient, NewTopic
    from spillway.sidecar.core.dlq_record import build_dlq_record
    from spillway.sidecar.core.model import (
        Action,
        Category,
        ExceptionInfo,
        FailedRecord,
        Stage,
        StageRef,
        TaskIdentity,
        Verdict,
    )
    from spillway.sidecar.core.settings import job_settings
    from spillway.sidecar.dlq import DlqPipeline
    from spillway.sidecar.runtime.kafka_auth import passthrough

    topic = f"dlq.tls-spark-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": tls_kafka.bootstrap_servers, "log_level": 0,
                         **resolve(client_tls(pki))})
    for f in admin.create_topics([NewTopic(topic, 2, 1)]).values():
        f.result(15)
    del admin
    overrides = passthrough({f"producer.kafka.{k}": v for k, v in client_tls(pki).items()})
    p = DlqPipeline(tls_kafka.bootstrap_servers, producer_overrides=overrides,
                    spool_dir=str(tmp_path_factory.mktemp("spool"))).start()
    settings = job_settings("tls-orders", {"errors.deadletterqueue.topic.name": topic,
                                           "errors.deadletterqueue.context.headers.enable":
                                               "true"})
    task = TaskIdentity(stage_id=1, partition_id=0, attempt_number=0, task_attempt_id=1)
    try:
        for i in range(6):
            rec = FailedRecord(record_id=f"r{i}", stage=StageRef(Stage.TRANSFORMATION),
                               exception=ExceptionInfo("builtins.ValueError", message="bad"),
                               function_name="etl.parse", key=f"k{i}".encode(),
                               value=f"v{i}".encode())
            v = Verdict(rec.record_id, Action.SKIP, Category.DATA, "data error", attempt=1)
            p.submit([build_dlq_record(settings, rec, v, task, now_ms=1_700_000_000_000 + i,
                                       sidecar_id="s")])
        assert p.force_flush(30)
    finally:
        p.shutdown(5)
    return topic


def test_read_dlq_and_the_ledger_over_mtls_with_the_password_from_a_file(
        spark, tls_kafka, pki, tls_dlq):
    from spillway.spark import _dlq_reader, _reprocess

    conf = client_tls(pki)
    peers = len(tls_kafka.peers)
    df = read_dlq(spark, tls_dlq, bootstrap_servers=tls_kafka.bootstrap_servers,
                  kafka_config=conf)
    rows = sorted(df.select("record_id", "value", "job", "ledger_key").collect())
    assert [(r.record_id, r.value) for r in rows] == [(f"r{i}", f"v{i}".encode())
                                                      for i in range(6)]
    assert {r.job for r in rows} == {"tls-orders"}
    assert len(tls_kafka.peers) > peers              # each read presented the client certificate
    # what is kept for reprocess, and pickled to its executors: the reference, not the password
    bootstrap, frozen, ledger = _dlq_reader.ledger_sources()[tls_dlq]
    assert dict(frozen)["ssl.key.password"] == conf["ssl.key.password"]
    assert KEY_PASSWORD.encode() not in cloudpickle.dumps(_reprocess.Ledger(
        "tls-orders", _dlq_reader.ledger_sources()))
    # reprocess's ledger producer resolves it where it runs, and its write lands over mTLS
    written = _reprocess.write_resolutions(
        _reprocess.Ledger("tls-orders", _dlq_reader.ledger_sources()),
        {(tls_dlq, rows[0].ledger_key): ("reprocessed", b"r0", None)}, "run-tls")
    assert written == 1
    resolved = read_dlq(spark, tls_dlq, bootstrap_servers=tls_kafka.bootstrap_servers,
                        kafka_config=conf, resolved="only").select("record_id",
                                                                   "resolution").collect()
    assert [(r.record_id, r.resolution) for r in resolved] == [("r0", "reprocessed")]


def test_read_dlq_names_the_missing_secret_file(spark, tls_kafka, pki, tls_dlq, tmp_path):
    conf = {**client_tls(pki), "ssl.key.password": f"${{directory:{tmp_path}:nope}}"}
    with pytest.raises(ValueError) as err:
        read_dlq(spark, tls_dlq, bootstrap_servers=tls_kafka.bootstrap_servers,
                 kafka_config=conf)
    assert str(err.value) == f"ssl.key.password: file not found: {tmp_path}/nope"
