"""``spillway dlq tail``, ``redrive`` and ``create-topic``: argparse wiring over `dlq.tools`,
`dlq.redrive` and `dlq.admin`.

The main CLI calls `add_dlq_commands(subparsers)`; each command stores its handler as
``args.func`` (``func(args) -> int``, the exit code: 0 ok; 1 (redrive) records failed, or it sent
nothing because every matching record was refused; 2 bad input, a refused request or an
unreachable cluster).

Topics these commands create obey the operator's prefix rule, ``dlq.topic.required.prefix``,
read as `spillway serve` reads it (``--config`` / ``$SPILLWAY_CONFIG``, then the environment).
"""

from __future__ import annotations

import argparse
import os
import sys

from spillway.client.kafka_auth import scrub
from spillway.sidecar.errors import DlqError

# `.dlq` (Kafka clients, the spool, OpenTelemetry) is imported by the commands that use it, not
# here: building the parser must stay cheap, `spillway serve` builds it before re-executing
# itself on another allocator (memtune.py)


def _add_client_options(p: argparse.ArgumentParser, *, idle: bool = True) -> None:
    p.add_argument("--bootstrap-servers", required=True, metavar="HOST:PORT[,...]",
                   help="Kafka bootstrap servers")
    p.add_argument("--topic", required=True, help="the DLQ topic")
    p.add_argument("-X", "--property", action="append", default=[], metavar="KEY=VALUE",
                   help="librdkafka client setting (e.g. security.protocol=SASL_SSL); repeatable; "
                        "a secret as a reference, e.g. 'sasl.password=${env:KAFKA_PASSWORD}' "
                        "(docs/SECURITY.md)")
    p.add_argument("--kafka-config", action="append", default=[], metavar="FILE",
                   help="librdkafka client settings from a properties file (-X wins); "
                        "repeatable")
    if not idle:
        return
    p.add_argument("--idle-ms", type=int, default=2000,
                   help="the end of the topic is reached when nothing new arrives for this long "
                        "after every partition answered once (default 2000); a partition with "
                        "no answer in 10 s is an error")


def _add_creation_options(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--partitions", type=int, default=1, metavar="N",
                   help=f"partitions of {what} (default 1)")
    p.add_argument("--replication-factor", type=int, default=3, metavar="N",
                   help=f"replicas of {what} (default 3; refused above the cluster's broker "
                        f"count)")
    p.add_argument("--config", metavar="FILE",
                   help="the sidecar's configuration (Java properties), for the operator's "
                        "dlq.topic.required.prefix that a created topic's name must start "
                        "with (default $SPILLWAY_CONFIG; $SPILLWAY_DLQ_TOPIC_REQUIRED_PREFIX "
                        "overrides it; unset: 'dlq.')")


