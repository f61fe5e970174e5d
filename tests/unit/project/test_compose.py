"""docker-compose.yml and everything it builds and mounts, checked offline (no Docker engine).

First the Compose Specification's JSON schema (vendored: tests/data/compose-spec.SOURCE.md), then
what a schema cannot know: build contexts, Dockerfiles and their COPY sources (through
.dockerignore), mounted files, files named by commands, pinned images, loopback-only ports,
depends_on targets and conditions, SPILLWAY_* variables against spillway's property table,
OTEL_* variables against the OpenTelemetry SDK, the addresses services give each other, the
sidecar's effective configuration, the DLQ topic, the runtime pin files and the collector
pipelines.

Each check returns precise messages naming the service and the key ("service sidecar:
environment SPILLWAY_X: ..."); an empty list is a pass. The negative tests at the end break a copy
of the real data and assert the message that names the break.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import ipaddress
import json
import os
import posixpath
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from spillway.sidecar.core import config
from support import paths

ROOT = paths.ROOT
COMPOSE_FILE = ROOT / "docker-compose.yml"
SCHEMA_FILE = ROOT / "tests" / "data" / "compose-spec.json"
SCHEMA_SOURCE = ROOT / "tests" / "data" / "compose-spec.SOURCE.md"
SIDECAR_DOCKERFILE = Path("sidecar/Dockerfile")
SPARK_DOCKERFILE = Path("deploy/spark.Dockerfile")
COLLECTOR_CONFIG = Path("deploy/otel-collector.yaml")
LOCK_FILES = {  # runtime pin file -> the distributions (and extras) whose dependencies it must hold
    Path("requirements/sidecar.txt"): [("sidecar", None), ("client", None)],
    Path("requirements/sidecar-msk-iam.txt"): [("sidecar", "msk-iam"), ("client", None)],
    Path("deploy/spark-requirements.txt"): [("client", None), ("spark_integration", "pandas")],
}
# Values of OTEL_TRACES_SAMPLER defined by the OpenTelemetry SDK environment-variable spec.
OTEL_SAMPLERS = {"always_on", "always_off", "traceidratio", "parentbased_always_on",
                 "parentbased_always_off", "parentbased_traceidratio", "jaeger_remote",
                 "parentbased_jaeger_remote", "xray"}

Errors = list[str]


# --- loading ----------------------------------------------------------------------------------


def load_compose(path: Path = COMPOSE_FILE) -> dict:
    with open(path, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


def services(data: dict) -> dict[str, dict]:
    return data.get("services") or {}


def environment(svc: dict, *, names: bool = False) -> dict[str, str]:
    """The service's environment values. A variable listed without a value takes the host's at
    run time: it appears (as "") only with names=True, since its value cannot be checked here."""
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return {k: "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in env.items() if names or v is not None}


def argv(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    return [str(v) for v in value]


def healthcheck_argv(svc: dict) -> list[str]:
    test = argv((svc.get("healthcheck") or {}).get("test"))
    if test[:1] == ["CMD"]:
        return test[1:]
    if test[:1] == ["CMD-SHELL"]:
        return shlex.split(" ".join(test[1:]))
    return test


def flag_values(args: list[str], *flags: str) -> list[str]:
    """Values of `--flag value` and `--flag=value` in an argument list."""
    out = []
    for i, a in enumerate(args):
        for f in flags:
            if a == f and i + 1 < len(args):
                out.append(args[i + 1])
            elif a.startswith(f + "="):
                out.append(a[len(f) + 1:])
    return out


# --- Dockerfiles ------------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def instruction_args(rest: str) -> list[str]:
    if rest.startswith("["):
        try:
            return [str(x) for x in json.loads(rest)]
        except json.JSONDecodeError:
            pass
    return shlex.split(rest)


def build_of(svc: dict, root: Path) -> tuple[Path, Path] | None:
    """(context dir, Dockerfile path) of a built service."""
    build = svc.get("build")
    if build is None:
        return None
    if isinstance(build, str):
        build = {"context": build}
    context = (root / build.get("context", ".")).resolve()
    return context, (context / build.get("dockerfile", "Dockerfile")).resolve()


def built_from(svc: dict, root: Path, dockerfile: Path) -> bool:
    b = build_of(svc, root)
    return b is not None and b[1] == (root / dockerfile).resolve()


def final_stage(path: Path) -> list[tuple[str, str]]:
    instrs = dockerfile_instructions(path)
    starts = [i for i, (word, _) in enumerate(instrs) if word == "FROM"]
    return instrs[starts[-1]:] if starts else instrs


def image_argv(svc: dict, root: Path) -> list[str]:
    """What the container runs: compose entrypoint/command over the built image's own."""
    entry, cmd = svc.get("entrypoint"), svc.get("command")
    b = build_of(svc, root)
    if b and b[1].is_file():
        for word, rest in final_stage(b[1]):
            if word == "ENTRYPOINT" and "entrypoint" not in svc:
                entry = instruction_args(rest)
            elif word == "CMD" and "command" not in svc:
                cmd = instruction_args(rest)
    return argv(entry) + argv(cmd)


def dockerignore_rules(context: Path, dockerfile: Path) -> list[tuple[bool, re.Pattern]]:
    """(exception?, regex) per line of the .dockerignore that applies to this build."""
    path = Path(str(dockerfile) + ".dockerignore")
    if not path.is_file():
        path = context / ".dockerignore"
    if not path.is_file():
        return []
    rules = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = posixpath.normpath(line.lstrip("!").strip().lstrip("/"))
        parts = []
        segments = pattern.split("/")
        for i, seg in enumerate(segments):
            if seg == "**":
                parts.append(".*" if i == len(segments) - 1 else "(?:.*/)?")
                continue
            rx = ""
            for ch in seg:
                rx += {"*": "[^/]*", "?": "[^/]"}.get(ch, re.escape(ch) if ch not in "[]" else ch)
            parts.append(rx + ("" if i == len(segments) - 1 else "/"))
        rules.append((negate, re.compile("".join(parts))))
    return rules


