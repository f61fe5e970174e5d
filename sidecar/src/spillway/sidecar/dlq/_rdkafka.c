/* A DLQ producer over librdkafka with no Python work per record (dlq/native.py wraps it).
 *
 * confluent-kafka's produce() converts every header of every record from Python objects and
 * calls back into Python for every delivery report: 9-14 us of a node's CPU per dead-lettered
 * record (docs/DLQ.md). Here one call hands a batch of DlqRecords to librdkafka
 * (rd_kafka_produceva, one vector of topic, key, value, token and headers per record), and
 * delivery reports, errors and log lines are stored by C callbacks and taken by Python once
 * per poll, as lists.
 *
 * librdkafka is the one confluent-kafka ships (or the system's), opened with dlopen by path:
 * no headers or link step at build time, so the few declarations used are written out below
 * (rdkafka.h, stable since librdkafka 1.4; `load` refuses an older library). Optional, like
 * core/_idindex.c: without it the sidecar produces through confluent-kafka.
 *
 * Callbacks never touch Python: they run in librdkafka's threads (logs) or inside rd_kafka_poll
 * and rd_kafka_flush, which are called with the GIL released, and store into `Sink` under its
 * mutex. A delivery report that cannot be stored (out of memory) is never dropped silently:
 * `lost` is set and the wrapper rebuilds the producer, which re-produces what it held.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

/* --- the librdkafka declarations used (rdkafka.h) --- */
typedef struct rd_kafka_s rd_kafka_t;
typedef struct rd_kafka_conf_s rd_kafka_conf_t;
typedef struct rd_kafka_error_s rd_kafka_error_t;
typedef struct {
    int err;
    void *rkt;
    int32_t partition;
    void *payload;
    size_t len;
    void *key;
    size_t key_len;
    int64_t offset;
    void *_private;
} rdk_message_t;
enum { V_END, V_TOPIC, V_RKT, V_PARTITION, V_VALUE, V_KEY, V_OPAQUE, V_MSGFLAGS, V_TIMESTAMP,
       V_HEADER, V_HEADERS };
typedef struct {
    int vtype;
    union {
        const char *cstr;
        void *ptr;
        int i;
        struct { void *ptr; size_t size; } mem;
        struct { const char *name; const void *val; ssize_t size; } header;
        char _pad[64];
    } u;
} rdk_vu_t;
#define RDK_PRODUCER 0
#define RDK_CONF_OK 0
#define RDK_MSG_F_COPY 0x2
#define RDK_ERR_QUEUE_FULL (-184)
#define RDK_ERR_FATAL (-150)

typedef void (*dr_cb_t)(rd_kafka_t *, const rdk_message_t *, void *);
typedef void (*error_cb_t)(rd_kafka_t *, int, const char *, void *);
typedef void (*log_cb_t)(const rd_kafka_t *, int, const char *, const char *);

static struct {
    int (*version)(void);
    rd_kafka_conf_t *(*conf_new)(void);
    int (*conf_set)(rd_kafka_conf_t *, const char *, const char *, char *, size_t);
    void (*conf_destroy)(rd_kafka_conf_t *);
    void (*conf_set_dr_msg_cb)(rd_kafka_conf_t *, dr_cb_t);
    void (*conf_set_error_cb)(rd_kafka_conf_t *, error_cb_t);
    void (*conf_set_log_cb)(rd_kafka_conf_t *, log_cb_t);
    void (*conf_set_opaque)(rd_kafka_conf_t *, void *);
    rd_kafka_t *(*new_)(int, rd_kafka_conf_t *, char *, size_t);
    void *(*opaque)(const rd_kafka_t *);
    void (*destroy)(rd_kafka_t *);
    rd_kafka_error_t *(*produceva)(rd_kafka_t *, const rdk_vu_t *, size_t);
    int (*error_code)(const rd_kafka_error_t *);
    const char *(*error_string)(const rd_kafka_error_t *);
    void (*error_destroy)(rd_kafka_error_t *);
    int (*poll)(rd_kafka_t *, int);
    int (*flush)(rd_kafka_t *, int);
    int (*outq_len)(rd_kafka_t *);
    int (*purge)(rd_kafka_t *, int);
    int (*fatal_error)(rd_kafka_t *, char *, size_t);
} rdk;
static int loaded = 0;

