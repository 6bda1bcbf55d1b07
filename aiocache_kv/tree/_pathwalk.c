/* The walks along a node's path that every request makes, in C: the optional fast path of
 * aiocache_kv/tree/pathwalk.py (which holds the Python reference of each function and says
 * what it returns).
 *
 * A match and an insert plan walk down from a root (descend: child lookups and key comparisons
 * of exact ints only, so no token's code runs; anything else is handed back to the Python
 * walk).  A match pins and stamps its path, a release unpins it, and every handle reads its
 * device/host run lengths from it: a few nodes each, but a dozen attribute reads and writes
 * per node, which in Python cost more than the rest of the step's bookkeeping.  Here a node's
 * slots are read and written at the offsets its class's member descriptors give (read once, by
 * bind(), from the class itself, and checked to be plain object slots), so no attribute lookup
 * runs.  Nothing here calls back into Python code: the values written are ints (the pin counts
 * and the clock the caller passes), whose release runs no code, and the tier states are
 * compared by identity with the members bind() was given.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "_tokens.h"

static PyTypeObject *node_type = NULL;
static PyObject *ABSENT = NULL, *FILLING = NULL, *RESIDENT = NULL;
static Py_ssize_t off_parent, off_pins, off_key, off_device, off_host, off_storage,
    off_host_pins, off_last_access, off_corrupt, off_children, off_n_dev_children;

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

/* the offset of the object slot ``name`` of type t, or -1 with an exception set */
static Py_ssize_t slot_offset(PyObject *t, const char *name)
{
    PyObject *d = PyObject_GetAttrString(t, name);
    if (d == NULL) {
        return -1;
    }
    Py_ssize_t off = -1;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READONLY)) {
            off = m->offset;
        }
    }
    Py_DECREF(d);
    if (off < 0) {
        PyErr_Format(PyExc_TypeError, "%s is not a writable __slots__ member", name);
    }
    return off;
}

/* bind(node_type, absent, filling, resident): the node class and the tier states */
static PyObject *bind(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *t, *a, *f, *r;
    if (!PyArg_ParseTuple(args, "O!OOO", &PyType_Type, &t, &a, &f, &r)) {
        return NULL;
    }
    Py_ssize_t o[11];
    const char *names[11] = {"parent",    "pins",        "key",     "device",
                             "host",      "storage",     "host_pins", "last_access",
                             "corrupt",   "children",    "n_dev_children"};
    for (int i = 0; i < 11; i++) {
        o[i] = slot_offset(t, names[i]);
        if (o[i] < 0) {
            return NULL;
        }
    }
    off_parent = o[0];
    off_pins = o[1];
    off_key = o[2];
    off_device = o[3];
    off_host = o[4];
    off_storage = o[5];
    off_host_pins = o[6];
    off_last_access = o[7];
    off_corrupt = o[8];
    off_children = o[9];
    off_n_dev_children = o[10];
    Py_INCREF(t);
    Py_INCREF(a);
    Py_INCREF(f);
    Py_INCREF(r);
    Py_XSETREF(node_type, (PyTypeObject *)t);
    Py_XSETREF(ABSENT, a);
    Py_XSETREF(FILLING, f);
    Py_XSETREF(RESIDENT, r);
    Py_RETURN_NONE;
}

/* a slot's value (borrowed), or NULL with AttributeError when it is unset */
static inline PyObject *get(PyObject *node, Py_ssize_t off, const char *name)
{
    PyObject *v = SLOT(node, off);
    if (v == NULL) {
        PyErr_Format(PyExc_AttributeError, "node has no %s", name);
    }
    return v;
}

/* an int slot's value; -1 with an exception set when it is not an int */
static inline long get_long(PyObject *node, Py_ssize_t off, const char *name)
{
    PyObject *v = get(node, off, name);
    if (v == NULL) {
        return -1;
    }
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "node.%s is not an int", name);
        return -1;
    }
    return PyLong_AsLong(v);
}

/* store a new int in a slot (the old value is an int: releasing it runs no code) */
static inline int set_long(PyObject *node, Py_ssize_t off, long value)
{
    PyObject *v = PyLong_FromLong(value);
    if (v == NULL) {
        return -1;
    }
    Py_XSETREF(SLOT(node, off), v);
    return 0;
}

/* the node's parent (borrowed): a node, Py_None at a root, NULL with an exception */
static inline PyObject *parent_of(PyObject *node)
{
    PyObject *p = get(node, off_parent, "parent");
    if (p != NULL && p != Py_None && !PyObject_TypeCheck(p, node_type)) {
        PyErr_SetString(PyExc_TypeError, "node.parent is not a node");
        return NULL;
    }
    return p;
}

