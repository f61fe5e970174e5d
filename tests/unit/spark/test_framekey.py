"""The C frame signature (`spark/_framekey.c`) gives what the client's Python one gives, packed
in bytes, for every traceback; the engine hands it to the client unless ruled out."""

from __future__ import annotations

import struct
import subprocess
import sys
from types import SimpleNamespace

import pytest
from spillway.client import _stack
from support.native import skip_without_a_c_compiler

try:
    from spillway.spark import _framekey as native
except ImportError:   # not built: the Python version is all there is (checked below)
    native = None

needs_native = pytest.mark.skipif(native is None, reason="spark/_framekey.c was not built")


def packed(key: tuple) -> bytes:
    """The Python version's key as the C version packs it (native Py_intptr_t values)."""
    return struct.pack(f"@{len(key)}n", *key)


def test_the_extension_is_built_where_a_c_compiler_and_pythons_headers_are():
    """`make test` installs spillway-spark with it on a machine that can build it (a silent
    fallback would only show in the benchmarks)."""
    skip_without_a_c_compiler()
    from spillway.spark import _framekey  # noqa: F401 - the import is the check


def _raised(depth: int) -> BaseException:
    def down(n):
        if n == 0:
            raise ValueError("bottom")
        return down(n - 1)

    try:
        down(depth)
    except ValueError as exc:
        return exc
    raise AssertionError("not raised")


def _from_generator() -> BaseException:
    def gen():
        yield 1
        raise KeyError("in a generator")

    try:
        list(gen())
    except KeyError as exc:
        return exc
    raise AssertionError("not raised")


@needs_native
@pytest.mark.parametrize("exc", [_raised(0), _raised(1), _raised(40), _from_generator()],
                         ids=["one frame", "two frames", "41 frames", "generator"])
def test_the_c_signature_is_the_python_one(exc):
    tb = exc.__traceback__
    assert native.frame_key(tb) == packed(_stack.frame_key(tb))
    assert native.frame_key(tb) == packed(_stack.frame_signature(tb)[0])


@needs_native
def test_no_traceback_and_look_alike_chains_give_the_same_values():
    assert native.frame_key(None) == packed(_stack.frame_key(None)) == b""
    code = compile("pass", "x", "exec")
    chain = SimpleNamespace(tb_frame=SimpleNamespace(f_code=code), tb_lasti=6,
                            tb_next=SimpleNamespace(tb_frame=SimpleNamespace(f_code=code),
                                                    tb_lasti=8, tb_next=None))
    assert _stack.frame_key(chain) == (id(code), 6, id(code), 8)
    assert native.frame_key(chain) == packed((id(code), 6, id(code), 8))


@needs_native
def test_keys_are_equal_exactly_where_the_python_ones_are():
    """Deeper than the C version's own buffer (32 frames), and one frame apart at each end."""
    excs = [_raised(d) for d in (0, 1, 31, 32, 33, 80)] + [_raised(31)]
    native_keys = [native.frame_key(e.__traceback__) for e in excs]
    python_keys = [_stack.frame_key(e.__traceback__) for e in excs]
    for i in range(len(excs)):
        for j in range(len(excs)):
            assert (native_keys[i] == native_keys[j]) == (python_keys[i] == python_keys[j])
    assert native_keys[2] == native_keys[-1]


@needs_native
def test_a_tb_lasti_that_is_not_an_int_is_a_type_error():
    chain = SimpleNamespace(tb_frame=SimpleNamespace(f_code=None), tb_lasti="6", tb_next=None)
    with pytest.raises(TypeError):
        native.frame_key(chain)


@needs_native
def test_a_broken_chain_raises_as_the_python_one_does():
    broken = SimpleNamespace(tb_frame=SimpleNamespace(), tb_lasti=0, tb_next=None)
    with pytest.raises(AttributeError):
        _stack.frame_key(broken)
    with pytest.raises(AttributeError):
        native.frame_key(broken)


@needs_native
@pytest.mark.parametrize("env, native_used", [("", True), ("framekey", False), ("all", False)])
def test_the_engine_gives_the_client_the_c_signature_unless_ruled_out(env, native_used):
    code = ("import spillway.spark._engine, spillway.client.columns as c; "
            "print(type(c._frame_key).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**_env(), "SPILLWAY_NO_EXTENSIONS": env}, check=True).stdout
    assert out.strip() == ("builtin_function_or_method" if native_used else "function")


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "SPILLWAY_NO_EXTENSIONS"}
