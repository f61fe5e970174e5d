/* Per-record objects of a report made in C (core/slots.py): a node makes several objects for
 * every record it dead-letters (the record's view over its report's columns, its DLQ record
 * and the headers of it, the drain's entry), and calling a Python class's __init__ for each
 * costs more than the rest of what a record's step does. Optional: slots.py says which classes
 * may be made here and does the same in Python when this module was not built.
 *
 * - make: instances of a class with __slots__, each slot set through its member descriptor
 *   from a column (a list, one value per instance) or one shared value, __init__ not called
 *   (slots.py allows a class only where that gives what its __init__ gives, and checks it);
 * - alike_until: where a run of objects stops having the given attributes (by identity);
 * - id_headers: a streak's DLQ record headers, before + ((name, utf8(id)),) + after per id.
 *
 * Built against the stable ABI of Python 3.11 (Py_LIMITED_API), so one wheel serves every
 * Python the sidecar supports.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef int (*descr_set_fn)(PyObject *, PyObject *, PyObject *);

/* Setters of `descrs` (a tuple of data descriptors) into `out`; -1 with an exception set. */
static int
setters(PyObject *descrs, descr_set_fn *out, Py_ssize_t n, const char *what)
{
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *d = PyTuple_GetItem(descrs, j);
        if (d == NULL)
            return -1;
        out[j] = (descr_set_fn)PyType_GetSlot(Py_TYPE(d), Py_tp_descr_set);
        if (out[j] == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "make: %s[%zd] is not a data descriptor", what, j);
            return -1;
        }
    }
    return 0;
}

/* make(cls, per_descrs, per_columns, shared_descrs, shared_values) -> list: one instance of
 * `cls` per row of the columns (lists of one length), slot per_descrs[j] set to
 * per_columns[j][i] and shared_descrs[j] to shared_values[j]. */
static PyObject *
make(PyObject *self, PyObject *args)
{
    PyObject *cls, *pd, *pc, *sd, *sv;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!:make", &PyType_Type, &cls, &PyTuple_Type, &pd,
                          &PyTuple_Type, &pc, &PyTuple_Type, &sd, &PyTuple_Type, &sv))
        return NULL;
    Py_ssize_t np = PyTuple_Size(pd), ns = PyTuple_Size(sd);
    if (np != PyTuple_Size(pc) || ns != PyTuple_Size(sv) || np < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "make: one column per descriptor, one value per shared descriptor, "
                        "at least one column");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot((PyTypeObject *)cls, Py_tp_alloc);
    if (alloc == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "make: the class has no allocator");
        return NULL;
    }
    descr_set_fn *set = PyMem_Malloc(sizeof(descr_set_fn) * (size_t)(np + ns));
    if (set == NULL)
        return PyErr_NoMemory();
    PyObject *out = NULL;
    if (setters(pd, set, np, "per_descrs") < 0 || setters(sd, set + np, ns, "shared_descrs") < 0)
        goto done;
    Py_ssize_t n = -1;
    for (Py_ssize_t j = 0; j < np; j++) {
        PyObject *col = PyTuple_GetItem(pc, j);
        if (!PyList_Check(col) || (n >= 0 && PyList_Size(col) != n)) {
            PyErr_Format(PyExc_ValueError, "make: per_columns[%zd] is not a list of the "
                         "columns' length", j);
            goto done;
        }
        n = PyList_Size(col);
    }
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = alloc((PyTypeObject *)cls, 0);
        if (obj == NULL)
            goto fail;
        PyList_SetItem(out, i, obj);   /* steals: freed with the list on failure */
        for (Py_ssize_t j = 0; j < np; j++) {
            PyObject *col = PyTuple_GetItem(pc, j);
            /* a list the caller could change meanwhile: read by its checked accessor */
            PyObject *v = PyList_GetItem(col, i);
            if (v == NULL || set[j](PyTuple_GetItem(pd, j), obj, v) < 0)
                goto fail;
        }
        for (Py_ssize_t j = 0; j < ns; j++)
            if (set[np + j](PyTuple_GetItem(sd, j), obj, PyTuple_GetItem(sv, j)) < 0)
                goto fail;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyMem_Free(set);
    return out;
}

