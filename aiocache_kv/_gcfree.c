/* Lists of plain ints the tree keeps for good, out of the cyclic garbage collector's view.
 *
 * A list is tracked by the collector whatever it holds, and every collection that sees it
 * visits every element.  The tree keeps each cached token run as a list (node keys) and its
 * page hashes as a list, so with millions of cached tokens a young collection after a large
 * insert, and every full collection, walk all of them: measured on an H100 machine, 7-12 ms
 * pauses of the event loop while 8 GiB was written through.  A list holding only exact ints
 * can never be part of a reference cycle, so it needs no tracking; reference counting still
 * frees it.  CPython untracks such tuples and dicts by itself, but never lists.
 *
 * untrack_ints(lst) -> bool: untrack ``lst`` if it is an exact list of exact ints or exact
 * bytes (page hashes; bytes hold no references either); whether it is untracked now.  The
 * caller must never put anything but ints or bytes into it afterwards.  A list untracked
 * already is not scanned again: only this module and ``_fastcheck.checked_key`` (which
 * checks the same) untrack lists; CPython never does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *untrack_ints(PyObject *self, PyObject *arg)
{
    (void)self;
    if (!PyList_CheckExact(arg)) {
        Py_RETURN_FALSE;
    }
    if (!PyObject_GC_IsTracked(arg)) {
        Py_RETURN_TRUE;
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(arg, i);
        if (!PyLong_CheckExact(item) && !PyBytes_CheckExact(item)) {
            Py_RETURN_FALSE;
        }
    }
    PyObject_GC_UnTrack(arg);
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"untrack_ints", untrack_ints, METH_O, "Untrack a list of ints from the cyclic GC."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_gcfree", "Int lists out of the cyclic GC's view.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__gcfree(void) { return PyModule_Create(&module); }
