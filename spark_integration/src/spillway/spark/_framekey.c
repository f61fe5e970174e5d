/* The frame signature of a failed record's traceback (`spillway.client._stack.frame_key`) in C.
 * Optional: the client's Python version is used when this module was not built, or with
 * SPILLWAY_NO_EXTENSIONS=framekey. `spillway.spark` hands it to the client (`columns.
 * use_frame_key`) when its first wrapper module is imported.
 *
 * Every failed record's exception is looked up by (class, message, frame signature) to find the
 * description an alike failure already has (`columns._exception_kind`); the signature is each
 * frame's code object id and instruction offset, read from the traceback's linked frames. In
 * Python that walk costs ~0.8 us a record (a few attribute reads and appends per frame); here
 * ~0.2, and one tuple instead of a list and a tuple.
 *
 * frame_key(tb) -> (id(code_0), tb_lasti_0, id(code_1), tb_lasti_1, ...), the same tuple as the
 * Python version's for any chain of objects with tb_frame, tb_lasti and tb_next (None ends it).
 *
 * Built against the stable ABI of Python 3.10 (Py_LIMITED_API), as `_udfcall.c`.
 */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *s_tb_frame, *s_tb_lasti, *s_tb_next, *s_f_code;

/* Append `item`, a new reference or NULL (an error already set), and drop the reference. */
static int
append_new(PyObject *list, PyObject *item)
{
    if (item == NULL)
        return -1;
    int bad = PyList_Append(list, item);
    Py_DECREF(item);
    return bad;
}

static PyObject *
frame_key(PyObject *module, PyObject *tb)
{
    PyObject *items = PyList_New(0);
    if (items == NULL)
        return NULL;
    Py_INCREF(tb);
    while (tb != Py_None) {
        PyObject *frame = PyObject_GetAttr(tb, s_tb_frame);
        if (frame == NULL)
            goto fail;
        /* frame.f_code: a frame's code object (PyFrame_GetCode would need a frame's struct) */
        PyObject *code = PyObject_GetAttr(frame, s_f_code);
        Py_DECREF(frame);
        if (code == NULL)
            goto fail;
        PyObject *id = PyLong_FromVoidPtr(code);   /* what id() gives */
        Py_DECREF(code);
        if (append_new(items, id) < 0 ||
                append_new(items, PyObject_GetAttr(tb, s_tb_lasti)) < 0)
            goto fail;
        PyObject *next = PyObject_GetAttr(tb, s_tb_next);
        if (next == NULL)
            goto fail;
        Py_DECREF(tb);
        tb = next;
    }
    Py_DECREF(tb);
    PyObject *out = PyList_AsTuple(items);
    Py_DECREF(items);
    return out;
fail:
    Py_DECREF(tb);
    Py_DECREF(items);
    return NULL;
}

static PyMethodDef methods[] = {
    {"frame_key", frame_key, METH_O,
     "frame_key(tb) -> tuple: each frame's id(code) and tb_lasti, in order."},
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
