/* The block-Fletcher page checksum of aiocache_kv/storage/integrity.py, in C (the optional
 * fast path; integrity.py's numpy/torch code is the reference and computes the same values).
 *
 * Payload as little-endian 64-bit words; s_b = the sum of block b (2048 words) mod 2**64;
 * S1 = sum(s_b), S2 = sum((b + 1) * s_b); a partial last block is one more block; a tail of
 * n % 8 bytes counts as the word (its little-endian value + 1) at position nwords / 2048 + 2.
 *
 * sums(views, nbytes) -> [(S1, S2), ...] over the first nbytes of each buffer.  The buffers
 * are held (Py_buffer) for the call; the summing runs without the GIL, so a storage worker's
 * checksum overlaps the event loop and the other workers.
 *
 * seal(views, keys, identities) and verify(views, keys, identities, sizes) are
 * integrity.seal_many / verify_many for a whole batch in one call (the Python code there is the
 * reference): the 72-byte trailer ``<4sHHQQQ32sII`` (magic "AKVP", version 2, algorithm 1,
 * payload length, S1, S2, the page's 32-byte identity, crc32 of the key's UTF-8 bytes, crc32 of
 * the 68 bytes before it) is packed / parsed here, so no Python runs per page.  Keys are
 * encoded and identities copied with the GIL held; every check and checksum runs without it.
 * verify returns one code per page, in the order the checks run in integrity._check_trailer:
 * 0 OK, 1 BAD_LENGTH, 2 BAD_MAGIC, 3 BAD_TRAILER, 4 BAD_VERSION, 5 BAD_KEY, 6 BAD_CHECKSUM,
 * 7 BAD_IDENTITY (checked after the key, before the checksum).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BLOCK_WORDS 2048

static inline uint64_t load_le64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static void block_fletcher(const uint8_t *p, Py_ssize_t n, uint64_t *out1, uint64_t *out2)
{
    Py_ssize_t nwords = n / 8, nblocks = nwords / BLOCK_WORDS;
    uint64_t s1 = 0, s2 = 0;
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        const uint8_t *q = p + (size_t)b * BLOCK_WORDS * 8;
        uint64_t s = 0;
        for (int w = 0; w < BLOCK_WORDS; w++) {
            s += load_le64(q + (size_t)w * 8);
        }
        s1 += s;
        s2 += (uint64_t)(b + 1) * s;
    }
    if (nwords % BLOCK_WORDS) {
        uint64_t s = 0;
        for (Py_ssize_t w = nblocks * BLOCK_WORDS; w < nwords; w++) {
            s += load_le64(p + (size_t)w * 8);
        }
        s1 += s;
        s2 += (uint64_t)(nblocks + 1) * s;
    }
    if (n % 8) {
        uint64_t extra = 0;
        for (Py_ssize_t i = n - 1; i >= nwords * 8; i--) {
            extra = (extra << 8) | p[i];
        }
        extra += 1;
        s1 += extra;
        s2 += (uint64_t)(nwords / BLOCK_WORDS + 2) * extra;
    }
    *out1 = s1;
    *out2 = s2;
}

static PyObject *sums(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *seq;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "On", &seq, &nbytes)) {
        return NULL;
    }
    if (nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes must be >= 0");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "sums needs a sequence of buffers");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *views = PyMem_Calloc((size_t)(count ? count : 1), sizeof(Py_buffer));
    uint64_t *out = PyMem_Calloc((size_t)(count ? count : 1) * 2, sizeof(uint64_t));
    PyObject *result = NULL;
    Py_ssize_t held = 0;
    if (views == NULL || out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < count; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, held), &views[held],
                               PyBUF_SIMPLE) < 0) {
            goto done;
        }
        if (views[held].len < nbytes) {
            PyErr_Format(PyExc_ValueError, "buffer %zd has %zd bytes, fewer than %zd", held,
                         views[held].len, nbytes);
            held++;
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        block_fletcher((const uint8_t *)views[i].buf, nbytes, &out[2 * i], &out[2 * i + 1]);
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(count);
    for (Py_ssize_t i = 0; result != NULL && i < count; i++) {
        PyObject *pair = Py_BuildValue("(KK)", (unsigned long long)out[2 * i],
                                       (unsigned long long)out[2 * i + 1]);
        if (pair == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, pair);
    }
done:
    for (Py_ssize_t i = 0; i < held; i++) {
        PyBuffer_Release(&views[i]);
    }
    PyMem_Free(views);
    PyMem_Free(out);
    Py_DECREF(fast);
    return result;
}

/* ------------------------------------------------------------------ framing (seal / verify) */

