/* The per-row function of a spillway UDF (`_udf.udf_function`) in C. Optional: `_udf.py` builds
 * the same function in Python when this module was not built (no C compiler at install).
 *
 * Spark calls a Python UDF once per row, and a wrapper written in Python costs a frame and a
 * dozen bytecodes per row on the happy path (~140 ns, a few percent of a cheap UDF). Here a row
 * costs one attribute read (pyspark's TaskContext._taskContext, to see that the task attempt is
 * the same), an increment, the user's function called with Spark's own argument tuple, and the
 * result's type test. Everything else (a new task attempt, a result the fast test does not
 * pass, a failure) calls back into Python, as the Python version does.
 *
 * - RowCounter: a task attempt's row count (`_udf._UdfState.counter`), shared by every use of
 *   the UDF in the task, so that positional record ids stay distinct;
 * - Call(fn, mode, kind, lo, hi, verify, tc_class, enter, failed, error_column, reduce); its
 *   `fn` may be replaced (by `enter`, for a task attempt that runs its rows guarded).
 *
 * Built against the stable ABI of Python 3.10 (Py_LIMITED_API), the oldest Python spillway-spark
 * supports, so one wheel serves every later Python.
 */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* Py_XSETREF is not part of the limited API */
#define SET_REF(field, value) do { PyObject *_old = (PyObject *)(field); (field) = (value); Py_XDECREF(_old); } while (0)

/* ---- RowCounter ------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    long long n;
} RowCounter;

static int
counter_init(RowCounter *self, PyObject *args, PyObject *kwds)
{
    long long start = 0;
    static char *kwlist[] = {"value", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|L:RowCounter", kwlist, &start))
        return -1;
    self->n = start;
    return 0;
}

static PyObject *
counter_get(RowCounter *self, void *closure)
{
    return PyLong_FromLongLong(self->n);
}

static int
counter_set(RowCounter *self, PyObject *value, void *closure)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "RowCounter.value cannot be deleted");
        return -1;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred())
        return -1;
    self->n = v;
    return 0;
}

static void
counter_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    freefunc free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    free(self);
    Py_DECREF(tp);
}

static PyGetSetDef counter_getset[] = {
    {"value", (getter)counter_get, (setter)counter_set, "rows counted so far", NULL},
    {NULL},
};

static PyType_Slot counter_slots[] = {
    {Py_tp_doc, "A task attempt's row count, shared by the uses of one UDF."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, counter_init},
    {Py_tp_dealloc, counter_dealloc},
    {Py_tp_getset, counter_getset},
    {0, NULL},
};

static PyType_Spec counter_spec = {
    "spillway.spark._udfcall.RowCounter", sizeof(RowCounter), 0, Py_TPFLAGS_DEFAULT,
    counter_slots,
};

/* ---- Call -------------------------------------------------------------------------------- */

enum { CHECK_NONE = 0, CHECK_ALWAYS = 1, CHECK_FAST = 2 };

typedef struct {
    PyObject_HEAD
    PyObject *fn;          /* the user's function */
    PyObject *kind;        /* CHECK_FAST: the one type a result passes without `verify` */
    PyObject *verify;      /* result -> None, or raises: the result does not fit */
    PyObject *tc_class;    /* pyspark's TaskContext class */
    PyObject *tc_name;     /* "_taskContext" */
    PyObject *enter;       /* () -> (state, TaskContext object, RowCounter): a new attempt */
    PyObject *failed;      /* (state, args, index, exception) -> the row's result */
    PyObject *reduce;      /* what pickling this object gives: (callable, args) */
    PyObject *state;       /* the attempt's `_udf._UdfState`, NULL before the first row */
    PyObject *state_tc;    /* the TaskContext object it was entered for */
    RowCounter *counter;   /* its row count */
    PyObject *dict;        /* functools.update_wrapper's attributes */
    PyTypeObject *counter_type;
    long long lo, hi;      /* CHECK_FAST over int: the range a result passes in */
    int mode, bounded, error_column;
} Call;

static int
call_traverse(Call *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->fn);
    Py_VISIT(self->kind);
    Py_VISIT(self->verify);
    Py_VISIT(self->tc_class);
    Py_VISIT(self->tc_name);
    Py_VISIT(self->enter);
    Py_VISIT(self->failed);
    Py_VISIT(self->reduce);
    Py_VISIT(self->state);
    Py_VISIT(self->state_tc);
    Py_VISIT((PyObject *)self->counter);
    Py_VISIT(self->dict);
    Py_VISIT((PyObject *)self->counter_type);
    return 0;
}

