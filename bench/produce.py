"""Baseline of target 1: one plain Python process producing the same records to the same broker
with the DLQ producer's settings (idempotent, acks=all, same linger.ms and batch.size), by the
confluent-kafka discipline the sidecar follows (delivery callback, poll(0) after produce, poll
and retry on BufferError, flush at the end).

    python -m bench.produce --bootstrap HOST:PORT --topic T --records N
                            [--linger-ms 20] [--batch-size 1000000] [--value-size 200]

Prints one JSON line: records, acknowledged, errors, seconds (produce of the first record to the
flush that returned with every delivery report served) and cpu_seconds (this process's CPU over
the same window, librdkafka's threads included: the floor of producing these records from
Python, beside which a node sidecar's CPU per dead-lettered record is read).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .records import key_bytes, spillway_like_headers, value_bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.produce")
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--records", type=int, required=True)
    ap.add_argument("--linger-ms", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=1_000_000)
    ap.add_argument("--value-size", type=int, default=200)
    ap.add_argument("--job", default="bench-baseline")
    args = ap.parse_args(argv)

    from confluent_kafka import Producer
    from spillway.sidecar.dlq.producer import producer_config

    conf = producer_config(args.bootstrap, linger_ms=args.linger_ms, batch_size=args.batch_size)
    p = Producer(conf)
    acked = 0
    errors = 0
    first_error = ""

    def on_delivery(err, _msg) -> None:
        nonlocal acked, errors, first_error
        if err is None:
            acked += 1
        else:
            errors += 1
            first_error = first_error or str(err)

    # Connect, get the idempotent producer id and learn the topic's leader before the clock
    # starts (the sidecar's long-lived producer has all of that by the time the candidate's
    # clock starts): one acknowledged record outside the window, not counted.
    p.produce(args.topic, value=b"warm-up", key=b"warm-up")
    if p.flush(30) != 0:
        raise SystemExit("bench.produce: the warm-up record was not acknowledged in 30 s")
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    for i in range(args.records):
        rid = f"{args.topic}-{i}"
        while True:
            try:
                p.produce(args.topic, value=value_bytes(i, args.value_size), key=key_bytes(i),
                          headers=spillway_like_headers(args.job, rid), on_delivery=on_delivery)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    left = p.flush(120)
    seconds = time.perf_counter() - t0
    cpu_seconds = time.process_time() - cpu0
    print(json.dumps({"records": args.records, "acknowledged": acked, "errors": errors,
                      "left": left, "first_error": first_error, "seconds": seconds,
                      "cpu_seconds": cpu_seconds}), flush=True)
    return 0 if acked == args.records else 1


if __name__ == "__main__":
    sys.exit(main())
