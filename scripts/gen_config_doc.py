"""Writes docs/CONFIGURATION.md from the property table in spillway.sidecar.core.config.

The table is the single source of truth; tests/unit/test_config_doc.py fails when the doc is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from spillway.sidecar.core import config

HEADER = """# Configuration

Generated from `spillway.sidecar.core.config` by `scripts/gen_config_doc.py`; do not edit by hand.

Every property can be given, highest precedence first, as a flag (`spillway serve --set
key=value`; per job: the `properties` of RegisterJob, i.e. `spillway.spark.Job(name, {...})`),
as an environment variable (`SPILLWAY_` + the name upper-cased, dots as underscores, e.g.
`SPILLWAY_ERRORS_TOLERANCE=all`), in the sidecar's Java-properties file (`--config`), or left at
its default. Job properties set on the sidecar are defaults for every job registered with it.
Invalid values stop start-up (or refuse the job) with a message naming the property.

DLQ producer settings for librdkafka pass through as `producer.kafka.<librdkafka key>`
(environment: `SPILLWAY_PRODUCER_KAFKA_<KEY>`).
"""


ALIASES_HEADER = """
## Other KIPs' names

Accepted wherever a property is (RegisterJob, flags, environment, file) and read as the
property they name; effective properties and messages use spillway's name. Setting both names
in one place to different values is refused, naming both (the same value twice is fine).

| alias | property | environment |
|---|---|---|"""

ALIASES_FOOTER = """
*The status-store family*: once any of its five knobs is set (under either name), every unset
one takes that KIP's default: `max.retries` 5, `initial.backoff.ms` 300, `max.backoff.ms` 10000,
`backoff.multiplier` 2.0, `jitter.factor` 0.25, and its formula shapes the delays. So a shape
knob alone retries 5 times, as the KIP says, instead of enabling nothing. *Deliberate
differences from that KIP*: an unset `max.backoff.ms` is lowered to `errors.retry.delay.max.ms`
when that is lower (KIP-298 calls it the maximum delay between two retries), and an unset
`initial.backoff.ms` is lowered to the cap, so a default never fails the KIP's start-up check
`initial <= max`; `errors.retry.timeout`, when positive, still bounds the retry time as well
(whichever bound is reached first ends the retries)."""


def render() -> str:
    out = [HEADER]
    for title, job in (("Job properties", True), ("Sidecar properties", False)):
        out.append(f"\n## {title}\n\n| property | default | environment | meaning |\n|---|---|---|---|")
        for p in config.PROPERTIES.values():
            if p.job is job:
                default = f"`{p.default}`" if p.default != "" else "(unset)"
                out.append(f"| `{p.name}` | {default} | `{config.env_name(p.name)}` | "
                           f"{p.doc.replace('|', '/')} |")
    out.append(ALIASES_HEADER)
    for alias, name in config.ALIASES.items():
        out.append(f"| `{alias}` | `{name}` | `{config.env_name(alias)}` |")
    out.append(ALIASES_FOOTER)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    target = Path(__file__).resolve().parents[1] / "docs" / "CONFIGURATION.md"
    if "--check" in sys.argv:
        sys.exit(0 if target.read_text() == render() else 1)
    target.write_text(render())
    print(f"wrote {target}")