def add_dlq_commands(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``dlq`` with its ``tail``, ``redrive`` and ``create-topic`` subcommands; returns
    the ``dlq`` parser."""
    dlq = subparsers.add_parser("dlq", help="inspect, redrive and create dead letter queue "
                                            "topics",
                                description="Inspect, redrive and create dead letter queue "
                                            "topics.")
    sub = dlq.add_subparsers(dest="dlq_command", metavar="{tail,redrive,create-topic}",
                             required=True)

    t = sub.add_parser("tail", help="print DLQ records with their headers",
                       description="Print DLQ records with their headers, one block per record. "
                                   "Without --from-beginning: the newest --max records "
                                   "(default 10).")
    _add_client_options(t)
    t.add_argument("--from-beginning", action="store_true",
                   help="start at the oldest record instead of the newest ones")
    t.add_argument("--max", type=int, default=None, metavar="N",
                   help="print at most N records (default: all from the beginning, else 10)")
    t.add_argument("--follow", action="store_true",
                   help="keep printing new records until interrupted")
    t.add_argument("--max-bytes", type=int, default=300, metavar="N",
                   help="cut keys, values and header values to N bytes (default 300)")
    t.set_defaults(func=run_tail)

    r = sub.add_parser(
        "redrive", help="re-publish DLQ records to a topic",
        description="Re-publish matching DLQ records (original key, value and headers, without "
                    "the error-context headers) to --target, adding or incrementing "
                    "spillway.redrive.count. Records redriven --max-redrives times are left "
                    "in place and counted. Exits 1 when records failed, or when it sent "
                    "nothing because every matching record was refused (one line says why).")
    _add_client_options(r)
    r.add_argument("--target", required=True,
                   help="the topic to publish to (must exist, unless --create-target)")
    r.add_argument("--create-target", action="store_true",
                   help="create --target when it does not exist, with --partitions and "
                        "--replication-factor; its name must start with the operator's "
                        "dlq.topic.required.prefix (see --config)")
    _add_creation_options(r, "a target --create-target creates")
    r.add_argument("--stage", help="only records that failed in this stage (e.g. TRANSFORMATION)")
    r.add_argument("--exception-class", help="only records whose exception class is this "
                                             "(qualified name, or the simple name)")
    r.add_argument("--job", help="only records of this job")
    r.add_argument("--since", help="only records dead-lettered at or after this ISO 8601 time "
                                   "(UTC when no zone is given)")
    r.add_argument("--until", help="only records dead-lettered before this ISO 8601 time")
    r.add_argument("--rate", help="at most this many records per second (e.g. 100/s)")
    r.add_argument("--dry-run", action="store_true",
                   help="print what would be redriven; publish nothing")
    r.add_argument("--max-redrives", type=int, default=3, metavar="N",
                   help="leave records already redriven N times (default 3)")
    r.add_argument("--allow-stage-input", action="store_true",
                   help="also send records whose key/value are a stage's input (e.g. a "
                        "transformed row; spillway.payload is not 'source') to a target that "
                        "is, or may be, their source topic (refused by default): for a "
                        "consumer that reprocesses stage inputs, e.g. a new topic")
    r.add_argument("--no-progress", action="store_true",
                   help="no total, running counts and ETA (every 2 s) or final counts on "
                        "stderr")
    r.add_argument("--ledger-topic", metavar="TOPIC",
                   help="the DLQ ledger: records resolved there (redriven before, fixed or "
                        "dead-lettered again by reprocess) are skipped, and each record Kafka "
                        "acknowledges is recorded there (default <topic>.ledger, created "
                        "compacted when missing)")
    r.add_argument("--no-ledger", action="store_true",
                   help="neither read nor write the ledger: every matching record is sent, "
                        "even one resolved before")
    r.set_defaults(func=run_redrive)

    c = sub.add_parser(
        "create-topic", help="create a DLQ topic (KIP-1191 opt-in set)",
        description="Create a DLQ topic under the operator's rules: its name starts with "
                    "dlq.topic.required.prefix, its replication factor is at most the "
                    "cluster's broker count, and it gets errors.deadletterqueue.group.enable="
                    "true (KIP-1191; created without it where the brokers refuse it as "
                    "unknown). An existing topic is an error, unless --if-not-exists.")
    _add_client_options(c, idle=False)
    _add_creation_options(c, "the topic")
    c.add_argument("--if-not-exists", action="store_true",
                   help="an existing topic is fine (exit 0) when it may be used as a DLQ")
    c.set_defaults(func=run_create_topic)
    return dlq


def _required_prefix(config_file: str | None) -> str:
    """The operator's ``dlq.topic.required.prefix``, as `spillway serve` would resolve it."""
    from spillway.sidecar.core import config
    from spillway.sidecar.core.guardrails import REQUIRED_PREFIX_PROP

    env = dict(os.environ)
    path = config_file or env.get("SPILLWAY_CONFIG")
    raw = config.resolve(env=env, file=config.load_properties_file(path) if path else {})
    return config.parse({REQUIRED_PREFIX_PROP: raw[REQUIRED_PREFIX_PROP]})[REQUIRED_PREFIX_PROP]


def run_create_topic(args: argparse.Namespace) -> int:
    from spillway.sidecar.dlq.admin import TopicAdmin, create_dlq_topic
    from spillway.sidecar.dlq.tools import quiet
    from spillway.sidecar.runtime.kafka_auth import cli_settings

    conf: dict = {}
    try:
        conf = cli_settings(args.property, args.kafka_config)
        prefix = _required_prefix(args.config)
        admin = TopicAdmin.connect(quiet({**conf, "bootstrap.servers": args.bootstrap_servers}))
        print(create_dlq_topic(admin, args.topic, partitions=args.partitions,
                               replication_factor=args.replication_factor,
                               required_prefix=prefix, if_not_exists=args.if_not_exists))
    except (DlqError, ValueError) as exc:
        print(f"spillway dlq create-topic: {scrub(str(exc), conf)}", file=sys.stderr)
        return 2
    return 0


def run_tail(args: argparse.Namespace) -> int:
    from spillway.sidecar.dlq import tools
    from spillway.sidecar.runtime.kafka_auth import cli_settings

    conf: dict = {}
    try:
        conf = cli_settings(args.property, args.kafka_config)
        tools.tail(args.bootstrap_servers, args.topic, from_beginning=args.from_beginning,
                   max_records=args.max, follow=args.follow, idle_s=args.idle_ms / 1000.0,
                   max_bytes=args.max_bytes, consumer_conf=conf, out=sys.stdout)
    except (DlqError, ValueError) as exc:
        print(f"spillway dlq tail: {scrub(str(exc), conf)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


def run_redrive(args: argparse.Namespace) -> int:
    from spillway.sidecar.dlq import ledger, redrive_rules
    from spillway.sidecar.dlq.redrive import NewTarget, redrive
    from spillway.sidecar.runtime.kafka_auth import cli_settings

    ledger.setup_tracing()
    conf: dict = {}
    try:
        conf = cli_settings(args.property, args.kafka_config)
        flt = redrive_rules.RedriveFilter(
            stage=args.stage, exception_class=args.exception_class, job=args.job,
            since_ms=redrive_rules.parse_time_ms(args.since) if args.since else None,
            until_ms=redrive_rules.parse_time_ms(args.until) if args.until else None)
        rate = redrive_rules.parse_rate(args.rate) if args.rate else None
        new = NewTarget(partitions=args.partitions, replication_factor=args.replication_factor,
                        required_prefix=_required_prefix(args.config)) \
            if args.create_target else None
        summary = redrive(args.bootstrap_servers, args.topic, args.target, flt=flt,
                          rate_per_s=rate, dry_run=args.dry_run,
                          max_redrives=args.max_redrives, idle_s=args.idle_ms / 1000.0,
                          client_conf=conf, out=sys.stdout,
                          allow_stage_input=args.allow_stage_input,
                          progress=None if args.no_progress else sys.stderr,
                          ledger_topic=args.ledger_topic, use_ledger=not args.no_ledger,
                          create_target=new)
    except (DlqError, ValueError) as exc:
        print(f"spillway dlq redrive: {scrub(str(exc), conf)}", file=sys.stderr)
        return 2
    finally:
        ledger.shutdown_tracing()
    if summary.failed or summary.ledger_failed:
        return 1
    if summary.sent_nothing():
        print(f"spillway dlq redrive: "
              f"{summary.refusals(args.target, args.max_redrives, args.dry_run)}",
              file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: ``python -m spillway.sidecar.cli.dlq dlq tail ...``."""
    parser = argparse.ArgumentParser(prog="spillway")
    add_dlq_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