#define TRAILER 72
#define HEAD 68
#define IDENT 32
#define FORMAT_VERSION 2
#define ALGO 1

enum {
    V_OK,
    V_BAD_LENGTH,
    V_BAD_MAGIC,
    V_BAD_TRAILER,
    V_BAD_VERSION,
    V_BAD_KEY,
    V_BAD_CHECKSUM,
    V_BAD_IDENTITY,
};

static uint32_t crc_table[256];

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) {
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        }
        crc_table[i] = c;
    }
}

/* zlib.crc32(data) (CRC-32/ISO-HDLC, starting value 0) */
static uint32_t crc32_bytes(const uint8_t *p, Py_ssize_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    for (Py_ssize_t i = 0; i < n; i++) {
        c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    }
    return c ^ 0xFFFFFFFFu;
}

static inline void store_le(uint8_t *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

static inline uint64_t load_le(const uint8_t *p, int bytes)
{
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; i--) {
        v = (v << 8) | p[i];
    }
    return v;
}

/* crc32 of key's UTF-8 bytes (surrogates passed through, as "surrogatepass"); -1 on error */
static int key_crc(PyObject *key, uint32_t *out)
{
    if (!PyUnicode_Check(key)) {
        PyErr_Format(PyExc_TypeError, "keys must be str, got %.80s", Py_TYPE(key)->tp_name);
        return -1;
    }
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(key, &n);
    if (utf8 != NULL) {
        *out = crc32_bytes((const uint8_t *)utf8, n);
        return 0;
    }
    if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
        return -1;
    }
    PyErr_Clear(); /* lone surrogates: encode as integrity._key_crc does */
    PyObject *raw = PyUnicode_AsEncodedString(key, "utf-8", "surrogatepass");
    if (raw == NULL) {
        return -1;
    }
    *out = crc32_bytes((const uint8_t *)PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw));
    Py_DECREF(raw);
    return 0;
}

/* Hold the ``count`` buffers of ``fast`` (writable if asked).  On error the buffers already
 * held are released and NULL is returned. */
static Py_buffer *hold_all(PyObject *fast, Py_ssize_t count, int flags)
{
    Py_buffer *views = PyMem_Calloc((size_t)(count ? count : 1), sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &views[i], flags) < 0) {
            for (Py_ssize_t j = 0; j < i; j++) {
                PyBuffer_Release(&views[j]);
            }
            PyMem_Free(views);
            return NULL;
        }
    }
    return views;
}

static void release_all(Py_buffer *views, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        PyBuffer_Release(&views[i]);
    }
    PyMem_Free(views);
}

/* the crc32 of every key; NULL (error set) on failure */
static uint32_t *key_crcs(PyObject *keys, Py_ssize_t count)
{
    uint32_t *crcs = PyMem_Calloc((size_t)(count ? count : 1), sizeof(uint32_t));
    if (crcs == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (key_crc(PySequence_Fast_GET_ITEM(keys, i), &crcs[i]) < 0) {
            PyMem_Free(crcs);
            return NULL;
        }
    }
    return crcs;
}

