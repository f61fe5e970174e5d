"""The dead letter queue pipeline: durable spool, Kafka producer, topic checks, operator tools.

- `DlqPipeline` (pipeline.py): the DeadLetterSink port; submit / wait_task / force_flush /
  shutdown / stats.
- `Spool` (spool.py): the SQLite spool, with its record codec (codec.py) and on-disk schema
  (schema.py); `MemoryQueue` (memqueue.py) for ``spool.enable=false``; the interface both
  offer the drain (store.py).
- `KafkaDlqProducer`, `classify` (producer.py): the Kafka adapter and its error table.
- `ensure_topic`, `TopicAdmin` (admin.py): guardrails, existence check, KIP-1191 opt-in,
  auto-create; topic creation for the tools.
- tools.py: reading a DLQ topic, ``spillway dlq tail``; redrive.py (rules in redrive_rules.py):
  ``spillway dlq redrive``.
"""

from .admin import ensure_topic
from .memqueue import MemoryQueue
from .pipeline import DlqPipeline
from .producer import DeliveryFailure, KafkaDlqProducer, Outcome, classify, producer_config
from .schema import default_spool_dir
from .spool import Spool
from .store import RejectedRecord, SpooledRecord

__all__ = [
    "DeliveryFailure",
    "DlqPipeline",
    "KafkaDlqProducer",
    "MemoryQueue",
    "Outcome",
    "RejectedRecord",
    "Spool",
    "SpooledRecord",
    "classify",
    "default_spool_dir",
    "ensure_topic",
    "producer_config",
]
