/* The DLQ drain's produce calls and delivery reports in C, on confluent-kafka's own producer.
 *
 * confluent-kafka's produce() costs about 3.5 µs for a DLQ record (11-13 headers, each
 * converted per call) and its delivery report one Python call and a Message object more; this
 * module makes both one C loop over a batch:
 *
 * - produce: rd_kafka_produceva() on the producer's rd_kafka_t for each record of a batch
 *   (topic, key, value and headers read from the DlqRecord objects), each with a small state
 *   holding its token;
 * - delivery reports: this module is also a librdkafka plugin (`conf_init`, loaded through the
 *   producer's `plugin.library.paths`), whose on_acknowledgement interceptor notes each
 *   record's token, error code and partition in an `Acks` sink, taken in one call a round, and
 *   frees the state, so that confluent-kafka's own delivery callback has nothing to do (it
 *   would otherwise take the GIL once per record).
 *
 * librdkafka is the one confluent-kafka loaded (found among the process's shared objects, its
 * functions looked up by name): only its public ABI is declared here, as rdkafka.h has it. The
 * drain falls back to confluent-kafka's produce() where this module was not built, or could not
 * bind (dlq/producer.py), with the same results.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>   /* defines _GNU_SOURCE, which dl_iterate_phdr needs */
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

/* ---- librdkafka's public ABI (rdkafka.h) --------------------------------------------------- */

typedef struct rd_kafka_s rd_kafka_t;
typedef struct rd_kafka_conf_s rd_kafka_conf_t;
typedef struct rd_kafka_topic_s rd_kafka_topic_t;
typedef struct rd_kafka_headers_s rd_kafka_headers_t;
typedef struct rd_kafka_error_s rd_kafka_error_t;
typedef int rd_kafka_resp_err_t;
typedef int rd_kafka_conf_res_t;

typedef struct {
    rd_kafka_resp_err_t err;
    rd_kafka_topic_t *rkt;
    int32_t partition;
    void *payload;
    size_t len;
    void *key;
    size_t key_len;
    int64_t offset;
    void *_private;
} rd_kafka_message_t;

enum { VT_END, VT_TOPIC, VT_RKT, VT_PARTITION, VT_VALUE, VT_KEY, VT_OPAQUE, VT_MSGFLAGS,
       VT_TIMESTAMP, VT_HEADER, VT_HEADERS };

typedef struct {
    int vtype;
    union {
        const char *cstr;
        rd_kafka_topic_t *rkt;
        int i;
        int32_t i32;
        int64_t i64;
        struct { void *ptr; size_t size; } mem;
        struct { const char *name; const void *val; ssize_t size; } header;
        rd_kafka_headers_t *headers;
        void *ptr;
        char _pad[64];
    } u;
} rd_kafka_vu_t;

#define MSG_F_COPY 0x2
#define PARTITION_UA (-1)
#define ERR_QUEUE_FULL (-184)
#define ERR_INVALID_ARG (-186)
#define CONF_UNKNOWN (-2)
#define CONF_INVALID (-1)
#define CONF_OK 0

typedef rd_kafka_resp_err_t on_ack_f(rd_kafka_t *, rd_kafka_message_t *, void *);
typedef rd_kafka_resp_err_t on_destroy_f(rd_kafka_t *, void *);
typedef rd_kafka_conf_res_t on_conf_set_f(rd_kafka_conf_t *, const char *, const char *, char *,
                                          size_t, void *);
typedef rd_kafka_resp_err_t on_conf_dup_f(rd_kafka_conf_t *, const rd_kafka_conf_t *, size_t,
                                          const char **, void *);
typedef rd_kafka_resp_err_t on_conf_destroy_f(void *);
typedef rd_kafka_resp_err_t on_new_f(rd_kafka_t *, const rd_kafka_conf_t *, void *, char *,
                                     size_t);

