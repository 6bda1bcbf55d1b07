/* Chained page hashes in C: the optional fast path of aiocache_kv/tree/hashing.py.
 *
 * h_i = BLAKE2b-256(h_{i-1} (32 bytes) || tokens of page i as int64 little-endian)
 *
 * BLAKE2b (unkeyed, 32-byte digest, one-shot) is written here from its specification,
 * RFC 7693; no outside code is vendored.  The pure-Python path (hashlib) computes the same values
 * and tests/test_tree.py checks that both agree (and this BLAKE2b against hashlib at block edges).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t load64(const uint8_t *p)
{
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) |
           ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) |
           ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static inline void store64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

#define G(a, b, c, d, x, y)              \
    do {                                 \
        v[a] = v[a] + v[b] + (x);        \
        v[d] = rotr64(v[d] ^ v[a], 32);  \
        v[c] = v[c] + v[d];              \
        v[b] = rotr64(v[b] ^ v[c], 24);  \
        v[a] = v[a] + v[b] + (y);        \
        v[d] = rotr64(v[d] ^ v[a], 16);  \
        v[c] = v[c] + v[d];              \
        v[b] = rotr64(v[b] ^ v[c], 63);  \
    } while (0)

/* RFC 7693 section 3.2: compress one 128-byte block; t counts bytes so far (below 2**64). */
static void compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last)
{
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++) {
        m[i] = load64(block + 8 * i);
    }
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t;
    if (last) {
        v[14] = ~v[14];
    }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 12
#endif
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r];
        G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) {
        h[i] ^= v[i] ^ v[i + 8];
    }
}

#define DIGEST 32