/* --- what the callbacks store --- */
#define MAX_EVENTS 256   /* errors and log lines kept between two takes; more are counted */

typedef struct { int64_t token; int32_t partition; int32_t err; } Report;
typedef struct { int level; int code; char *text; } Event;   /* a log line or an error */

typedef struct {
    pthread_mutex_t mu;
    Report *reports;
    size_t n, cap;
    int lost;                        /* a delivery report could not be stored */
    Event errors[MAX_EVENTS], logs[MAX_EVENTS];
    size_t n_errors, n_logs, dropped;
} Sink;

static void
sink_event(Event *events, size_t *n, size_t *dropped, int level, int code, const char *a,
           const char *b)
{
    if (*n >= MAX_EVENTS) {
        (*dropped)++;
        return;
    }
    size_t la = strlen(a), lb = b ? strlen(b) : 0;
    char *text = malloc(la + lb + 3);
    if (text == NULL) {
        (*dropped)++;
        return;
    }
    memcpy(text, a, la);
    if (b) {
        memcpy(text + la, ": ", 2);
        memcpy(text + la + 2, b, lb);
        la += lb + 2;
    }
    text[la] = 0;
    events[*n].level = level;
    events[*n].code = code;
    events[*n].text = text;
    (*n)++;
}

static void
on_delivery(rd_kafka_t *rk, const rdk_message_t *m, void *opaque)
{
    Sink *s = opaque;
    (void)rk;
    pthread_mutex_lock(&s->mu);
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 4096;
        Report *r = realloc(s->reports, cap * sizeof(Report));
        if (r == NULL) {
            s->lost = 1;
            pthread_mutex_unlock(&s->mu);
            return;
        }
        s->reports = r;
        s->cap = cap;
    }
    s->reports[s->n].token = (int64_t)(intptr_t)m->_private;
    s->reports[s->n].partition = m->partition;
    s->reports[s->n].err = m->err;
    s->n++;
    pthread_mutex_unlock(&s->mu);
}

static void
on_error(rd_kafka_t *rk, int err, const char *reason, void *opaque)
{
    Sink *s = opaque;
    (void)rk;
    pthread_mutex_lock(&s->mu);
    sink_event(s->errors, &s->n_errors, &s->dropped, 0, err, reason ? reason : "", NULL);
    pthread_mutex_unlock(&s->mu);
}

static void
on_log(const rd_kafka_t *rk, int level, const char *fac, const char *buf)
{
    Sink *s = rdk.opaque(rk);
    if (s == NULL)
        return;
    pthread_mutex_lock(&s->mu);
    sink_event(s->logs, &s->n_logs, &s->dropped, level, 0, fac ? fac : "", buf ? buf : "");
    pthread_mutex_unlock(&s->mu);
}

