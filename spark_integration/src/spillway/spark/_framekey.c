/* The frame signature of a failed record's traceback (`spillway.client._stack.frame_key`) in C.
 * Optional: the client's Python version is used when this module was not built, or with
 * SPILLWAY_NO_EXTENSIONS=framekey. `spillway.spark` hands it to the client (`columns.
 * use_frame_key`) when its first wrapper module is imported.
 *
 * Every failed record's exception is looked up by (class, message, frame signature) to find the
 * description an alike failure already has (`columns._exception_kind`); the signature is each
 * frame's code object id and instruction offset, read from the traceback's linked frames. In
 * Python that walk costs ~0.7 us a record (a few attribute reads and appends per frame); here
 * the walk fills a buffer and the key is one bytes object, not a tuple of ints: a lookup then
 * hashes and compares bytes, not one int object per value (~0.4 us less per failed record in
 * all, target 4's check).
 *
 * frame_key(tb) -> bytes: (id(code_0), tb_lasti_0, id(code_1), tb_lasti_1, ...) packed as native
 * Py_intptr_t values, for any chain of objects with tb_frame, tb_lasti (an int) and tb_next
 * (None ends it). Equal exactly when the Python version's tuples are equal.
 *
 * Built against the stable ABI of Python 3.10 (Py_LIMITED_API), as `_udfcall.c`.
 */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *s_tb_frame, *s_tb_lasti, *s_tb_next, *s_f_code;

/* One frame of the signature: its code object's address (what id() gives: identity only, no
 * reference kept; the cache entry a signature matches holds its code objects) and tb_lasti. */
typedef struct {
    Py_intptr_t code;
    Py_intptr_t lasti;
} Frame;

#define LOCAL_FRAMES 32

static PyObject *
frame_key(PyObject *module, PyObject *tb)
{
    Frame local[LOCAL_FRAMES], *frames = local;
    Py_ssize_t n = 0, cap = LOCAL_FRAMES;
    PyObject *out = NULL;
    Py_INCREF(tb);
    while (tb != Py_None) {
        if (n == cap) {
            Frame *more = PyMem_Malloc(2 * cap * sizeof(Frame));
            if (more == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            memcpy(more, frames, n * sizeof(Frame));
            if (frames != local)
                PyMem_Free(frames);
            frames = more;
            cap *= 2;
        }
        PyObject *frame = PyObject_GetAttr(tb, s_tb_frame);
        if (frame == NULL)
            goto done;
        /* frame.f_code: a frame's code object (PyFrame_GetCode would need a frame's struct) */
        PyObject *code = PyObject_GetAttr(frame, s_f_code);
        Py_DECREF(frame);
        if (code == NULL)
            goto done;
        frames[n].code = (Py_intptr_t)code;
        Py_DECREF(code);
        PyObject *lasti = PyObject_GetAttr(tb, s_tb_lasti);
        if (lasti == NULL)
            goto done;
        frames[n].lasti = (Py_intptr_t)PyLong_AsSsize_t(lasti);
        Py_DECREF(lasti);
        if (frames[n].lasti == -1 && PyErr_Occurred())
            goto done;
        n++;
        PyObject *next = PyObject_GetAttr(tb, s_tb_next);
        if (next == NULL)
            goto done;
        Py_DECREF(tb);
        tb = next;
    }
    out = PyBytes_FromStringAndSize((const char *)frames, n * (Py_ssize_t)sizeof(Frame));
done:
    Py_DECREF(tb);
    if (frames != local)
        PyMem_Free(frames);
    return out;
}

static PyMethodDef methods[] = {
    {"frame_key", frame_key, METH_O,
     "frame_key(tb) -> bytes: each frame's id(code) and tb_lasti, in order, packed."},
    {NULL, NULL, 0, NULL},
};

static int
exec_module(PyObject *module)
{
    s_tb_frame = PyUnicode_InternFromString("tb_frame");
    s_tb_lasti = PyUnicode_InternFromString("tb_lasti");
    s_tb_next = PyUnicode_InternFromString("tb_next");
    s_f_code = PyUnicode_InternFromString("f_code");
    if (!s_tb_frame || !s_tb_lasti || !s_tb_next || !s_f_code)
        return -1;
    return 0;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_framekey", NULL, 0, methods, slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__framekey(void)
{
    return PyModuleDef_Init(&module_def);
}
