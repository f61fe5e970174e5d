"""Kafka settings with secrets from files and the environment, and MSK IAM's token callback, for
every Kafka client spillway runs (`spillway.client.kafka_auth`, the sidecar's
`runtime.kafka_auth`). The MSK IAM signer is a fake here: the real one needs AWS."""

from __future__ import annotations

import logging
import sys
import types

import pytest
from spillway.client import kafka_auth
from spillway.client.kafka_auth import KafkaConfigError, redacted, resolve, scrub
from spillway.sidecar.errors import ConfigError
from spillway.sidecar.runtime.kafka_auth import check_command_line, cli_settings, passthrough
from support.paths import DOCS

SECRET = "pa55-Wörd:{with}$pecials"


@pytest.fixture
def secrets(tmp_path):
    """A mounted-Secret-like directory and a properties file holding the same secret."""
    d = tmp_path / "kafka-secret"
    d.mkdir()
    (d / "password").write_text(SECRET + "\n")
    (d / "username").write_text("svc-dlq")
    props = tmp_path / "secrets.properties"
    escaped = SECRET.replace(":", "\\:")   # as a properties writer would escape it
    props.write_text("# Kafka credentials\n"
                     f"dlq.password = {escaped}\n"
                     "other: one \\\n    two\n")
    return d, props


def test_env_file_and_directory_references_are_read(secrets):
    d, props = secrets
    out = resolve({"sasl.username": f"${{directory:{d}:username}}",
                   "sasl.password": f"${{directory:{d}:password}}",
                   "ssl.key.password": f"${{file:{props}:dlq.password}}",
                   "sasl.oauthbearer.client.secret": "${env:DLQ_SECRET}",
                   "security.protocol": "SASL_SSL", "linger.ms": 5},
                  env={"DLQ_SECRET": SECRET})
    assert out == {"sasl.username": "svc-dlq", "sasl.password": SECRET,
                   "ssl.key.password": SECRET, "sasl.oauthbearer.client.secret": SECRET,
                   "security.protocol": "SASL_SSL", "linger.ms": 5}


def test_a_reference_inside_a_longer_value(secrets):
    d, _ = secrets
    out = resolve({"sasl.oauthbearer.config": f"principal=dlq secret=${{directory:{d}:password}}"
                                              " scope=${env:SCOPE}"}, env={"SCOPE": "kafka"})
    assert out["sasl.oauthbearer.config"] == f"principal=dlq secret={SECRET} scope=kafka"


def test_properties_files_read_as_java_reads_them(secrets):
    _, props = secrets
    values = kafka_auth.parse_properties_text(props.read_text())
    assert values == {"dlq.password": SECRET, "other": "one two"}
    assert kafka_auth.parse_properties_text("a\\ b=c\\td\n!x=1\nu=\\u00e9\nbare") == \
        {"a b": "c\td", "u": "é", "bare": ""}


def test_only_one_trailing_newline_is_removed(tmp_path):
    (tmp_path / "p").write_text("secret\n\n")
    assert resolve({"sasl.password": f"${{directory:{tmp_path}:p}}"})["sasl.password"] == \
        "secret\n"


@pytest.mark.parametrize("value, says", [
    ("${env:KAFKA_PASSWORD}", "the environment variable KAFKA_PASSWORD is not set"),
    ("${directory:/nonexistent/kafka:password}", "file not found: /nonexistent/kafka/password"),
    ("${file:/nonexistent/k.properties:password}", "file not found: /nonexistent/k.properties"),
    ("${vault:secret/kafka:password}", "unknown reference ${vault:...}"),
])
def test_a_missing_source_names_the_property_and_the_source(value, says):
    with pytest.raises(KafkaConfigError) as err:
        resolve({"sasl.password": value}, prefix="producer.kafka.", env={})
    assert err.value.property == "producer.kafka.sasl.password"
    assert str(err.value).startswith("producer.kafka.sasl.password: ")
    assert says in str(err.value)


