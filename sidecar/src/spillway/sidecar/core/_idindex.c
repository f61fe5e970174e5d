/* The per-id loops of spillway's id table (core/idtable.py) in C: the table's state stays in
 * its Python arrays, and these functions only walk them. Optional: idtable.py does the same in
 * Python when this module was not built (no C compiler at install), with the same results.
 *
 * - insert: a stretch of new keys indexed in order, up to the first key already present
 *   (IdTable.add_new's loop: a home's tally inserts every id of a run this way);
 * - reindex: every key indexed into a fresh, empty index (IdTable._rebuild: growth);
 * - digests: record ids' 60-bit digests, hash(id) & (2**60 - 1) (tolerance.record_key);
 * - payload_tags: records' keyed BLAKE2b-64 payload tags (tolerance.payload_tagger).
 *
 * Built against the stable ABI of Python 3.11 (Py_LIMITED_API), so one wheel serves every
 * Python the sidecar supports.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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


/* --- payload tags: keyed BLAKE2b-64 of a record's key and value (tolerance.payload_tag) ---
 * BLAKE2b as RFC 7693 specifies it (the same digests as hashlib.blake2b(digest_size=8,
 * key=secret): tests/unit/sidecar/core/test_idtable_native.py compares them over every length around the
 * block size). The keyed first block is compressed once per call, as payload_tagger does. */
static const uint64_t B2_IV[8] = {
    UINT64_C(0x6a09e667f3bcc908), UINT64_C(0xbb67ae8584caa73b), UINT64_C(0x3c6ef372fe94f82b),
    UINT64_C(0xa54ff53a5f1d36f1), UINT64_C(0x510e527fade682d1), UINT64_C(0x9b05688c2b3e6c1f),
    UINT64_C(0x1f83d9abfb41bd6b), UINT64_C(0x5be0cd19137e2179)};
static const uint8_t B2_SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

typedef struct {
    uint64_t h[8];
    uint64_t t;          /* bytes compressed so far (a record is far below 2**64) */
    uint8_t b[128];
    size_t c;            /* bytes in b */
} B2;

#define ROTR64(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
#define B2_G(a, b, c, d, x, y) do { \
        v[a] = v[a] + v[b] + (x); v[d] = ROTR64(v[d] ^ v[a], 32); \
        v[c] = v[c] + v[d]; v[b] = ROTR64(v[b] ^ v[c], 24); \
        v[a] = v[a] + v[b] + (y); v[d] = ROTR64(v[d] ^ v[a], 16); \
        v[c] = v[c] + v[d]; v[b] = ROTR64(v[b] ^ v[c], 63); } while (0)

