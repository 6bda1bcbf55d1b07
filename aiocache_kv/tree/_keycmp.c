/* Common prefixes of token lists in C: the optional fast path of aiocache_kv/tree/keycmp.py.
 *
 * The tree compares a node's key with the tokens of a request on every match and insert.  In
 * Python that is a slice (a new list, one reference per token) and a list comparison; here it
 * is one pass over both lists in place.  Equal items are most often the same int objects (a
 * shared prefix), which the identity check settles without a comparison call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* common_len(key, tokens, pos, limit) -> how many leading items of key[:limit] equal
 * tokens[pos:pos + limit], in order (limit is clipped to what both lists hold). */
static PyObject *common_len(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "common_len(key, tokens, pos, limit)");
        return NULL;
    }
    PyObject *key = args[0], *tokens = args[1];
    if (!PyList_CheckExact(key) || !PyList_CheckExact(tokens)) {
        PyErr_SetString(PyExc_TypeError, "common_len needs two lists");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[2]);
    if (pos == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[3]);
    if (limit == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (pos < 0 || limit < 0) {
        PyErr_SetString(PyExc_ValueError, "pos and limit must be >= 0");
        return NULL;
    }
    Py_ssize_t i = 0;
    for (;; i++) {
        /* sizes read again each round: a comparison below may run Python code */
        if (i >= limit || i >= PyList_GET_SIZE(key) || pos + i >= PyList_GET_SIZE(tokens)) {
            break;
        }
        PyObject *a = PyList_GET_ITEM(key, i);
        PyObject *b = PyList_GET_ITEM(tokens, pos + i);
        if (a == b) {
            continue;
        }
        Py_INCREF(a);
        Py_INCREF(b);
        int eq = PyObject_RichCompareBool(a, b, Py_EQ);
        Py_DECREF(a);
        Py_DECREF(b);
        if (eq < 0) {
            return NULL;
        }
        if (!eq) {
            break;
        }
    }
    return PyLong_FromSsize_t(i);
}

static PyMethodDef methods[] = {
    {"common_len", (PyCFunction)(void (*)(void))common_len, METH_FASTCALL,
     "common_len(key, tokens, pos, limit)\n--\n\n"
     "How many leading items of ``key[:limit]`` equal ``tokens[pos:pos + limit]``."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aiocache_kv.tree._keycmp",
    "C fast path of aiocache_kv.tree.keycmp (optional; the Python path computes the same).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__keycmp(void) { return PyModule_Create(&module); }