/* every identity (IDENT bytes each) copied into one block; NULL (error set) on failure */
static uint8_t *copy_identities(PyObject *identities, Py_ssize_t count)
{
    uint8_t *out = PyMem_Malloc((size_t)(count ? count : 1) * IDENT);
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *ident = PySequence_Fast_GET_ITEM(identities, i);
        if (!PyBytes_CheckExact(ident) || PyBytes_GET_SIZE(ident) != IDENT) {
            PyErr_Format(PyExc_ValueError, "identity %zd must be %d bytes", i, IDENT);
            PyMem_Free(out);
            return NULL;
        }
        memcpy(out + (size_t)i * IDENT, PyBytes_AS_STRING(ident), IDENT);
    }
    return out;
}

static void write_trailer(uint8_t *t, uint64_t n, uint64_t s1, uint64_t s2,
                          const uint8_t *ident, uint32_t kcrc)
{
    memcpy(t, "AKVP", 4);
    store_le(t + 4, FORMAT_VERSION, 2);
    store_le(t + 6, ALGO, 2);
    store_le(t + 8, n, 8);
    store_le(t + 16, s1, 8);
    store_le(t + 24, s2, 8);
    memcpy(t + 32, ident, IDENT);
    store_le(t + 64, kcrc, 4);
    store_le(t + 68, crc32_bytes(t, HEAD), 4);
}

static int check_frame(const uint8_t *p, Py_ssize_t len, Py_ssize_t got, const uint8_t *ident,
                       uint32_t kcrc)
{
    if (got != len || len <= TRAILER) {
        return V_BAD_LENGTH;
    }
    Py_ssize_t n = len - TRAILER;
    const uint8_t *t = p + n;
    if (memcmp(t, "AKVP", 4) != 0) {
        return V_BAD_MAGIC;
    }
    if (crc32_bytes(t, HEAD) != (uint32_t)load_le(t + 68, 4)) {
        return V_BAD_TRAILER;
    }
    if (load_le(t + 4, 2) != FORMAT_VERSION || load_le(t + 6, 2) != ALGO) {
        return V_BAD_VERSION;
    }
    if (load_le(t + 8, 8) != (uint64_t)n) {
        return V_BAD_LENGTH;
    }
    if ((uint32_t)load_le(t + 64, 4) != kcrc) {
        return V_BAD_KEY;
    }
    if (memcmp(t + 32, ident, IDENT) != 0) {
        return V_BAD_IDENTITY;
    }
    uint64_t s1, s2;
    block_fletcher(p, n, &s1, &s2);
    if (s1 != load_le(t + 16, 8) || s2 != load_le(t + 24, 8)) {
        return V_BAD_CHECKSUM;
    }
    return V_OK;
}