static struct {
    int bound;
    char path[1024];
    rd_kafka_error_t *(*produceva)(rd_kafka_t *, const rd_kafka_vu_t *, size_t);
    rd_kafka_resp_err_t (*error_code)(const rd_kafka_error_t *);
    void (*error_destroy)(rd_kafka_error_t *);
    rd_kafka_headers_t *(*headers_new)(size_t);
    void (*headers_destroy)(rd_kafka_headers_t *);
    rd_kafka_resp_err_t (*header_add)(rd_kafka_headers_t *, const char *, ssize_t, const void *,
                                      ssize_t);
    rd_kafka_topic_t *(*topic_new)(rd_kafka_t *, const char *, void *);
    void (*topic_destroy)(rd_kafka_topic_t *);
    rd_kafka_resp_err_t (*add_on_conf_set)(rd_kafka_conf_t *, const char *, on_conf_set_f *,
                                           void *);
    rd_kafka_resp_err_t (*add_on_conf_dup)(rd_kafka_conf_t *, const char *, on_conf_dup_f *,
                                           void *);
    rd_kafka_resp_err_t (*add_on_conf_destroy)(rd_kafka_conf_t *, const char *,
                                               on_conf_destroy_f *, void *);
    rd_kafka_resp_err_t (*add_on_new)(rd_kafka_conf_t *, const char *, on_new_f *, void *);
    rd_kafka_resp_err_t (*add_on_ack)(rd_kafka_t *, const char *, on_ack_f *, void *);
    rd_kafka_resp_err_t (*add_on_destroy)(rd_kafka_t *, const char *, on_destroy_f *, void *);
} lib;

static PyObject *producer_type;   /* confluent_kafka.Producer, given to bind() */

/* confluent-kafka's Handle begins with its rd_kafka_t (confluent_kafka.h). A record's state
 * (its token) is freed by the interceptor, which clears the message's opaque pointer; it is
 * shaped as confluent-kafka's own (`Producer_msgstate`: {Handle *self; PyObject *dr_cb;}),
 * which its dr_msg_cb would free calling nothing, should a report ever reach it unseen. */
typedef struct { PyObject_HEAD rd_kafka_t *rk; } cfl_handle;
typedef struct { void *self; void *dr_cb; int64_t token; } msgstate;

/* ---- the acknowledgement sink --------------------------------------------------------------- */

typedef struct {
    pthread_mutex_t mu;
    int refs;        /* the Python object's, a conf's and a client's references */
    int oom;         /* a report could not be noted: the caller must rebuild the producer */
    size_t n, cap;
    int64_t *tokens;
    int32_t *parts;
    int32_t *errs;
} acks_t;

static acks_t *
acks_new(void)
{
    acks_t *a = calloc(1, sizeof(*a));
    if (a == NULL)
        return NULL;
    pthread_mutex_init(&a->mu, NULL);
    a->refs = 1;
    return a;
}

static void
acks_retain(acks_t *a)
{
    pthread_mutex_lock(&a->mu);
    a->refs++;
    pthread_mutex_unlock(&a->mu);
}

static void
acks_release(acks_t *a)
{
    pthread_mutex_lock(&a->mu);
    int left = --a->refs;
    pthread_mutex_unlock(&a->mu);
    if (left)
        return;
    pthread_mutex_destroy(&a->mu);
    free(a->tokens);
    free(a->parts);
    free(a->errs);
    free(a);
}

/* Sinks by number, so that a producer's configuration can name one ("spillway.acks"). */
#define MAX_SINKS 256
static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;
static acks_t *registry[MAX_SINKS];

/* set while this thread is inside produceva: a record refused there is reported by its return
 * value, and its on_acknowledgement (librdkafka calls it when partitioning fails) is not */
static __thread int producing;

static rd_kafka_resp_err_t
on_ack(rd_kafka_t *rk, rd_kafka_message_t *m, void *opaque)
{
    (void)rk;
    acks_t *a = opaque;
    msgstate *ms = m->_private;
    if (producing || ms == NULL)
        return 0;
    /* The report's state is taken here, before librdkafka queues the report for poll(): with
     * none left, confluent-kafka's dr_msg_cb returns at once, where it would take the GIL
     * (and give it back) for each record to free the state. The message is the report's
     * own until then; only its opaque pointer is cleared. */
    int64_t token = ms->token;
    m->_private = NULL;
    free(ms);
    pthread_mutex_lock(&a->mu);
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 4096;
        int64_t *t = realloc(a->tokens, cap * sizeof(*t));
        if (t) a->tokens = t;
        int32_t *p = t ? realloc(a->parts, cap * sizeof(*p)) : NULL;
        if (p) a->parts = p;
        int32_t *e = p ? realloc(a->errs, cap * sizeof(*e)) : NULL;
        if (e) a->errs = e;
        if (e == NULL) {
            a->oom = 1;
            pthread_mutex_unlock(&a->mu);
            return 0;
        }
        a->cap = cap;
    }
    a->tokens[a->n] = token;
    a->parts[a->n] = m->partition;
    a->errs[a->n] = m->err;
    a->n++;
    pthread_mutex_unlock(&a->mu);
    return 0;
}

