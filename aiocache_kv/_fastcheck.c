/* Checks of caller input on the per-request path, in C: the optional fast path of
 * aiocache_kv/fastcheck.py (which holds the numpy reference of every function here and says
 * what each returns).  Each function is one pass over a list or an int64 buffer; none keeps a
 * reference to its arguments or touches Python state beyond them, and none raises for bad
 * *values*: it returns where the first one is, and the Python caller words the typed error.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#include "_pagecheck.h"

/* whether an exact int is in [0, 2**30) without converting it (its internal layout) */
static inline int is_small_nonnegative(PyObject *v)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyUnstable_Long_IsCompact((PyLongObject *)v) &&
           PyUnstable_Long_CompactValue((PyLongObject *)v) >= 0;
#else
    Py_ssize_t size = Py_SIZE(v); /* digits, negative for a negative value */
    return size == 0 || size == 1;
#endif
}

/* the first index in [i, n) of items whose element is not an int in [0, 2**63 - 1], or -1;
 * *inexact (if given) is set when an element before ``exact_to`` is an int subclass (a bool) */
static Py_ssize_t scan_tokens(PyObject **items, Py_ssize_t i, Py_ssize_t n, Py_ssize_t exact_to,
                              int *inexact)
{
#if PY_VERSION_HEX < 0x030C0000
    /* the common case, four exact ints in [0, 2**30) at a time with one branch (their
     * digit counts are 0 or 1: as unsigned, at most 1) */
    for (; i + 4 <= n; i += 4) {
        PyObject *a = items[i], *b = items[i + 1], *c = items[i + 2], *d = items[i + 3];
        int odd = (Py_TYPE(a) != &PyLong_Type) | (Py_TYPE(b) != &PyLong_Type) |
                  (Py_TYPE(c) != &PyLong_Type) | (Py_TYPE(d) != &PyLong_Type) |
                  ((size_t)Py_SIZE(a) > 1) | ((size_t)Py_SIZE(b) > 1) |
                  ((size_t)Py_SIZE(c) > 1) | ((size_t)Py_SIZE(d) > 1);
        if (odd) {
            break; /* the item-by-item loop below finds which */
        }
    }
#endif
    for (; i < n; i++) {
        PyObject *item = items[i];
        if (PyLong_CheckExact(item)) {
            if (is_small_nonnegative(item)) {
                continue; /* the common case: no conversion call */
            }
        } else if (!PyLong_Check(item)) {
            return i;
        } else if (inexact != NULL && i < exact_to) {
            *inexact = 1;
        }
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow != 0 || v < 0) {
            return i;
        }
    }
    return -1;
}

static int ssize_arg(PyObject *obj, Py_ssize_t *out)
{
    *out = PyLong_AsSsize_t(obj);
    if (*out == -1 && PyErr_Occurred()) {
        return -1;
    }
    return 0;
}