/* Unkeyed BLAKE2b with a 32-byte digest of msg[0:len), written to out. */
static void blake2b_256(const uint8_t *msg, size_t len, uint8_t out[DIGEST])
{
    uint64_t h[8];
    uint8_t tail[128];
    size_t off = 0;
    memcpy(h, IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ DIGEST; /* depth 1, fanout 1, no key, digest length 32 */
    while (len - off > 128) {
        compress(h, msg + off, (uint64_t)(off + 128), 0);
        off += 128;
    }
    memset(tail, 0, sizeof tail);
    memcpy(tail, msg + off, len - off);
    compress(h, tail, (uint64_t)len, 1);
    for (int i = 0; i < DIGEST / 8; i++) {
        store64(out + 8 * i, h[i]); /* the digest is h[0..3] in little-endian order */
    }
}

static PyObject *raw_blake2b_256(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    uint8_t digest[DIGEST];
    (void)self;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    blake2b_256((const uint8_t *)view.buf, (size_t)view.len, digest);
    PyBuffer_Release(&view);
    return PyBytes_FromStringAndSize((const char *)digest, DIGEST);
}

/* Arguments by keyword, or a wrong count (rare): the slow, general parser. */
static int parse_keywords(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                          PyObject **prev, PyObject **tokens, PyObject **page_size)
{
    static char *kwlist[] = {"prev", "tokens", "page_size", NULL};
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames), i;
    int ok = 0;
    PyObject *tuple = PyTuple_New(nargs), *dict = PyDict_New();
    if (tuple == NULL || dict == NULL) {
        goto done;
    }
    for (i = 0; i < nargs; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(tuple, i, args[i]);
    }
    for (i = 0; i < nkw; i++) {
        if (PyDict_SetItem(dict, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
            goto done;
        }
    }
    /* the objects stay alive: the caller holds args for the whole call */
    ok = PyArg_ParseTupleAndKeywords(tuple, dict, "OOO:chain_hashes", kwlist, prev, tokens,
                                     page_size);
done:
    Py_XDECREF(tuple);
    Py_XDECREF(dict);
    return ok;
}

static PyObject *chain_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames)
{
    PyObject *prev_obj, *tokens, *page_obj;
    uint8_t prev[DIGEST];
    Py_ssize_t page_size, n, npages, i, j;
    PyObject *seq, *out = NULL;
    PyObject **items;
    uint8_t *buf = NULL;
    (void)self;

    if (kwnames == NULL && nargs == 3) {
        prev_obj = args[0];
        tokens = args[1];
        page_obj = args[2];
    }
    else if (!parse_keywords(args, nargs, kwnames, &prev_obj, &tokens, &page_obj)) {
        return NULL;
    }
    if (!PyBytes_CheckExact(prev_obj) || PyBytes_GET_SIZE(prev_obj) != DIGEST) {
        PyErr_Format(PyExc_ValueError, "prev must be %d bytes", DIGEST);
        return NULL;
    }
    memcpy(prev, PyBytes_AS_STRING(prev_obj), DIGEST);
    page_size = PyNumber_AsSsize_t(page_obj, PyExc_OverflowError);
    if (page_size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (page_size < 1 || page_size > (PY_SSIZE_T_MAX - DIGEST) / 8) {
        PyErr_Format(PyExc_ValueError, "page_size must be >= 1, got %zd", page_size);
        return NULL;
    }
    seq = PySequence_Fast(tokens, "tokens must be a sequence of ints");
    if (seq == NULL) {
        return NULL;
    }
    n = PySequence_Fast_GET_SIZE(seq);
    items = PySequence_Fast_ITEMS(seq);
    if (PyList_Check(seq)) {
        /* An item that is not an exact int is converted by its own __index__, which may
         * change the list under the loop (and free the items it reads): hash a tuple copy,
         * which holds every item, then. */
        for (j = 0; j < n; j++) {
            if (!PyLong_CheckExact(items[j])) {
                PyObject *copy = PyList_AsTuple(seq);
                Py_DECREF(seq);
                if (copy == NULL) {
                    return NULL;
                }
                seq = copy;
                n = PyTuple_GET_SIZE(seq);
                items = PySequence_Fast_ITEMS(seq);
                break;
            }
        }
    }
    npages = n / page_size + (n % page_size != 0); /* a short last page is hashed as it is */
    buf = PyMem_Malloc(DIGEST + 8 * (size_t)page_size);
    out = PyList_New(npages);
    if (buf == NULL || out == NULL) {
        if (buf == NULL) {
            PyErr_NoMemory();
        }
        goto fail;
    }
    for (i = 0; i < npages; i++) {
        Py_ssize_t start = i * page_size;
        Py_ssize_t count = n - start < page_size ? n - start : page_size;
        PyObject *value;
        memcpy(buf, prev, DIGEST);
        for (j = 0; j < count; j++) {
            long long tok = PyLong_AsLongLong(items[start + j]);
            if (tok == -1 && PyErr_Occurred()) {
                goto fail;
            }
            store64(buf + DIGEST + 8 * j, (uint64_t)tok);
        }
        blake2b_256(buf, DIGEST + 8 * (size_t)count, prev);
        value = PyBytes_FromStringAndSize((const char *)prev, DIGEST);
        if (value == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(out, i, value);
    }
    PyMem_Free(buf);
    Py_DECREF(seq);
    return out;

fail:
    PyMem_Free(buf);
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef methods[] = {
    {"chain_hashes", (PyCFunction)(void (*)(void))chain_hashes, METH_FASTCALL | METH_KEYWORDS,
     "chain_hashes(prev, tokens, page_size)\n--\n\n"
     "32-byte hashes of the pages of ``tokens``, chained from ``prev`` (32 bytes).\n\n"
     "Token ids must be in ``[0, MAX_TOKEN_ID]`` (the cache validates them first).  A short\n"
     "last page, if any, is hashed as it is.  See :mod:`aiocache_kv.tree.hashing`."},
    {"blake2b_256", raw_blake2b_256, METH_O,
     "blake2b_256(data) -> bytes\n\n"
     "Unkeyed BLAKE2b with a 32-byte digest of a bytes-like object."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aiocache_kv.tree._chainhash",
    "C fast path of aiocache_kv.tree.hashing (optional; the pure-Python path computes the same).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__chainhash(void) { return PyModule_Create(&module); }