/* pages of the node's key */
static inline Py_ssize_t pages_of(PyObject *node, Py_ssize_t page_size)
{
    PyObject *key = get(node, off_key, "key");
    if (key == NULL) {
        return -1;
    }
    if (!PyList_CheckExact(key)) {
        PyErr_SetString(PyExc_TypeError, "node.key is not a list");
        return -1;
    }
    return PyList_GET_SIZE(key) / page_size;
}

/* the pages a pin change of ``node`` moves between evictable and protected, per tier
 * (pathwalk.protect_delta); -1 with an exception set */
static int protect_delta(PyObject *node, Py_ssize_t page_size, Py_ssize_t *dev, Py_ssize_t *host)
{
    PyObject *d = get(node, off_device, "device");
    PyObject *h = get(node, off_host, "host");
    PyObject *s = get(node, off_storage, "storage");
    if (d == NULL || h == NULL || s == NULL) {
        return -1;
    }
    if (d == FILLING || h == FILLING) {
        return 0;
    }
    Py_ssize_t k = pages_of(node, page_size);
    if (k < 0) {
        return -1;
    }
    if (d != ABSENT) {
        *dev += k;
    }
    if (h != ABSENT && s != FILLING) {
        long hp = get_long(node, off_host_pins, "host_pins");
        if (hp == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (hp == 0) {
            *host += k;
        }
    }
    return 0;
}

static int ready(PyObject *node, Py_ssize_t page_size)
{
    if (node_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "pathwalk: bind() was not called");
        return 0;
    }
    if (!PyObject_TypeCheck(node, node_type)) {
        PyErr_SetString(PyExc_TypeError, "expected a node");
        return 0;
    }
    if (page_size < 1) {
        PyErr_SetString(PyExc_ValueError, "page_size must be >= 1");
        return 0;
    }
    return 1;
}

/* the node and page size of a walk's arguments (nargs of them, the node first and the page
 * size second), or NULL with an exception set */
static PyObject *walk_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
                           const char *usage, Py_ssize_t *p)
{
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    *p = PyLong_AsSsize_t(args[1]);
    if ((*p == -1 && PyErr_Occurred()) || !ready(args[0], *p)) {
        return NULL;
    }
    return args[0];
}

/* one step up a path: 1 with the node's parent and pin count, 0 at the root (the walk
 * ends), -1 with an exception set */
static int step(PyObject *node, PyObject **parent, long *pins)
{
    PyObject *up = parent_of(node);
    if (up == NULL) {
        return -1;
    }
    if (up == Py_None) {
        return 0;
    }
    *pins = get_long(node, off_pins, "pins");
    if (*pins == -1 && PyErr_Occurred()) {
        return -1;
    }
    *parent = up;
    return 1;
}

/* (a, b) of two sizes, or NULL with an exception set */
static PyObject *pair(Py_ssize_t a, Py_ssize_t b)
{
    PyObject *x = PyLong_FromSsize_t(a), *y = PyLong_FromSsize_t(b);
    PyObject *out = x && y ? PyTuple_Pack(2, x, y) : NULL;
    Py_XDECREF(x);
    Py_XDECREF(y);
    return out;
}

/* (a, b, obj) with a new reference to obj taken, or NULL with an exception set */
static PyObject *pair_and(Py_ssize_t a, Py_ssize_t b, PyObject *obj)
{
    PyObject *x = PyLong_FromSsize_t(a), *y = PyLong_FromSsize_t(b);
    PyObject *out = x && y ? PyTuple_Pack(3, x, y, obj) : NULL;
    Py_XDECREF(x);
    Py_XDECREF(y);
    return out;
}

/* pin_path(node, page_size, clock) -> (dev, host): see pathwalk.py */
static PyObject *pin_path(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Py_ssize_t p;
    PyObject *node = walk_args(args, nargs, 3, "pin_path(node, page_size, clock)", &p);
    if (node == NULL) {
        return NULL;
    }
    PyObject *clock = args[2];
    if (clock != Py_None && !PyLong_CheckExact(clock)) {
        PyErr_SetString(PyExc_TypeError, "clock must be an int or None");
        return NULL;
    }
    Py_ssize_t dev = 0, host = 0;
    PyObject *parent;
    long pins;
    int more;
    while ((more = step(node, &parent, &pins)) > 0) {
        if (pins == 0 && protect_delta(node, p, &dev, &host) < 0) {
            return NULL;
        }
        if (set_long(node, off_pins, pins + 1) < 0) {
            return NULL;
        }
        if (clock != Py_None) {
            Py_INCREF(clock);
            Py_XSETREF(SLOT(node, off_last_access), clock);
        }
        node = parent;
    }
    if (more < 0) {
        return NULL;
    }
    return pair(dev, host);
}

