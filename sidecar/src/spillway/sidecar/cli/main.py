"""`spillway` command line: serve the sidecar, read its status, operate the DLQ.

    spillway serve  [--config FILE] [--listen HOST:PORT] [--unix-socket PATH]
                    [--bootstrap-servers HOST:PORT] [--tls-cert F --tls-key F [--tls-ca F]]
                    [--token-file F] [--peer-token-file F] [--admin-token-file F]
                    [--advertised-address HOST:PORT] [--set key=value ...]
    spillway status [--sidecar ADDR] [--json] [--tls-ca F] [--token-file F | --admin-token-file F]
    spillway dlq tail|redrive ...
    spillway job list [--job NAME] | end NAME [--run RUN_ID]   (operator; see cli/job.py)

Configuration precedence for `serve`: flags (and --set), then SPILLWAY_* environment variables,
then the --config file (Java properties, KIP property names), then defaults.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading

from spillway.sidecar.cli.dlq import add_dlq_commands
from spillway.sidecar.cli.job import add_job_commands
from spillway.sidecar.cli.operator import add_client_security_args, operator_client
from spillway.sidecar.cli.status import add_status_command
from spillway.sidecar.core import config
from spillway.sidecar.errors import ConfigError, SpillwayError
from spillway.sidecar.runtime import kafka_auth


def _parse_set(values: list[str]) -> dict[str, str]:
    out = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--set", f"expected key=value, got {item!r}")
        out[key.strip()] = value
    return out


# One flag per secure setting of `spillway serve` (docs/SECURITY.md).
# `serve` flags that are shorthands for one property each (flags win over --set)
_PROPERTY_FLAGS = (("--listen", "listen.address"), ("--unix-socket", "listen.unix.socket"),
                   ("--bootstrap-servers", "bootstrap.servers"),
                   ("--tls-cert", "tls.cert.file"), ("--tls-key", "tls.key.file"),
                   ("--tls-ca", "tls.ca.file"), ("--token-file", "auth.token.file"),
                   ("--peer-token-file", "auth.peer.token.file"),
                   ("--admin-token-file", "auth.admin.token.file"),
                   ("--advertised-address", "advertised.address"))


def serve_properties(args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    explicit = _parse_set(args.set or [])
    kafka_auth.check_command_line(explicit, prefix=config.PRODUCER_PASSTHROUGH, flag="--set")
    for flag, prop in _PROPERTY_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            explicit[prop] = value
    config_path = args.config or env.get("SPILLWAY_CONFIG")
    file_props = config.load_properties_file(config_path) if config_path else {}
    return config.resolve(explicit=explicit, env=env, file=file_props)


def _check_free(prop: str, host: str, port: int) -> None:
    """Bind errors in one line, before gRPC's core logs its own (a port 0 is always free)."""
    import errno
    import socket

    if not port:
        return
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(prop, f"cannot resolve host {host!r}: {exc.strerror}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            why = ("the port is in use (another sidecar?)" if exc.errno == errno.EADDRINUSE
                   else exc.strerror)
            raise ConfigError(prop, f"cannot listen on {host}:{port}: {why}") from None


def _restart_env(props: dict, spool_dir: str | None) -> dict[str, str]:
    """What this process must be re-executed with (runtime/restart.py); empty: nothing."""
    from spillway.sidecar.runtime import memtune, restart

    updates = {}
    if memtune.wanted():  # glibc's malloc, so a burst's memory goes back (memtune.py)
        updates[memtune.ENV] = memtune.CHOICE
    if spool_dir is not None:
        from spillway.sidecar.service import runstate

        if runstate.wanted(props):
            # run states are kept as hash() digests: the same seed after a restart (runstate.py)
            seed = runstate.hash_seed(spool_dir)
            if seed is not None and os.environ.get(restart.HASH_SEED) != seed:
                updates[restart.HASH_SEED] = seed
    return updates


