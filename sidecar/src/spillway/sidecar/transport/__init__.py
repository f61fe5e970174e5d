"""Transport and security: how the sidecar is reached and whom it trusts.

The gRPC adapters translate between protobuf and the service's plain values (`servicer`,
`rpc`, `validate`, `convert`, `tally`, `columns`, `status`); `security` authenticates every
call before any servicer code runs; `listeners` binds and reloads TLS; `localcred` makes the
default configuration's local credential; `probe` is the plaintext health-only listener.
"""
