"""The application service: a sidecar's runs, reports, flushes, summaries and ends.

`Sidecar` (sidecar.py) is the facade the transport calls; `registry` holds the live runs and
their tokens, `admission` the backpressure gate, `runstate` the runs' durable state,
`topic_checks` a run's DLQ topic, `ending` and `status` ending a run and the status page.
"""