def test_a_missing_key_names_the_key_and_the_file_never_the_values(secrets):
    _, props = secrets
    with pytest.raises(KafkaConfigError) as err:
        resolve({"sasl.password": f"${{file:{props}:kafka.password}}"})
    assert str(err.value) == f"sasl.password: no key 'kafka.password' in {props}"
    assert SECRET not in str(err.value)


def test_secrets_are_hidden_when_shown_and_scrubbed_from_messages():
    conf = {"sasl.password": SECRET, "ssl.key.password": "k3y-pass", "sasl.username": "svc",
            "sasl.oauthbearer.client.secret": "${env:X}", "oauth_cb": print}
    assert redacted(conf) == {"sasl.password": "[hidden]", "ssl.key.password": "[hidden]",
                              "sasl.username": "svc", "sasl.oauthbearer.client.secret": "${env:X}",
                              "oauth_cb": "[hidden]"}
    assert scrub(f"auth failed for svc with {SECRET} (k3y-pass)", conf) == \
        "auth failed for svc with [hidden] ([hidden])"
    for key in ("sasl.password", "ssl.keystore.password", "sasl.oauthbearer.client.secret",
                "ssl.key.pem", "sasl.oauthbearer.assertion.private.key.passphrase"):
        assert kafka_auth.is_secret(key), key
    for key in ("sasl.username", "ssl.key.location", "sasl.oauthbearer.token.endpoint.url"):
        assert not kafka_auth.is_secret(key), key


# --- MSK IAM (OAUTHBEARER with a token callback) -----------------------------------------------