def cmd_serve(args: argparse.Namespace) -> int:
    from spillway.sidecar.runtime import memtune, restart

    own = getattr(args, "own_command_line", False)
    env = dict(os.environ)
    raw = serve_properties(args, env)
    props = config.parse(raw)
    role = None
    if args.process_role:  # one of several processes, started by the supervisor below
        from spillway.sidecar.runtime.processes import ProcessRole

        role = ProcessRole.from_json(args.process_role)
    supervisor = role is None and props["sidecar.processes"] > 1
    spool_dir = None
    if not supervisor:
        from spillway.sidecar.dlq import default_spool_dir

        spool_dir = props["spool.dir"] or default_spool_dir(raw)
        if role is None:  # (the supervisor checked the directories of all its processes)
            from spillway.sidecar.runtime import stranded

            stranded.check(spool_dir, props)
    if own:
        # only when this process is the command: main() called by a host program must not
        # restart it. Once, before the server's imports (restart.py)
        restart.reexec(_restart_env(props, spool_dir))
    from spillway.sidecar.runtime import gctune, shutdown, threadnames

    memtune.limit_malloc_arenas()  # before any thread starts (memory returned after a drain)
    if own:
        # before any thread starts: `top -H` tells them apart. Only in a process that is the
        # command: a host program calling main() keeps its own threads' names and profile hook
        threadnames.name_os_threads()
    for warning in config.unknown_environment(env):
        logging.getLogger("spillway.sidecar").warning("%s", warning)
    if role is not None:
        from spillway.sidecar.runtime.processes import die_with_parent

        die_with_parent(role.parent_pid)
    elif supervisor:
        from spillway.sidecar.runtime.processes import supervise

        return supervise(args, raw, props)
    from spillway.sidecar.server import start_server

    if props.get("listen.address") and role is None:  # the supervisor holds a shared one
        host, _, port = props["listen.address"].rpartition(":")
        _check_free("listen.address", host, int(port))
    if props.get("health.listen.address") and role is None:
        host, _, port = props["health.listen.address"].rpartition(":")
        _check_free("health.listen.address", host, int(port))
    if props.get("metrics.prometheus.port"):
        _check_free("metrics.prometheus.port", props["metrics.prometheus.host"],
                    props["metrics.prometheus.port"])
    running = start_server(raw, install_global_telemetry=True, process=role)
    gctune.tune()  # after start-up: what it allocated is frozen, never walked again
    logging.getLogger("spillway.sidecar").info("allocator: %s", memtune.allocator())
    done = threading.Event()

    def _stop(signum, _frame):
        logging.getLogger("spillway.sidecar").info("signal %s: stopping", signum)
        done.set()

    # before the line below: whoever reads it may stop us at once
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # SIGUSR1: every thread's stack to stderr (a supervisor asks before it kills a stop that hung)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Tell whoever started us where we listen (port 0 picks a free one): one parseable line.
    print(f"spillway sidecar listening on {running.address}", flush=True)
    # a timed wait: a signal taken by another thread than this one (the only one that runs
    # Python's handlers) is still handled within the period; an untimed wait may never wake
    while not done.wait(0.5):
        pass
    running.stop(shutdown.stop_budget_s(running.sidecar.props["shutdown.grace.ms"]))
    if own:  # the process is ours to end (shutdown.py)
        shutdown.exit_watchdog()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from spillway.sidecar import __version__

    p = argparse.ArgumentParser(prog="spillway", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"spillway {__version__}")
    p.add_argument("--log-level", default=os.environ.get("SPILLWAY_LOG_LEVEL", "INFO"),
                   help="DEBUG, INFO, WARNING or ERROR (default $SPILLWAY_LOG_LEVEL or INFO)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the sidecar")
    s.add_argument("--config", help="Java-properties file with KIP property names")
    s.add_argument("--listen", help="TCP host:port (default 127.0.0.1:50051; '' disables)")
    s.add_argument("--unix-socket", help="also (or only) serve on this Unix socket path")
    s.add_argument("--bootstrap-servers", help="Kafka for DLQ writes")
    s.add_argument("--tls-cert", help="serve TLS with this PEM certificate chain (tls.cert.file)")
    s.add_argument("--tls-key", help="its PEM private key (tls.key.file)")
    s.add_argument("--tls-ca", help="CA bundle: require client certificates signed by it "
                                    "(mutual TLS; tls.ca.file)")
    s.add_argument("--token-file", help="node API token file (auth.token.file)")
    s.add_argument("--peer-token-file", help="sidecar-to-sidecar token file "
                                             "(auth.peer.token.file)")
    s.add_argument("--admin-token-file", help="operator token file (auth.admin.token.file)")
    s.add_argument("--advertised-address", help="host:port other nodes reach this sidecar at "
                                                "(advertised.address)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="any property, e.g. --set errors.tolerance=all (repeatable)")
    s.add_argument("--process-role", help=argparse.SUPPRESS)  # set by sidecar.processes
    s.set_defaults(func=cmd_serve)

    add_status_command(sub, add_client_security_args, operator_client)

    add_dlq_commands(sub)
    add_job_commands(sub, add_client_security_args, operator_client)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.own_command_line = argv is None
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what sidecar.processes repeats
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except BrokenPipeError:
        # the reader went away (`spillway status | head`): quietly, as other Unix tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except (SpillwayError, ValueError) as exc:
        print(f"spillway: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # client errors (unreachable sidecar) print cleanly too
        if type(exc).__module__.startswith("spillway."):
            print(f"spillway: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
