/* The per-id loops of spillway's id table (core/idtable.py) in C: the table's state stays in
 * its Python arrays, and these functions only walk them. Optional: idtable.py does the same in
 * Python when this module was not built (no C compiler at install), with the same results.
 *
 * - insert: a stretch of new keys indexed in order, up to the first key already present
 *   (IdTable.add_new's loop: a home's tally inserts every id of a run this way);
 * - reindex: every key indexed into a fresh, empty index (IdTable._rebuild: growth);
 * - digests: record ids' 60-bit digests, hash(id) & (2**60 - 1) (tolerance.record_key).
 *
 * Built against the stable ABI of Python 3.11 (Py_LIMITED_API), so one wheel serves every
 * Python the sidecar supports.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define KEY_MASK ((UINT64_C(1) << 60) - 1)

static int
flat(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *what)
{
    if (PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_FORMAT
                           | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->itemsize != itemsize || view->ndim != 1) {
        PyErr_Format(PyExc_TypeError, "%s: arrays of %zd-byte unsigned items are needed",
                     what, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The index (4-byte slots, a power of two of them, `mask` + 1) and the keys (8-byte) of a call,
 * as buffers; -1 with an exception set (and nothing held) when either does not fit. */
static int
index_and_keys(PyObject *io, PyObject *ko, unsigned long long mask, Py_buffer *ib,
               Py_buffer *kb, const char *fn)
{
    if (flat(io, ib, 1, 4, fn) < 0)
        return -1;
    if (flat(ko, kb, 0, 8, fn) < 0) {
        PyBuffer_Release(ib);
        return -1;
    }
    Py_ssize_t nslots = ib->len / 4;
    if (nslots == 0 || (unsigned long long)nslots != mask + 1 || (nslots & (nslots - 1))) {
        PyBuffer_Release(ib);
        PyBuffer_Release(kb);
        PyErr_Format(PyExc_ValueError, "%s: the mask does not fit the index", fn);
        return -1;
    }
    return 0;
}

/* A slot's entry number e (1-based, counted from off) names keys[e - off]; one out of range
 * (which the table never writes) never matches. */
#define MATCHES(e) ((Py_ssize_t)(e) - off >= 0 && (Py_ssize_t)(e) - off < nkeys \
                    && keys[(Py_ssize_t)(e) - off] == key)

/* insert(index, mask, keys, first, off) -> q: keys[first:] indexed in order, keys[first + k]
 * as entry number first + off + k, until a key already indexed (one earlier in the stretch
 * included) or the end; q: how many were indexed. The caller made room (the index stays at
 * most half full and entry numbers fit 32 bits). */
static PyObject *
insert(PyObject *self, PyObject *args)
{
    PyObject *io, *ko;
    unsigned long long mask;
    Py_ssize_t first, off, q = 0;
    Py_buffer ib, kb;
    if (!PyArg_ParseTuple(args, "OKOnn:insert", &io, &mask, &ko, &first, &off))
        return NULL;
    if (index_and_keys(io, ko, mask, &ib, &kb, "insert") < 0)
        return NULL;
    uint32_t *index = (uint32_t *)ib.buf;
    const uint64_t *keys = (const uint64_t *)kb.buf;
    Py_ssize_t nslots = ib.len / 4, nkeys = kb.len / 8;
    if (first < 0 || first > nkeys || off < 1 || first + off + (nkeys - first) > (Py_ssize_t)UINT32_MAX
            || 2 * (nkeys - first) > nslots) {
        PyBuffer_Release(&ib);
        PyBuffer_Release(&kb);
        PyErr_SetString(PyExc_ValueError, "insert: first or off do not fit the keys");
        return NULL;
    }
    for (Py_ssize_t p = first; p < nkeys; p++) {
        const uint64_t key = keys[p];
        uint64_t i = key & mask;
        uint32_t e;
        Py_ssize_t probes = 0;
        int found = 0;
        while ((e = index[i]) != 0) {
            if (MATCHES(e)) {
                found = 1;
                break;
            }
            if (++probes >= nslots) {   /* a full index: never, the caller keeps it half empty */
                PyBuffer_Release(&ib);
                PyBuffer_Release(&kb);
                PyErr_SetString(PyExc_ValueError, "insert: the index is full");
                return NULL;
            }
            i = (i + 1) & mask;
        }
        if (found)
            break;
        index[i] = (uint32_t)(first + off + q);
        q++;
    }
    PyBuffer_Release(&ib);
    PyBuffer_Release(&kb);
    return PyLong_FromSsize_t(q);
}

/* reindex(index, mask, keys): keys[n] indexed as entry number n + 1, in order, into an empty
 * index with room for them all. */
static PyObject *
reindex(PyObject *self, PyObject *args)
{
    PyObject *io, *ko;
    unsigned long long mask;
    Py_buffer ib, kb;
    if (!PyArg_ParseTuple(args, "OKO:reindex", &io, &mask, &ko))
        return NULL;
    if (index_and_keys(io, ko, mask, &ib, &kb, "reindex") < 0)
        return NULL;
    uint32_t *index = (uint32_t *)ib.buf;
    const uint64_t *keys = (const uint64_t *)kb.buf;
    Py_ssize_t nslots = ib.len / 4, nkeys = kb.len / 8, n;
    for (n = 0; n < nslots; n++) {
        if (index[n])
            break;
    }
    if (n < nslots || nkeys >= nslots || nkeys >= (Py_ssize_t)UINT32_MAX) {
        PyBuffer_Release(&ib);
        PyBuffer_Release(&kb);
        PyErr_SetString(PyExc_ValueError,
                        "reindex: the index must be empty and larger than the keys");
        return NULL;
    }
    for (n = 0; n < nkeys; n++) {
        uint64_t i = keys[n] & mask;
        while (index[i])
            i = (i + 1) & mask;
        index[i] = (uint32_t)(n + 1);
    }
    PyBuffer_Release(&ib);
    PyBuffer_Release(&kb);
    Py_RETURN_NONE;
}

/* digests(ids) -> bytes: hash(id) & (2**60 - 1) of each item of the sequence ids, 8 bytes
 * each in the machine's byte order (array("Q").frombytes reads them). */
static PyObject *
digests(PyObject *self, PyObject *ids)
{
    Py_ssize_t n = PySequence_Size(ids);
    if (n < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out == NULL)
        return NULL;
    uint64_t *d = (uint64_t *)PyBytes_AsString(out);
    int is_list = PyList_Check(ids);
    for (Py_ssize_t k = 0; k < n; k++) {
        /* a strong reference while it is hashed: a str subclass's __hash__ may change the list */
        PyObject *item = is_list ? PyList_GetItem(ids, k) : PySequence_GetItem(ids, k);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        if (is_list)
            Py_INCREF(item);
        if (!PyUnicode_Check(item)) {
            PyErr_Format(PyExc_TypeError, "digests: record ids are str, item %zd is not", k);
            Py_DECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_hash_t h = PyObject_Hash(item);
        Py_DECREF(item);
        if (h == -1 && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        d[k] = ((uint64_t)h) & KEY_MASK;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"insert", insert, METH_VARARGS,
     "insert(index, mask, keys, first, off) -> how many of keys[first:] were indexed"},
    {"reindex", reindex, METH_VARARGS, "reindex(index, mask, keys): every key, into an empty index"},
    {"digests", digests, METH_O, "digests(ids) -> bytes: each id's hash & (2**60 - 1)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_idindex", "The id table's per-id loops (core/idtable.py).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__idindex(void)
{
    return PyModule_Create(&module);
}