def ignored(rel: str, rules: list[tuple[bool, re.Pattern]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents wins."""
    pieces = rel.split("/")
    prefixes = ["/".join(pieces[:i]) for i in range(1, len(pieces) + 1)]
    out = False
    for negate, rx in rules:
        if any(rx.fullmatch(p) for p in prefixes):
            out = not negate
    return out


# --- mounts -----------------------------------------------------------------------------------


def mounts(svc: dict, data: dict, root: Path) -> list[tuple[str, Path, str]]:
    """(container path, host path, what) of the service's bind mounts and file configs, then the
    absolute COPY destinations of its image (a mount hides what the image has there)."""
    out: list[tuple[str, Path, str]] = []
    for i, vol in enumerate(svc.get("volumes") or []):
        if isinstance(vol, str):
            src, _, rest = vol.partition(":")
            target = rest.split(":")[0]
            if src.startswith((".", "/", "~")):
                out.append((target, root / src, f"volumes[{i}]"))
        elif vol.get("type") == "bind":
            out.append((vol["target"], root / vol["source"], f"volumes[{i}]"))
    for kind in ("configs", "secrets"):
        top = data.get(kind) or {}
        for i, ref in enumerate(svc.get(kind) or []):
            name = ref if isinstance(ref, str) else ref.get("source")
            target = (f"/{name}" if isinstance(ref, str) or "target" not in ref
                      else ref["target"])
            if kind == "secrets" and not target.startswith("/"):
                target = f"/run/secrets/{target}"
            spec = top.get(name) or {}
            if "file" in spec:
                out.append((target, root / spec["file"], f"{kind}[{i}] ({name})"))
    b = build_of(svc, root)
    if b and b[1].is_file():
        for word, rest in final_stage(b[1]):
            if word in ("COPY", "ADD"):
                args = instruction_args(rest)
                if any(a.startswith("--from") for a in args):
                    continue
                args = [a for a in args if not a.startswith("--")]
                if len(args) == 2 and args[1].startswith("/"):
                    out.append((args[1].rstrip("/") or "/", b[0] / args[0],
                                f"{b[1].relative_to(root.resolve())}: COPY {args[0]}"))
    return out


def host_path(container_path: str, svc: dict, data: dict, root: Path) -> tuple[Path, str] | None:
    for target, source, what in mounts(svc, data, root):
        target = target.rstrip("/") or "/"
        if container_path == target or container_path.startswith(target + "/"):
            return source / os.path.relpath(container_path, target), what
    return None


# --- the checks -------------------------------------------------------------------------------


def schema_errors(data: dict, root: Path = ROOT) -> Errors:
    schema = json.loads((root / SCHEMA_FILE.relative_to(ROOT)).read_text(encoding="utf-8"))
    validator = jsonschema.Draft7Validator(schema)
    out = []
    for err in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path))):
        where = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        out.append(f"{where}: {err.message}")
    return out


def build_errors(data: dict, root: Path = ROOT) -> Errors:
    out = []
    real_root = root.resolve()
    for name, svc in services(data).items():
        if "image" not in svc and "build" not in svc:
            out.append(f"service {name}: has neither image nor build")
        b = build_of(svc, root)
        if b is None:
            continue
        context, dockerfile = b
        inside = context.is_relative_to(real_root)
        shown = context.relative_to(real_root) if inside else context
        if not inside:
            out.append(f"service {name}: build.context {context} is outside the repository")
        elif not context.is_dir():
            out.append(f"service {name}: build.context {shown} does not exist")
        elif not dockerfile.is_file():
            out.append(f"service {name}: build.dockerfile {dockerfile.relative_to(context)} "
                       f"does not exist in {shown}")
    return out


def _unpinned(ref: str) -> str | None:
    if "$" in ref:
        return "uses interpolation, so its version cannot be checked"
    if "@sha256:" in ref:
        return None
    last = ref.rsplit("/", 1)[-1]
    if ":" not in last:
        return "has no tag: pin a version"
    tag = last.split(":", 1)[1]
    if tag in ("", "latest"):
        return f"uses tag {tag!r}: pin a version"
    return None


def image_errors(data: dict, root: Path = ROOT) -> Errors:
    out = []
    seen_dockerfiles = set()
    for name, svc in services(data).items():
        if "image" in svc and (problem := _unpinned(str(svc["image"]))):
            out.append(f"service {name}: image {svc['image']!r} {problem}")
        b = build_of(svc, root)
        if b is None or not b[1].is_file() or b[1] in seen_dockerfiles:
            continue
        seen_dockerfiles.add(b[1])
        stages = set()
        for word, rest in dockerfile_instructions(b[1]):
            if word != "FROM":
                continue
            args = [a for a in rest.split() if not a.startswith("--")]
            if len(args) >= 3 and args[1].lower() == "as":
                stages.add(args[2])
            if (args and args[0] not in stages and args[0] != "scratch"
                    and (problem := _unpinned(args[0]))):
                out.append(f"{b[1].relative_to(root.resolve())}: FROM {args[0]} {problem}")
    return out


def copy_errors(data: dict, root: Path = ROOT) -> Errors:
    out = []
    seen = set()
    for name, svc in services(data).items():
        b = build_of(svc, root)
        if b is None or not b[1].is_file() or b in seen:
            continue
        seen.add(b)
        context, dockerfile = b
        rules = dockerignore_rules(context, dockerfile)
        label = dockerfile.relative_to(root.resolve())
        for word, rest in dockerfile_instructions(dockerfile):
            if word not in ("COPY", "ADD"):
                continue
            args = instruction_args(rest)
            if any(a.startswith("--from") for a in args):
                continue
            sources = [a for a in args if not a.startswith("--")][:-1]
            for src in sources:
                if "://" in src:
                    continue
                found = (sorted(context.glob(src.rstrip("/"))) if any(c in src for c in "*?[")
                         else [context / src] if (context / src).exists() else [])
                if not found:
                    out.append(f"{label}: {word} {src}: no such file in the build context "
                               f"(service {name})")
                    continue
                for path in found:
                    rel = path.resolve().relative_to(context).as_posix()
                    files = ([path] if path.is_file()
                             else [p for p in path.rglob("*") if p.is_file()])
                    sent = [f for f in files
                            if not ignored(f.resolve().relative_to(context).as_posix(), rules)]
                    if ignored(rel, rules) or not sent:
                        out.append(f"{label}: {word} {src}: excluded by .dockerignore "
                                   f"(service {name})")
    return out


def mount_errors(data: dict, root: Path = ROOT) -> Errors:
    out = []
    real_root = root.resolve()
    for kind in ("configs", "secrets"):
        for name, spec in (data.get(kind) or {}).items():
            if spec and "file" in spec:
                path = (root / spec["file"]).resolve()
                if not path.is_relative_to(real_root):
                    out.append(f"{kind}.{name}.file {spec['file']} is outside the repository")
                elif not path.is_file():
                    out.append(f"{kind}.{name}.file {spec['file']} does not exist")
    declared_volumes = set(data.get("volumes") or {})
    for name, svc in services(data).items():
        for _target, source, what in mounts(svc, data, root):
            if what.startswith(("configs", "secrets")) or ": COPY " in what:
                continue  # top-level files are checked above, COPY sources by copy_errors
            path = source.resolve()
            if not path.is_relative_to(real_root):
                out.append(f"service {name}: {what}: host path {source} is outside the "
                           "repository")
            elif not path.exists():
                out.append(f"service {name}: {what}: host path "
                           f"{path.relative_to(real_root)} does not exist")
        for kind in ("configs", "secrets"):
            for i, ref in enumerate(svc.get(kind) or []):
                ref_name = ref if isinstance(ref, str) else ref.get("source")
                if ref_name not in (data.get(kind) or {}):
                    out.append(f"service {name}: {kind}[{i}]: {ref_name!r} is not defined in "
                               f"top-level {kind}")
        for i, vol in enumerate(svc.get("volumes") or []):
            src = (vol.partition(":")[0] if isinstance(vol, str)
                   else vol.get("source", "") if vol.get("type") == "volume" else "")
            if isinstance(vol, str) and (":" not in vol or src.startswith((".", "/", "~"))):
                continue
            if src and src not in declared_volumes:
                out.append(f"service {name}: volumes[{i}]: named volume {src!r} is not declared "
                           "in top-level volumes")
    return out


def command_path_errors(data: dict, root: Path = ROOT) -> Errors:
    """Files that commands, entrypoints and healthchecks name inside mounted repo paths."""
    out = []
    for name, svc in services(data).items():
        workdir = svc.get("working_dir")
        for where, args in (("command", image_argv(svc, root)),
                            ("healthcheck.test", healthcheck_argv(svc))):
            for arg in args:
                for token in (arg, arg.partition("=")[2]):
                    if not token or token.startswith("-") or "://" in token:
                        continue
                    if not token.startswith("/"):
                        if workdir is None or "/" not in token:
                            continue
                        token = posixpath.normpath(posixpath.join(workdir, token))
                    hit = host_path(token, svc, data, root)
                    if hit is None or not hit[0].resolve().is_relative_to(root.resolve()):
                        continue  # an image path, or a host path mount_errors reports
                    if not hit[0].exists():
                        out.append(f"service {name}: {where} names {token}, which is "
                                   f"{hit[0].resolve().relative_to(root.resolve())} in the "
                                   f"repository via {hit[1]}: no such file")
    return out


def _client_env_literals(root: Path) -> set[str]:
    found = set()
    for path in (root / "client" / "src").rglob("*.py"):
        found |= set(re.findall(r"SPILLWAY_[A-Z0-9_]+", path.read_text(encoding="utf-8")))
    return found


def _otel_env_names() -> set[str]:
    import opentelemetry.environment_variables as api_env
    import opentelemetry.sdk.environment_variables as sdk_env

    return {getattr(m, n) for m in (sdk_env, api_env) for n in dir(m) if n.startswith("OTEL_")}


def env_errors(data: dict, root: Path = ROOT) -> Errors:
    out = []
    by_env = {config.env_name(p): p for p in config.PROPERTIES}
    passthrough = config.env_name(config.PRODUCER_PASSTHROUGH)
    client_reads = _client_env_literals(root)
    otel = _otel_env_names()
    for name, svc in services(data).items():
        given = environment(svc)
        for key in environment(svc, names=True):
            value = given.get(key)
            where = f"service {name}: environment {key}"
            if key.startswith(config.ENV_PREFIX):
                if key in by_env and value is not None:
                    prop = config.PROPERTIES[by_env[key]]
                    try:
                        prop.parse(prop.name, value)
                    except config.ConfigError as exc:
                        out.append(f"{where}={value!r}: {exc}")
                elif key in by_env or key.startswith(passthrough) or key in client_reads:
                    pass
                else:
                    close = difflib.get_close_matches(key, sorted(by_env) + sorted(client_reads),
                                                      n=1)
                    hint = f" (did you mean {close[0]}?)" if close else ""
                    out.append(f"{where}: no spillway property has this variable and "
                               f"client/src does not read it{hint}")
            elif key.startswith("OTEL_"):
                if key not in otel:
                    close = difflib.get_close_matches(key, sorted(otel), n=1)
                    hint = f" (did you mean {close[0]}?)" if close else ""
                    out.append(f"{where}: not an OpenTelemetry SDK environment variable{hint}")
                elif value is None:
                    pass
                elif key == "OTEL_TRACES_SAMPLER" and value not in OTEL_SAMPLERS:
                    out.append(f"{where}={value!r}: not a standard sampler "
                               f"({', '.join(sorted(OTEL_SAMPLERS))})")
                elif key == "OTEL_TRACES_SAMPLER_ARG":
                    try:
                        ok = 0.0 <= float(value) <= 1.0
                    except ValueError:
                        ok = False
                    if not ok:
                        out.append(f"{where}={value!r}: must be a ratio in [0, 1]")
    return out


def _published(entry) -> tuple[str | None, str | None]:
    """(host IP or None, published port or None) of one `ports` entry."""
    if isinstance(entry, dict):
        return entry.get("host_ip"), (str(entry["published"]) if "published" in entry else None)
    text = str(entry).split("/")[0]
    if text.startswith("["):
        ip, _, rest = text[1:].partition("]")
        parts = rest.lstrip(":").split(":")
        return ip, parts[0] or None
    parts = text.split(":")
    if len(parts) == 3:
        return parts[0], parts[1] or None
    if len(parts) == 2:
        return None, parts[0]
    return None, None


def port_errors(data: dict, root: Path = ROOT) -> Errors:
    out = []
    taken: dict[str, str] = {}
    for name, svc in services(data).items():
        if svc.get("network_mode") == "host":
            out.append(f"service {name}: network_mode host publishes every port on every "
                       "interface")
        for i, entry in enumerate(svc.get("ports") or []):
            ip, port = _published(entry)
            try:
                loopback = ip is not None and ipaddress.ip_address(ip).is_loopback
            except ValueError:
                loopback = False
            if not loopback:
                out.append(f"service {name}: ports[{i}] {entry!r} is published on "
                           f"{ip or 'every host interface'}: bind it to 127.0.0.1")
            if port and f"{ip}:{port}" in taken:
                out.append(f"service {name}: ports[{i}] host port {port} is already published "
                           f"by service {taken[f'{ip}:{port}']}")
            elif port:
                taken[f"{ip}:{port}"] = name
    return out


def _has_healthcheck(svc: dict, root: Path) -> bool:
    hc = svc.get("healthcheck")
    if hc is not None:
        return not hc.get("disable") and bool(hc.get("test")) and hc.get("test") != ["NONE"]
    b = build_of(svc, root)
    return bool(b and b[1].is_file() and
                any(w == "HEALTHCHECK" and not r.upper().startswith("NONE")
                    for w, r in final_stage(b[1])))


def depends_on_errors(data: dict, root: Path = ROOT) -> Errors:
    out = []
    svcs = services(data)
    graph: dict[str, list[str]] = {}
    for name, svc in svcs.items():
        deps = svc.get("depends_on") or {}
        deps = {d: {"condition": "service_started"} for d in deps} if isinstance(deps, list) \
            else deps
        graph[name] = list(deps)
        for dep, spec in deps.items():
            cond = (spec or {}).get("condition", "service_started")
            if dep not in svcs:
                out.append(f"service {name}: depends_on {dep!r}: no such service")
                continue
            if cond == "service_healthy" and not _has_healthcheck(svcs[dep], root):
                out.append(f"service {name}: depends_on {dep} with service_healthy, but {dep} "
                           "defines no healthcheck (one in its Dockerfile counts when it is "
                           "built here)")
            if cond == "service_completed_successfully" and \
                    str(svcs[dep].get("restart", "no")) in ("always", "unless-stopped"):
                out.append(f"service {name}: depends_on {dep} with "
                           f"service_completed_successfully, but {dep} has restart "
                           f"{svcs[dep]['restart']}: it never completes")
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                out.append("depends_on cycle: " + " -> ".join(path + [node, nxt]))
            elif nxt in graph and not state.get(nxt):
                visit(nxt, path + [node])
        state[node] = 2

    for node in graph:
        if not state.get(node):
            visit(node, [])
    return out


def _service_for_host(host: str, data: dict) -> str | None:
    for name, svc in services(data).items():
        if host in (name, svc.get("hostname"), svc.get("container_name")):
            return name
    return None


def _split_hostport(addr: str) -> tuple[str, int | None]:
    host, _, port = addr.rpartition(":")
    if not host:
        return addr, None
    return host.strip("[]"), int(port) if port.isdigit() else None


def _sidecar_files(svc: dict, data: dict, root: Path) -> dict[str, str]:
    """The sidecar's --config file(s), read as the sidecar reads them."""
    props: dict[str, str] = {}
    for path in flag_values(image_argv(svc, root), "--config"):
        hit = host_path(path, svc, data, root)
        if hit and hit[0].is_file():
            props.update(config.load_properties_file(str(hit[0])))
    return props


def sidecar_raw(svc: dict, data: dict, root: Path) -> dict[str, str]:
    """The sidecar's layered properties: its flags, then its environment, then its file."""
    args = image_argv(svc, root)
    explicit = dict(v.split("=", 1) for v in flag_values(args, "--set") if "=" in v)
    for flag, prop in (("--listen", "listen.address"), ("--unix-socket", "listen.unix.socket"),
                       ("--bootstrap-servers", "bootstrap.servers")):
        for v in flag_values(args, flag):
            explicit[prop] = v
    return config.resolve(explicit=explicit, env=environment(svc),
                          file=_sidecar_files(svc, data, root))


def _sidecar_services(data: dict, root: Path) -> dict[str, dict]:
    return {n: s for n, s in services(data).items() if built_from(s, root, SIDECAR_DOCKERFILE)}


def _duration_s(text: str) -> float:
    total = 0.0
    for amount, unit in re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", str(text)):
        total += float(amount) * {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}[unit]
    return total


def sidecar_errors(data: dict, root: Path = ROOT) -> Errors:
    from spillway.sidecar.core.settings import job_settings

    out = []
    sidecars = _sidecar_services(data, root)
    if not sidecars:
        return [f"no service is built from {SIDECAR_DOCKERFILE}"]
    for name, svc in sidecars.items():
        if not flag_values(image_argv(svc, root), "--config"):
            out.append(f"service {name}: the sidecar is not started with --config")
        try:
            raw = sidecar_raw(svc, data, root)
            props = config.parse(raw)
            job_settings("sidecar-defaults", {},
                         {k: v for k, v in raw.items() if k in config.JOB_PROPERTIES})
        except config.ConfigError as exc:
            out.append(f"service {name}: sidecar configuration: {exc}")
            continue
        host, _ = _split_hostport(props["listen.address"])
        if not props["listen.address"]:
            out.append(f"service {name}: listen.address is empty: the Spark containers cannot "
                       "reach the sidecar")
        elif host in ("localhost",) or (host and _is_loopback(host)):
            out.append(f"service {name}: listen.address {props['listen.address']} is loopback: "
                       "other containers cannot reach it; set SPILLWAY_LISTEN_ADDRESS="
                       "0.0.0.0:50051")
        if not props["bootstrap.servers"]:
            out.append(f"service {name}: bootstrap.servers is empty: no DLQ writes")
        targets = {(v.split(":")[1] if isinstance(v, str) else v.get("target"))
                   for v in svc.get("volumes") or [] if isinstance(v, dict) or ":" in v}
        if props["spool.enable"] and props["spool.dir"] not in targets:
            out.append(f"service {name}: spool.dir {props['spool.dir'] or '(default)'} is not "
                       "a volume of the service: the spool would not survive the container")
        grace = _duration_s(svc.get("stop_grace_period", "10s"))
        if grace * 1000 <= props["shutdown.grace.ms"]:
            out.append(f"service {name}: stop_grace_period {svc.get('stop_grace_period', '10s')}"
                       f" is not longer than shutdown.grace.ms={props['shutdown.grace.ms']}")
    return out


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _collector_config_for(svc: dict, data: dict, root: Path) -> Path | None:
    for path in flag_values(image_argv(svc, root), "--config"):
        hit = host_path(path, svc, data, root)
        if hit and hit[0].is_file():
            return hit[0]
    return None


def _otlp_grpc_port(collector_file: Path) -> int | None:
    cfg = yaml.safe_load(collector_file.read_text(encoding="utf-8")) or {}
    for rname, rcfg in (cfg.get("receivers") or {}).items():
        if rname.split("/")[0] == "otlp":
            endpoint = (((rcfg or {}).get("protocols") or {}).get("grpc") or {}).get("endpoint")
            if endpoint:
                return _split_hostport(endpoint)[1]
    return None


def address_errors(data: dict, root: Path = ROOT) -> Errors:
    """Addresses services give each other name a service that listens there."""
    out = []
    sidecars = _sidecar_services(data, root)
    kafka_listeners: set[tuple[str, int]] = set()
    for name, svc in services(data).items():
        for listener in environment(svc).get("KAFKA_ADVERTISED_LISTENERS", "").split(","):
            if "://" in listener:
                host, port = _split_hostport(listener.split("://", 1)[1])
                target = _service_for_host(host, data)
                if target == name and port:
                    kafka_listeners.add((host, port))

    def sidecar_addr(where: str, addr: str) -> None:
        if addr.startswith("unix:"):
            return
        host, port = _split_hostport(addr)
        target = _service_for_host(host, data)
        if target not in sidecars:
            out.append(f"{where}: {addr}: {host} is not a sidecar service "
                       f"({', '.join(sidecars) or 'none'})")
            return
        try:
            listen = config.parse(sidecar_raw(sidecars[target], data, root))["listen.address"]
        except config.ConfigError:
            return  # sidecar_errors names the bad property
        if _split_hostport(listen)[1] != port:
            out.append(f"{where}: {addr}: sidecar {target} listens on {listen}")

    def kafka_addr(where: str, servers: str) -> None:
        for addr in filter(None, (s.strip() for s in servers.split(","))):
            if _split_hostport(addr) not in kafka_listeners:
                out.append(f"{where}: {addr} is not an advertised listener of a Kafka service "
                           f"({', '.join(f'{h}:{p}' for h, p in sorted(kafka_listeners))})")

    for name, svc in services(data).items():
        env = environment(svc)
        args = image_argv(svc, root)
        if "SPILLWAY_SIDECAR_ADDRESS" in env:
            sidecar_addr(f"service {name}: environment SPILLWAY_SIDECAR_ADDRESS",
                         env["SPILLWAY_SIDECAR_ADDRESS"])
        for v in flag_values(args, "--sidecar"):
            sidecar_addr(f"service {name}: command --sidecar", v)
        if "SPILLWAY_BOOTSTRAP_SERVERS" in env:
            kafka_addr(f"service {name}: environment SPILLWAY_BOOTSTRAP_SERVERS",
                       env["SPILLWAY_BOOTSTRAP_SERVERS"])
        for v in flag_values(args, "--bootstrap-servers", "--bootstrap-server"):
            kafka_addr(f"service {name}: command bootstrap servers", v)
        if "OTEL_EXPORTER_OTLP_ENDPOINT" in env:
            url = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
            target = _service_for_host(url.hostname or "", data)
            where = f"service {name}: environment OTEL_EXPORTER_OTLP_ENDPOINT"
            cfg = target and _collector_config_for(services(data)[target], data, root)
            if url.scheme not in ("http", "https"):
                out.append(f"{where}: {url.geturl()} needs an http:// or https:// scheme")
            if not target or not cfg:
                out.append(f"{where}: {url.hostname} is not a collector service with a "
                           "mounted --config")
            elif _otlp_grpc_port(cfg) != url.port:
                out.append(f"{where}: port {url.port} is not the OTLP/gRPC receiver port "
                           f"{_otlp_grpc_port(cfg)} of {target}")
        for arg in args:
            if arg.startswith("spark://"):
                host, port = _split_hostport(arg[len("spark://"):])
                target = _service_for_host(host, data)
                if target is None:
                    out.append(f"service {name}: command {arg}: no service {host}")
                    continue
                master_port = flag_values(image_argv(services(data)[target], root), "--port")
                if port != int((master_port or ["7077"])[0]):
                    out.append(f"service {name}: command {arg}: {target} listens on port "
                               f"{(master_port or ['7077'])[0]}")
    return out


def dlq_topic_errors(data: dict, root: Path = ROOT) -> Errors:
    out = []
    created: set[str] = set()
    for svc in services(data).values():
        args = image_argv(svc, root)
        if any(a.endswith("kafka-topics.sh") for a in args) and "--create" in args:
            created.update(flag_values(args, "--topic"))
    prefixes: set[str] = set()  # every sidecar's guardrail must accept the topic
    sidecars = _sidecar_services(data, root)
    used = []
    for name, svc in sidecars.items():
        try:
            raw = sidecar_raw(svc, data, root)
        except config.ConfigError:
            continue  # sidecar_errors names the bad property
        prefixes.add(raw["errors.deadletterqueue.topic.name.prefix"]
                     or raw["dlq.topic.required.prefix"])  # a job default narrows it
        if raw["errors.deadletterqueue.topic.name"]:
            used.append((f"service {name}: errors.deadletterqueue.topic.name",
                         raw["errors.deadletterqueue.topic.name"]))
    prefixes = prefixes or {config.PROPERTIES["dlq.topic.required.prefix"].default}
    for name, svc in services(data).items():
        used += [(f"service {name}: command --dlq-topic", t)
                 for t in flag_values(image_argv(svc, root), "--dlq-topic")]
    if not used:
        out.append("no service names a DLQ topic (--dlq-topic or errors.deadletterqueue."
                   "topic.name)")
    for where, topic in used:
        bad = sorted(p for p in prefixes if not topic.startswith(p))
        if bad:
            out.append(f"{where}: {topic!r} does not start with the DLQ prefix {bad[0]!r}")
        if topic not in created:
            out.append(f"{where}: {topic!r} is not created by any kafka-topics.sh --create "
                       f"service (created: {', '.join(sorted(created)) or 'none'})")
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            pins[_norm(name)] = version.strip() if sep else ""
    return pins


def _dist_deps(root: Path, dist: str, extra: str | None) -> set[str]:
    meta = tomllib.loads((root / dist / "pyproject.toml").read_text(encoding="utf-8"))
    deps = list(meta["project"].get("dependencies", []))
    if extra:
        deps += meta["project"].get("optional-dependencies", {}).get(extra, [])
    return {_norm(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) for d in deps}


def pin_errors(data: dict, root: Path = ROOT) -> Errors:
    out = []
    dev = _pins(root / "requirements" / "dev.txt")
    for lock, dists in LOCK_FILES.items():
        if not (root / lock).is_file():
            out.append(f"{lock}: missing")
            continue
        pins = _pins(root / lock)
        for pkg, version in sorted(pins.items()):
            if not version:
                out.append(f"{lock}: {pkg} is not pinned with ==")
            elif pkg in dev and dev[pkg] != version:
                out.append(f"{lock}: {pkg}=={version} but requirements/dev.txt pins "
                           f"{pkg}=={dev[pkg]}")
        needed = set().union(*(_dist_deps(root, d, e) for d, e in dists))
        needed = {d for d in needed if not d.startswith("spillway-") and d != "pyspark"}
        for pkg in sorted(needed - set(pins)):
            out.append(f"{lock}: lacks {pkg}, a dependency of "
                       f"{', '.join(d for d, _ in dists)}")
    # the image with an extra installs its pin file instead of sidecar.txt: the same pins
    base, extra = root / "requirements/sidecar.txt", root / "requirements/sidecar-msk-iam.txt"
    if base.is_file() and extra.is_file():
        with_extra = _pins(extra)
        for pkg, version in sorted(_pins(base).items()):
            if with_extra.get(pkg) != version:
                out.append(f"requirements/sidecar-msk-iam.txt: {pkg}=={with_extra.get(pkg)} "
                           f"but requirements/sidecar.txt pins {pkg}=={version}")
    spark = root / SPARK_DOCKERFILE
    if spark.is_file():
        images = [r.split()[0] for w, r in dockerfile_instructions(spark) if w == "FROM"]
        m = re.match(r"(?:docker\.io/)?apache/spark:(\d+\.\d+\.\d+)", images[-1] if images else "")
        if not m:
            out.append(f"{SPARK_DOCKERFILE}: FROM {images[-1] if images else '(none)'} is not an "
                       "apache/spark:<version>-... image")
        elif m.group(1) != dev.get("pyspark"):
            out.append(f"{SPARK_DOCKERFILE}: Spark {m.group(1)} in the image but "
                       f"requirements/dev.txt pins pyspark=={dev.get('pyspark')}: driver, "
                       "executors and tests must run one Spark version")
    return out


def collector_errors(data: dict, root: Path = ROOT) -> Errors:
    """The collector config parses and its pipelines use only defined components."""
    path = root / COLLECTOR_CONFIG
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        return [f"{COLLECTOR_CONFIG}: cannot be read: {exc}"]
    if not isinstance(cfg, dict):
        return [f"{COLLECTOR_CONFIG}: not a mapping"]
    out = []
    sections = {k: (cfg.get(k) or {}) for k in ("receivers", "processors", "exporters",
                                                "connectors", "extensions")}
    svc = cfg.get("service") or {}
    pipelines = svc.get("pipelines") or {}
    if not pipelines:
        out.append(f"{COLLECTOR_CONFIG}: service.pipelines is empty")
    used: dict[str, set[str]] = {k: set() for k in sections}
    for pname, pipe in pipelines.items():
        if pname.split("/")[0] not in ("traces", "metrics", "logs", "profiles"):
            out.append(f"{COLLECTOR_CONFIG}: service.pipelines.{pname}: unknown signal type")
        pipe = pipe or {}
        for role in ("receivers", "processors", "exporters"):
            names = pipe.get(role) or []
            if role != "processors" and not names:
                out.append(f"{COLLECTOR_CONFIG}: service.pipelines.{pname}.{role} is empty")
            for comp in names:
                if comp in sections[role]:
                    used[role].add(comp)
                elif role != "processors" and comp in sections["connectors"]:
                    used["connectors"].add(comp)
                else:
                    out.append(f"{COLLECTOR_CONFIG}: service.pipelines.{pname}.{role}: {comp!r} "
                               f"is not defined under {role}")
    for ext in svc.get("extensions") or []:
        if ext in sections["extensions"]:
            used["extensions"].add(ext)
        else:
            out.append(f"{COLLECTOR_CONFIG}: service.extensions: {ext!r} is not defined under "
                       "extensions")
    for section, defined in sections.items():
        for comp in sorted(set(defined) - used[section]):
            out.append(f"{COLLECTOR_CONFIG}: {section}.{comp} is defined but no pipeline uses it")
    for rname, rcfg in sections["receivers"].items():
        for proto, pcfg in ((rcfg or {}).get("protocols") or {}).items():
            endpoint = (pcfg or {}).get("endpoint", "")
            host = _split_hostport(endpoint)[0] if endpoint else "localhost"
            if host == "localhost" or _is_loopback(host):
                out.append(f"{COLLECTOR_CONFIG}: receivers.{rname}.protocols.{proto}.endpoint "
                           f"{endpoint or '(default: localhost)'} is unreachable from other "
                           "containers: use 0.0.0.0")
    for ename, ecfg in sections["exporters"].items():
        endpoint = str((ecfg or {}).get("endpoint", ""))
        host = urlsplit(endpoint).hostname if "://" in endpoint else _split_hostport(endpoint)[0]
        if host and host not in ("0.0.0.0", "localhost", "::") and not _is_loopback(host) \
                and _service_for_host(host, data) is None:
            out.append(f"{COLLECTOR_CONFIG}: exporters.{ename}.endpoint {endpoint}: no compose "
                       f"service {host}")
    return out


def schema_provenance_errors(data: dict, root: Path = ROOT) -> Errors:
    digest = hashlib.sha256((root / SCHEMA_FILE.relative_to(ROOT)).read_bytes()).hexdigest()
    note = (root / SCHEMA_SOURCE.relative_to(ROOT)).read_text(encoding="utf-8")
    if digest not in note:
        return [(f"{SCHEMA_FILE.relative_to(ROOT)} (sha256 {digest}) is not the file that "
                f"{SCHEMA_SOURCE.relative_to(ROOT)} describes")]
    return []


CHECKS: list[Callable[[dict, Path], Errors]] = [
    schema_errors, schema_provenance_errors, build_errors, image_errors, copy_errors,
    mount_errors, command_path_errors, env_errors, port_errors, depends_on_errors,
    sidecar_errors, address_errors, dlq_topic_errors, pin_errors, collector_errors,
]


# --- the real files pass ----------------------------------------------------------------------


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_compose_stack(check, compose):
    errors = check(compose, ROOT)
    assert not errors, "\n".join(errors)


def test_no_obsolete_version_key_and_named_volumes_only(compose):
    assert "version" not in compose, "the top-level `version` key is obsolete: remove it"
    for name, svc in services(compose).items():
        for vol in svc.get("volumes") or []:
            if isinstance(vol, str) and ":" in vol and not vol.startswith((".", "/", "~")):
                assert vol.split(":")[0] in (compose.get("volumes") or {}), (name, vol)


def test_the_stack_has_its_parts(compose):
    """One sidecar per Spark worker, executors pointed at it, and the demo job submitted."""
    svcs = services(compose)
    sidecars = _sidecar_services(compose, ROOT)
    workers = {n: s for n, s in svcs.items()
               if "org.apache.spark.deploy.worker.Worker" in image_argv(s, ROOT)}
    assert workers, "no Spark worker service"
    assert len(sidecars) == len(workers), (
        f"one sidecar per node: {len(workers)} worker(s) {sorted(workers)} but "
        f"{len(sidecars)} sidecar(s) {sorted(sidecars)}")
    for name, svc in workers.items():
        assert built_from(svc, ROOT, SPARK_DOCKERFILE), f"service {name}: not built from " \
                                                        f"{SPARK_DOCKERFILE}"
        assert "SPILLWAY_SIDECAR_ADDRESS" in environment(svc, names=True), (
            f"service {name}: environment SPILLWAY_SIDECAR_ADDRESS is missing: its executors "
            "would not find the node's sidecar")
    jobs = [n for n, s in svcs.items() if any(a.endswith("demo_job.py") for a in image_argv(s,
                                                                                        ROOT))]
    assert jobs, "no service runs examples/demo_job.py"
    for name in jobs:
        args = image_argv(svcs[name], ROOT)
        assert args[0].endswith("spark-submit"), f"service {name}: not run by spark-submit"
        for flag in ("--sidecar", "--bootstrap-servers", "--master"):
            assert flag_values(args, flag), f"service {name}: demo_job.py without {flag}"


# --- broken copies are reported ---------------------------------------------------------------


def broken(compose: dict, edit: Callable[[dict], None]) -> dict:
    data = copy.deepcopy(compose)
    edit(data)
    return data


def _messages(check, data, root=ROOT) -> str:
    return "\n".join(check(data, root))


def test_schema_reports_an_unknown_top_level_key(compose):
    data = broken(compose, lambda d: d.update(servcies={}))
    assert "(top level): 'servcies' does not match any of the regexes: '^x-'" in \
        _messages(schema_errors, data)


def test_schema_reports_a_misspelt_service_key(compose):
    data = broken(compose, lambda d: d["services"]["kafka"].update(healtcheck={}))
    msg = _messages(schema_errors, data)
    assert "services.kafka: 'healtcheck' does not match any of the regexes: '^x-'" in msg


def test_schema_reports_restart_parsed_as_a_boolean(compose):
    # An unquoted `restart: no` is YAML's false, which the schema refuses.
    data = broken(compose, lambda d: d["services"]["demo-job"].update(restart=False))
    assert "services.demo-job.restart: False is not of type 'string'" in \
        _messages(schema_errors, data)


@pytest.mark.parametrize("ref, problem", [
    ("apache/kafka", "has no tag"), ("apache/kafka:latest", "uses tag 'latest'"),
    ("apache/kafka:${KAFKA_TAG}", "uses interpolation"),
])
def test_an_unpinned_image_is_reported(compose, ref, problem):
    data = broken(compose, lambda d: d["services"]["kafka"].update(image=ref))
    assert f"service kafka: image {ref!r} {problem}" in _messages(image_errors, data)


def test_an_unpinned_from_in_a_dockerfile_is_reported(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM python:3.11 AS build\nFROM build\n"
                                         "FROM python AS final\n")
    data = {"services": {"a": {"build": "."}}}
    assert _messages(image_errors, data, tmp_path) == "Dockerfile: FROM python has no tag: " \
                                                      "pin a version"


def test_a_missing_build_context_or_dockerfile_is_reported(compose):
    data = broken(compose, lambda d: d["services"]["sidecar"]["build"].update(context="sidecarr"))
    assert "service sidecar: build.context sidecarr does not exist" in \
        _messages(build_errors, data)
    data = broken(compose, lambda d: d["services"]["sidecar"]["build"].update(
        dockerfile="sidecar/Dockerfil"))
    assert "service sidecar: build.dockerfile sidecar/Dockerfil does not exist in ." in \
        _messages(build_errors, data)


def test_a_missing_or_ignored_copy_source_is_reported(tmp_path):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "main.py").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text("")
    (tmp_path / ".dockerignore").write_text("*\n!app\napp/**/*.pyc\n")
    (tmp_path / "Dockerfile").write_text(
        "FROM python:3.11.13-slim AS b\nCOPY app/ /app/\nCOPY nothere.txt \\\n  /x\n"
        "COPY --chown=1:1 docs/ /docs/\nFROM python:3.11.13-slim\nCOPY --from=b /app /app\n")
    data = {"services": {"a": {"build": {"context": "."}, "image": "a:1"}}}
    assert _messages(copy_errors, data, tmp_path).splitlines() == [
        "Dockerfile: COPY nothere.txt: no such file in the build context (service a)",
        "Dockerfile: COPY docs/: excluded by .dockerignore (service a)",
    ]


def test_a_missing_mount_or_config_file_is_reported(compose):
    def edit(d):
        d["services"]["demo-job"]["volumes"][0]["source"] = "./example"
        d["configs"]["otel-collector-config"]["file"] = "./deploy/otel.yaml"
        d["services"]["sidecar"]["volumes"] = ["spool:/var/lib/spillway/spool"]

    msg = _messages(mount_errors, broken(compose, edit))
    assert "service demo-job: volumes[0]: host path example does not exist" in msg
    assert "configs.otel-collector-config.file ./deploy/otel.yaml does not exist" in msg
    assert "service sidecar: volumes[0]: named volume 'spool' is not declared" in msg


def test_a_command_naming_a_missing_file_is_reported(compose):
    def edit(d):
        cmd = d["services"]["demo-job"]["command"]
        cmd[cmd.index("/opt/spillway/examples/demo_job.py")] = "/opt/spillway/examples/demo.py"

    assert ("service demo-job: command names /opt/spillway/examples/demo.py, which is "
            "examples/demo.py in the repository via volumes[0]: no such file") in \
        _messages(command_path_errors, broken(compose, edit))


def test_a_moved_sidecar_config_is_reported(compose):
    # The image's CMD reads /etc/spillway/sidecar.properties; the mount now points elsewhere.
    data = broken(compose, lambda d: d["configs"]["sidecar-properties"].update(
        file="./deploy/missing.properties"))
    assert ("service sidecar: command names /etc/spillway/sidecar.properties, which is "
            "deploy/missing.properties in the repository via configs[0] (sidecar-properties): "
            "no such file") in _messages(command_path_errors, data)


def test_unknown_or_bad_environment_variables_are_reported(compose):
    def edit(d):
        env = d["services"]["sidecar"]["environment"]
        env["SPILLWAY_LISTEN_ADRESS"] = env.pop("SPILLWAY_LISTEN_ADDRESS")
        env["SPILLWAY_SPOOL_MAX_BYTES"] = "lots"
        env["OTEL_SERVICE"] = "x"
        env["OTEL_TRACES_SAMPLER"] = "sometimes"
        d["services"]["spark-worker"]["environment"]["SPILLWAY_SIDECAR_ADRESS"] = "sidecar:1"

    msg = _messages(env_errors, broken(compose, edit))
    assert ("service sidecar: environment SPILLWAY_LISTEN_ADRESS: no spillway property has this "
            "variable and client/src does not read it (did you mean SPILLWAY_LISTEN_ADDRESS?)"
            ) in msg
    assert ("service sidecar: environment SPILLWAY_SPOOL_MAX_BYTES='lots': spool.max.bytes: "
            "must be an integer") in msg
    assert "service sidecar: environment OTEL_SERVICE: not an OpenTelemetry SDK environment " \
           "variable (did you mean OTEL_SERVICE_NAME?)" in msg
    assert "service sidecar: environment OTEL_TRACES_SAMPLER='sometimes': not a standard " \
           "sampler" in msg
    assert "service spark-worker: environment SPILLWAY_SIDECAR_ADRESS: no spillway property " \
           "has this variable and client/src does not read it (did you mean " \
           "SPILLWAY_SIDECAR_ADDRESS?)" in msg


def test_variables_passed_through_from_the_host_are_checked_by_name(compose):
    data = broken(compose, lambda d: d["services"]["spark-master"].update(
        environment=["SPILLWAY_SPOOL_MAX_BYTES", "SPILLWAY_SPOOL_MAX_BYTE", "OTEL_TRACES_SAMPLER",
                     "SPILLWAY_SIDECAR_ADDRESS=sidecar:50051"]))
    assert _messages(env_errors, data).splitlines() == [
        ("service spark-master: environment SPILLWAY_SPOOL_MAX_BYTE: no spillway property has "
        "this variable and client/src does not read it (did you mean SPILLWAY_SPOOL_MAX_BYTES?)")]


def test_the_client_variable_is_accepted_only_while_the_client_reads_it(compose, tmp_path):
    (tmp_path / "client" / "src").mkdir(parents=True)
    (tmp_path / "client" / "src" / "m.py").write_text('ENV = "SPILLWAY_OTHER"\n')
    assert "environment SPILLWAY_SIDECAR_ADDRESS: no spillway property" in \
        _messages(env_errors, compose, tmp_path)


@pytest.mark.parametrize("entry", ["9094:9094", "0.0.0.0:9094:9094", 9094,
                                   {"target": 9094, "published": "9094"}])
def test_a_port_published_beyond_loopback_is_reported(compose, entry):
    data = broken(compose, lambda d: d["services"]["kafka"].update(ports=[entry]))
    assert f"service kafka: ports[0] {entry!r} is published on" in _messages(port_errors, data)


def test_a_host_port_published_twice_is_reported(compose):
    data = broken(compose, lambda d: d["services"]["jaeger"].update(
        ports=["127.0.0.1:8080:16686"]))
    assert "service jaeger: ports[0] host port 8080 is already published by service " \
           "spark-master" in _messages(port_errors, data)


def test_bad_depends_on_is_reported(compose):
    def edit(d):
        d["services"]["sidecar"]["depends_on"]["kafak"] = {"condition": "service_started"}
        d["services"]["spark-worker"]["depends_on"]["jaeger"] = {"condition": "service_healthy"}
        d["services"]["kafka"]["depends_on"] = ["sidecar"]
        d["services"]["topic-init"]["restart"] = "always"

    msg = _messages(depends_on_errors, broken(compose, edit))
    assert "service sidecar: depends_on 'kafak': no such service" in msg
    assert "service spark-worker: depends_on jaeger with service_healthy, but jaeger defines " \
           "no healthcheck" in msg
    assert "depends_on cycle: kafka -> sidecar -> kafka" in msg
    assert "depends_on topic-init with service_completed_successfully, but topic-init has " \
           "restart always" in msg


def test_a_sidecar_the_other_containers_cannot_reach_is_reported(compose):
    def edit(d):
        d["services"]["sidecar"]["environment"]["SPILLWAY_LISTEN_ADDRESS"] = "127.0.0.1:50051"
        d["services"]["sidecar"]["volumes"] = []
        d["services"]["sidecar"]["stop_grace_period"] = "5s"

    msg = _messages(sidecar_errors, broken(compose, edit))
    assert "service sidecar: listen.address 127.0.0.1:50051 is loopback" in msg
    assert "service sidecar: spool.dir /var/lib/spillway/spool is not a volume" in msg
    assert "service sidecar: stop_grace_period 5s is not longer than shutdown.grace.ms=10000" \
        in msg


def test_a_bad_sidecar_setting_is_reported(compose):
    data = broken(compose, lambda d: d["services"]["sidecar"]["environment"].update(
        SPILLWAY_ERRORS_TOLERANCE="some"))
    assert "service sidecar: sidecar configuration: errors.tolerance: must be one of none, all" \
        in _messages(sidecar_errors, data)


def test_wrong_addresses_are_reported(compose):
    def edit(d):
        d["services"]["spark-worker"]["environment"]["SPILLWAY_SIDECAR_ADDRESS"] = "sidecar:5005"
        d["services"]["sidecar"]["environment"]["SPILLWAY_BOOTSTRAP_SERVERS"] = "kafka:9093"
        d["services"]["sidecar"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] = \
            "http://otel-collector:4318"
        cmd = d["services"]["demo-job"]["command"]
        cmd[cmd.index("sidecar:50051")] = "jaeger:50051"
        cmd[cmd.index("spark://spark-master:7077")] = "spark://spark-mastr:7077"

    msg = _messages(address_errors, broken(compose, edit))
    assert "service spark-worker: environment SPILLWAY_SIDECAR_ADDRESS: sidecar:5005: sidecar " \
           "sidecar listens on 0.0.0.0:50051" in msg
    assert "service sidecar: environment SPILLWAY_BOOTSTRAP_SERVERS: kafka:9093 is not an " \
           "advertised listener of a Kafka service (kafka:9092)" in msg
    assert "service sidecar: environment OTEL_EXPORTER_OTLP_ENDPOINT: port 4318 is not the " \
           "OTLP/gRPC receiver port 4317 of otel-collector" in msg
    assert "service demo-job: command --sidecar: jaeger:50051: jaeger is not a sidecar " \
           "service (sidecar)" in msg
    assert "service demo-job: command spark://spark-mastr:7077: no service spark-mastr" in msg


def test_a_dlq_topic_without_the_prefix_or_not_created_is_reported(compose):
    def edit(d):
        cmd = d["services"]["demo-job"]["command"]
        cmd[cmd.index("dlq.spillway-demo")] = "spillway-demo-errors"

    msg = _messages(dlq_topic_errors, broken(compose, edit))
    assert "service demo-job: command --dlq-topic: 'spillway-demo-errors' does not start with " \
           "the DLQ prefix 'dlq.'" in msg
    assert "'spillway-demo-errors' is not created by any kafka-topics.sh --create service " \
           "(created: dlq.spillway-demo)" in msg


def test_pin_drift_is_reported(tmp_path):
    for dist, deps in (("client", '["grpcio>=1", "protobuf>=1"]'),
                       ("sidecar", '["spillway-client", "grpcio>=1", "confluent-kafka>=2"]'),
                       ("spark_integration", '["spillway-client", "pyspark>=4"]')):
        (tmp_path / dist).mkdir()
        (tmp_path / dist / "pyproject.toml").write_text(
            f'[project]\nname = "{dist}"\ndependencies = {deps}\n'
            '[project.optional-dependencies]\npandas = ["pandas>=2"]\n')
    (tmp_path / "requirements").mkdir()
    (tmp_path / "deploy").mkdir()
    (tmp_path / "requirements" / "dev.txt").write_text(
        "grpcio==1.85.1\nprotobuf==7.36.2\nconfluent_kafka==2.16.1\npyspark==4.3.0\n"
        "pandas==3.1.1\n")
    (tmp_path / "requirements" / "sidecar.txt").write_text(
        "# comment\ngrpcio==1.85.0\nprotobuf==7.36.2\nconfluent-kafka\n")
    (tmp_path / "requirements" / "sidecar-msk-iam.txt").write_text(
        "grpcio==1.85.0\nprotobuf==7.36.1\nconfluent-kafka==2.16.1\n")
    (tmp_path / "deploy" / "spark-requirements.txt").write_text(
        "grpcio==1.85.1\nprotobuf==7.36.2\n")
    (tmp_path / "deploy" / "spark.Dockerfile").write_text(
        "FROM apache/spark:4.2.0-scala2.13-java17-python3-ubuntu\n")
    assert _messages(pin_errors, {}, tmp_path).splitlines() == [
        "requirements/sidecar.txt: confluent-kafka is not pinned with ==",
        "requirements/sidecar.txt: grpcio==1.85.0 but requirements/dev.txt pins grpcio==1.85.1",
        ("requirements/sidecar-msk-iam.txt: grpcio==1.85.0 but requirements/dev.txt pins "
         "grpcio==1.85.1"),
        ("requirements/sidecar-msk-iam.txt: protobuf==7.36.1 but requirements/dev.txt pins "
         "protobuf==7.36.2"),
        "deploy/spark-requirements.txt: lacks pandas, a dependency of client, spark_integration",
        ("requirements/sidecar-msk-iam.txt: confluent-kafka==2.16.1 but "
         "requirements/sidecar.txt pins confluent-kafka=="),
        ("requirements/sidecar-msk-iam.txt: protobuf==7.36.1 but requirements/sidecar.txt "
         "pins protobuf==7.36.2"),
        ("deploy/spark.Dockerfile: Spark 4.2.0 in the image but requirements/dev.txt pins "
        "pyspark==4.3.0: driver, executors and tests must run one Spark version"),
    ]


def test_a_broken_collector_pipeline_is_reported(compose, tmp_path):
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "otel-collector.yaml").write_text(
        "receivers:\n  otlp:\n    protocols:\n      grpc:\n        endpoint: localhost:4317\n"
        "processors:\n  batch: {}\n"
        "exporters:\n  debug: {}\n  otlp/tempo:\n    endpoint: tempo:4317\n"
        "service:\n  extensions: [health_check]\n  pipelines:\n"
        "    traces:\n      receivers: [otlp]\n      processors: [batch]\n"
        "      exporters: [otlp/jaeger]\n"
        "    metrics:\n      receivers: [otlp]\n      exporters: [debug]\n"
        "    spans:\n      receivers: [otlp]\n      exporters: [debug]\n")
    assert _messages(collector_errors, compose, tmp_path).splitlines() == [
        ("deploy/otel-collector.yaml: service.pipelines.traces.exporters: 'otlp/jaeger' is not "
        "defined under exporters"),
        "deploy/otel-collector.yaml: service.pipelines.spans: unknown signal type",
        ("deploy/otel-collector.yaml: service.extensions: 'health_check' is not defined under "
        "extensions"),
        "deploy/otel-collector.yaml: exporters.otlp/tempo is defined but no pipeline uses it",
        ("deploy/otel-collector.yaml: receivers.otlp.protocols.grpc.endpoint localhost:4317 is "
        "unreachable from other containers: use 0.0.0.0"),
        ("deploy/otel-collector.yaml: exporters.otlp/tempo.endpoint tempo:4317: no compose "
        "service tempo"),
    ]


