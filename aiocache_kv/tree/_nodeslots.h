/* A tree node's slots read and written at the offsets its class's member descriptors give
 * (bind() reads them once, from the class itself, and checks they are plain object slots), and
 * the path walks built on them, and new nodes made from a prototype; included once, by
 * _pathwalk.c, whose header says why.
 */
#ifndef AIOCACHE_KV_NODESLOTS_H
#define AIOCACHE_KV_NODESLOTS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

static PyTypeObject *node_type = NULL;
static PyObject *ABSENT = NULL, *FILLING = NULL, *RESIDENT = NULL;
static Py_ssize_t off_parent, off_pins, off_key, off_device, off_host, off_storage,
    off_host_pins, off_last_access, off_corrupt, off_children, off_n_dev_children,
    off_device_pages;

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
    Py_ssize_t o[12];
    const char *names[12] = {"parent",    "pins",        "key",       "device",
                             "host",      "storage",     "host_pins", "last_access",
                             "corrupt",   "children",    "n_dev_children", "device_pages"};
    for (int i = 0; i < 12; i++) {
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
    off_device_pages = o[11];
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

/* pin (and, with a clock not None, stamp) the path from a non-root node up: the pages the
 * pins moved from evictable to protected are added to *dev and *host; -1 with an exception */
static int pin_from(PyObject *node, Py_ssize_t p, PyObject *clock, Py_ssize_t *dev,
                    Py_ssize_t *host)
{
    PyObject *parent;
    long pins;
    int more;
    while ((more = step(node, &parent, &pins)) > 0) {
        if (pins == 0 && protect_delta(node, p, dev, host) < 0) {
            return -1;
        }
        if (set_long(node, off_pins, pins + 1) < 0) {
            return -1;
        }
        if (clock != Py_None) {
            Py_INCREF(clock);
            Py_XSETREF(SLOT(node, off_last_access), clock);
        }
        node = parent;
    }
    return more;
}

/* A new node's slots as Node.__init__ leaves them, copied from a prototype node (prototype()):
 * every slot but key, parent, ns, children and start, each holding an immutable value, so
 * nodes may share it.  make_node() copies them (no Python code runs), then sets those five
 * (start: the tokens on the path before the node, its parent's start plus its parent's key). */
#define MAX_SLOTS 64
static Py_ssize_t n_proto = 0, proto_off[MAX_SLOTS], off_ns = -1, off_start = -1;
static PyObject *proto_val[MAX_SLOTS];

static int immutable(PyObject *v)
{
    return v == Py_None || PyLong_Check(v) || PyFloat_CheckExact(v) ||
           PyFrozenSet_CheckExact(v) || PyUnicode_CheckExact(v);
}

/* prototype(node): take node's slots (but key, parent, ns, children, start) as every new
 * node's */
static PyObject *prototype(PyObject *self, PyObject *node)
{
    (void)self;
    if (node_type == NULL || !Py_IS_TYPE(node, node_type)) {
        PyErr_SetString(PyExc_TypeError, "prototype() needs a node, after bind()");
        return NULL;
    }
    Py_ssize_t count = 0, offs[MAX_SLOTS], ns = -1, start = -1;
    PyObject *vals[MAX_SLOTS];
    for (PyMemberDef *m = node_type->tp_members; m != NULL && m->name != NULL; m++) {
        if (m->type != T_OBJECT_EX || (m->flags & READONLY)) {
            continue;
        }
        if (strcmp(m->name, "ns") == 0) {
            ns = m->offset;
        }
        if (strcmp(m->name, "start") == 0) {
            start = m->offset;
        }
        if (m->offset == off_key || m->offset == off_parent || m->offset == off_children ||
            m->offset == ns || m->offset == start) {
            continue;
        }
        PyObject *v = SLOT(node, m->offset);
        if (v == NULL || !immutable(v) || count == MAX_SLOTS) {
            PyErr_Format(PyExc_TypeError, "a new node's %s must be set and immutable", m->name);
            return NULL;
        }
        offs[count] = m->offset;
        vals[count++] = v;
    }
    if (ns < 0 || start < 0) {
        PyErr_SetString(PyExc_TypeError, "the node class has no ns or no start slot");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n_proto; i++) {
        Py_CLEAR(proto_val[i]);
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        proto_off[i] = offs[i];
        proto_val[i] = Py_NewRef(vals[i]);
    }
    n_proto = count;
    off_ns = ns;
    off_start = start;
    Py_RETURN_NONE;
}

/* a new node (key, parent, ns) as Node(key, parent, ns) makes it, with key kept as given
 * (already out of the GC's view); NULL with an exception set */
static PyObject *make_node(PyObject *key, PyObject *parent, PyObject *ns)
{
    if (n_proto == 0) { /* no prototype: the class makes it */
        PyObject *init[3] = {key, parent, ns};
        return PyObject_Vectorcall((PyObject *)node_type, init, 3, NULL);
    }
    PyObject *up_start = SLOT(parent, off_start), *up_key = SLOT(parent, off_key);
    if (up_start == NULL || !PyLong_CheckExact(up_start) || up_key == NULL ||
        !PyList_CheckExact(up_key)) {
        PyErr_SetString(PyExc_TypeError, "a new node's parent needs an int start and a key list");
        return NULL;
    }
    Py_ssize_t before = PyLong_AsSsize_t(up_start);
    if (before == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *start = PyLong_FromSsize_t(before + PyList_GET_SIZE(up_key));
    if (start == NULL) {
        return NULL;
    }
    PyObject *children = PyDict_New();
    if (children == NULL) {
        Py_DECREF(start);
        return NULL;
    }
    PyObject *node = node_type->tp_alloc(node_type, 0);
    if (node == NULL) {
        Py_DECREF(start);
        Py_DECREF(children);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n_proto; i++) {
        SLOT(node, proto_off[i]) = Py_NewRef(proto_val[i]);
    }
    SLOT(node, off_key) = Py_NewRef(key);
    SLOT(node, off_parent) = Py_NewRef(parent);
    SLOT(node, off_ns) = Py_NewRef(ns);
    SLOT(node, off_children) = children;
    SLOT(node, off_start) = start;
    return node;
}

#endif