static int
call_clear(Call *self)
{
    Py_CLEAR(self->fn);
    Py_CLEAR(self->kind);
    Py_CLEAR(self->verify);
    Py_CLEAR(self->tc_class);
    Py_CLEAR(self->tc_name);
    Py_CLEAR(self->enter);
    Py_CLEAR(self->failed);
    Py_CLEAR(self->reduce);
    Py_CLEAR(self->state);
    Py_CLEAR(self->state_tc);
    Py_CLEAR(self->counter);
    Py_CLEAR(self->dict);
    Py_CLEAR(self->counter_type);
    return 0;
}

static void
call_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    call_clear((Call *)self);
    freefunc free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    free(self);
    Py_DECREF(tp);
}

static int
call_init(Call *self, PyObject *args, PyObject *kwds)
{
    PyObject *fn, *kind, *verify, *tc_class, *enter, *failed, *reduce, *counter_type;
    long long lo, hi;
    int mode, bounded, error_column;
    static char *kwlist[] = {"fn", "mode", "kind", "bounded", "lo", "hi", "verify", "tc_class",
                             "enter", "failed", "error_column", "reduce", "counter_type",
                             NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OiOpLLOOOOpOO:Call", kwlist, &fn, &mode,
                                     &kind, &bounded, &lo, &hi, &verify, &tc_class, &enter,
                                     &failed, &error_column, &reduce, &counter_type))
        return -1;
    if (mode < CHECK_NONE || mode > CHECK_FAST) {
        PyErr_Format(PyExc_ValueError, "Call: mode must be 0, 1 or 2, got %d", mode);
        return -1;
    }
    if (!PyCallable_Check(fn) || !PyCallable_Check(enter) || !PyCallable_Check(failed)
            || (mode != CHECK_NONE && !PyCallable_Check(verify))) {
        PyErr_SetString(PyExc_TypeError, "Call: fn, enter, failed and verify must be callable");
        return -1;
    }
    if (!PyType_Check(counter_type)) {
        PyErr_SetString(PyExc_TypeError, "Call: counter_type must be RowCounter");
        return -1;
    }
    if (!PyTuple_Check(reduce) || PyTuple_Size(reduce) != 2) {
        PyErr_SetString(PyExc_TypeError, "Call: reduce must be a (callable, args) pair");
        return -1;
    }
    PyObject *name = PyUnicode_InternFromString("_taskContext");
    if (name == NULL)
        return -1;
    call_clear(self);
    Py_INCREF(fn); self->fn = fn;
    Py_INCREF(kind); self->kind = kind;
    Py_INCREF(verify); self->verify = verify;
    Py_INCREF(tc_class); self->tc_class = tc_class;
    self->tc_name = name;
    Py_INCREF(enter); self->enter = enter;
    Py_INCREF(failed); self->failed = failed;
    Py_INCREF(reduce); self->reduce = reduce;
    Py_INCREF(counter_type); self->counter_type = (PyTypeObject *)counter_type;
    self->mode = mode;
    self->bounded = bounded;
    self->lo = lo;
    self->hi = hi;
    self->error_column = error_column;
    return 0;
}

/* A new task attempt (or the first row): `enter()` gives its state. */
static int
call_enter(Call *self)
{
    PyObject *got = PyObject_CallObject(self->enter, NULL);
    if (got == NULL)
        return -1;
    if (!PyTuple_Check(got) || PyTuple_Size(got) != 3
            || !PyObject_TypeCheck(PyTuple_GetItem(got, 2), self->counter_type)) {
        PyErr_SetString(PyExc_TypeError, "UDF enter() must give (state, TaskContext, RowCounter)");
        Py_DECREF(got);
        return -1;
    }
    PyObject *st = PyTuple_GetItem(got, 0), *tc = PyTuple_GetItem(got, 1);
    PyObject *counter = PyTuple_GetItem(got, 2);
    Py_INCREF(st);
    Py_INCREF(tc);
    Py_INCREF(counter);
    SET_REF(self->state, st);
    SET_REF(self->state_tc, tc);
    SET_REF(self->counter, (RowCounter *)counter);
    Py_DECREF(got);
    return 0;
}