/* a long long argument (an int, or an object with __index__, as PyArg_ParseTuple's "L") */
static int ll_arg(PyObject *obj, long long *out)
{
    *out = PyLong_AsLongLong(obj);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* an int argument (as PyArg_ParseTuple's "i": OverflowError outside a C int) */
static int int_arg(PyObject *obj, int *out)
{
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (v < INT_MIN || v > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "signed integer is out of range for a C int");
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* whether a fast call got ``want`` arguments (TypeError naming ``usage`` if not) */
static int nargs_ok(Py_ssize_t nargs, Py_ssize_t want, const char *usage)
{
    if (nargs == want) {
        return 1;
    }
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", usage, want, nargs);
    return 0;
}

/* first_bad_token(tokens, start=0) -> index of the first element from start on that is not
 * an int in [0, 2**63 - 1], or -1 */
static PyObject *first_bad_token(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs < 1 || nargs > 2 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "first_bad_token needs a list (and a start)");
        return NULL;
    }
    PyObject *arg = args[0];
    Py_ssize_t i = 0;
    if (nargs == 2) {
        if (ssize_arg(args[1], &i) < 0) {
            return NULL;
        }
        if (i < 0) {
            PyErr_SetString(PyExc_ValueError, "start must be >= 0");
            return NULL;
        }
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    return PyLong_FromSsize_t(scan_tokens(((PyListObject *)arg)->ob_item, i, n, 0, NULL));
}

/* exact_ints(tokens) -> tokens itself when no item is an int subclass (a bool, an IntEnum, a
 * hostile subclass), else a new list in which each such item is an exact int of its value.
 * No Python code runs: an int subclass's value is read from the object (no __index__,
 * __hash__ or __eq__ is called), so a later tree walk cannot run a caller's code that changes
 * the list under it.  Items that are not ints, and values out of a long long's range, stay as
 * they are (the token check names them). */
static PyObject *exact_ints(PyObject *self, PyObject *arg)
{
    (void)self;
    if (!PyList_CheckExact(arg)) {
        PyErr_SetString(PyExc_TypeError, "exact_ints needs a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    PyObject **items = ((PyListObject *)arg)->ob_item;
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4) {
        if ((Py_TYPE(items[i]) != &PyLong_Type) | (Py_TYPE(items[i + 1]) != &PyLong_Type) |
            (Py_TYPE(items[i + 2]) != &PyLong_Type) | (Py_TYPE(items[i + 3]) != &PyLong_Type)) {
            break;
        }
    }
    for (; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item) && PyLong_Check(item)) {
            break;
        }
    }
    if (i == n) {
        Py_INCREF(arg);
        return arg;
    }
    PyObject *out = PyList_GetSlice(arg, 0, n); /* new references to the same items */
    if (out == NULL) {
        return NULL;
    }
    items = ((PyListObject *)out)->ob_item;
    for (; i < n; i++) {
        PyObject *item = items[i];
        if (PyLong_CheckExact(item) || !PyLong_Check(item)) {
            continue;
        }
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow != 0) {
            continue;
        }
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        PyObject *exact = PyLong_FromLongLong(v);
        if (exact == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        items[i] = exact; /* the list owned the old item's reference */
        Py_DECREF(item);
    }
    return out;
}

/* checked_key(tokens, start, pos, n) -> first_bad_token(tokens, start) if it is >= 0, else a
 * new list tokens[pos:n], out of the cyclic collector's view when its items are exact ints
 * (see _gcfree.c; items before start are the caller's: a tree walk matched them as ints);
 * needs 0 <= pos <= start and pos <= n <= len(tokens) */
static PyObject *checked_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 4 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "checked_key needs a list, start, pos and n");
        return NULL;
    }
    PyObject *tokens = args[0];
    Py_ssize_t start, pos, n;
    if (ssize_arg(args[1], &start) < 0 || ssize_arg(args[2], &pos) < 0 ||
        ssize_arg(args[3], &n) < 0) {
        return NULL;
    }
    Py_ssize_t len = PyList_GET_SIZE(tokens);
    if (pos < 0 || start < pos || n < pos || n > len) {
        PyErr_SetString(PyExc_ValueError, "checked_key needs 0 <= pos <= start, pos <= n <= len");
        return NULL;
    }
    PyObject **items = ((PyListObject *)tokens)->ob_item;
    int inexact = 0;
    for (Py_ssize_t i = pos; i < start && i < n; i++) {
        inexact |= !PyLong_CheckExact(items[i]);
    }
    Py_ssize_t bad = scan_tokens(items, start, len, n, &inexact);
    if (bad >= 0) {
        return PyLong_FromSsize_t(bad);
    }
    PyObject *key = PyList_GetSlice(tokens, pos, n);
    if (key != NULL && !inexact && PyObject_GC_IsTracked(key)) {
        PyObject_GC_UnTrack(key);
    }
    return key;
}

static int int64_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        return -1;
    }
    if (view->len % 8 != 0) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s must be an int64 buffer", what);
        return -1;
    }
    return 0;
}

/* slot_pages(slots, page_size, limit, out) -> 0 ok, 1 a slot outside [0, limit), 2 a run of
 * page_size slots that is not page * page_size + 0..page_size-1.  Writes the page ids (slot
 * // page_size of each run's first slot; the slots themselves when page_size is 1) to out. */
static PyObject *slot_pages(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *slots_obj, *out_obj;
    long long p, limit;
    if (!PyArg_ParseTuple(args, "OLLO", &slots_obj, &p, &limit, &out_obj)) {
        return NULL;
    }
    if (p < 1) {
        PyErr_SetString(PyExc_ValueError, "page_size must be >= 1");
        return NULL;
    }
    Py_buffer sv, ov;
    if (int64_buffer(slots_obj, &sv, 0, "slots") < 0) {
        return NULL;
    }
    if (int64_buffer(out_obj, &ov, 1, "out") < 0) {
        PyBuffer_Release(&sv);
        return NULL;
    }
    long code = slot_pages_core((const int64_t *)sv.buf, sv.len / 8, p, limit, (int64_t *)ov.buf,
                                ov.len / 8);
    PyBuffer_Release(&sv);
    PyBuffer_Release(&ov);
    return PyLong_FromLong(code);
}

