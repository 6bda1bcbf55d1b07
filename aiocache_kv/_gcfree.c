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
 * keep(lst) -> lst: the same, returning the list (gcfree.keep).
 * untrack_ints(lst) -> bool: untrack ``lst`` if it is an exact list of exact ints or exact
 * bytes (page hashes; bytes hold no references either); whether it is untracked now.  The
 * caller must never put anything but ints or bytes into it afterwards.  A list untracked
 * already is not scanned again: only this module, ``_fastcheck.checked_key`` and
 * ``tree/_pathwalk.c``'s grow (which check the same) untrack lists; CPython never does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* untrack arg under the rule above; whether it is untracked now */
static int untrack(PyObject *arg)
{
    if (!PyList_CheckExact(arg)) {
        return 0;
    }
    if (!PyObject_GC_IsTracked(arg)) {
        return 1;
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(arg, i);
        if (!PyLong_CheckExact(item) && !PyBytes_CheckExact(item)) {
            return 0;
        }
    }
    PyObject_GC_UnTrack(arg);
    return 1;
}

static PyObject *untrack_ints(PyObject *self, PyObject *arg)
{
    (void)self;
    return PyBool_FromLong(untrack(arg));
}

/* keep(lst) -> lst, untracked where untrack_ints would (gcfree.keep, in one C call) */
static PyObject *keep(PyObject *self, PyObject *arg)
{
    (void)self;
    untrack(arg);
    Py_INCREF(arg);
    return arg;
}

static PyMethodDef methods[] = {
    {"untrack_ints", untrack_ints, METH_O, "Untrack a list of ints from the cyclic GC."},
    {"keep", keep, METH_O, "The list, untracked where untrack_ints would untrack it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_gcfree", "Int lists out of the cyclic GC's view.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__gcfree(void) { return PyModule_Create(&module); }
