"""Kafka client settings with their secrets kept off command lines and out of logs.

Every Kafka client spillway runs builds its librdkafka settings through `resolve`: the sidecar's
DLQ producer, admin calls and Kafka check (``producer.kafka.<key>``), ``spillway dlq tail`` and
``redrive`` (``-X KEY=VALUE``, ``--kafka-config FILE``), `read_dlq` and `Job.reprocess`
(``kafka_config=``).

A value may say where its secret is, in Kafka's own config-provider syntax (the three providers
are always on; no ``config.providers`` line is needed):

- ``${env:NAME}``: the environment variable NAME (Kafka's EnvVarConfigProvider);
- ``${file:/path/to/file.properties:key}``: the value of ``key`` in a Java properties file
  (Kafka's FileConfigProvider);
- ``${directory:/path/to/dir:name}``: the whole content of the file ``name`` in that directory,
  e.g. a mounted Kubernetes Secret (Kafka's DirectoryConfigProvider); one trailing newline is
  removed (``echo`` writes one; no password ends in one).

A reference may also stand inside a longer value (``sasl.oauthbearer.config``). A missing
variable, file or key is a `KafkaConfigError` that names the property and the variable, file or
key, never a value.

``sasl.oauthbearer.method=aws-msk-iam`` (librdkafka knows ``default`` and ``oidc``; spillway adds
this one) sets confluent-kafka's ``oauth_cb`` to a token from ``aws-msk-iam-sasl-signer-python``
(`MSKAuthTokenProvider`, the extra ``spillway-sidecar[msk-iam]`` / ``spillway-spark[msk-iam]``),
for the AWS region ``sasl.oauthbearer.aws.region`` (default: ``AWS_REGION``, then
``AWS_DEFAULT_REGION``), with the default AWS credentials, or those of the profile
``sasl.oauthbearer.aws.profile`` or of the role ``sasl.oauthbearer.aws.role.arn``. These
``sasl.oauthbearer.aws.*`` keys are spillway's and never reach librdkafka.

`is_secret` names the settings whose values are secrets; `redacted` is a mapping safe to show and
`scrub` takes secret values out of a message. Pure: no Kafka client is imported here.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("spillway.kafka.oauth")

PROVIDERS = ("env", "file", "directory")
MSK_IAM = "aws-msk-iam"
METHOD = "sasl.oauthbearer.method"
AWS_REGION = "sasl.oauthbearer.aws.region"
AWS_PROFILE = "sasl.oauthbearer.aws.profile"
AWS_ROLE_ARN = "sasl.oauthbearer.aws.role.arn"
_AWS_KEYS = (AWS_REGION, AWS_PROFILE, AWS_ROLE_ARN)
HIDDEN = "[hidden]"

# librdkafka's sensitive settings, and any key whose name says it holds a secret
_SECRET_KEYS = frozenset({
    "sasl.password", "sasl.oauthbearer.client.secret", "sasl.oauthbearer.config",
    "ssl.key.password", "ssl.keystore.password", "ssl.key.pem", "ssl_key",
    "sasl.oauthbearer.assertion.private.key.passphrase",
    "sasl.oauthbearer.assertion.private.key.pem", "oauth_cb",
})
_SECRET_WORDS = ("password", "secret", "passphrase")

# Kafka's ConfigTransformer pattern: ${provider:[path:]key}
_REFERENCE = re.compile(r"\$\{([^}:]*?):(?:([^}]*?):)?([^}]*?)\}")


class KafkaConfigError(ValueError):
    """A Kafka setting that cannot be used; ``property`` is its name as the caller gave it,
    ``reason`` what is wrong with it."""

    def __init__(self, prop: str, message: str) -> None:
        self.property = prop
        self.reason = message
        super().__init__(f"{prop}: {message}")


def is_secret(key: str) -> bool:
    """True for a setting whose value must never be shown (``sasl.password``, …)."""
    name = key.lower()
    return name in _SECRET_KEYS or any(w in name for w in _SECRET_WORDS)


def has_reference(value: Any) -> bool:
    return isinstance(value, str) and _REFERENCE.search(value) is not None


def resolve(conf: Mapping[str, Any], *, prefix: str = "",
            env: Mapping[str, str] | None = None,
            signer: Any = None) -> dict[str, Any]:
    """``conf`` as librdkafka settings: every ``${provider:...}`` reference replaced by what it
    names, and ``sasl.oauthbearer.method=aws-msk-iam`` replaced by an ``oauth_cb``.

    ``prefix`` is put before a key in messages (``producer.kafka.``); ``env`` defaults to
    ``os.environ``; ``signer`` replaces the MSK IAM signer module (tests). Raises
    KafkaConfigError naming the property and the variable, file or key that is missing.
    """
    env = os.environ if env is None else env
    out: dict[str, Any] = {}
    for key, value in conf.items():
        out[key] = _substitute(prefix + key, value, env) if isinstance(value, str) else value
    if str(out.get(METHOD, "")).lower() == MSK_IAM:
        if "oauth_cb" in out:
            raise KafkaConfigError(prefix + METHOD, f"{MSK_IAM} sets oauth_cb itself; "
                                                    "give one or the other")
        del out[METHOD]
        aws = {k: str(out.pop(k)) for k in _AWS_KEYS if k in out}
        out["oauth_cb"] = msk_iam_oauth_cb(aws, prefix=prefix, env=env, signer=signer)
    else:
        unused = [k for k in _AWS_KEYS if k in out]
        if unused:
            raise KafkaConfigError(prefix + unused[0],
                                   f"only used with {prefix}{METHOD}={MSK_IAM}")
    return out


def _substitute(prop: str, value: str, env: Mapping[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        provider, path, key = m.group(1), m.group(2), m.group(3)
        if provider == "env" and path is None:
            if key not in env:
                raise KafkaConfigError(prop, f"the environment variable {key} is not set")
            return env[key]
        if provider == "file" and path is not None:
            return _properties_value(prop, path, key)
        if provider == "directory" and path is not None:
            return _file_content(prop, os.path.join(path, key))
        raise KafkaConfigError(prop, (
            f"unknown reference ${{{provider}:...}}: expected ${{env:NAME}}, "
            "${file:/path/file.properties:key} or ${directory:/path/dir:file}"))

    return _REFERENCE.sub(one, value)


def _read(prop: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        raise KafkaConfigError(prop, f"file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KafkaConfigError(prop, f"cannot read {path}: "
                                     f"{getattr(exc, 'strerror', None) or type(exc).__name__}") \
            from None


def _file_content(prop: str, path: str) -> str:
    text = _read(prop, path)
    if text.endswith("\r\n"):
        return text[:-2]
    return text[:-1] if text.endswith("\n") else text


def _properties_value(prop: str, path: str, key: str) -> str:
    values = parse_properties_text(_read(prop, path))
    if key not in values:
        raise KafkaConfigError(prop, f"no key {key!r} in {path}")
    return values[key]


def parse_properties_text(text: str) -> dict[str, str]:
    """A Java properties file's keys and values (``key=value``, ``key: value`` or
    ``key value``; ``#``/``!`` comments, backslash line continuations and escapes)."""
    out: dict[str, str] = {}
    logical = ""
    for raw in text.splitlines():
        line = raw.lstrip()
        if not logical and (not line or line[0] in "#!"):
            continue
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2:
            logical += line[:-1]
            continue
        logical += line
        key, value = _split_property(logical)
        out[key] = value
        logical = ""
    if logical:
        key, value = _split_property(logical)
        out[key] = value
    return out