static rd_kafka_resp_err_t
on_destroy(rd_kafka_t *rk, void *opaque)
{
    (void)rk;
    acks_release(opaque);
    return 0;
}

/* ---- the plugin: a conf that names a sink gets the interceptor on its client ---------------- */

typedef struct { acks_t *acks; } confstate;

static rd_kafka_resp_err_t plugin_setup(rd_kafka_conf_t *conf, acks_t *acks, char *errstr,
                                        size_t errstr_size);

static rd_kafka_conf_res_t
on_conf_set(rd_kafka_conf_t *conf, const char *name, const char *val, char *errstr,
            size_t errstr_size, void *opaque)
{
    (void)conf;
    confstate *cs = opaque;
    if (strcmp(name, "spillway.acks") != 0)
        return CONF_UNKNOWN;
    char *end = NULL;
    long slot = val ? strtol(val, &end, 10) : -1;
    acks_t *a = NULL;
    if (val && end && *end == '\0' && slot >= 0 && slot < MAX_SINKS) {
        pthread_mutex_lock(&registry_mu);
        a = registry[slot];
        if (a)
            acks_retain(a);
        pthread_mutex_unlock(&registry_mu);
    }
    if (a == NULL) {
        snprintf(errstr, errstr_size, "spillway.acks: no acknowledgement sink %s",
                 val ? val : "(none)");
        return CONF_INVALID;
    }
    if (cs->acks)
        acks_release(cs->acks);
    cs->acks = a;
    return CONF_OK;
}

static rd_kafka_resp_err_t
on_conf_dup(rd_kafka_conf_t *new_conf, const rd_kafka_conf_t *old_conf, size_t filter_cnt,
            const char **filter, void *opaque)
{
    (void)old_conf; (void)filter_cnt; (void)filter;
    confstate *cs = opaque;
    char errstr[256];
    return plugin_setup(new_conf, cs->acks, errstr, sizeof(errstr));
}

static rd_kafka_resp_err_t
on_conf_destroy(void *opaque)
{
    confstate *cs = opaque;
    if (cs->acks)
        acks_release(cs->acks);
    free(cs);
    return 0;
}

static rd_kafka_resp_err_t
on_new(rd_kafka_t *rk, const rd_kafka_conf_t *conf, void *opaque, char *errstr,
       size_t errstr_size)
{
    (void)conf; (void)errstr; (void)errstr_size;
    confstate *cs = opaque;
    if (cs->acks == NULL)
        return 0;
    acks_retain(cs->acks);   /* the client's, released by on_destroy */
    rd_kafka_resp_err_t err = lib.add_on_ack(rk, "spillway", on_ack, cs->acks);
    if (err == 0)
        err = lib.add_on_destroy(rk, "spillway", on_destroy, cs->acks);
    else
        acks_release(cs->acks);
    return err;
}

static rd_kafka_resp_err_t
plugin_setup(rd_kafka_conf_t *conf, acks_t *acks, char *errstr, size_t errstr_size)
{
    confstate *cs = calloc(1, sizeof(*cs));
    if (cs == NULL) {
        snprintf(errstr, errstr_size, "spillway: out of memory");
        return ERR_INVALID_ARG;
    }
    if (acks) {
        acks_retain(acks);
        cs->acks = acks;
    }
    lib.add_on_conf_set(conf, "spillway", on_conf_set, cs);
    lib.add_on_conf_dup(conf, "spillway", on_conf_dup, cs);
    lib.add_on_new(conf, "spillway", on_new, cs);
    lib.add_on_conf_destroy(conf, "spillway", on_conf_destroy, cs);
    return 0;
}