/* first_repeat(pages, stamp, epoch) -> index of the first page id seen before in pages, or -1.
 * stamp is scratch indexed by page id; epoch must differ from every value it holds for these
 * ids (the caller counts up), so no clearing is needed.  Ids must index stamp. */
static PyObject *first_repeat(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *pages_obj, *stamp_obj;
    long long epoch;
    if (!PyArg_ParseTuple(args, "OOL", &pages_obj, &stamp_obj, &epoch)) {
        return NULL;
    }
    Py_buffer pv, sv;
    if (int64_buffer(pages_obj, &pv, 0, "pages") < 0) {
        return NULL;
    }
    if (int64_buffer(stamp_obj, &sv, 1, "stamp") < 0) {
        PyBuffer_Release(&pv);
        return NULL;
    }
    int bad_id = 0;
    Py_ssize_t found = first_repeat_core((const int64_t *)pv.buf, pv.len / 8, (int64_t *)sv.buf,
                                         sv.len / 8, epoch, &bad_id);
    PyBuffer_Release(&pv);
    PyBuffer_Release(&sv);
    if (bad_id) {
        PyErr_SetString(PyExc_IndexError, "page id outside the stamp array");
        return NULL;
    }
    return PyLong_FromSsize_t(found);
}

/* held_check(pages, existing, state, held) -> (first_bad, differing).  Page i < len(existing)
 * is fine if it equals existing[i] or is in state `held`; later pages must be `held`.
 * first_bad is the first index breaking that (-1: none); differing counts i < len(existing)
 * with pages[i] != existing[i].  state is one byte per page id; ids must index it. */
static PyObject *held_check(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *pages_obj, *existing_obj, *state_obj;
    int held;
    if (!PyArg_ParseTuple(args, "OOOi", &pages_obj, &existing_obj, &state_obj, &held)) {
        return NULL;
    }
    Py_buffer pv, ev, sv;
    if (int64_buffer(pages_obj, &pv, 0, "pages") < 0) {
        return NULL;
    }
    if (int64_buffer(existing_obj, &ev, 0, "existing") < 0) {
        PyBuffer_Release(&pv);
        return NULL;
    }
    if (PyObject_GetBuffer(state_obj, &sv, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&pv);
        PyBuffer_Release(&ev);
        return NULL;
    }
    Py_ssize_t differing = 0;
    int bad_id = 0;
    Py_ssize_t bad = held_check_core((const int64_t *)pv.buf, pv.len / 8, (const int64_t *)ev.buf,
                                     ev.len / 8, (const uint8_t *)sv.buf, sv.len, held,
                                     &differing, &bad_id);
    PyBuffer_Release(&pv);
    PyBuffer_Release(&ev);
    PyBuffer_Release(&sv);
    if (bad_id) {
        PyErr_SetString(PyExc_IndexError, "page id outside the state array");
        return NULL;
    }
    return Py_BuildValue("nn", bad, differing);
}

/* insert_pages(slots, page_size, limit, out, existing, state, held, stamp, epoch)
 *   -> (code, index, differing): every check of an insert in one call.  First slot_pages()
 * into out (code 1 or 2 as there; index -1), then first_repeat() of out (code 3: out[index]
 * repeats an earlier id), then held_check() of out (code 4: out[index] is neither
 * existing[index] nor in state `held`).  Code 0: all fine; differing counts the leading ids
 * that are not the tree's own. */
