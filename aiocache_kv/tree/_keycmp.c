/* Common prefixes of token lists in C: the optional fast path of aiocache_kv/tree/keycmp.py.
 *
 * The tree compares a node's key with the tokens of a request on every match and insert.  In
 * Python that is a slice (a new list, one reference per token) and a list comparison; here it
 * is one pass over both lists in place.  Equal items are most often the same int objects (a
 * shared prefix), which the identity check settles without a comparison call; two distinct
 * small exact ints (token ids a tokenizer made afresh) are compared by value inline.  Only
 * other objects take a comparison call, which may run Python code: the lists are read again
 * after it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "_tokens.h"

/* pointers compared per memcmp call while the lists hold the same objects */
#define CHUNK 32

/* how many items the loop may read: limit clipped to what both lists hold now */
static inline Py_ssize_t bound(PyObject *key, PyObject *tokens, Py_ssize_t pos, Py_ssize_t limit)
{
    Py_ssize_t n = limit;
    if (n > PyList_GET_SIZE(key)) {
        n = PyList_GET_SIZE(key);
    }
    if (n > PyList_GET_SIZE(tokens) - pos) {
        n = PyList_GET_SIZE(tokens) - pos;
    }
    return n;
}

/* how many leading items of key[:limit] equal tokens[pos:pos + limit], in order (limit is
 * clipped to what both lists hold); with ints_only, a token that is not an int never equals
 * (so every token counted is an int equal to a key item) */
static PyObject *compare(PyObject *const *args, Py_ssize_t nargs, int ints_only)
{
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
    Py_ssize_t n = bound(key, tokens, pos, limit);
    while (i < n) {
        PyObject **ka = ((PyListObject *)key)->ob_item;
        PyObject **tb = ((PyListObject *)tokens)->ob_item + pos;
        /* the same objects (a shared prefix): whole chunks of pointers by memcmp, which
         * compares several per instruction, then the chunk that differs item by item */
        while (i + CHUNK <= n && memcmp(ka + i, tb + i, CHUNK * sizeof(PyObject *)) == 0) {
            i += CHUNK;
        }
        while (i < n && ka[i] == tb[i]) {
            i++;
        }
        if (i >= n) {
            break;
        }
        PyObject *a = ka[i];
        PyObject *b = tb[i];
        Py_ssize_t va, vb;
        if (small_int(a, &va) && small_int(b, &vb)) {
            if (va != vb) {
                break;
            }
            i++;
            continue;
        }
        if (ints_only && !PyLong_Check(b)) {
            break;
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
        i++;
        n = bound(key, tokens, pos, limit); /* the comparison may have run Python code */
    }
    return PyLong_FromSsize_t(i);
}

/* common_len(key, tokens, pos, limit) -> how many leading items of key[:limit] equal
 * tokens[pos:pos + limit], in order (limit is clipped to what both lists hold). */
static PyObject *common_len(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return compare(args, nargs, 0);
}

/* int_common_len(key, tokens, pos, limit) -> common_len's count, where a token that is not an
 * int never equals: every token it counts is an int equal to a key item. */
static PyObject *int_common_len(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return compare(args, nargs, 1);
}

/* page_key(tokens, pos, page_size) -> tuple(tokens[pos:pos + page_size]) when those are
 * page_size exact ints, else None (too few, or another object: hashing it could run code) */
static PyObject *page_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "page_key(tokens: list, pos, page_size)");
        return NULL;
    }
    PyObject *tokens = args[0];
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t p = PyLong_AsSsize_t(args[2]);
    if (p == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (pos < 0 || p < 1) {
        PyErr_SetString(PyExc_ValueError, "pos must be >= 0 and page_size >= 1");
        return NULL;
    }
    if (PyList_GET_SIZE(tokens) - pos < p) {
        Py_RETURN_NONE;
    }
    PyObject *out = page_tuple(((PyListObject *)tokens)->ob_item + pos, p);
    if (out == NULL && !PyErr_Occurred()) {
        Py_RETURN_NONE;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"common_len", (PyCFunction)(void (*)(void))common_len, METH_FASTCALL,
     "common_len(key, tokens, pos, limit)\n--\n\n"
     "How many leading items of ``key[:limit]`` equal ``tokens[pos:pos + limit]``."},
    {"int_common_len", (PyCFunction)(void (*)(void))int_common_len, METH_FASTCALL,
     "int_common_len(key, tokens, pos, limit)\n--\n\n"
     "common_len, where a token that is not an int never equals."},
    {"page_key", (PyCFunction)(void (*)(void))page_key, METH_FASTCALL,
     "page_key(tokens, pos, page_size)\n--\n\n"
     "The tuple of a page's tokens if they are exact ints, else None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aiocache_kv.tree._keycmp",
    "C fast path of aiocache_kv.tree.keycmp (optional; the Python path computes the same).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__keycmp(void) { return PyModule_Create(&module); }