/* whether a node left without a pin may be a victim of a tier now (pathwalk.may_be_victim):
 * a device-resident node with no device-present child, or a device-absent childless one;
 * -1 with an exception set */
static int may_be_victim(PyObject *node)
{
    PyObject *d = get(node, off_device, "device");
    if (d == NULL) {
        return -1;
    }
    if (d == RESIDENT) {
        long k = get_long(node, off_n_dev_children, "n_dev_children");
        if (k == -1 && PyErr_Occurred()) {
            return -1;
        }
        return k == 0;
    }
    if (d == ABSENT) {
        PyObject *ch = get(node, off_children, "children");
        if (ch == NULL) {
            return -1;
        }
        if (!PyDict_CheckExact(ch)) {
            PyErr_SetString(PyExc_TypeError, "node.children is not a dict");
            return -1;
        }
        return PyDict_GET_SIZE(ch) == 0;
    }
    return 0;
}

/* unpin_path(node, page_size) -> (dev, host, victims): see pathwalk.py */
static PyObject *unpin_path(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Py_ssize_t p;
    PyObject *node = walk_args(args, nargs, 2, "unpin_path(node, page_size)", &p);
    if (node == NULL) {
        return NULL;
    }
    Py_ssize_t dev = 0, host = 0;
    PyObject *unpinned = NULL, *parent;
    long pins;
    int more;
    while ((more = step(node, &parent, &pins)) > 0) {
        if (pins <= 0) {
            PyErr_Format(PyExc_AssertionError, "unpin of unpinned %R", node);
            goto fail;
        }
        if (set_long(node, off_pins, pins - 1) < 0) {
            goto fail;
        }
        if (pins == 1) {
            if (protect_delta(node, p, &dev, &host) < 0) {
                goto fail;
            }
            if (unpinned == NULL && (unpinned = PyList_New(0)) == NULL) {
                goto fail;
            }
            int victim = may_be_victim(node);
            if (victim < 0 || (victim && PyList_Append(unpinned, node) < 0)) {
                goto fail;
            }
        }
        node = parent;
    }
    if (more < 0) {
        goto fail;
    }
    PyObject *out = pair_and(dev, host, unpinned == NULL ? Py_None : unpinned);
    Py_XDECREF(unpinned);
    return out;
fail:
    Py_XDECREF(unpinned);
    return NULL;
}

/* path_lens(node) -> (device_len, host_len): see pathwalk.py */
static PyObject *path_lens(PyObject *self, PyObject *node)
{
    (void)self;
    if (!ready(node, 1)) {
        return NULL;
    }
    enum { NEITHER, ON_DEVICE, HOST_ONLY } run = NEITHER;
    Py_ssize_t dev = 0, host = 0;
    for (;;) {
        PyObject *parent = parent_of(node);
        if (parent == NULL) {
            return NULL;
        }
        if (parent == Py_None) {
            break;
        }
        Py_ssize_t k = pages_of(node, 1);
        PyObject *d = get(node, off_device, "device");
        PyObject *h = get(node, off_host, "host");
        PyObject *c = get(node, off_corrupt, "corrupt");
        if (k < 0 || d == NULL || h == NULL || c == NULL) {
            return NULL;
        }
        int corrupt = PyObject_IsTrue(c); /* a bool: no code runs */
        if (corrupt < 0) {
            return NULL;
        }
        if (d == RESIDENT) {
            if (run == ON_DEVICE) {
                dev += k;
            }
            else {
                host = run == HOST_ONLY ? host : 0;
                dev = k;
                run = ON_DEVICE;
            }
        }
        else if (h == RESIDENT && !corrupt) {
            if (run == HOST_ONLY) {
                host += k;
            }
            else {
                host = k;
                run = HOST_ONLY;
            }
        }
        else {
            run = NEITHER;
        }
        node = parent;
    }
    if (run == ON_DEVICE) {
        return pair(dev, host);
    }
    return pair(0, run == HOST_ONLY ? host : 0);
}

/* descend(node, page_size, tokens, n, plan) -> (node, pos, child, same, steps) or None:
 * see pathwalk.py */
