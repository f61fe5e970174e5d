"""The process: wiring a sidecar from its properties and serving it (`bootstrap`), several
processes behind one address (`processes`), shutdown, memory and GC tuning of a long-running
process, start-up refusals over stranded spools, the embedded broker for `make run`, and the
Kafka clients' settings with their secrets resolved (`kafka_auth`)."""