/* librdkafka's plugin entry point (plugin.library.paths names this file). */
__attribute__((visibility("default"))) rd_kafka_resp_err_t
conf_init(rd_kafka_conf_t *conf, void **plug_opaquep, char *errstr, size_t errstr_size)
{
    (void)plug_opaquep;
    if (!lib.bound) {
        snprintf(errstr, errstr_size, "spillway's produce module is not bound to librdkafka");
        return ERR_INVALID_ARG;
    }
    return plugin_setup(conf, NULL, errstr, errstr_size);
}

/* ---- Acks: the Python object ---------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    acks_t *acks;
    int slot;
} AcksObject;

static PyObject *
Acks_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (!lib.bound) {
        PyErr_SetString(PyExc_RuntimeError, "bind() first");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, ":Acks"))
        return NULL;
    (void)kwds;
    AcksObject *self = (AcksObject *)PyType_GenericNew(type, NULL, NULL);
    if (self == NULL)
        return NULL;
    self->slot = -1;
    self->acks = acks_new();
    if (self->acks == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    pthread_mutex_lock(&registry_mu);
    for (int i = 0; i < MAX_SINKS; i++)
        if (registry[i] == NULL) {
            registry[i] = self->acks;
            self->slot = i;
            break;
        }
    pthread_mutex_unlock(&registry_mu);
    if (self->slot < 0) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_RuntimeError, "too many acknowledgement sinks alive");
        return NULL;
    }
    return (PyObject *)self;
}

static void
Acks_dealloc(PyObject *op)
{
    AcksObject *self = (AcksObject *)op;
    if (self->slot >= 0) {
        pthread_mutex_lock(&registry_mu);
        registry[self->slot] = NULL;
        pthread_mutex_unlock(&registry_mu);
    }
    if (self->acks)
        acks_release(self->acks);
    PyTypeObject *tp = Py_TYPE(op);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(op);
    Py_DECREF(tp);
}

/* take() -> (acknowledged tokens, their partitions, [(token, error code)] of the failed) */
static PyObject *
Acks_take(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    acks_t *a = ((AcksObject *)op)->acks;
    pthread_mutex_lock(&a->mu);
    size_t n = a->n;
    int oom = a->oom;
    int64_t *tokens = a->tokens;
    int32_t *parts = a->parts, *errs = a->errs;
    a->tokens = NULL; a->parts = NULL; a->errs = NULL;
    a->n = a->cap = 0;
    a->oom = 0;
    pthread_mutex_unlock(&a->mu);

    PyObject *acked = NULL, *partitions = NULL, *failed = NULL, *out = NULL;
    size_t good = 0;
    for (size_t i = 0; i < n; i++)
        good += errs[i] == 0;
    if (!(acked = PyList_New((Py_ssize_t)good)) || !(partitions = PyList_New((Py_ssize_t)good))
            || !(failed = PyList_New(0)))
        goto done;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        PyObject *t = PyLong_FromLongLong(tokens[i]);
        if (t == NULL)
            goto done;
        if (errs[i] == 0) {
            PyObject *p = PyLong_FromLong(parts[i]);
            if (p == NULL) {
                Py_DECREF(t);
                goto done;
            }
            PyList_SetItem(acked, (Py_ssize_t)k, t);
            PyList_SetItem(partitions, (Py_ssize_t)k, p);
            k++;
        } else {
            PyObject *pair = Py_BuildValue("(Ni)", t, (int)errs[i]);
            if (pair == NULL || PyList_Append(failed, pair) < 0) {
                Py_XDECREF(pair);
                goto done;
            }
            Py_DECREF(pair);
        }
    }
    if (oom) {
        PyErr_SetString(PyExc_MemoryError, "delivery reports were lost: out of memory");
        goto done;
    }
    out = PyTuple_Pack(3, acked, partitions, failed);
done:
    free(tokens); free(parts); free(errs);
    Py_XDECREF(acked); Py_XDECREF(partitions); Py_XDECREF(failed);
    return out;
}

static PyObject *
Acks_slot(PyObject *op, void *closure)
{
    (void)closure;
    return PyLong_FromLong(((AcksObject *)op)->slot);
}

