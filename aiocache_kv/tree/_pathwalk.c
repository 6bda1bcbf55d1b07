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
 *
 * The common match and the common insert are one call each (pin_match, grow): the walk over
 * whole nodes, the check of the tokens after it, a new leaf for an insert (made from the slots
 * prototype() took from a Node(), so no __init__ runs; only without a prototype is the class
 * called) and the pin and stamp of the path.  Where the request is not that simple they change
 * nothing and return None, and the tree's general path runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "_nodeslots.h"
#include "_tokens.h"

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
    if (pin_from(node, p, clock, &dev, &host) < 0) {
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

/* what looking up the child of a page finds */
enum found { FOUND, NO_CHILD, NOT_EXACT, FAILED };

/* the child of node for the page of tokens at pos, a node (*child, borrowed); NO_CHILD with
 * the page's key in *key (a new reference) when key is not NULL; NOT_EXACT where the page
 * holds an item that is not an exact int (looking it up could run code); FAILED with an
 * exception set */
static enum found lookup(PyObject *node, PyObject *tokens, Py_ssize_t pos, Py_ssize_t p,
                         PyObject **child, PyObject **key)
{
    PyObject *k = child_key(tokens, pos, p);
    if (k == NULL) {
        return PyErr_Occurred() ? FAILED : NOT_EXACT;
    }
    PyObject *children = get(node, off_children, "children");
    if (children != NULL && !PyDict_CheckExact(children)) {
        PyErr_SetString(PyExc_TypeError, "node.children is not a dict");
    }
    *child = children && PyDict_CheckExact(children) ? PyDict_GetItemWithError(children, k)
                                                     : NULL;
    if (*child == NULL || !PyObject_TypeCheck(*child, node_type)) {
        if (*child != NULL) {
            PyErr_SetString(PyExc_TypeError, "a child is not a node");
        }
        if (PyErr_Occurred()) {
            Py_DECREF(k);
            return FAILED;
        }
        if (key != NULL) {
            *key = k;
        }
        else {
            Py_DECREF(k);
        }
        return NO_CHILD;
    }
    Py_DECREF(k);
    return FOUND;
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
        enum found f = lookup(node, tokens, pos, p, &child, NULL);
        if (f != FOUND) {
            child = NULL;
            if (f == NOT_EXACT) {
                goto fallback;
            }
            if (f == FAILED) {
                goto fail;
            }
            break;
        }
        Py_INCREF(child);
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

/* whether node is anchor or one of its ancestors; -1 with an exception set */
static int leads_to(PyObject *node, PyObject *anchor)
{
    while (anchor != Py_None) {
        if (anchor == node) {
            return 1;
        }
        if ((anchor = parent_of(anchor)) == NULL) {
            return -1;
        }
    }
    return 0;
}

/* a common path's root, page size, tokens and n (its first four arguments, of nargs, and
 * the int clock at index clock_at), or NULL with an exception set */
static PyObject *root_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
                           Py_ssize_t clock_at, const char *usage, Py_ssize_t *p, Py_ssize_t *n)
{
    PyObject *root = walk_args(args, nargs, want, usage, p);
    if (root == NULL) {
        return NULL;
    }
    if (!PyList_CheckExact(args[2]) || !PyLong_CheckExact(args[clock_at])) {
        PyErr_Format(PyExc_TypeError, "%s: a token list and an int clock", usage);
        return NULL;
    }
    if ((*n = PyLong_AsSsize_t(args[3])) == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *up = parent_of(root);
    if (up == NULL) {
        return NULL;
    }
    if (up != Py_None || *n < 0 || *n % *p || *n > PyList_GET_SIZE(args[2])) {
        PyErr_Format(PyExc_ValueError, "%s starts at a root, with n page-aligned tokens", usage);
        return NULL;
    }
    return root;
}

/* the walk over whole nodes both common paths take: from *node (a strong reference, moved
 * down the path) along tokens[:n] while the child of each page matches whole (and, with
 * resident, is on device); *pos: the tokens walked.  FOUND at its end (n reached, or no child
 * for the next page: that page's key in *ckey, a new reference, where ckey is not NULL);
 * NOT_EXACT where the general walk must run instead (a split, an item that is not an exact
 * int, a node off device); FAILED with an exception set */
static enum found whole_walk(PyObject **node, PyObject *tokens, Py_ssize_t n, Py_ssize_t p,
                             int resident, Py_ssize_t *pos, PyObject **ckey)
{
    while (*pos < n) {
        PyObject *child;
        enum found f = lookup(*node, tokens, *pos, p, &child, ckey);
        if (f == NO_CHILD) {
            return FOUND;
        }
        if (f != FOUND) {
            return f;
        }
        PyObject *cd = get(child, off_device, "device"), *key_of = get(child, off_key, "key");
        if (cd == NULL || key_of == NULL) {
            return FAILED;
        }
        if ((resident && cd != RESIDENT) || !PyList_CheckExact(key_of)) {
            return NOT_EXACT; /* a host-only node to adopt pages, or one still loading */
        }
        Py_ssize_t same = exact_common_len(key_of, tokens, *pos, n - *pos);
        if (same < 0) {
            return same == DESCEND_FALLBACK ? NOT_EXACT : FAILED;
        }
        if (same < PyList_GET_SIZE(key_of)) {
            return NOT_EXACT; /* the walk ends inside a node: a split */
        }
        Py_INCREF(child);
        Py_SETREF(*node, child);
        *pos += same;
    }
    return FOUND;
}

/* pin and stamp the path up from node: (node, pos, dev, host), or NULL with an exception */
static PyObject *pinned(PyObject *node, Py_ssize_t pos, Py_ssize_t p, PyObject *clock)
{
    Py_ssize_t dev = 0, host = 0;
    if (pin_from(node, p, clock, &dev, &host) < 0) {
        return NULL;
    }
    PyObject *at = PyLong_FromSsize_t(pos), *d = PyLong_FromSsize_t(dev),
             *h = PyLong_FromSsize_t(host);
    PyObject *out = at && d && h ? PyTuple_Pack(4, node, at, d, h) : NULL;
    Py_XDECREF(at);
    Py_XDECREF(d);
    Py_XDECREF(h);
    return out;
}

/* what a common path returns where the general one must run: None, or NULL where an
 * exception is set (a failure, not a refusal) */
static PyObject *general(void)
{
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* grow(root, page_size, tokens, n, skip, anchor, pages, clock, ns) -> (leaf, pos, dev, host)
 * or None: see pathwalk.py.  Everything that can refuse is done before the first change. */
static PyObject *grow(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Py_ssize_t p, n, skip;
    PyObject *node = root_args(args, nargs, 9, 7,
                               "grow(root, page_size, tokens, n, skip, anchor, pages, clock, ns)",
                               &p, &n);
    if (node == NULL) {
        return NULL;
    }
    PyObject *tokens = args[2], *anchor = args[5], *pages = args[6], *clock = args[7];
    if (anchor != Py_None && !PyObject_TypeCheck(anchor, node_type)) {
        PyErr_SetString(PyExc_TypeError, "grow: the anchor is a node or None");
        return NULL;
    }
    if ((skip = PyLong_AsSsize_t(args[4])) == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *ckey = NULL, *ndc = NULL, *key = NULL, *leaf = NULL, *out = NULL;
    Py_INCREF(node); /* strong: an allocation here may collect garbage, which runs code */
    Py_ssize_t pos = 0;
    enum found walked = whole_walk(&node, tokens, n, p, 1, &pos, &ckey);
    if (walked != FOUND) {
        goto fallback;
    }
    /* one new leaf after exactly the skipped pages, every token after them plain */
    if (pos >= n || pos != skip * p || !plain_tokens(tokens, pos)) {
        goto fallback;
    }
    if (skip > 0) {
        int on = leads_to(node, anchor);
        if (on <= 0) {
            goto fallback;
        }
    }
    long ndev = get_long(node, off_n_dev_children, "n_dev_children");
    if ((ndev == -1 && PyErr_Occurred()) || (ndc = PyLong_FromLong(ndev + 1)) == NULL ||
        (key = PyList_GetSlice(tokens, pos, n)) == NULL) {
        goto done;
    }
    PyObject_GC_UnTrack(key); /* exact ints only (plain_tokens): Node()'s keep() skips it */
    leaf = make_node(key, node, args[8]);
    if (leaf == NULL) {
        goto done;
    }
    if (!Py_IS_TYPE(leaf, node_type)) {
        PyErr_SetString(PyExc_TypeError, "the node class made something else");
        goto done;
    }
    /* the leaf's slots hold what Node() gave them (ints, None, members): no code runs */
    Py_INCREF(clock);
    Py_XSETREF(SLOT(leaf, off_last_access), clock);
    Py_INCREF(pages);
    Py_XSETREF(SLOT(leaf, off_device_pages), pages);
    Py_INCREF(RESIDENT);
    Py_XSETREF(SLOT(leaf, off_device), RESIDENT);
    PyObject *children = get(node, off_children, "children");
    if (children == NULL || PyDict_SetItem(children, ckey, leaf) < 0) {
        goto done; /* not linked: the tree is as it was */
    }
    /* the tree has changed from here */
    Py_XSETREF(SLOT(node, off_n_dev_children), ndc);
    ndc = NULL;
    out = pinned(leaf, pos, p, clock);
    goto done;
fallback:
    out = general();
done:
    Py_XDECREF(ckey);
    Py_XDECREF(ndc);
    Py_XDECREF(key);
    Py_XDECREF(leaf);
    Py_DECREF(node);
    return out;
}

/* pin_match(root, page_size, tokens, n, clock) -> (node, pos, dev, host) or None: see
 * pathwalk.py.  Nothing changes before the pin, and nothing can refuse after it. */
static PyObject *pin_match(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Py_ssize_t p, n;
    PyObject *node =
        root_args(args, nargs, 5, 4, "pin_match(root, page_size, tokens, n, clock)", &p, &n);
    if (node == NULL) {
        return NULL;
    }
    PyObject *tokens = args[2], *clock = args[4];
    PyObject *out = NULL;
    Py_INCREF(node); /* strong: an allocation here may collect garbage, which runs code */
    Py_ssize_t pos = 0;
    enum found walked = whole_walk(&node, tokens, n, p, 0, &pos, NULL);
    if (walked != FOUND) {
        goto fallback;
    }
    /* a miss (the root: its own pin rule) or a token after the walk that is not plain */
    if (pos == 0 || !plain_tokens(tokens, pos)) {
        goto fallback;
    }
    out = pinned(node, pos, p, clock);
    goto done;
fallback:
    out = general();
done:
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
    {"prototype", prototype, METH_O,
     "prototype(node)\n--\n\nThe slots every new node starts with (but key, parent, ns, "
     "children, start)."},
    {"pin_match", (PyCFunction)(void (*)(void))pin_match, METH_FASTCALL,
     "pin_match(root, page_size, tokens, n, clock)\n--\n\nThe common match, a walk over "
     "whole nodes, pinned and stamped, or None where the tree's match must run."},
    {"grow", (PyCFunction)(void (*)(void))grow, METH_FASTCALL,
     "grow(root, page_size, tokens, n, skip, anchor, pages, clock, ns)\n--\n\nThe common "
     "insert, one new pinned leaf below the device path, or None where the tree's insert must "
     "run."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aiocache_kv.tree._pathwalk",
    "C fast path of aiocache_kv.tree.pathwalk (optional; the Python path computes the same).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pathwalk(void) { return PyModule_Create(&module); }
