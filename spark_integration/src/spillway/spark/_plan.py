"""`WrapperPlan`: what every task of one wrapper call runs with, besides its data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._runtime import JobSpec, WrapperSpec


@dataclass(frozen=True)
class WrapperPlan:
    """Built once on the driver (`job.Job`) and pickled into the Spark plan (classic or
    Connect) with the per-partition function (`_partitions`) or the UDF (`_udf`): the job, the
    wrapper, and the user's hooks. ``record_id``: the user's own record id; ``source``: a
    row's Kafka columns when it does not carry them; ``refresh``: run before a
    refresh-retriable record runs again."""

    spec: JobSpec
    wrapper: WrapperSpec
    record_id: Callable[..., str] | None = None
    source: Callable[[Any], Any] | None = None
    refresh: Callable[[], None] | None = None