static PyMethodDef Acks_methods[] = {
    {"take", Acks_take, METH_NOARGS,
     "take() -> (tokens, partitions, [(token, code)]): the reports noted since the last call"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Acks_getset[] = {
    {"slot", Acks_slot, NULL, "the number a producer's spillway.acks names it by", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Acks_slots[] = {
    {Py_tp_new, Acks_new},
    {Py_tp_dealloc, Acks_dealloc},
    {Py_tp_methods, Acks_methods},
    {Py_tp_getset, Acks_getset},
    {Py_tp_doc, "Acks(): where a producer's interceptor notes its records' delivery reports"},
    {0, NULL},
};

static PyType_Spec Acks_spec = {
    "spillway.sidecar.dlq._produce.Acks", sizeof(AcksObject), 0, Py_TPFLAGS_DEFAULT, Acks_slots,
};

/* ---- bind and produce ----------------------------------------------------------------------- */

static int
find_rdkafka(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size; (void)data;
    if (info->dlpi_name && strstr(info->dlpi_name, "librdkafka")
            && strlen(info->dlpi_name) < sizeof(lib.path)) {
        strcpy(lib.path, info->dlpi_name);
        return 1;
    }
    return 0;
}

#define SYM(field, name) \
    if (!(*(void **)&lib.field = dlsym(h, name))) { missing = name; goto fail; }

/* bind(Producer) -> librdkafka's path: looks up librdkafka's functions in the copy
 * confluent-kafka loaded (import confluent_kafka first). */
static PyObject *
bind(PyObject *module, PyObject *type)
{
    (void)module;
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "bind() takes confluent_kafka.Producer");
        return NULL;
    }
    if (!lib.bound) {
        lib.path[0] = '\0';
        if (!dl_iterate_phdr(find_rdkafka, NULL)) {
            PyErr_SetString(PyExc_ImportError, "librdkafka is not loaded in this process");
            return NULL;
        }
        void *h = dlopen(lib.path, RTLD_NOW | RTLD_NOLOAD);
        const char *missing = NULL;
        if (h == NULL) {
            PyErr_Format(PyExc_ImportError, "cannot open librdkafka: %s", dlerror());
            return NULL;
        }
        SYM(produceva, "rd_kafka_produceva")
        SYM(error_code, "rd_kafka_error_code")
        SYM(error_destroy, "rd_kafka_error_destroy")
        SYM(headers_new, "rd_kafka_headers_new")
        SYM(headers_destroy, "rd_kafka_headers_destroy")
        SYM(header_add, "rd_kafka_header_add")
        SYM(topic_new, "rd_kafka_topic_new")
        SYM(topic_destroy, "rd_kafka_topic_destroy")
        SYM(add_on_conf_set, "rd_kafka_conf_interceptor_add_on_conf_set")
        SYM(add_on_conf_dup, "rd_kafka_conf_interceptor_add_on_conf_dup")
        SYM(add_on_conf_destroy, "rd_kafka_conf_interceptor_add_on_conf_destroy")
        SYM(add_on_new, "rd_kafka_conf_interceptor_add_on_new")
        SYM(add_on_ack, "rd_kafka_interceptor_add_on_acknowledgement")
        SYM(add_on_destroy, "rd_kafka_interceptor_add_on_destroy")
        lib.bound = 1;
        goto bound;
fail:
        dlclose(h);
        PyErr_Format(PyExc_ImportError, "librdkafka (%s) has no %s", lib.path, missing);
        return NULL;
    }
bound:
    Py_INCREF(type);
    Py_XDECREF(producer_type);
    producer_type = type;
    return PyUnicode_FromString(lib.path);
}

/* a bytes, a str (as UTF-8) or None: its bytes; -1 with an exception set otherwise */
static int
as_mem(PyObject *o, const char **buf, Py_ssize_t *len, const char *what)
{
    if (o == Py_None) {
        *buf = NULL;
        *len = 0;
        return 0;
    }
    if (PyBytes_Check(o)) {
        char *b;
        if (PyBytes_AsStringAndSize(o, &b, len) < 0)
            return -1;
        *buf = b;
        return 0;
    }
    if (PyUnicode_Check(o)) {
        *buf = PyUnicode_AsUTF8AndSize(o, len);
        return *buf ? 0 : -1;
    }
    PyErr_Format(PyExc_TypeError, "a DLQ record's %s must be bytes, str or None", what);
    return -1;
}

/* librdkafka's upper bound of a record's size in a request (rd_kafka_msg_wire_size: the v2
 * record's varints at their widest) and of one header's (its two length varints) */
#define WIRE_OVERHEAD 36
#define HEADER_OVERHEAD 10

static rd_kafka_headers_t *
build_headers(PyObject *hs, Py_ssize_t *wire)
{
    int is_tuple = PyTuple_Check(hs);
    if (!is_tuple && !PyList_Check(hs)) {
        PyErr_SetString(PyExc_TypeError, "a DLQ record's headers must be a tuple or a list");
        return NULL;
    }
    Py_ssize_t n = is_tuple ? PyTuple_Size(hs) : PyList_Size(hs);
    rd_kafka_headers_t *h = lib.headers_new((size_t)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = is_tuple ? PyTuple_GetItem(hs, i) : PyList_GetItem(hs, i);
        if (!PyTuple_Check(pair) || PyTuple_Size(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "a DLQ record's header must be a (name, value) "
                            "tuple");
            goto fail;
        }
        Py_ssize_t nlen, vlen;
        const char *name = PyUnicode_AsUTF8AndSize(PyTuple_GetItem(pair, 0), &nlen);
        const char *val;
        if (name == NULL || as_mem(PyTuple_GetItem(pair, 1), &val, &vlen, "header value") < 0)
            goto fail;
        lib.header_add(h, name, nlen, val, val ? vlen : 0);
        *wire += HEADER_OVERHEAD + nlen + vlen;
    }
    return h;
fail:
    lib.headers_destroy(h);
    return NULL;
}

static PyObject *s_topic, *s_key, *s_value, *s_headers;

/* produce(producer, tokens, records, start, max_bytes) -> (next, code): hands records[start:]
 * to librdkafka, each reported under its token, until one is refused or the next would take
 * the records handed over past `max_bytes` of request (librdkafka's own bound of a record's
 * size: the first record is always taken; 0: no bound); `next` is the index of the first record
 * not taken (len(records) when all were), `code` why (0 when all were taken or the bytes were
 * reached, -184 when librdkafka's queue is full, else the error that refused records[next]). */
static PyObject *
produce(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "produce(producer, tokens, records, start, max_bytes)");
        return NULL;
    }
    PyObject *producer = args[0], *tokens = args[1], *records = args[2];
    Py_ssize_t start = PyLong_AsSsize_t(args[3]), max_bytes = PyLong_AsSsize_t(args[4]);
    if ((start < 0 || max_bytes < 0) && PyErr_Occurred())
        return NULL;
    if (!lib.bound || producer_type == NULL
            || !PyObject_IsInstance(producer, producer_type)) {
        PyErr_SetString(PyExc_TypeError, "produce() takes the bound confluent_kafka.Producer");
        return NULL;
    }
    if (!PyList_Check(tokens) || !PyList_Check(records)
            || PyList_Size(tokens) != PyList_Size(records)) {
        PyErr_SetString(PyExc_TypeError, "produce() takes two lists of one length");
        return NULL;
    }
    rd_kafka_t *rk = ((cfl_handle *)producer)->rk;
    if (rk == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the producer is closed");
        return NULL;
    }
    Py_ssize_t total = PyList_Size(records), i = start, taken_bytes = 0;
    int code = 0;
    PyObject *topic_obj = NULL;   /* the topic of `rkt` */
    rd_kafka_topic_t *rkt = NULL;
    for (; i < total; i++) {
        PyObject *rec = PyList_GetItem(records, i);
        long long token = PyLong_AsLongLong(PyList_GetItem(tokens, i));
        if (token == -1 && PyErr_Occurred())
            goto error;
        PyObject *topic = PyObject_GetAttr(rec, s_topic);
        if (topic == NULL)
            goto error;
        if (topic != topic_obj
                && (topic_obj == NULL || PyObject_RichCompareBool(topic, topic_obj, Py_EQ) != 1)) {
            const char *name = PyUnicode_Check(topic) ? PyUnicode_AsUTF8AndSize(topic, NULL)
                                                      : NULL;
            if (name == NULL) {
                Py_DECREF(topic);
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_TypeError, "a DLQ record's topic must be a str");
                goto error;
            }
            if (rkt)
                lib.topic_destroy(rkt);
            Py_CLEAR(topic_obj);
            rkt = lib.topic_new(rk, name, NULL);
            if (rkt == NULL) {   /* an invalid topic name: refused, as produce() would */
                Py_DECREF(topic);
                code = ERR_INVALID_ARG;
                break;
            }
            Py_INCREF(topic);
            topic_obj = topic;
        }
        Py_DECREF(topic);
        PyObject *key = PyObject_GetAttr(rec, s_key), *value = NULL, *hs = NULL;
        const char *kb, *vb;
        Py_ssize_t kl, vl;
        if (key == NULL || as_mem(key, &kb, &kl, "key") < 0
                || !(value = PyObject_GetAttr(rec, s_value))
                || as_mem(value, &vb, &vl, "value") < 0
                || !(hs = PyObject_GetAttr(rec, s_headers))) {
            Py_XDECREF(key); Py_XDECREF(value);
            goto error;
        }
        rd_kafka_headers_t *h = NULL;
        Py_ssize_t wire = WIRE_OVERHEAD + kl + vl;
        if (hs != Py_None && PyObject_IsTrue(hs) && !(h = build_headers(hs, &wire))) {
            Py_DECREF(key); Py_DECREF(value); Py_DECREF(hs);
            goto error;
        }
        if (max_bytes > 0 && i > start && taken_bytes + wire > max_bytes) {
            if (h) lib.headers_destroy(h);
            Py_DECREF(key); Py_DECREF(value); Py_DECREF(hs);
            break;
        }
        msgstate *ms = malloc(sizeof(*ms));
        if (ms == NULL) {
            if (h) lib.headers_destroy(h);
            Py_DECREF(key); Py_DECREF(value); Py_DECREF(hs);
            PyErr_NoMemory();
            goto error;
        }
        ms->self = producer;
        ms->dr_cb = NULL;
        ms->token = token;
        rd_kafka_vu_t vu[7];
        int nv = 0;
        vu[nv].vtype = VT_RKT; vu[nv++].u.rkt = rkt;
        vu[nv].vtype = VT_PARTITION; vu[nv++].u.i32 = PARTITION_UA;
        vu[nv].vtype = VT_VALUE; vu[nv].u.mem.ptr = (void *)vb; vu[nv++].u.mem.size = (size_t)vl;
        vu[nv].vtype = VT_KEY; vu[nv].u.mem.ptr = (void *)kb; vu[nv++].u.mem.size = (size_t)kl;
        vu[nv].vtype = VT_MSGFLAGS; vu[nv++].u.i = MSG_F_COPY;
        vu[nv].vtype = VT_OPAQUE; vu[nv++].u.ptr = ms;
        if (h) {
            vu[nv].vtype = VT_HEADERS; vu[nv++].u.headers = h;
        }
        producing = 1;
        rd_kafka_error_t *err = lib.produceva(rk, vu, (size_t)nv);
        producing = 0;
        Py_DECREF(key); Py_DECREF(value); Py_DECREF(hs);
        if (err) {   /* not taken: the message state and the headers are still ours */
            code = lib.error_code(err);
            lib.error_destroy(err);
            free(ms);
            if (h) lib.headers_destroy(h);
            break;
        }
        taken_bytes += wire;
    }
    if (rkt)
        lib.topic_destroy(rkt);
    Py_XDECREF(topic_obj);
    return Py_BuildValue("(ni)", i, code);
error:
    if (rkt)
        lib.topic_destroy(rkt);
    Py_XDECREF(topic_obj);
    return NULL;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_O, "bind(confluent_kafka.Producer) -> the path of the librdkafka used"},
    {"produce", (PyCFunction)(void (*)(void))produce, METH_FASTCALL,
     "produce(producer, tokens, records, start, max_bytes) -> (next, code)"},
    {NULL, NULL, 0, NULL},
};

static int
exec_module(PyObject *m)
{
    if (!(s_topic = PyUnicode_InternFromString("topic"))
            || !(s_key = PyUnicode_InternFromString("key"))
            || !(s_value = PyUnicode_InternFromString("value"))
            || !(s_headers = PyUnicode_InternFromString("headers")))
        return -1;
    PyObject *acks = PyType_FromSpec(&Acks_spec);
    if (acks == NULL)
        return -1;
    if (PyModule_AddObject(m, "Acks", acks) < 0) {
        Py_DECREF(acks);
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_produce",
    "The DLQ drain's produce calls and delivery reports in C (see the file's head)", 0,
    methods, slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__produce(void)
{
    return PyModuleDef_Init(&module);
}