class FakeSigner:
    """`MSKAuthTokenProvider`'s three entry points, recording their calls."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def generate_auth_token(self, region):
        self.calls.append(("default", region))
        return f"token-{region}", 1_900_000_000_000

    def generate_auth_token_from_profile(self, region, profile):
        self.calls.append(("profile", region, profile))
        return "token-profile", 1_900_000_000_000

    def generate_auth_token_from_role_arn(self, region, role_arn):
        self.calls.append(("role", region, role_arn))
        return "token-role", 1_900_000_000_000


MSK = {"security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER",
       "sasl.oauthbearer.method": "aws-msk-iam"}


def test_msk_iam_becomes_an_oauth_cb_with_the_signers_token():
    signer = FakeSigner()
    out = resolve({**MSK, "sasl.oauthbearer.aws.region": "eu-west-1"}, signer=signer)
    assert set(out) == {"security.protocol", "sasl.mechanism", "oauth_cb"}   # spillway's keys gone
    assert out["oauth_cb"]("") == ("token-eu-west-1", 1_900_000_000.0)       # seconds, not ms
    assert signer.calls == [("default", "eu-west-1")]


def test_msk_iam_region_from_the_environment_and_profile_or_role():
    signer = FakeSigner()
    cb = resolve(MSK, env={"AWS_REGION": "us-east-2"}, signer=signer)["oauth_cb"]
    assert cb("")[0] == "token-us-east-2"
    cb = resolve({**MSK, "sasl.oauthbearer.aws.profile": "dlq"},
                 env={"AWS_DEFAULT_REGION": "ap-south-1"}, signer=signer)["oauth_cb"]
    assert cb("")[0] == "token-profile"
    cb = resolve({**MSK, "sasl.oauthbearer.aws.role.arn": "arn:aws:iam::1:role/dlq",
                  "sasl.oauthbearer.aws.region": "us-east-1"}, env={}, signer=signer)["oauth_cb"]
    assert cb("")[0] == "token-role"
    assert signer.calls[1:] == [("profile", "ap-south-1", "dlq"),
                                ("role", "us-east-1", "arn:aws:iam::1:role/dlq")]


@pytest.mark.parametrize("conf, prop, says", [
    (MSK, "producer.kafka.sasl.oauthbearer.aws.region", "needs the AWS region"),
    ({**MSK, "sasl.oauthbearer.aws.region": "r", "sasl.oauthbearer.aws.profile": "p",
      "sasl.oauthbearer.aws.role.arn": "a"}, "producer.kafka.sasl.oauthbearer.aws.role.arn",
     "not both"),
    ({**MSK, "oauth_cb": print}, "producer.kafka.sasl.oauthbearer.method", "give one"),
    ({"sasl.oauthbearer.aws.region": "r"}, "producer.kafka.sasl.oauthbearer.aws.region",
     "only used with producer.kafka.sasl.oauthbearer.method=aws-msk-iam"),
])
def test_msk_iam_misconfigurations_name_the_property(conf, prop, says):
    with pytest.raises(KafkaConfigError) as err:
        resolve(conf, prefix="producer.kafka.", env={}, signer=FakeSigner())
    assert err.value.property == prop and says in str(err.value)


def test_a_failing_signer_is_logged_with_its_cause(caplog):
    class NoCredentials(FakeSigner):
        def generate_auth_token(self, region):
            raise LookupError("Unable to locate credentials")

    cb = resolve({**MSK, "sasl.oauthbearer.aws.region": "eu-west-1"},
                 signer=NoCredentials())["oauth_cb"]
    with caplog.at_level(logging.WARNING, logger="spillway.kafka.oauth"), \
            pytest.raises(LookupError):
        cb("")
    assert caplog.messages == ["MSK IAM: no token for region eu-west-1 (LookupError: Unable to "
                               "locate credentials); the Kafka client retries"]


def test_msk_iam_without_the_signer_package_says_which_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "aws_msk_iam_sasl_signer", None)   # import fails
    with pytest.raises(KafkaConfigError) as err:
        resolve({**MSK, "sasl.oauthbearer.aws.region": "eu-west-1"})
    assert "aws-msk-iam-sasl-signer-python" in str(err.value)
    assert "spillway-sidecar[msk-iam]" in str(err.value)
    assert "spillway-spark[msk-iam]" in str(err.value)


def test_msk_iam_uses_the_installed_signer_module(monkeypatch):
    signer = FakeSigner()
    package = types.ModuleType("aws_msk_iam_sasl_signer")
    package.MSKAuthTokenProvider = signer
    monkeypatch.setitem(sys.modules, "aws_msk_iam_sasl_signer", package)
    cb = resolve({**MSK, "sasl.oauthbearer.aws.region": "eu-north-1"})["oauth_cb"]
    assert cb("") == ("token-eu-north-1", 1_900_000_000.0)


@pytest.mark.parametrize("client", ["Producer", "Consumer", "AdminClient"])
def test_confluent_kafka_calls_the_msk_iam_callback(client):
    """The resolved settings build each kind of confluent-kafka client spillway uses, and the
    client asks the callback (so the signer) for its token."""
    import confluent_kafka
    import confluent_kafka.admin

    signer = FakeSigner()
    conf = resolve({**MSK, "sasl.oauthbearer.aws.region": "eu-west-1"}, signer=signer)
    conf.update({"bootstrap.servers": "127.0.0.1:1", "log_level": 0})
    if client == "Consumer":
        conf["group.id"] = "g"
    cls = getattr(confluent_kafka, client, None) or confluent_kafka.admin.AdminClient
    handle = cls(conf)
    handle.poll(0.2) if client != "Consumer" else handle.consume(1, 0.2)
    assert signer.calls and signer.calls[0] == ("default", "eu-west-1")
    if client == "Consumer":
        handle.close()


# --- the sidecar (producer.kafka.*) ------------------------------------------------------------


def test_the_sidecars_clients_get_the_resolved_settings(secrets, monkeypatch):
    from spillway.sidecar.dlq.producer import KafkaDlqProducer, producer_config
    from spillway.sidecar.service.topic_checks import kafka_conf

    d, _ = secrets
    monkeypatch.setenv("DLQ_USER", "svc-dlq")
    raw = {"bootstrap.servers": "k:9093", "producer.kafka.security.protocol": "SASL_SSL",
           "producer.kafka.sasl.mechanism": "SCRAM-SHA-512",
           "producer.kafka.sasl.username": "${env:DLQ_USER}",
           "producer.kafka.sasl.password": f"${{directory:{d}:password}}",
           "errors.tolerance": "all"}
    overrides = passthrough(raw)
    assert overrides == {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                         "sasl.username": "svc-dlq", "sasl.password": SECRET}
    built: list[dict] = []
    producer = KafkaDlqProducer(producer_config("k:9093", linger_ms=5, batch_size=1000,
                                                overrides=overrides),
                                factory=lambda conf: built.append(conf) or object())
    producer._get()
    assert built[0]["sasl.password"] == SECRET and built[0]["sasl.username"] == "svc-dlq"
    assert built[0]["enable.idempotence"] is True           # the pipeline's settings still hold
    admin = kafka_conf({"bootstrap.servers": "k:9093", "_kafka_overrides": overrides})
    assert admin["sasl.password"] == SECRET and admin["security.protocol"] == "SASL_SSL"


def test_the_sidecar_logs_its_kafka_settings_as_given_never_a_secret(secrets, caplog):
    d, _ = secrets
    raw = {"producer.kafka.security.protocol": "SASL_SSL",
           "producer.kafka.sasl.username": f"${{directory:{d}:username}}",
           "producer.kafka.sasl.password": f"${{directory:{d}:password}}",
           "producer.kafka.ssl.key.password": SECRET}      # literal, from a properties file
    with caplog.at_level(logging.INFO, logger="spillway.sidecar.kafka"):
        passthrough(raw)
    [line] = [r.getMessage() for r in caplog.records if r.name == "spillway.sidecar.kafka"]
    assert line == ("Kafka client settings: producer.kafka.sasl.password="
                    f"${{directory:{d}:password}}, producer.kafka.sasl.username="
                    f"${{directory:{d}:username}}, producer.kafka.security.protocol=SASL_SSL, "
                    "producer.kafka.ssl.key.password=[hidden]")
    assert SECRET not in caplog.text and "svc-dlq" not in caplog.text


def test_a_missing_secret_stops_the_sidecar_naming_the_property_and_file(tmp_path):
    from spillway.sidecar.core import config
    from spillway.sidecar.runtime.bootstrap import configure

    raw = config.resolve(explicit={
        "listen.address": "127.0.0.1:0", "bootstrap.servers": "127.0.0.1:1",
        "spool.dir": str(tmp_path / "spool"),
        "producer.kafka.sasl.username": "svc",
        "producer.kafka.sasl.password": f"${{directory:{tmp_path}/secret:password}}"}, env={})
    with pytest.raises(ConfigError) as err:
        configure(raw)
    assert err.value.property == "producer.kafka.sasl.password"
    assert str(err.value) == (f"producer.kafka.sasl.password: file not found: "
                              f"{tmp_path}/secret/password")


def test_serve_refuses_a_literal_secret_on_the_command_line(monkeypatch, tmp_path):
    from spillway.sidecar.cli.main import build_parser, serve_properties

    def props(*argv, env=None):
        return serve_properties(build_parser().parse_args(["serve", *argv]), env or {})

    with pytest.raises(ConfigError) as err:
        props("--set", f"producer.kafka.sasl.password={SECRET}")
    assert err.value.property == "producer.kafka.sasl.password"
    assert "readable by every local user" in str(err.value) and SECRET not in str(err.value)
    # a reference on the command line, the variable, or the properties file: accepted
    assert props("--set", "producer.kafka.sasl.password=${env:KAFKA_PASSWORD}")[
        "producer.kafka.sasl.password"] == "${env:KAFKA_PASSWORD}"
    assert props(env={"SPILLWAY_PRODUCER_KAFKA_SASL_PASSWORD": SECRET})[
        "producer.kafka.sasl.password"] == SECRET
    f = tmp_path / "sidecar.properties"
    f.write_text("producer.kafka.ssl.key.password=k3y\n")
    assert props("--config", str(f))["producer.kafka.ssl.key.password"] == "k3y"
    assert props("--set", "producer.kafka.sasl.username=svc")["producer.kafka.sasl.username"] \
        == "svc"


# --- the spillway dlq commands (-X, --kafka-config) --------------------------------------------


def test_cli_settings_from_a_file_and_x_references(secrets, tmp_path):
    d, props = secrets
    f = tmp_path / "client.properties"
    f.write_text(f"security.protocol=SASL_SSL\nsasl.mechanism=PLAIN\nsasl.username=svc\n"
                 f"sasl.password=${{directory:{d}:password}}\nlinger.ms=5\n")
    conf = cli_settings(["linger.ms=50", f"ssl.key.password=${{file:{props}:dlq.password}}"],
                        [str(f)])
    assert conf == {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN",
                    "sasl.username": "svc", "sasl.password": SECRET, "linger.ms": "50",
                    "ssl.key.password": SECRET}
    assert cli_settings(["security.protocol=SSL", "a = b"]) == {"security.protocol": "SSL",
                                                                "a": "b"}


def test_cli_refuses_literal_secrets_and_never_echoes_a_setting(tmp_path):
    with pytest.raises(ConfigError) as err:
        cli_settings([f"sasl.password={SECRET}"])
    assert err.value.property == "sasl.password" and SECRET not in str(err.value)
    with pytest.raises(ConfigError) as err:
        cli_settings([SECRET.replace("=", "")])
    assert SECRET.replace("=", "") not in str(err.value) and "KEY=VALUE" in str(err.value)
    with pytest.raises(ConfigError) as err:
        cli_settings([], [str(tmp_path / "missing.properties")])
    assert str(err.value) == f"--kafka-config: file not found: {tmp_path}/missing.properties"
    check_command_line({"sasl.username": "svc", "sasl.password": ""}, flag="-X")   # no secret


def test_cli_error_output_carries_no_secret(secrets, tmp_path, capsys):
    """`spillway dlq tail` with SASL settings from a file against nothing: exit 2, one line
    naming the cluster, the password nowhere."""
    import argparse

    from spillway.sidecar.cli.dlq import add_dlq_commands

    d, _ = secrets
    parser = argparse.ArgumentParser(prog="spillway")
    add_dlq_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["dlq", "tail", "--bootstrap-servers", "127.0.0.1:1", "--topic",
                              "dlq.x", "-X", "security.protocol=SASL_PLAINTEXT",
                              "-X", "sasl.mechanism=PLAIN", "-X", "sasl.username=svc",
                              "-X", f"sasl.password=${{directory:{d}:password}}",
                              "-X", "socket.timeout.ms=1000", "--idle-ms", "100"])
    assert args.func(args) == 2
    out = capsys.readouterr()
    assert "spillway dlq tail: cannot read the cluster's metadata" in out.err
    assert SECRET not in out.err + out.out


def test_librdkafka_debug_logs_carry_no_secret(secrets, caplog):
    """Even at librdkafka's debug=all, routed to Python logging as spillway does, the resolved
    password and key password are not in the log (librdkafka redacts them)."""
    from confluent_kafka import Consumer

    d, _ = secrets
    conf = resolve({"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN",
                    "sasl.username": "svc", "sasl.password": f"${{directory:{d}:password}}",
                    "ssl.key.password": "${env:KEYPASS}"}, env={"KEYPASS": "k3y-Passw0rd"})
    logger = logging.getLogger("spillway.test.librdkafka")
    with caplog.at_level(logging.DEBUG, logger="spillway.test.librdkafka"):
        c = Consumer({**conf, "bootstrap.servers": "127.0.0.1:1", "group.id": "g",
                      "debug": "all", "logger": logger})
        c.consume(1, 0.5)
        c.close()
    text = caplog.text
    assert "sasl.password = [redacted]" in text            # librdkafka did dump its settings
    assert SECRET not in text and "k3y-Passw0rd" not in text


# --- read_dlq (kafka_config) -------------------------------------------------------------------


def test_read_dlq_refuses_a_literal_secret_before_anything_runs():
    from spillway.spark import read_dlq

    with pytest.raises(ValueError) as err:
        read_dlq(None, "dlq.orders", bootstrap_servers="127.0.0.1:1",
                 kafka_config={"security.protocol": "SASL_SSL", "sasl.password": SECRET})
    assert str(err.value).startswith("kafka_config: sasl.password must be a reference")
    assert SECRET not in str(err.value)


def test_read_dlq_builds_its_consumer_from_the_resolved_settings(secrets, monkeypatch):
    import confluent_kafka
    from spillway.spark import _dlq_reader

    d, _ = secrets
    built: list[dict] = []
    monkeypatch.setattr(confluent_kafka, "Consumer", lambda conf: built.append(conf))
    _dlq_reader._consumer("k:9093", {"sasl.password": f"${{directory:{d}:password}}"})
    assert built[0]["sasl.password"] == SECRET and built[0]["bootstrap.servers"] == "k:9093"


# --- docs/SECURITY.md's "Kafka authentication" ------------------------------------------------


def test_the_security_doc_settings_build_real_clients(tmp_path, monkeypatch):
    """Every properties block of the how-to is accepted by the sidecar's property parser (the
    sidecar's) and builds a confluent-kafka Producer (librdkafka checks every key and value,
    and loads the CA, certificate and key), its references read from files written here; every
    `spillway` command of it parses."""
    import re
    import shlex

    from confluent_kafka import Producer
    from spillway.sidecar.cli.main import build_parser
    from spillway.sidecar.core import config
    from spillway.sidecar.dlq.producer import producer_config
    from support.kafka_tls import encrypted_key
    from support.tls import Ca

    doc = (DOCS / "SECURITY.md").read_text()
    section = doc[doc.index("## Kafka authentication"):]
    section = section[:section.index("\n## ")] if "\n## " in section else section
    ca = Ca.create(tmp_path / "pki")
    user = ca.issue(tmp_path / "pki", "dlq-user")
    mount = tmp_path / "kafka"
    mount.mkdir()
    (mount / "ca.crt").write_bytes(ca.path.read_bytes())
    (mount / "user.crt").write_bytes(user.cert.read_bytes())
    encrypted_key(user, "user-key-pass", mount / "user.key")
    for name, value in (("sasl.username", "u"), ("sasl.password", "p"),
                        ("user.password", "user-key-pass")):
        (mount / name).write_text(value + "\n")
    for var in ("CONFLUENT_API_KEY", "CONFLUENT_API_SECRET", "KAFKA_USER"):
        monkeypatch.setenv(var, "from-env")
    blocks = re.findall(r"```properties\n(.*?)```", section, re.DOTALL)
    assert len(blocks) >= 5
    for block in blocks:
        props = kafka_auth.parse_properties_text(block.replace("/etc/spillway/kafka", str(mount)))
        if any(k.startswith(config.PRODUCER_PASSTHROUGH) for k in props):
            raw = config.resolve(file=props, env={})          # unknown properties refused
            conf = producer_config(raw["bootstrap.servers"] or "127.0.0.1:1", linger_ms=5,
                                   batch_size=1000,
                                   overrides=passthrough(raw, signer=FakeSigner()))
        else:
            conf = {"bootstrap.servers": "127.0.0.1:1", **resolve(props, signer=FakeSigner())}
        Producer({**conf, "log_level": 0})                    # librdkafka accepts every setting
    cli_file = tmp_path / "kafka-client.properties"     # the CLI's file, as the doc writes it
    [text] = [b for b in blocks if "sasl.username=dlq-operator" in b]
    cli_file.write_text(text.replace("/etc/spillway/kafka", str(mount)))
    commands = [shlex.split(line.replace("kafka-client.properties", str(cli_file))
                            .replace("/etc/spillway/kafka", str(mount)), comments=True)
                for block in re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
                for line in block.replace("\\\n", " ").splitlines()]
    spillway = [c[c.index("--") + 1:] if c[0] == "kubectl" else c   # kubectl exec -- spillway
                for c in commands if c and (c[0] == "spillway" or "exec" in c)]
    assert [c[2] for c in spillway] == ["tail", "redrive", "tail"]
    for argv in spillway:
        args = build_parser().parse_args(argv[1:])
        conf = cli_settings(args.property, args.kafka_config)
        assert conf["sasl.password"] == "p" and conf["security.protocol"] == "SASL_SSL"