def test_an_edited_schema_is_reported(compose, tmp_path):
    (tmp_path / "tests" / "data").mkdir(parents=True)
    (tmp_path / "tests" / "data" / "compose-spec.json").write_text("{}")
    (tmp_path / "tests" / "data" / "compose-spec.SOURCE.md").write_text(
        SCHEMA_SOURCE.read_text(encoding="utf-8"))
    assert "is not the file that tests/data/compose-spec.SOURCE.md describes" in \
        _messages(schema_provenance_errors, compose, tmp_path)


def test_dockerignore_matching_follows_docker(tmp_path):
    assert dockerignore_rules(tmp_path, tmp_path / "Dockerfile") == []
    (tmp_path / ".dockerignore").write_text("*\n!client\n**/__pycache__\n**/*.py[co]\n")
    rules = dockerignore_rules(tmp_path, tmp_path / "Dockerfile")
    assert ignored("tests/unit/x.py", rules)
    assert not ignored("client/src/spillway/client/x.py", rules)
    assert ignored("client/src/spillway/client/__pycache__/x.cpython-311.pyc", rules)
    assert ignored("client/x.pyc", rules)
    assert ignored("__pycache__", rules)
    # A Dockerfile's own <name>.dockerignore takes precedence over the context's.
    (tmp_path / "Dockerfile.dockerignore").write_text("tests\n")
    rules = dockerignore_rules(tmp_path, tmp_path / "Dockerfile")
    assert ignored("tests/x.py", rules) and not ignored("docs/x.md", rules)