static PyObject *descend(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Py_ssize_t p, n;
    PyObject *node = walk_args(args, nargs, 5, "descend(node, page_size, tokens, n, plan)", &p);
    if (node == NULL) {
        return NULL;
    }
    PyObject *tokens = args[2];
    if (!PyList_CheckExact(tokens)) {
        PyErr_SetString(PyExc_TypeError, "descend needs a list of tokens");
        return NULL;
    }
    n = PyLong_AsSsize_t(args[3]);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int plan = PyObject_IsTrue(args[4]);
    if (plan < 0) {
        return NULL;
    }
    PyObject *steps = NULL, *child = NULL, *out = NULL;
    if (plan && (steps = PyList_New(0)) == NULL) {
        return NULL;
    }
    Py_INCREF(node); /* strong: an allocation here may collect garbage, which runs code */
    Py_ssize_t pos = 0, same = 0;
    while (pos < n) {
        PyObject *key = child_key(tokens, pos, p);
        if (key == NULL) {
            if (PyErr_Occurred()) {
                goto fail;
            }
            goto fallback;
        }
        PyObject *children = get(node, off_children, "children");
        if (children == NULL || !PyDict_CheckExact(children)) {
            if (children != NULL) {
                PyErr_SetString(PyExc_TypeError, "node.children is not a dict");
            }
            Py_DECREF(key);
            goto fail;
        }
        child = PyDict_GetItemWithError(children, key);
        Py_DECREF(key);
        if (child == NULL) {
            if (PyErr_Occurred()) {
                goto fail;
            }
            break;
        }
        Py_INCREF(child);
        if (!PyObject_TypeCheck(child, node_type)) {
            PyErr_SetString(PyExc_TypeError, "a child is not a node");
            goto fail;
        }
        PyObject *d = get(node, off_device, "device"), *cd = get(child, off_device, "device");
        if (d == NULL || cd == NULL) {
            goto fail;
        }
        if (plan && d == FILLING && cd != FILLING) {
            Py_CLEAR(child); /* nothing hangs below a node still loading but its own load */
            break;
        }
        PyObject *ckey = get(child, off_key, "key");
        if (ckey == NULL) {
            goto fail;
        }
        if (!PyList_CheckExact(ckey)) {
            PyErr_SetString(PyExc_TypeError, "node.key is not a list");
            goto fail;
        }
        Py_ssize_t klen = PyList_GET_SIZE(ckey);
        same = exact_common_len(ckey, tokens, pos, n - pos);
        if (same < 0) {
            if (same == DESCEND_FALLBACK) {
                goto fallback;
            }
            goto fail;
        }
        if (same < klen) {
            break; /* child: the node the walk ends inside */
        }
        if (steps != NULL && PyList_Append(steps, child) < 0) {
            goto fail;
        }
        Py_SETREF(node, child);
        child = NULL;
        pos += klen;
        same = 0;
    }
    PyObject *at = PyLong_FromSsize_t(pos), *matched = PyLong_FromSsize_t(same);
    out = at && matched ? PyTuple_Pack(5, node, at, child ? child : Py_None, matched,
                                       steps ? steps : Py_None)
                        : NULL;
    Py_XDECREF(at);
    Py_XDECREF(matched);
    goto done;
fallback:
    out = Py_None;
    Py_INCREF(out);
    goto done;
fail:
    out = NULL;
done:
    Py_XDECREF(child);
    Py_XDECREF(steps);
    Py_DECREF(node);
    return out;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS,
     "bind(node_type, absent, filling, resident)\n--\n\nThe node class and the tier states."},
    {"pin_path", (PyCFunction)(void (*)(void))pin_path, METH_FASTCALL,
     "pin_path(node, page_size, clock)\n--\n\nPin (and stamp) the path to a non-root node."},
    {"unpin_path", (PyCFunction)(void (*)(void))unpin_path, METH_FASTCALL,
     "unpin_path(node, page_size)\n--\n\nDrop one pin from the path to a non-root node."},
    {"path_lens", path_lens, METH_O,
     "path_lens(node)\n--\n\nThe device run and the host-only run after it, in tokens."},
    {"descend", (PyCFunction)(void (*)(void))descend, METH_FASTCALL,
     "descend(node, page_size, tokens, n, plan)\n--\n\nThe walk down a match or insert "
     "takes, or None where the Python walk must take it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aiocache_kv.tree._pathwalk",
    "C fast path of aiocache_kv.tree.pathwalk (optional; the Python path computes the same).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pathwalk(void) { return PyModule_Create(&module); }
