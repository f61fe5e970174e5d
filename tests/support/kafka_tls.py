"""A Kafka endpoint that requires TLS client certificates: a TLS-terminating proxy in front of a
Tansu broker that advertises the proxy's address, so that every connection librdkafka opens
(bootstrap, then the broker named in the metadata) goes through TLS.

Tansu 0.6.0 has its own ``--cert``/``--key`` flags, but its command line refuses them together,
so the TLS listener is this proxy (asyncio, one thread); it records the common name of every
client certificate it accepted.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from spillway.sidecar.runtime.embedded import EmbeddedBroker
from support.ports import free_port
from support.tls import Ca, Leaf


def encrypted_key(leaf: Leaf, password: str, path: Path) -> Path:
    """``leaf``'s private key written again, encrypted with ``password`` (PKCS#8 PEM)."""
    key = serialization.load_pem_private_key(leaf.key.read_bytes(), None)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.BestAvailableEncryption(password.encode()))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    return path


def client_pki(directory: Path, key_password: str) -> dict:
    """A CA, the broker's certificate, and a client certificate whose key is encrypted with
    ``key_password``, that password in ``secret/ssl-key-password`` (as a mounted Kubernetes
    Secret holds one file per key)."""
    ca = Ca.create(directory)
    server = ca.issue(directory, "kafka-broker")
    client = ca.issue(directory, "spillway-dlq")
    key = encrypted_key(client, key_password, directory / "spillway-dlq.enc.key")
    secret = directory / "kafka-secret"
    secret.mkdir()
    (secret / "ssl-key-password").write_text(key_password + "\n")
    return {"ca": ca, "server": server, "cert": client.cert, "key": key, "secret": secret,
            "dir": directory}


def client_tls(pki: dict) -> dict[str, str]:
    """librdkafka settings for `client_pki`'s client: mTLS, the key password a reference."""
    return {"security.protocol": "SSL", "ssl.ca.location": str(pki["ca"].path),
            "ssl.certificate.location": str(pki["cert"]), "ssl.key.location": str(pki["key"]),
            "ssl.key.password": f"${{directory:{pki['secret']}:ssl-key-password}}"}


@dataclass
class TlsKafka:
    """Tansu on a loopback port behind a TLS proxy on another; `bootstrap_servers` is the
    proxy. Client certificates signed by ``ca`` are required."""

    ca: Ca
    server: Leaf
    log_path: Path
    port: int = 0
    peers: list[str] = field(default_factory=list)
    _broker: EmbeddedBroker | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> TlsKafka:
        self.port = free_port()
        self._broker = EmbeddedBroker(log_path=str(self.log_path),
                                      advertised_port=self.port).start()
        upstream = self._broker.port
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.ca.path))
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(str(self.server.cert), str(self.server.key))
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ctx, upstream, ready),
                                        name="tls-kafka-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the TLS proxy did not start")
        return self

    def _serve(self, ctx: ssl.SSLContext, upstream: int, ready: threading.Event) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        loop.set_exception_handler(lambda _loop, _context: None)  # refused handshakes

        async def pump(reader, writer) -> None:
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        async def handle(reader, writer) -> None:
            cert = writer.get_extra_info("peercert") or {}
            cn = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
            self.peers.append(cn[0] if cn else "")
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream)
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

        async def main() -> None:
            server = await asyncio.start_server(handle, "127.0.0.1", self.port, ssl=ctx)
            ready.set()
            async with server:
                await server.serve_forever()

        try:
            loop.run_until_complete(main())
        except asyncio.CancelledError:
            pass

    def stop(self) -> None:
        if self._loop is not None:
            loop = self._loop

            def cancel() -> None:
                for task in asyncio.all_tasks(loop):
                    task.cancel()

            loop.call_soon_threadsafe(cancel)
            self._thread.join(5)
        if self._broker is not None:
            self._broker.stop()
