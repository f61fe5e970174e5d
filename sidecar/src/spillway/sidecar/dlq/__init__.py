"""The dead letter queue pipeline: durable spool, Kafka producer, topic checks, operator tools.

- `DlqPipeline` (pipeline.py): the DeadLetterSink port; submit / wait_task / force_flush /
  shutdown / stats.
- `Spool` (spool.py): the SQLite spool; `MemoryQueue` for ``spool.enable=false``.
- `KafkaDlqProducer`, `classify` (producer.py): the Kafka adapter and its error table.
- `ensure_topic` (admin.py): guardrails, existence check, auto-create.
- tools.py: ``spillway dlq tail`` and ``spillway dlq redrive``.
"""

from .admin import ensure_topic
from .pipeline import DlqPipeline, default_spool_dir
from .producer import DeliveryFailure, KafkaDlqProducer, Outcome, classify, producer_config
from .spool import MemoryQueue, RejectedRecord, Spool, SpooledRecord

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