static PyObject *insert_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    long long p, limit, epoch;
    int held;
    if (!nargs_ok(nargs, 9, "insert_pages") || ll_arg(args[1], &p) < 0 ||
        ll_arg(args[2], &limit) < 0 || int_arg(args[6], &held) < 0 ||
        ll_arg(args[8], &epoch) < 0) {
        return NULL;
    }
    PyObject *slots_obj = args[0], *out_obj = args[3], *existing_obj = args[4];
    PyObject *state_obj = args[5], *stamp_obj = args[7];
    if (p < 1) {
        PyErr_SetString(PyExc_ValueError, "page_size must be >= 1");
        return NULL;
    }
    if (limit < 0) { /* (a negative limit would turn into a huge unsigned bound below) */
        PyErr_Format(PyExc_ValueError, "limit must be >= 0, got %lld", limit);
        return NULL;
    }
    Py_buffer views[5];
    int got = 0;
    long code = 0;
    Py_ssize_t index = -1, differing = 0;
    int bad_id = 0;
    if (int64_buffer(slots_obj, &views[0], 0, "slots") < 0) {
        goto done;
    }
    got = 1;
    if (int64_buffer(out_obj, &views[1], 1, "out") < 0) {
        goto done;
    }
    got = 2;
    if (int64_buffer(existing_obj, &views[2], 0, "existing") < 0) {
        goto done;
    }
    got = 3;
    if (PyObject_GetBuffer(state_obj, &views[3], PyBUF_SIMPLE) < 0) {
        goto done;
    }
    got = 4;
    if (int64_buffer(stamp_obj, &views[4], 1, "stamp") < 0) {
        goto done;
    }
    got = 5;
    int64_t *ids = (int64_t *)views[1].buf;
    Py_ssize_t n = views[1].len / 8;
    if (insert_fast((const int64_t *)views[0].buf, views[0].len / 8, p, limit, ids, n,
                    (const int64_t *)views[2].buf, views[2].len / 8,
                    (const uint8_t *)views[3].buf, views[3].len, held, (int64_t *)views[4].buf,
                    views[4].len / 8, epoch, &differing)) {
        goto done; /* code 0, index -1 */
    }
    code = slot_pages_core((const int64_t *)views[0].buf, views[0].len / 8, p, limit, ids, n);
    if (code == 0 && n > 1) {
        index = first_repeat_core(ids, n, (int64_t *)views[4].buf, views[4].len / 8, epoch,
                                  &bad_id);
        code = index >= 0 ? 3 : 0;
    }
    if (code == 0 && !bad_id) {
        index = held_check_core(ids, n, (const int64_t *)views[2].buf, views[2].len / 8,
                                (const uint8_t *)views[3].buf, views[3].len, held, &differing,
                                &bad_id);
        code = index >= 0 ? 4 : 0;
    }
done:
    for (int i = 0; i < got; i++) {
        PyBuffer_Release(&views[i]);
    }
    if (got < 5) {
        return NULL;
    }
    if (bad_id) {
        PyErr_SetString(PyExc_IndexError, "page id outside the stamp or state array");
        return NULL;
    }
    PyObject *c = PyLong_FromLong(code), *i = PyLong_FromSsize_t(index);
    PyObject *d = PyLong_FromSsize_t(differing);
    PyObject *out = c && i && d ? PyTuple_Pack(3, c, i, d) : NULL;
    Py_XDECREF(c);
    Py_XDECREF(i);
    Py_XDECREF(d);
    return out;
}

/* set_states(state, ids, value): state[ids[i]] = value for each i (the uint8 state array of
 * a page allocator); IndexError, with nothing written, if an id is outside state */
static PyObject *set_states(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    int value;
    if (!nargs_ok(nargs, 3, "set_states") || int_arg(args[2], &value) < 0) {
        return NULL;
    }
    PyObject *state_obj = args[0], *ids_obj = args[1];
    if (value < 0 || value > 255) {
        PyErr_SetString(PyExc_ValueError, "value must fit in a uint8");
        return NULL;
    }
    Py_buffer sv, iv;
    if (PyObject_GetBuffer(state_obj, &sv, PyBUF_WRITABLE) < 0) {
        return NULL;
    }
    if (int64_buffer(ids_obj, &iv, 0, "ids") < 0) {
        PyBuffer_Release(&sv);
        return NULL;
    }
    const int64_t *ids = (const int64_t *)iv.buf;
    Py_ssize_t n = iv.len / 8;
    uint8_t *st = (uint8_t *)sv.buf;
    int bad = 0;
    /* ids[0], ids[0] + 1, ...: an allocator's run, one memset (an OR of differences: the
     * loop vectorizes) */
    const uint64_t first = n ? (uint64_t)ids[0] : 0;
    uint64_t off = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        off |= (uint64_t)ids[i] ^ (first + (uint64_t)i);
    }
    if (off == 0 && n) {
        bad = (int64_t)first < 0 || (int64_t)first > (int64_t)sv.len - (int64_t)n;
        if (!bad) {
            memset(st + first, value, (size_t)n);
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            bad |= (uint64_t)ids[i] >= (uint64_t)sv.len; /* a negative id wraps above */
        }
        if (!bad) {
            for (Py_ssize_t i = 0; i < n; i++) {
                st[ids[i]] = (uint8_t)value;
            }
        }
    }
    PyBuffer_Release(&sv);
    PyBuffer_Release(&iv);
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "page id outside the state array");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* page_slots(pages, page_size, out): out[i * p + j] = pages[i] * p + j */
static PyObject *page_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    long long p;
    if (!nargs_ok(nargs, 3, "page_slots") || ll_arg(args[1], &p) < 0) {
        return NULL;
    }
    PyObject *pages_obj = args[0], *out_obj = args[2];
    Py_buffer pv, ov;
    if (int64_buffer(pages_obj, &pv, 0, "pages") < 0) {
        return NULL;
    }
    if (int64_buffer(out_obj, &ov, 1, "out") < 0) {
        PyBuffer_Release(&pv);
        return NULL;
    }
    Py_ssize_t n = pv.len / 8;
    /* (n * p computed only once it cannot overflow) */
    int ok = p >= 1 && (n == 0 || p <= (long long)(PY_SSIZE_T_MAX / 8) / n) && ov.len / 8 == n * p;
    if (ok) {
        page_slots_core((const int64_t *)pv.buf, n, p, (int64_t *)ov.buf);
    }
    PyBuffer_Release(&pv);
    PyBuffer_Release(&ov);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "out must hold len(pages) * page_size slots");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* hex_keys(prefix, hashes, suffix, nbytes) -> [prefix + h.hex() + suffix for h in hashes], or
 * the index (an int) of the first item that is not exactly bytes of nbytes; prefix and suffix
 * are ASCII str (storage keys: a checked tag and component around each page hash) */
