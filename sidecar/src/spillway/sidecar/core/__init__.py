"""The pure policy core: no grpc, confluent_kafka, pyspark or opentelemetry imports here.

It talks to the world through the ports in `ports.py`; the adapters that translate it live in
`spillway.sidecar.transport`.
"""
