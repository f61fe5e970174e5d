"""The application service: a sidecar's runs, reports, flushes, summaries and ends.

`Sidecar` (sidecar.py) is the facade the transport calls, built once by `runtime.bootstrap`
over collaborators that own their state: `registration.Registrar` (RegisterJob),
`reporting.Reporting` (reports and flushes), `ending.Ending` (EndJob, idle expiry),
`status.Status` (counters, summaries, GetStatus). They take and return plain values
(`values`); `identity` is who and where this sidecar is; `registry` holds the live runs and
their tokens, `admission` the backpressure gate, `runstate` the runs' durable state,
`topic_checks` a run's DLQ topic.
"""