static void
b2_compress(B2 *s, int last)
{
    uint64_t v[16], m[16];
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = B2_IV[i];
    }
    v[12] ^= s->t;
    if (last)
        v[14] = ~v[14];
    for (int i = 0; i < 16; i++) {
        const uint8_t *p = s->b + 8 * i;
        m[i] = (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16
               | (uint64_t)p[3] << 24 | (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40
               | (uint64_t)p[6] << 48 | (uint64_t)p[7] << 56;
    }
    for (int r = 0; r < 12; r++) {
        const uint8_t *z = B2_SIGMA[r];
        B2_G(0, 4, 8, 12, m[z[0]], m[z[1]]);
        B2_G(1, 5, 9, 13, m[z[2]], m[z[3]]);
        B2_G(2, 6, 10, 14, m[z[4]], m[z[5]]);
        B2_G(3, 7, 11, 15, m[z[6]], m[z[7]]);
        B2_G(0, 5, 10, 15, m[z[8]], m[z[9]]);
        B2_G(1, 6, 11, 12, m[z[10]], m[z[11]]);
        B2_G(2, 7, 8, 13, m[z[12]], m[z[13]]);
        B2_G(3, 4, 9, 14, m[z[14]], m[z[15]]);
    }
    for (int i = 0; i < 8; i++)
        s->h[i] ^= v[i] ^ v[i + 8];
}

static void
b2_update(B2 *s, const uint8_t *in, size_t n)
{
    while (n > 0) {
        if (s->c == 128) {      /* a full block is compressed only once more input comes */
            s->t += 128;
            b2_compress(s, 0);
            s->c = 0;
        }
        size_t k = 128 - s->c < n ? 128 - s->c : n;
        memcpy(s->b + s->c, in, k);
        s->c += k;
        in += k;
        n -= k;
    }
}

static uint64_t
b2_final64(B2 *s)
{
    s->t += s->c;
    memset(s->b + s->c, 0, 128 - s->c);
    b2_compress(s, 1);
    return s->h[0];     /* the 8-byte digest, read little-endian */
}

/* bytes or None (NULL) of a record's key or value */
static int
payload_part(PyObject *o, const char **p, Py_ssize_t *n, const char *what, Py_ssize_t k)
{
    if (o == Py_None) {
        *p = NULL;
        return 0;
    }
    char *b;
    if (!PyBytes_Check(o)) {
        PyErr_Format(PyExc_TypeError, "payload_tags: record %zd's %s is not bytes or None",
                     k, what);
        return -1;
    }
    if (PyBytes_AsStringAndSize(o, &b, n) < 0)
        return -1;
    *p = b;
    return 0;
}

static PyObject *s_key, *s_value, *s_tag;

/* payload_tags(secret, records) -> bytes: each record's payload tag (its own `tag` when that
 * is >= 0), 8 bytes each in native order, as tolerance.payload_tagger(secret) gives them */
static PyObject *
payload_tags(PyObject *self, PyObject *args)
{
    const char *secret;
    Py_ssize_t secret_n;
    PyObject *records;
    (void)self;
    if (!PyArg_ParseTuple(args, "y#O!", &secret, &secret_n, &PyList_Type, &records))
        return NULL;
    if (secret_n > 64) {
        PyErr_SetString(PyExc_ValueError, "payload_tags: a BLAKE2b key is at most 64 bytes");
        return NULL;
    }
    B2 keyed;
    for (int i = 0; i < 8; i++)
        keyed.h[i] = B2_IV[i];
    keyed.h[0] ^= UINT64_C(0x01010000) ^ ((uint64_t)secret_n << 8) ^ 8;
    keyed.t = 0;
    keyed.c = 0;
    if (secret_n > 0) {     /* the key, padded to a block; compressed with the first input */
        memset(keyed.b, 0, 128);
        memcpy(keyed.b, secret, (size_t)secret_n);
        keyed.c = 128;
    }
    Py_ssize_t n = PyList_Size(records);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out == NULL)
        return NULL;
    uint64_t *d = (uint64_t *)PyBytes_AsString(out);
    int compressed = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *rec = PyList_GetItem(records, k), *tag, *key = NULL, *value = NULL;
        Py_INCREF(rec);     /* held while its properties run (they may change the list) */
        if ((tag = PyObject_GetAttr(rec, s_tag)) == NULL)
            goto fail;
        long long given = PyLong_AsLongLong(tag);
        if (given == -1 && PyErr_Occurred()) {   /* a tag past 2**63 is a tag too */
            unsigned long long u = (unsigned long long)-1;
            if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                u = PyLong_AsUnsignedLongLong(tag);
            }
            Py_DECREF(tag);
            if (u == (unsigned long long)-1 && PyErr_Occurred())
                goto fail;
            d[k] = (uint64_t)u;
            Py_DECREF(rec);
            continue;
        }
        Py_DECREF(tag);
        if (given >= 0) {
            d[k] = (uint64_t)given;
            Py_DECREF(rec);
            continue;
        }
        if (!compressed && keyed.c == 128) {   /* as b2_update would, once for all records */
            keyed.t = 128;
            b2_compress(&keyed, 0);
            keyed.c = 0;
        }
        compressed = 1;
        const char *kp, *vp;
        Py_ssize_t kn = 0, vn = 0;
        if ((key = PyObject_GetAttr(rec, s_key)) == NULL
                || payload_part(key, &kp, &kn, "key", k) < 0
                || (value = PyObject_GetAttr(rec, s_value)) == NULL
                || payload_part(value, &vp, &vn, "value", k) < 0)
            goto fail;
        B2 s = keyed;
        if (kp == NULL) {
            static const uint8_t no_key[4] = {0xff, 0xff, 0xff, 0xff};
            b2_update(&s, no_key, 4);
        } else {
            uint8_t len[4] = {(uint8_t)kn, (uint8_t)(kn >> 8), (uint8_t)(kn >> 16),
                              (uint8_t)(kn >> 24)};
            if ((uint64_t)kn > UINT32_MAX) {
                PyErr_Format(PyExc_ValueError, "payload_tags: record %zd's key is too long", k);
                goto fail;
            }
            b2_update(&s, len, 4);
            b2_update(&s, (const uint8_t *)kp, (size_t)kn);
        }
        if (vp == NULL) {
            static const uint8_t no_value = 0xff;
            b2_update(&s, &no_value, 1);
        } else {
            static const uint8_t some = 0;
            b2_update(&s, &some, 1);
            b2_update(&s, (const uint8_t *)vp, (size_t)vn);
        }
        d[k] = b2_final64(&s);
        Py_DECREF(key);
        Py_DECREF(value);
        Py_DECREF(rec);
        continue;
fail:
        Py_XDECREF(key);
        Py_XDECREF(value);
        Py_DECREF(rec);
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"insert", insert, METH_VARARGS,
     "insert(index, mask, keys, first, off) -> how many of keys[first:] were indexed"},
    {"reindex", reindex, METH_VARARGS, "reindex(index, mask, keys): every key, into an empty index"},
    {"digests", digests, METH_O, "digests(ids) -> bytes: each id's hash & (2**60 - 1)"},
    {"payload_tags", payload_tags, METH_VARARGS,
     "payload_tags(secret, records) -> bytes: each record's keyed BLAKE2b-64 payload tag"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_idindex", "The id table's per-id loops (core/idtable.py).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__idindex(void)
{
    if ((s_key = PyUnicode_InternFromString("key")) == NULL
            || (s_value = PyUnicode_InternFromString("value")) == NULL
            || (s_tag = PyUnicode_InternFromString("tag")) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