static PyObject *seal(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *seq, *keyseq, *identseq;
    if (!PyArg_ParseTuple(args, "OOO", &seq, &keyseq, &identseq)) {
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "seal needs a sequence of buffers");
    if (fast == NULL) {
        return NULL;
    }
    PyObject *keys = PySequence_Fast(keyseq, "seal needs a sequence of keys");
    if (keys == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    PyObject *idents = PySequence_Fast(identseq, "seal needs a sequence of identities");
    if (idents == NULL) {
        Py_DECREF(keys);
        Py_DECREF(fast);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *views = NULL;
    uint32_t *crcs = NULL;
    uint8_t *ids = NULL;
    if (PySequence_Fast_GET_SIZE(keys) != count || PySequence_Fast_GET_SIZE(idents) != count) {
        PyErr_SetString(PyExc_ValueError, "seal needs one key and one identity per buffer");
        goto done;
    }
    if ((crcs = key_crcs(keys, count)) == NULL || (ids = copy_identities(idents, count)) == NULL) {
        goto done;
    }
    if ((views = hold_all(fast, count, PyBUF_WRITABLE)) == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (views[i].len <= TRAILER) {
            PyErr_Format(PyExc_ValueError, "buffer %zd has %zd bytes, no room for the trailer",
                         i, views[i].len);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        uint8_t *p = (uint8_t *)views[i].buf;
        Py_ssize_t n = views[i].len - TRAILER;
        uint64_t s1, s2;
        block_fletcher(p, n, &s1, &s2);
        write_trailer(p + n, (uint64_t)n, s1, s2, ids + (size_t)i * IDENT, crcs[i]);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    if (views != NULL) {
        release_all(views, count);
    }
    PyMem_Free(crcs);
    PyMem_Free(ids);
    Py_DECREF(idents);
    Py_DECREF(keys);
    Py_DECREF(fast);
    return result;
}

static PyObject *verify(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *seq, *keyseq, *identseq, *sizeseq;
    if (!PyArg_ParseTuple(args, "OOOO", &seq, &keyseq, &identseq, &sizeseq)) {
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "verify needs a sequence of buffers");
    if (fast == NULL) {
        return NULL;
    }
    PyObject *keys = PySequence_Fast(keyseq, "verify needs a sequence of keys");
    if (keys == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    PyObject *idents = PySequence_Fast(identseq, "verify needs a sequence of identities");
    if (idents == NULL) {
        Py_DECREF(keys);
        Py_DECREF(fast);
        return NULL;
    }
    PyObject *sizes = PySequence_Fast(sizeseq, "verify needs a sequence of sizes");
    if (sizes == NULL) {
        Py_DECREF(idents);
        Py_DECREF(keys);
        Py_DECREF(fast);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *views = NULL;
    uint32_t *crcs = NULL;
    uint8_t *ids = NULL;
    Py_ssize_t *got = NULL;
    int *codes = NULL;
    if (PySequence_Fast_GET_SIZE(keys) != count || PySequence_Fast_GET_SIZE(sizes) != count ||
        PySequence_Fast_GET_SIZE(idents) != count) {
        PyErr_SetString(PyExc_ValueError,
                        "verify needs one key, one identity and one size per buffer");
        goto done;
    }
    got = PyMem_Calloc((size_t)(count ? count : 1), sizeof(Py_ssize_t));
    codes = PyMem_Calloc((size_t)(count ? count : 1), sizeof(int));
    if (got == NULL || codes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if ((crcs = key_crcs(keys, count)) == NULL || (ids = copy_identities(idents, count)) == NULL) {
        goto done;
    }
    if ((views = hold_all(fast, count, PyBUF_SIMPLE)) == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *size = PySequence_Fast_GET_ITEM(sizes, i);
        if (size == Py_None) {
            got[i] = views[i].len; /* None: the object filled the slot */
            continue;
        }
        got[i] = PyLong_AsSsize_t(size);
        if (got[i] == -1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                goto done;
            }
            PyErr_Clear(); /* an absurd size: not the slot's */
            got[i] = -1;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        codes[i] = check_frame((const uint8_t *)views[i].buf, views[i].len, got[i],
                               ids + (size_t)i * IDENT, crcs[i]);
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(count);
    for (Py_ssize_t i = 0; result != NULL && i < count; i++) {
        PyObject *code = PyLong_FromLong(codes[i]);
        if (code == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, code);
    }
done:
    if (views != NULL) {
        release_all(views, count);
    }
    PyMem_Free(crcs);
    PyMem_Free(ids);
    PyMem_Free(got);
    PyMem_Free(codes);
    Py_DECREF(sizes);
    Py_DECREF(idents);
    Py_DECREF(keys);
    Py_DECREF(fast);
    return result;
}

static PyMethodDef methods[] = {
    {"sums", sums, METH_VARARGS, "Block-Fletcher (S1, S2) of the first nbytes of each buffer."},
    {"seal", seal, METH_VARARGS, "Checksum each slot's payload and write its trailer."},
    {"verify", verify, METH_VARARGS, "Check each slot's frame; one verdict code per slot."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_blocksum", "Page checksums in C.", -1, methods, NULL, NULL,
    NULL, NULL,
};

PyMODINIT_FUNC PyInit__blocksum(void)
{
    crc_init();
    return PyModule_Create(&module);
}
