"""The policy core's public face (`spillway.sidecar.core.__init__`, as httpx's
tests/test_exported_members.py checks httpx's): every name `__all__` lists is there, public and
defined in the core, and `__all__` lists each once."""

from __future__ import annotations

import types

import spillway.sidecar.core as core


def test_every_exported_name_is_there_public_and_the_cores():
    for name in core.__all__:
        assert not name.startswith("_"), name
        value = getattr(core, name)   # AttributeError: listed, not imported
        if isinstance(value, types.ModuleType):
            assert value.__name__ == f"spillway.sidecar.core.{name}"
        elif isinstance(value, types.GenericAlias):   # a type alias (Group, Streak)
            assert value.__origin__ is tuple, name
        elif hasattr(value, "__module__"):
            assert value.__module__.startswith("spillway.sidecar.core."), (name, value)


def test_the_list_has_each_name_once():
    assert len(set(core.__all__)) == len(core.__all__)


def test_the_engine_and_the_values_the_service_uses_are_exported():
    for name in ("PolicyEngine", "run_key", "Tally", "SliceAsk", "DlqBuilder", "Verdict",
                 "Decision", "DlqRecord", "JobSettings", "job_settings", "SystemClock"):
        assert name in core.__all__, name
