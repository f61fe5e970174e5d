"""What the sidecar tells operators: spans and the KIP metric set (`telemetry`, `exported`),
the Prometheus endpoint (`prometheus`) and what health says (`health`)."""