static void
sink_free(Sink *s)
{
    for (size_t i = 0; i < s->n_errors; i++)
        free(s->errors[i].text);
    for (size_t i = 0; i < s->n_logs; i++)
        free(s->logs[i].text);
    free(s->reports);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* --- the Producer type --- */
typedef struct {
    PyObject_HEAD
    rd_kafka_t *rk;
    Sink *sink;
    int busy;     /* calls running with the GIL released: close() must not destroy under them */
} Producer;

static PyObject *s_topic, *s_key, *s_value, *s_headers;

static rd_kafka_t *
live(Producer *self)
{
    if (self->rk == NULL)
        PyErr_SetString(PyExc_RuntimeError, "the native DLQ producer is closed");
    return self->rk;
}

static int
Producer_init(Producer *self, PyObject *args, PyObject *kwds)
{
    PyObject *conf, *k, *v;
    Py_ssize_t pos = 0;
    char errstr[512];
    if (kwds != NULL && PyDict_Size(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Producer(config) takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!", &PyDict_Type, &conf))
        return -1;
    if (!loaded) {
        PyErr_SetString(PyExc_RuntimeError, "librdkafka is not loaded (call load() first)");
        return -1;
    }
    if (self->rk != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the native DLQ producer is already initialized");
        return -1;
    }
    rd_kafka_conf_t *c = rdk.conf_new();
    while (PyDict_Next(conf, &pos, &k, &v)) {
        const char *name, *value;
        if (!PyUnicode_Check(k) || !PyUnicode_Check(v)) {
            PyErr_SetString(PyExc_TypeError, "the producer's settings must be str: str");
            rdk.conf_destroy(c);
            return -1;
        }
        if ((name = PyUnicode_AsUTF8AndSize(k, NULL)) == NULL
                || (value = PyUnicode_AsUTF8AndSize(v, NULL)) == NULL) {
            rdk.conf_destroy(c);
            return -1;
        }
        if (rdk.conf_set(c, name, value, errstr, sizeof errstr) != RDK_CONF_OK) {
            PyErr_SetString(PyExc_ValueError, errstr);
            rdk.conf_destroy(c);
            return -1;
        }
    }
    Sink *s = calloc(1, sizeof(Sink));
    if (s == NULL) {
        rdk.conf_destroy(c);
        PyErr_NoMemory();
        return -1;
    }
    pthread_mutex_init(&s->mu, NULL);
    rdk.conf_set_dr_msg_cb(c, on_delivery);
    rdk.conf_set_error_cb(c, on_error);
    rdk.conf_set_log_cb(c, on_log);
    rdk.conf_set_opaque(c, s);
    rd_kafka_t *rk = rdk.new_(RDK_PRODUCER, c, errstr, sizeof errstr);   /* owns c on success */
    if (rk == NULL) {
        rdk.conf_destroy(c);
        sink_free(s);
        PyErr_SetString(PyExc_ValueError, errstr);
        return -1;
    }
    self->rk = rk;
    self->sink = s;
    return 0;
}

static void
shut(Producer *self)
{
    rd_kafka_t *rk = self->rk;
    Sink *s = self->sink;
    self->rk = NULL;
    self->sink = NULL;
    if (rk != NULL) {
        Py_BEGIN_ALLOW_THREADS
        rdk.destroy(rk);     /* joins librdkafka's threads: no callback runs after this */
        Py_END_ALLOW_THREADS
    }
    if (s != NULL)
        sink_free(s);
}

static void
Producer_dealloc(PyObject *o)
{
    PyTypeObject *tp = Py_TYPE(o);
    shut((Producer *)o);
    freefunc tp_free = PyType_GetSlot(tp, Py_tp_free);
    tp_free(o);
    Py_DECREF(tp);
}

/* bytes, None (NULL) or, for header values, str (as UTF-8) */
static int
as_mem(PyObject *o, const char **p, Py_ssize_t *n, int str_ok)
{
    if (o == Py_None) {
        *p = NULL;
        *n = 0;
        return 0;
    }
    if (PyBytes_Check(o)) {
        char *b;
        if (PyBytes_AsStringAndSize(o, &b, n) < 0)
            return -1;
        *p = b;
        return 0;
    }
    if (str_ok && PyUnicode_Check(o)) {
        *p = PyUnicode_AsUTF8AndSize(o, n);
        return *p == NULL ? -1 : 0;
    }
    return 1;
}

/* headers and their (name, value) pairs: tuples (what DlqRecords hold) or lists; -1 else */
static Py_ssize_t
seq_size(PyObject *o)
{
    return PyTuple_Check(o) ? PyTuple_Size(o) : (PyList_Check(o) ? PyList_Size(o) : -1);
}

static PyObject *   /* borrowed, from a tuple or list of at least i + 1 items */
seq_item(PyObject *o, Py_ssize_t i)
{
    return PyTuple_Check(o) ? PyTuple_GetItem(o, i) : PyList_GetItem(o, i);
}

#define FIXED 5     /* topic, value, key, opaque, flags */
#define MAX_HEADERS 1024

/* produce(records, tokens, start) -> (taken, err, reason): records[start:] (DlqRecords: topic,
 * key, value, headers) handed to librdkafka in order, each reported under tokens[i]; stops at
 * the first one refused (err: librdkafka's code, -184 when its queue is full) */
static PyObject *
Producer_produce(Producer *self, PyObject *args)
{
    PyObject *records, *tokens;
    Py_ssize_t start, total, i;
    rd_kafka_t *rk = live(self);
    if (rk == NULL)
        return NULL;
    if (!PyArg_ParseTuple(args, "O!O!n", &PyList_Type, &records, &PyList_Type, &tokens, &start))
        return NULL;
    total = PyList_Size(records);
    if (PyList_Size(tokens) != total) {
        PyErr_SetString(PyExc_ValueError, "produce: one token per record is needed");
        return NULL;
    }
    if (start < 0 || start > total) {
        PyErr_SetString(PyExc_ValueError, "produce: start is out of range");
        return NULL;
    }
    rdk_vu_t fixed[FIXED + 32], *vu = fixed;
    size_t vu_cap = FIXED + 32;
    int err = 0;
    PyObject *reason_o = NULL;
    for (i = start; i < total; i++) {
        /* the record and its token are held: reading them may run Python code (a property,
         * __index__) that changes the lists */
        PyObject *rec = PyList_GetItem(records, i), *tok = PyList_GetItem(tokens, i),
                 *topic = NULL, *key = NULL, *value = NULL, *headers = NULL;
        Py_INCREF(rec);
        Py_INCREF(tok);
        long long token = PyLong_AsLongLong(tok);
        Py_DECREF(tok);
        int bad = 0;
        if (token == -1 && PyErr_Occurred())
            goto fail_rec;
        topic = PyObject_GetAttr(rec, s_topic);
        key = topic ? PyObject_GetAttr(rec, s_key) : NULL;
        value = key ? PyObject_GetAttr(rec, s_value) : NULL;
        headers = value ? PyObject_GetAttr(rec, s_headers) : NULL;
        if (headers == NULL)
            goto fail_rec;
        Py_ssize_t nh = headers == Py_None ? 0 : seq_size(headers);
        if (nh < 0 || nh > MAX_HEADERS || !PyUnicode_Check(topic)) {
            PyErr_Format(PyExc_TypeError, "DLQ record %zd: a str topic and a tuple or list of "
                         "at most %d headers are needed", i, MAX_HEADERS);
            goto fail_rec;
        }
        if ((size_t)nh + FIXED > vu_cap) {
            rdk_vu_t *bigger = vu == fixed ? malloc((nh + FIXED) * sizeof(rdk_vu_t))
                                           : realloc(vu, (nh + FIXED) * sizeof(rdk_vu_t));
            if (bigger == NULL) {
                PyErr_NoMemory();
                goto fail_rec;
            }
            vu = bigger;
            vu_cap = nh + FIXED;
        }
        const char *p;
        Py_ssize_t n;
        vu[0].vtype = V_TOPIC;
        if ((vu[0].u.cstr = PyUnicode_AsUTF8AndSize(topic, NULL)) == NULL)
            goto fail_rec;
        if ((bad = as_mem(value, &p, &n, 0)) != 0)
            goto bad_rec;
        vu[1].vtype = V_VALUE;
        vu[1].u.mem.ptr = (void *)p;
        vu[1].u.mem.size = (size_t)n;
        if ((bad = as_mem(key, &p, &n, 0)) != 0)
            goto bad_rec;
        vu[2].vtype = V_KEY;
        vu[2].u.mem.ptr = (void *)p;
        vu[2].u.mem.size = (size_t)n;
        vu[3].vtype = V_OPAQUE;
        vu[3].u.ptr = (void *)(intptr_t)token;
        vu[4].vtype = V_MSGFLAGS;
        vu[4].u.i = RDK_MSG_F_COPY;
        for (Py_ssize_t h = 0; h < nh; h++) {
            PyObject *pair = seq_item(headers, h), *name;
            if (seq_size(pair) != 2 || !PyUnicode_Check(name = seq_item(pair, 0))) {
                bad = 1;
                goto bad_rec;
            }
            rdk_vu_t *x = &vu[FIXED + h];
            x->vtype = V_HEADER;
            if ((x->u.header.name = PyUnicode_AsUTF8AndSize(name, NULL)) == NULL)
                goto fail_rec;
            if ((bad = as_mem(seq_item(pair, 1), &p, &n, 1)) != 0)
                goto bad_rec;
            x->u.header.val = p;
            x->u.header.size = p == NULL ? 0 : n;
        }
        rd_kafka_error_t *e = rdk.produceva(rk, vu, FIXED + (size_t)nh);
        if (e != NULL) {
            err = rdk.error_code(e);
            reason_o = PyUnicode_FromString(rdk.error_string(e));
            rdk.error_destroy(e);
            if (reason_o == NULL)
                goto fail_rec;
        }
        Py_DECREF(rec); Py_DECREF(topic); Py_DECREF(key); Py_DECREF(value); Py_DECREF(headers);
        if (err)
            break;      /* records[i] was not taken */
        continue;
bad_rec:
        if (bad > 0)
            PyErr_Format(PyExc_TypeError, "DLQ record %zd: keys and values must be bytes or "
                         "None, headers (str, bytes | str | None) pairs", i);
fail_rec:
        Py_DECREF(rec);
        Py_XDECREF(topic); Py_XDECREF(key); Py_XDECREF(value); Py_XDECREF(headers);
        goto fail;
    }
    if (vu != fixed)
        free(vu);
    if (reason_o == NULL && (reason_o = PyUnicode_FromString("")) == NULL)
        return NULL;
    return Py_BuildValue("niN", i - start, err, reason_o);
fail:
    if (vu != fixed)
        free(vu);
    Py_XDECREF(reason_o);
    return NULL;
}

static int
timeout_ms(PyObject *args, int *ms)
{
    double s;
    if (!PyArg_ParseTuple(args, "d", &s))
        return -1;
    *ms = s <= 0 ? 0 : (s > 86400.0 ? 86400000 : (int)(s * 1000.0 + 0.5));
    return 0;
}

/* poll(timeout_s) -> events served; flush(timeout_s) -> records still outstanding. librdkafka
 * serves its events with the GIL released (delivery reports are stored, see take) */
static PyObject *
serve_events(Producer *self, PyObject *args, int flush)
{
    int ms, n;
    rd_kafka_t *rk = live(self);
    if (rk == NULL || timeout_ms(args, &ms) < 0)
        return NULL;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    if (flush) {
        rdk.flush(rk, ms);
        n = rdk.outq_len(rk);
    } else {
        n = rdk.poll(rk, ms);
    }
    Py_END_ALLOW_THREADS
    self->busy--;
    return PyLong_FromLong(n);
}

static PyObject *
Producer_poll(Producer *self, PyObject *args)
{
    return serve_events(self, args, 0);
}

static PyObject *
Producer_flush(Producer *self, PyObject *args)
{
    return serve_events(self, args, 1);
}

static PyObject *
Producer_outstanding(Producer *self, PyObject *unused)
{
    rd_kafka_t *rk = live(self);
    (void)unused;
    return rk == NULL ? NULL : PyLong_FromLong(rdk.outq_len(rk));
}

/* purge(flags): librdkafka's RD_KAFKA_PURGE_F_* (queue 1, in flight 2, non-blocking 4) */
static PyObject *
Producer_purge(Producer *self, PyObject *args)
{
    int flags, err;
    rd_kafka_t *rk = live(self);
    if (rk == NULL || !PyArg_ParseTuple(args, "i", &flags))
        return NULL;
    if (flags & ~7) {
        PyErr_SetString(PyExc_ValueError, "purge: flags are 1, 2 and 4 or'ed");
        return NULL;
    }
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    err = rdk.purge(rk, flags);
    Py_END_ALLOW_THREADS
    self->busy--;
    return PyLong_FromLong(err);
}

/* fatal() -> (code, reason): librdkafka's fatal error, code 0 when there is none */
static PyObject *
Producer_fatal(Producer *self, PyObject *unused)
{
    char errstr[512] = "";
    rd_kafka_t *rk = live(self);
    (void)unused;
    if (rk == NULL)
        return NULL;
    int code = rdk.fatal_error(rk, errstr, sizeof errstr);
    return Py_BuildValue("is", code, errstr);
}

static PyObject *
events_list(Event *events, size_t n)
{
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out != NULL && i < n; i++) {
        PyObject *t = Py_BuildValue("iis", events[i].level, events[i].code, events[i].text);
        if (t == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SetItem(out, (Py_ssize_t)i, t);
    }
    for (size_t i = 0; i < n; i++)
        free(events[i].text);
    return out;
}

/* take() -> (acked tokens, their partitions, [(failed token, code)], [(code, reason)] errors,
 * [(level, facility: line)] log lines, events dropped, lost): what the callbacks stored since
 * the last take */
static PyObject *
Producer_take(Producer *self, PyObject *unused)
{
    (void)unused;
    if (live(self) == NULL)
        return NULL;
    Sink *s = self->sink;
    Report *reports;
    Event errors[MAX_EVENTS], logs[MAX_EVENTS];
    size_t n, n_errors, n_logs, dropped;
    int lost;
    pthread_mutex_lock(&s->mu);
    reports = s->reports; n = s->n;
    s->reports = NULL; s->n = s->cap = 0;
    n_errors = s->n_errors; n_logs = s->n_logs; dropped = s->dropped; lost = s->lost;
    memcpy(errors, s->errors, n_errors * sizeof(Event));
    memcpy(logs, s->logs, n_logs * sizeof(Event));
    s->n_errors = s->n_logs = s->dropped = 0;
    s->lost = 0;
    pthread_mutex_unlock(&s->mu);

    size_t n_ok = 0;
    for (size_t i = 0; i < n; i++)
        n_ok += reports[i].err == 0;
    PyObject *acked = PyList_New((Py_ssize_t)n_ok), *parts = PyList_New((Py_ssize_t)n_ok),
             *failed = PyList_New((Py_ssize_t)(n - n_ok)), *errs = events_list(errors, n_errors),
             *lines = events_list(logs, n_logs);
    PyObject *result = NULL;
    if (acked && parts && failed && errs && lines) {
        size_t a = 0, f = 0;
        for (size_t i = 0; i < n; i++) {
            Report *r = &reports[i];
            if (r->err == 0) {
                PyObject *t = PyLong_FromLongLong(r->token), *p = PyLong_FromLong(r->partition);
                if (t == NULL || p == NULL) {
                    Py_XDECREF(t); Py_XDECREF(p);
                    goto done;
                }
                PyList_SetItem(acked, (Py_ssize_t)a, t);
                PyList_SetItem(parts, (Py_ssize_t)a++, p);
            } else {
                PyObject *t = Py_BuildValue("Li", (long long)r->token, (int)r->err);
                if (t == NULL)
                    goto done;
                PyList_SetItem(failed, (Py_ssize_t)f++, t);
            }
        }
        result = Py_BuildValue("OOOOOnO", acked, parts, failed, errs, lines, (Py_ssize_t)dropped,
                               lost ? Py_True : Py_False);
    }
done:
    free(reports);
    Py_XDECREF(acked); Py_XDECREF(parts); Py_XDECREF(failed); Py_XDECREF(errs);
    Py_XDECREF(lines);
    return result;
}

static PyObject *
Producer_close(Producer *self, PyObject *unused)
{
    (void)unused;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the native DLQ producer is polled, flushed or "
                        "purged by another thread: close it after that call returns");
        return NULL;
    }
    shut(self);
    Py_RETURN_NONE;
}

static PyMethodDef Producer_methods[] = {
    {"produce", (PyCFunction)Producer_produce, METH_VARARGS, NULL},
    {"poll", (PyCFunction)Producer_poll, METH_VARARGS, NULL},
    {"flush", (PyCFunction)Producer_flush, METH_VARARGS, NULL},
    {"outstanding", (PyCFunction)Producer_outstanding, METH_NOARGS, NULL},
    {"purge", (PyCFunction)Producer_purge, METH_VARARGS, NULL},
    {"fatal", (PyCFunction)Producer_fatal, METH_NOARGS, NULL},
    {"take", (PyCFunction)Producer_take, METH_NOARGS, NULL},
    {"close", (PyCFunction)Producer_close, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Producer_slots[] = {
    {Py_tp_init, Producer_init},
    {Py_tp_dealloc, Producer_dealloc},
    {Py_tp_methods, Producer_methods},
    {Py_tp_doc, "Producer(config: dict[str, str]): a librdkafka producer for DLQ records."},
    {0, NULL},
};

static PyType_Spec Producer_spec = {
    "spillway.sidecar.dlq._rdkafka.Producer", sizeof(Producer), 0,
    Py_TPFLAGS_DEFAULT, Producer_slots,
};

/* load(path) -> librdkafka's version (an int, 0xMMmmrrxx): open it and find what is used */
static PyObject *
load(PyObject *mod, PyObject *args)
{
    const char *path;
    (void)mod;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    if (loaded)
        return PyLong_FromLong(rdk.version());
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        PyErr_Format(PyExc_OSError, "cannot open librdkafka: %s", dlerror());
        return NULL;
    }
#define SYM(field, name) \
    if ((*(void **)&rdk.field = dlsym(h, name)) == NULL) { \
        PyErr_Format(PyExc_OSError, "%s lacks %s (librdkafka >= 1.4 is needed)", path, name); \
        dlclose(h); \
        return NULL; \
    }
    SYM(version, "rd_kafka_version")
    SYM(conf_new, "rd_kafka_conf_new")
    SYM(conf_set, "rd_kafka_conf_set")
    SYM(conf_destroy, "rd_kafka_conf_destroy")
    SYM(conf_set_dr_msg_cb, "rd_kafka_conf_set_dr_msg_cb")
    SYM(conf_set_error_cb, "rd_kafka_conf_set_error_cb")
    SYM(conf_set_log_cb, "rd_kafka_conf_set_log_cb")
    SYM(conf_set_opaque, "rd_kafka_conf_set_opaque")
    SYM(new_, "rd_kafka_new")
    SYM(opaque, "rd_kafka_opaque")
    SYM(destroy, "rd_kafka_destroy")
    SYM(produceva, "rd_kafka_produceva")
    SYM(error_code, "rd_kafka_error_code")
    SYM(error_string, "rd_kafka_error_string")
    SYM(error_destroy, "rd_kafka_error_destroy")
    SYM(poll, "rd_kafka_poll")
    SYM(flush, "rd_kafka_flush")
    SYM(outq_len, "rd_kafka_outq_len")
    SYM(purge, "rd_kafka_purge")
    SYM(fatal_error, "rd_kafka_fatal_error")
#undef SYM
    if (rdk.version() < 0x01040000) {
        PyErr_Format(PyExc_OSError, "%s is librdkafka %x: 1.4 or later is needed", path,
                     rdk.version());
        dlclose(h);
        return NULL;
    }
    loaded = 1;      /* never closed: producers made from it may live until exit */
    return PyLong_FromLong(rdk.version());
}

static PyMethodDef module_methods[] = {
    {"load", load, METH_VARARGS, "load(path) -> version: open librdkafka"},
    {NULL, NULL, 0, NULL},
};

static int
exec_module(PyObject *m)
{
    if ((s_topic = PyUnicode_InternFromString("topic")) == NULL
            || (s_key = PyUnicode_InternFromString("key")) == NULL
            || (s_value = PyUnicode_InternFromString("value")) == NULL
            || (s_headers = PyUnicode_InternFromString("headers")) == NULL)
        return -1;
    PyObject *tp = PyType_FromSpec(&Producer_spec);
    if (tp == NULL)
        return -1;
    if (PyModule_AddObject(m, "Producer", tp) < 0) {
        Py_DECREF(tp);
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_rdkafka",
    "A DLQ producer over librdkafka with no Python work per record (dlq/native.py).",
    0, module_methods, module_slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__rdkafka(void)
{
    return PyModuleDef_Init(&module);
}
