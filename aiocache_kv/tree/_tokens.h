/* Token-list helpers the tree's C walks share (included by _keycmp.c and _pathwalk.c):
 * reading small exact ints inline, a common prefix that runs no Python code, a page's key.
 * Everything here is static inline: each extension gets its own copy.
 */
#ifndef AIOCACHE_KV_TOKENS_H
#define AIOCACHE_KV_TOKENS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* whether v is an exact int small enough to read inline (one digit), and its value */
static inline int small_int(PyObject *v, Py_ssize_t *out)
{
    if (!PyLong_CheckExact(v)) {
        return 0;
    }
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)v)) {
        return 0;
    }
    *out = PyUnstable_Long_CompactValue((PyLongObject *)v);
    return 1;
#else
    Py_ssize_t size = Py_SIZE(v);
    if (size < -1 || size > 1) {
        return 0;
    }
    *out = size * (Py_ssize_t)((PyLongObject *)v)->ob_digit[0];
    return 1;
#endif
}

#define DESCEND_FALLBACK (-2)

/* keycmp.int_common_len(key, tokens, pos, limit) where no comparison can run Python code:
 * items that are the same object, or exact ints, are compared here, a token that is not an
 * int ends the run; DESCEND_FALLBACK where another pair (an int subclass) would need a
 * comparison call, -1 with an exception set */
static inline Py_ssize_t exact_common_len(PyObject *key, PyObject *tokens, Py_ssize_t pos,
                                          Py_ssize_t limit)
{
    Py_ssize_t n = limit;
    if (n > PyList_GET_SIZE(key)) {
        n = PyList_GET_SIZE(key);
    }
    if (n > PyList_GET_SIZE(tokens) - pos) {
        n = PyList_GET_SIZE(tokens) - pos;
    }
    PyObject **ka = ((PyListObject *)key)->ob_item;
    PyObject **tb = ((PyListObject *)tokens)->ob_item + pos;
    Py_ssize_t i = 0;
    /* the same objects (a shared prefix): 32 pointers per memcmp */
    while (i + 32 <= n && memcmp(ka + i, tb + i, 32 * sizeof(PyObject *)) == 0) {
        i += 32;
    }
    for (; i < n; i++) {
        PyObject *a = ka[i], *b = tb[i];
        if (a == b) {
            continue;
        }
        Py_ssize_t va, vb;
        if (small_int(a, &va) && small_int(b, &vb)) {
            if (va != vb) {
                break;
            }
            continue;
        }
        if (!PyLong_Check(b)) {
            break;
        }
        if (!PyLong_CheckExact(a) || !PyLong_CheckExact(b)) {
            return DESCEND_FALLBACK;
        }
        int eq = PyObject_RichCompareBool(a, b, Py_EQ); /* two exact ints: no code runs */
        if (eq < 0) {
            return -1;
        }
        if (!eq) {
            break;
        }
    }
    return i;
}

/* tuple(items[:p]) when those are exact ints (new reference); NULL with no exception set
 * where one is not (hashing it could run code), NULL with an exception on failure */
static inline PyObject *page_tuple(PyObject **items, Py_ssize_t p)
{
    for (Py_ssize_t i = 0; i < p; i++) {
        if (!PyLong_CheckExact(items[i])) {
            return NULL;
        }
    }
    PyObject *t = PyTuple_New(p);
    if (t == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < p; i++) {
        Py_INCREF(items[i]);
        PyTuple_SET_ITEM(t, i, items[i]);
    }
    return t;
}

/* the child key of the page at pos (new reference): the token at page size 1, else a tuple
 * of the page; NULL as page_tuple gives it, or where the list holds no whole page there */
static inline PyObject *child_key(PyObject *tokens, Py_ssize_t pos, Py_ssize_t p)
{
    if (pos + p > PyList_GET_SIZE(tokens)) {
        return NULL;
    }
    PyObject **items = ((PyListObject *)tokens)->ob_item + pos;
    if (p > 1) {
        return page_tuple(items, p);
    }
    if (!PyLong_CheckExact(items[0])) {
        return NULL;
    }
    Py_INCREF(items[0]);
    return items[0];
}

/* whether tokens[from:] are all exact ints in [0, 2**30) (one digit, not negative), the
 * tokens a new key may take with no further check; 0 at any other item (which may still be
 * a valid token: the Python check decides).  Before 3.12 an int's size is its sign times
 * its digits, so 0 or 1: four items at a time, one branch */
static inline int plain_tokens(PyObject *tokens, Py_ssize_t from)
{
    PyObject **items = ((PyListObject *)tokens)->ob_item;
    const Py_ssize_t n = PyList_GET_SIZE(tokens);
    Py_ssize_t i = from;
#if PY_VERSION_HEX < 0x030C0000
    for (; i + 4 <= n; i += 4) {
        PyObject *a = items[i], *b = items[i + 1], *c = items[i + 2], *d = items[i + 3];
        if ((Py_TYPE(a) != &PyLong_Type) | (Py_TYPE(b) != &PyLong_Type) |
            (Py_TYPE(c) != &PyLong_Type) | (Py_TYPE(d) != &PyLong_Type) |
            ((size_t)Py_SIZE(a) > 1) | ((size_t)Py_SIZE(b) > 1) | ((size_t)Py_SIZE(c) > 1) |
            ((size_t)Py_SIZE(d) > 1)) {
            return 0;
        }
    }
#endif
    for (; i < n; i++) {
        Py_ssize_t v;
        if (!small_int(items[i], &v) || v < 0) {
            return 0;
        }
    }
    return 1;
}

#endif