# --- the sidecar's healthcheck against a real sidecar ------------------------------------------


def _provision_tls(compose: dict, svc: dict, tmp_path: Path) -> tuple[str, Path]:
    """Run the stack's own certificate generator (service `certs`) into tmp_path: returns the
    sidecar's mount point of the volume it fills and the host directory standing in for it."""
    certs = services(compose)["certs"]
    shell, script, out_dir = image_argv(certs, ROOT)
    volume = next(v.split(":")[0] for v in certs["volumes"] if v.split(":")[1] == out_dir)
    mount = next(v.split(":")[1] for v in svc["volumes"]
                 if isinstance(v, str) and v.split(":")[0] == volume)
    target = tmp_path / "tls"
    uid = str(os.getuid())
    subprocess.run([shell, str(host_path(script, certs, compose, ROOT)[0]), str(target)],
                   check=True, capture_output=True, timeout=60,
                   env={**os.environ, "SIDECAR_UID": uid, "SPARK_UID": uid})
    return mount, target


@pytest.mark.e2e
def test_the_sidecar_healthcheck_passes_on_a_live_sidecar_and_fails_without_one(
        compose, broker, tmp_path):
    """Run `spillway serve` with the compose service's config file and environment (addresses
    moved to loopback), then the compose healthcheck command against it."""
    from support.ports import free_port

    svc = services(compose)["sidecar"]
    listen = environment(svc)["SPILLWAY_LISTEN_ADDRESS"]
    port = _split_hostport(listen)[1]
    check = healthcheck_argv(svc)
    probe_addr = f"127.0.0.1:{port}"
    assert check[0] == "python" and any(probe_addr in a for a in check), (
        f"the healthcheck should probe {probe_addr} with python: {check}")
    addr = f"127.0.0.1:{free_port()}"
    check = [sys.executable] + [a.replace(probe_addr, addr) for a in check[1:]]

    config_path = host_path(flag_values(image_argv(svc, ROOT), "--config")[0], svc, compose,
                            ROOT)[0]
    mount, tls_dir = _provision_tls(compose, svc, tmp_path)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith((config.ENV_PREFIX, "OTEL_"))}
    env.update({k: v.replace(mount, str(tls_dir)) for k, v in environment(svc).items()
                if not k.startswith("OTEL_")})
    env.update(SPILLWAY_LISTEN_ADDRESS=addr, SPILLWAY_BOOTSTRAP_SERVERS=broker.bootstrap_servers,
               SPILLWAY_SPOOL_DIR=str(tmp_path / "spool"), OTEL_SDK_DISABLED="true")
    with open(tmp_path / "sidecar.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spillway.sidecar.cli", "serve", "--config",
             str(config_path)],
            stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        try:
            line = proc.stdout.readline()
            assert "listening on" in line, (line, (tmp_path / "sidecar.log").read_text())
            up = subprocess.run(check, check=False, capture_output=True, text=True, timeout=30,
                                env=env)
            assert up.returncode == 0, up.stderr
            # the operator's `docker compose exec sidecar spillway status` (mTLS + admin token)
            status = subprocess.run([sys.executable, "-m", "spillway.sidecar.cli", "status",
                                     "--sidecar", addr], check=False, capture_output=True,
                                    text=True, timeout=60, env=env)
            assert status.returncode == 0 and "sidecar spark-worker" in status.stdout, (
                status.stdout, status.stderr)
        finally:
            proc.terminate()
            proc.wait(30)
    down = subprocess.run(check, check=False, capture_output=True, text=True, timeout=30,
                          env=env)
    assert down.returncode != 0, "the healthcheck passed with no sidecar listening"
