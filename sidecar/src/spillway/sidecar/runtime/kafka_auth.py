"""The Kafka settings of the sidecar and of the ``spillway dlq`` commands, secrets resolved.

Both sides take librdkafka settings as strings (``producer.kafka.<key>`` properties; ``-X
KEY=VALUE`` and ``--kafka-config FILE``) and resolve them with `spillway.client.kafka_auth`:
``${env:NAME}``, ``${file:/path/file.properties:key}`` and ``${directory:/path/dir:file}``
references are read here, once, at start-up, and ``sasl.oauthbearer.method=aws-msk-iam`` becomes
an ``oauth_cb``. A reference that cannot be read stops start-up with a ConfigError naming the
property and the variable or file.

A secret setting (`kafka_auth.is_secret`) given literally on a command line (``--set``, ``-X``)
is refused: every local user can read a process's arguments. The same value is accepted from a
properties file, the environment (``SPILLWAY_PRODUCER_KAFKA_*``) or a reference. The sidecar
logs its Kafka settings once, as given: references as written, a literal secret as ``[hidden]``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from spillway.client import kafka_auth
from spillway.sidecar.core.config import PRODUCER_PASSTHROUGH, load_properties_file
from spillway.sidecar.errors import ConfigError

log = logging.getLogger("spillway.sidecar.kafka")


def check_command_line(settings: Mapping[str, str], *, prefix: str = "", flag: str) -> None:
    """ConfigError for a secret given literally on the command line (``flag``)."""
    key = kafka_auth.literal_secret({k[len(prefix):]: v for k, v in settings.items()
                                     if k.startswith(prefix)})
    if key is not None:
        raise ConfigError(prefix + key, (
            f"a secret given on the command line ({flag}) is readable by every local user; "
            f"give it as a reference (${{env:NAME}}, ${{directory:/path/dir:file}}, "
            f"${{file:/path/file.properties:key}}) or in a properties file"))


def passthrough(raw: Mapping[str, str], *, signer: Any = None) -> dict[str, Any]:
    """The sidecar's ``producer.kafka.<key>`` settings (prefix removed), resolved."""
    given = {k[len(PRODUCER_PASSTHROUGH):]: v for k, v in raw.items()
             if k.startswith(PRODUCER_PASSTHROUGH)}
    try:
        resolved = kafka_auth.resolve(given, prefix=PRODUCER_PASSTHROUGH, signer=signer)
    except kafka_auth.KafkaConfigError as exc:
        raise ConfigError(exc.property, exc.reason) from None
    if given:   # as given: references as written, a secret given literally (in a file) hidden
        shown = sorted(kafka_auth.redacted(given).items())
        log.info("Kafka client settings: %s",
                 ", ".join(f"{PRODUCER_PASSTHROUGH}{k}={v}" for k, v in shown))
    return resolved


def cli_settings(items: Sequence[str], files: Sequence[str] = (), *,
                 signer: Any = None) -> dict[str, Any]:
    """``spillway dlq``'s client settings: ``--kafka-config`` files in order, then ``-X``
    (which wins), resolved. ValueError (ConfigError) naming the setting."""
    given: dict[str, str] = {}
    for path in files:
        try:
            given.update(load_properties_file(path))
        except ConfigError as exc:
            raise ConfigError("--kafka-config", str(exc).partition(": ")[2]) from None
    x: dict[str, str] = {}
    for n, item in enumerate(items, 1):
        k, sep, v = item.partition("=")
        if not sep or not k.strip():   # not echoed: it may be a value typed without its key
            raise ConfigError("-X", f"expected KEY=VALUE, the -X number {n} is not")
        x[k.strip()] = v.strip()
    check_command_line(x, flag="-X")
    given.update(x)
    try:
        return kafka_auth.resolve(given, signer=signer)
    except kafka_auth.KafkaConfigError as exc:
        raise ConfigError(exc.property, exc.reason) from None