_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}


def _split_property(line: str) -> tuple[str, str]:
    key, i = [], 0
    while i < len(line) and line[i] not in "=: \t\f":
        if line[i] == "\\" and i + 1 < len(line):
            i += 1
        key.append(line[i])
        i += 1
    while i < len(line) and line[i] in " \t\f":
        i += 1
    if i < len(line) and line[i] in "=:":
        i += 1
    while i < len(line) and line[i] in " \t\f":
        i += 1
    return "".join(key), _unescape(line[i:])


def _unescape(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            n = text[i + 1]
            if n == "u" and i + 6 <= len(text):
                out.append(chr(int(text[i + 2:i + 6], 16)))
                i += 6
                continue
            out.append(_ESCAPES.get(n, n))
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def msk_iam_oauth_cb(aws: Mapping[str, str], *, prefix: str = "",
                     env: Mapping[str, str] | None = None,
                     signer: Any = None) -> Callable[[str], tuple[str, float]]:
    """confluent-kafka's ``oauth_cb`` for MSK IAM: ``(token, expiry in seconds since the
    epoch)`` from `MSKAuthTokenProvider` (``signer`` replaces that module in tests)."""
    env = os.environ if env is None else env
    region = aws.get(AWS_REGION) or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if not region:
        raise KafkaConfigError(prefix + AWS_REGION, (
            f"{METHOD}={MSK_IAM} needs the AWS region: set {prefix}{AWS_REGION} "
            "or AWS_REGION"))
    if aws.get(AWS_PROFILE) and aws.get(AWS_ROLE_ARN):
        raise KafkaConfigError(prefix + AWS_ROLE_ARN,
                               f"give {prefix}{AWS_PROFILE} or {prefix}{AWS_ROLE_ARN}, not both")
    if signer is None:
        try:
            from aws_msk_iam_sasl_signer import MSKAuthTokenProvider as signer
        except ImportError:
            raise KafkaConfigError(prefix + METHOD, (
                f"{MSK_IAM} needs the package aws-msk-iam-sasl-signer-python: "
                "pip install 'spillway-sidecar[msk-iam]' (the sidecar and the spillway CLI) "
                "or 'spillway-spark[msk-iam]' (read_dlq, Job.reprocess)")) from None
    profile, role = aws.get(AWS_PROFILE), aws.get(AWS_ROLE_ARN)

    def oauth_cb(_config: str) -> tuple[str, float]:
        try:
            if profile:
                token, expiry_ms = signer.generate_auth_token_from_profile(region, profile)
            elif role:
                token, expiry_ms = signer.generate_auth_token_from_role_arn(region, role)
            else:
                token, expiry_ms = signer.generate_auth_token(region)
        except Exception as exc:
            # librdkafka only learns that no token came ("OAuth token not set"): say why here
            log.warning("MSK IAM: no token for region %s (%s: %s); the Kafka client retries",
                        region, type(exc).__name__, exc)
            raise
        return token, (expiry_ms / 1000.0 if expiry_ms else time.time() + 900.0)

    return oauth_cb


def literal_secret(conf: Mapping[str, Any]) -> str | None:
    """The first secret setting of ``conf`` given literally (not as a reference), or None."""
    for key, value in conf.items():
        if is_secret(key) and isinstance(value, str) and value and not has_reference(value):
            return key
    return None


def redacted(conf: Mapping[str, Any]) -> dict[str, str]:
    """``conf`` safe to show: secrets and references as `HIDDEN` or the reference itself."""
    out = {}
    for key, value in conf.items():
        if has_reference(value):
            out[key] = str(value)
        elif is_secret(key) or callable(value):
            out[key] = HIDDEN
        else:
            out[key] = str(value)
    return out


def secret_values(conf: Mapping[str, Any]) -> list[str]:
    """The values of ``conf``'s secret settings (longest first), for `scrub`."""
    vals = {str(v) for k, v in conf.items()
            if is_secret(k) and isinstance(v, str) and len(v) >= 4}
    return sorted(vals, key=len, reverse=True)


def scrub(text: str, conf: Mapping[str, Any]) -> str:
    """``text`` with every secret value of ``conf`` replaced by `HIDDEN`."""
    for value in secret_values(conf):
        text = text.replace(value, HIDDEN)
    return text