static PyObject *hex_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 4 || !PyUnicode_CheckExact(args[0]) || !PyList_CheckExact(args[1]) ||
        !PyUnicode_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "hex_keys needs a str, a list, a str and a size");
        return NULL;
    }
    PyObject *prefix = args[0], *hashes = args[1], *suffix = args[2];
    Py_ssize_t nbytes;
    if (ssize_arg(args[3], &nbytes) < 0) {
        return NULL;
    }
    if (!PyUnicode_IS_ASCII(prefix) || !PyUnicode_IS_ASCII(suffix) || nbytes < 0 ||
        nbytes > (1 << 20)) {
        PyErr_SetString(PyExc_ValueError, "hex_keys needs ASCII affixes and 0 <= size <= 1 MiB");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    PyObject **items = ((PyListObject *)hashes)->ob_item;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_CheckExact(items[i]) || PyBytes_GET_SIZE(items[i]) != nbytes) {
            return PyLong_FromSsize_t(i);
        }
    }
    static const char digits[] = "0123456789abcdef";
    Py_ssize_t plen = PyUnicode_GET_LENGTH(prefix), slen = PyUnicode_GET_LENGTH(suffix);
    const Py_UCS1 *pre = PyUnicode_1BYTE_DATA(prefix), *suf = PyUnicode_1BYTE_DATA(suffix);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyUnicode_New(plen + 2 * nbytes + slen, 127);
        if (key == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        Py_UCS1 *d = PyUnicode_1BYTE_DATA(key);
        const unsigned char *h = (const unsigned char *)PyBytes_AS_STRING(items[i]);
        memcpy(d, pre, (size_t)plen);
        d += plen;
        for (Py_ssize_t j = 0; j < nbytes; j++) {
            *d++ = (Py_UCS1)digits[h[j] >> 4];
            *d++ = (Py_UCS1)digits[h[j] & 15];
        }
        memcpy(d, suf, (size_t)slen);
        PyList_SET_ITEM(out, i, key);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"first_bad_token", (PyCFunction)(void (*)(void))first_bad_token, METH_FASTCALL,
     "Index of the first non-token (from start), or -1."},
    {"exact_ints", exact_ints, METH_O, "The list, or a copy with int subclasses made exact."},
    {"checked_key", (PyCFunction)(void (*)(void))checked_key, METH_FASTCALL,
     "first_bad_token(tokens, start) if >= 0, else tokens[pos:n], untracked."},
    {"slot_pages", slot_pages, METH_VARARGS, "Page ids of whole-page slot runs (status code)."},
    {"first_repeat", first_repeat, METH_VARARGS, "Index of the first repeated page id, or -1."},
    {"held_check", held_check, METH_VARARGS, "(first page not held, pages differing)."},
    {"page_slots", (PyCFunction)(void (*)(void))page_slots, METH_FASTCALL,
     "Token slots of whole pages."},
    {"insert_pages", (PyCFunction)(void (*)(void))insert_pages, METH_FASTCALL,
     "(code, index, differing) of an insert."},
    {"set_states", (PyCFunction)(void (*)(void))set_states, METH_FASTCALL, "state[ids] = value."},
    {"hex_keys", (PyCFunction)(void (*)(void))hex_keys, METH_FASTCALL,
     "prefix + h.hex() + suffix of each hash, or the index of the first bad one."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastcheck", "Per-request input checks in C.", -1, methods, NULL, NULL,
    NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastcheck(void) { return PyModule_Create(&module); }
