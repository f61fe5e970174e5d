"""The output checks' fast test (spark/_schema.py): a value it passes is one pyspark's own type
verifier accepts, for every atomic type it covers, at the edges of each integer range, for
near-miss types (bool for an int, int for a double, a str subclass, numpy scalars, bytearray)
and for nulls; what it does not pass still goes to the verifier, so answers never change."""

from __future__ import annotations

import decimal
import itertools

import pytest
from pyspark.sql import Row
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    ByteType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
    _make_type_verifier,
)
from spillway.spark._schema import OutputSchemaError, _fast_ok, row_checker, value_checker

np = pytest.importorskip("numpy")


class _Text(str):
    pass


TYPES = [BooleanType(), ByteType(), ShortType(), IntegerType(), LongType(), FloatType(),
         DoubleType(), StringType(), BinaryType(), DecimalType(10, 2)]
EDGES = [1 << 7, 1 << 15, 1 << 31, 1 << 63]
VALUES = ([None, True, False, 0, 1, -1, 1.5, float("nan"), float("inf"), "x", _Text("y"), b"z",
           bytearray(b"w"), decimal.Decimal("1.5"), np.int64(3), np.float64(2.5), [1], (1,),
           {"a": 1}]
          + [s * e + d for e in EDGES for s in (1, -1) for d in (-1, 0, 1)])


def _accepts(verify, value) -> bool:
    try:
        verify(value)
        return True
    except Exception:  # noqa: BLE001 - pyspark raises several types
        return False


@pytest.mark.parametrize("dtype", TYPES, ids=lambda t: t.simpleString())
@pytest.mark.parametrize("nullable", [True, False])
def test_a_value_the_fast_test_passes_is_one_the_verifier_accepts(dtype, nullable):
    fast = _fast_ok(dtype, nullable)
    verify = _make_type_verifier(dtype, nullable=nullable)
    if isinstance(dtype, DecimalType):
        assert fast is None  # no fast test: always the verifier
        return
    assert fast is not None
    passed = 0
    for value in VALUES:
        if fast(value):
            passed += 1
            assert _accepts(verify, value), (dtype, nullable, value)
    assert passed  # the test is not vacuous: each type passes some value


def test_the_fast_test_takes_the_common_values_and_not_the_near_misses():
    assert _fast_ok(DoubleType(), True)(1.5) and not _fast_ok(DoubleType(), True)(1)
    assert _fast_ok(LongType(), False)((1 << 63) - 1) and not _fast_ok(LongType(), False)(1 << 63)
    assert not _fast_ok(LongType(), False)(True) and not _fast_ok(LongType(), False)(None)
    assert _fast_ok(IntegerType(), True)(None) and not _fast_ok(IntegerType(), True)(1 << 31)


def test_value_checks_answer_as_before_for_every_value():
    # a value the fast test does not take is decided by the verifier (and the conversion), as
    # before: accepted and refused values are the same whether or not the fast test ran
    for dtype, exact, value in itertools.product(TYPES, (True, False), VALUES):
        check = value_checker(dtype, "value", "stage", exact=exact)
        fast = _fast_ok(dtype, True)
        try:
            check(value)
            ok = True
        except OutputSchemaError:
            ok = False
        if fast is not None and fast(value):
            assert ok, (dtype, exact, value)


def test_row_checks_take_fitting_tuples_dicts_and_rows_and_refuse_the_rest():
    schema = StructType([StructField("id", LongType(), False),
                         StructField("amount", DoubleType(), True),
                         StructField("note", StringType(), True)])
    check = row_checker(schema, "parse")
    assert check((1, 2.5, "x")) == (1, 2.5, "x")
    assert check({"id": 1, "amount": None}) == {"id": 1, "amount": None}
    assert check(Row(id=1, amount=2.5, note=None)) == {"id": 1, "amount": 2.5, "note": None}
    assert check((1, 2, "x")) == (1, 2, "x")  # int for a double: the conversion takes it
    for bad in [(None, 2.5, "x"), (1, 2.5), {"amount": 2.5}, (1 << 63, 2.5, "x"),
                ("1", 2.5, "x")]:
        with pytest.raises(OutputSchemaError):
            check(bad)
