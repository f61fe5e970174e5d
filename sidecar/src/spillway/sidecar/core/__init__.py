"""The pure policy core: no grpc, confluent_kafka, pyspark or opentelemetry imports here.

It talks to the world through the ports in `ports.py`; adapters live in `spillway.sidecar.adapters`.
"""
