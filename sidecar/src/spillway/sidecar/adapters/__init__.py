"""Adapters: translate between the pure core and grpc, Kafka, OpenTelemetry."""