/* Whether `out` passes without `verify` (CHECK_FAST): its exact type, and for int the range. */
static int
passes(Call *self, PyObject *out)
{
    if ((PyObject *)Py_TYPE(out) != self->kind)
        return 0;
    if (!self->bounded)
        return 1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(out, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return !overflow && v >= self->lo && v <= self->hi;
}

static PyObject *
call_call(Call *self, PyObject *args, PyObject *kwargs)
{
    if (kwargs != NULL && PyDict_Size(kwargs) > 0) {
        PyErr_SetString(PyExc_TypeError, "a spillway UDF takes its columns as positional "
                        "arguments, not named ones");
        return NULL;
    }
    PyObject *current = PyObject_GetAttr(self->tc_class, self->tc_name);
    if (current == NULL)
        return NULL;
    Py_DECREF(current);  /* only compared: the class keeps it */
    if (self->state == NULL || current != self->state_tc) {
        if (call_enter(self) < 0)
            return NULL;
    }
    long long index = self->counter->n++;
    PyObject *fn = self->fn;
    Py_INCREF(fn);   /* held for the call: Python code it runs may replace `fn` */
    PyObject *out = PyObject_Call(fn, args, NULL);
    Py_DECREF(fn);
    if (out != NULL && self->mode != CHECK_NONE
            && (self->mode == CHECK_ALWAYS || !passes(self, out))) {
        PyObject *ok = PyObject_CallFunctionObjArgs(self->verify, out, NULL);
        if (ok == NULL)
            Py_CLEAR(out);
        else
            Py_DECREF(ok);
    }
    if (out != NULL) {
        if (!self->error_column)
            return out;
        PyObject *pair = PyTuple_Pack(2, out, Py_None);
        Py_DECREF(out);
        return pair;
    }
    /* The row failed: an Exception goes to `failed` (reported, decided); anything else
     * (KeyboardInterrupt, SystemExit) goes on up, as the Python version lets it. */
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return NULL;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    if (value == NULL) {
        PyErr_SetString(PyExc_SystemError, "a UDF row failed without an exception");
        return NULL;
    }
    PyObject *idx = PyLong_FromLongLong(index);
    PyObject *st = self->state;
    Py_INCREF(st);   /* `failed` may run Python that enters another attempt */
    PyObject *result = idx == NULL ? NULL
        : PyObject_CallFunctionObjArgs(self->failed, st, args, idx, value, NULL);
    Py_DECREF(st);
    Py_XDECREF(idx);
    Py_DECREF(value);
    return result;
}

static PyObject *
call_reduce(Call *self, PyObject *unused)
{
    Py_INCREF(self->reduce);
    return self->reduce;
}

static PyObject *
call_get_dict(Call *self, void *closure)
{
    if (self->dict == NULL && (self->dict = PyDict_New()) == NULL)
        return NULL;
    Py_INCREF(self->dict);
    return self->dict;
}

static PyMethodDef call_methods[] = {
    {"__reduce__", (PyCFunction)call_reduce, METH_NOARGS,
     "Pickled as the arguments it was made from: Spark ships the UDF to its executors."},
    {NULL},
};

static PyMemberDef call_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(Call, dict), READONLY, NULL},
    {NULL},
};

static PyObject *
call_get_fn(Call *self, void *closure)
{
    PyObject *fn = self->fn != NULL ? self->fn : Py_None;
    Py_INCREF(fn);
    return fn;
}

static int
call_set_fn(Call *self, PyObject *value, void *closure)
{
    if (value == NULL || !PyCallable_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "Call.fn must be a callable");
        return -1;
    }
    Py_INCREF(value);
    SET_REF(self->fn, value);
    return 0;
}

static PyGetSetDef call_getset[] = {
    {"__dict__", (getter)call_get_dict, NULL, "attributes (functools.update_wrapper's)", NULL},
    {"fn", (getter)call_get_fn, (setter)call_set_fn, "the function each row calls", NULL},
    {NULL},
};

static PyType_Slot call_slots[] = {
    {Py_tp_doc, "A spillway UDF's per-row function (see spillway.spark._udf)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, call_init},
    {Py_tp_dealloc, call_dealloc},
    {Py_tp_traverse, call_traverse},
    {Py_tp_clear, call_clear},
    {Py_tp_call, call_call},
    {Py_tp_methods, call_methods},
    {Py_tp_members, call_members},
    {Py_tp_getset, call_getset},
    {0, NULL},
};

static PyType_Spec call_spec = {
    "spillway.spark._udfcall.Call", sizeof(Call), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, call_slots,
};

/* ---- module ------------------------------------------------------------------------------ */

static int
add_type(PyObject *module, PyType_Spec *spec, const char *name)
{
    PyObject *tp = PyType_FromSpec(spec);
    if (tp == NULL)
        return -1;
    if (PyModule_AddObject(module, name, tp) < 0) {
        Py_DECREF(tp);
        return -1;
    }
    return 0;
}

static int
exec_module(PyObject *module)
{
    if (add_type(module, &counter_spec, "RowCounter") < 0)
        return -1;
    return add_type(module, &call_spec, "Call");
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_udfcall",
    "A spillway UDF's per-row function in C (see spillway.spark._udf).", 0, NULL,
    module_slots,
};

PyMODINIT_FUNC
PyInit__udfcall(void)
{
    return PyModuleDef_Init(&module_def);
}