/* alike_until(objs, start, end, names, values) -> int: the first index in [start, end) of
 * `objs` (a list) whose attribute names[j] is not values[j] for some j; `end` if none. */
static PyObject *
alike_until(PyObject *self, PyObject *args)
{
    PyObject *objs, *names, *values;
    Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "O!nnO!O!:alike_until", &PyList_Type, &objs, &start, &end,
                          &PyTuple_Type, &names, &PyTuple_Type, &values))
        return NULL;
    Py_ssize_t k = PyTuple_Size(names);
    if (k != PyTuple_Size(values)) {
        PyErr_SetString(PyExc_ValueError, "alike_until: one value per name");
        return NULL;
    }
    if (start < 0 || end > PyList_Size(objs) || start > end) {
        PyErr_SetString(PyExc_IndexError, "alike_until: start and end are not within the list");
        return NULL;
    }
    Py_ssize_t i = start;
    for (; i < end; i++) {
        PyObject *o = PyList_GetItem(objs, i);
        if (o == NULL)
            return NULL;
        int same = 1;
        for (Py_ssize_t j = 0; j < k && same; j++) {
            PyObject *a = PyObject_GetAttr(o, PyTuple_GetItem(names, j));
            if (a == NULL)
                return NULL;
            same = a == PyTuple_GetItem(values, j);
            Py_DECREF(a);
        }
        if (!same)
            break;
    }
    return PyLong_FromSsize_t(i);
}

/* id_headers(before, name, ids, after) -> list: for each id (str) of `ids` (a list), the tuple
 * before + ((name, id encoded as UTF-8 with backslashreplace),) + after. */
static PyObject *
id_headers(PyObject *self, PyObject *args)
{
    PyObject *before, *name, *ids, *after;
    if (!PyArg_ParseTuple(args, "O!UO!O!:id_headers", &PyTuple_Type, &before, &name,
                          &PyList_Type, &ids, &PyTuple_Type, &after))
        return NULL;
    Py_ssize_t nb = PyTuple_Size(before), na = PyTuple_Size(after), n = PyList_Size(ids);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = PyList_GetItem(ids, i);
        if (id == NULL)
            goto fail;
        if (!PyUnicode_Check(id)) {
            PyErr_Format(PyExc_TypeError, "id_headers: ids[%zd] is not a str", i);
            goto fail;
        }
        PyObject *b = PyUnicode_AsEncodedString(id, "utf-8", "backslashreplace");
        if (b == NULL)
            goto fail;
        PyObject *h = PyTuple_Pack(2, name, b);
        Py_DECREF(b);
        if (h == NULL)
            goto fail;
        PyObject *t = PyTuple_New(nb + 1 + na);
        if (t == NULL) {
            Py_DECREF(h);
            goto fail;
        }
        for (Py_ssize_t j = 0; j < nb; j++) {
            PyObject *x = PyTuple_GetItem(before, j);
            Py_INCREF(x);
            PyTuple_SetItem(t, j, x);
        }
        PyTuple_SetItem(t, nb, h);
        for (Py_ssize_t j = 0; j < na; j++) {
            PyObject *x = PyTuple_GetItem(after, j);
            Py_INCREF(x);
            PyTuple_SetItem(t, nb + 1 + j, x);
        }
        PyList_SetItem(out, i, t);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"make", make, METH_VARARGS,
     "make(cls, per_descrs, per_columns, shared_descrs, shared_values) -> list of instances"},
    {"alike_until", alike_until, METH_VARARGS,
     "alike_until(objs, start, end, names, values) -> the first index not alike"},
    {"id_headers", id_headers, METH_VARARGS,
     "id_headers(before, name, ids, after) -> each id's header tuple"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_slots", "Per-record objects of a report made in C (core/slots.py).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__slots(void)
{
    return PyModule_Create(&module);
}
