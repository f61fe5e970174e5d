"""spillway client: the thin gRPC client that executors use to reach their node's sidecar."""
