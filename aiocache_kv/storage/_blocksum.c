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
 *
 * Fused passes (storage/presum.py): seal takes an optional 4th argument, one presum per page
 * (the sum the copy that wrote the page took): where it covers the payload only the trailer is
 * written.  verify takes an optional 5th, the sums a read took as the bytes arrived
 * (_pageio.c): compared with the trailer's instead of summing again, and an optional 6th,
 * one writable row of 3 uint64 per page: then only the trailer is checked (the payload is
 * verified at load-back, storage/deferred.py) and its (S1, S2, payload bytes) go to the row
 * (bytes 0 where a check failed); scatter_check is the load-back's CPU copy that verifies those
 * pages block by block as it scatters them.  gather_sum is the CPU
 * device->host copy that sums each 16 KiB block right after gathering it (still in L1);
 * slot_sums sums host slots into the pool's table (a CUDA copy's waiter thread).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "_fletcher.h"
#include "_idlerun.h"

static void block_fletcher(const uint8_t *p, Py_ssize_t n, uint64_t *out1, uint64_t *out2)
{
    fl_sum(p, n, out1, out2);
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
                       uint32_t kcrc, const uint64_t *given, uint8_t *trailer_out)
{
    if (trailer_out != NULL) { /* trailer only: (S1, S2, n) go out, bytes 0 until checked */
        memset(trailer_out, 0, 24);
    }
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
    if (trailer_out != NULL) { /* the payload is verified later, by whoever reads it next */
        uint64_t row[3] = {load_le(t + 16, 8), load_le(t + 24, 8), (uint64_t)n};
        memcpy(trailer_out, row, sizeof(row));
        return V_OK;
    }
    uint64_t s1, s2;
    if (given != NULL && given[2] == (uint64_t)n) { /* summed while it was read */
        s1 = given[0];
        s2 = given[1];
    } else {
        block_fletcher(p, n, &s1, &s2);
    }
    if (s1 != load_le(t + 16, 8) || s2 != load_le(t + 24, 8)) {
        return V_BAD_CHECKSUM;
    }
    return V_OK;
}

/* The precomputed sums of ``count`` pages, 3 words each (S1, S2, payload bytes they cover; 0:
 * none), from ``presums`` (a sequence of None, (S1, S2, bytes) tuples, or buffers of at least 3
 * native uint64: a host pool's per-page row); all zero where ``presums`` is None.  NULL (error
 * set) on failure.  A sum is used only where its byte count is the payload's length. */
static uint64_t *read_presums(PyObject *presums, Py_ssize_t count)
{
    uint64_t *pre = PyMem_Calloc((size_t)(count ? count : 1) * 3, sizeof(uint64_t));
    if (pre == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    if (presums == NULL || presums == Py_None) {
        return pre;
    }
    /* a tuple copy: it holds every item while an item's __index__ (run by the int
     * conversions below) may change the caller's list */
    PyObject *fast = PySequence_Tuple(presums);
    if (fast == NULL) {
        PyMem_Free(pre);
        return NULL;
    }
    if (PyTuple_GET_SIZE(fast) != count) {
        PyErr_SetString(PyExc_ValueError, "one presum (or None) per buffer is needed");
        goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyTuple_GET_ITEM(fast, i);
        if (item == Py_None) {
            continue;
        }
        if (PyTuple_Check(item)) { /* (S1, S2, bytes) as ints */
            if (PyTuple_GET_SIZE(item) != 3) {
                PyErr_Format(PyExc_ValueError, "presum %zd must be (S1, S2, bytes)", i);
                goto fail;
            }
            for (int k = 0; k < 3; k++) {
                pre[3 * i + k] = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(item, k));
                if (pre[3 * i + k] == (uint64_t)-1 && PyErr_Occurred()) {
                    goto fail;
                }
            }
            continue;
        }
        Py_buffer b;
        if (PyObject_GetBuffer(item, &b, PyBUF_SIMPLE) < 0) {
            goto fail;
        }
        if (b.len < (Py_ssize_t)(3 * sizeof(uint64_t))) {
            PyBuffer_Release(&b);
            PyErr_Format(PyExc_ValueError, "presum %zd has %zd bytes, fewer than 24", i, b.len);
            goto fail;
        }
        memcpy(pre + 3 * i, b.buf, 3 * sizeof(uint64_t));
        PyBuffer_Release(&b);
    }
    Py_DECREF(fast);
    return pre;
fail:
    Py_DECREF(fast);
    PyMem_Free(pre);
    return NULL;
}

static PyObject *seal(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *seq, *keyseq, *identseq, *preseq = NULL;
    if (!PyArg_ParseTuple(args, "OOO|O", &seq, &keyseq, &identseq, &preseq)) {
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
    uint64_t *pre = NULL;
    if (PySequence_Fast_GET_SIZE(keys) != count || PySequence_Fast_GET_SIZE(idents) != count) {
        PyErr_SetString(PyExc_ValueError, "seal needs one key and one identity per buffer");
        goto done;
    }
    if ((crcs = key_crcs(keys, count)) == NULL || (ids = copy_identities(idents, count)) == NULL) {
        goto done;
    }
    if ((pre = read_presums(preseq, count)) == NULL) {
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
        if (n > 0 && pre[3 * i + 2] == (uint64_t)n) { /* taken by the copy that wrote it */
            s1 = pre[3 * i];
            s2 = pre[3 * i + 1];
        } else {
            block_fletcher(p, n, &s1, &s2);
        }
        write_trailer(p + n, (uint64_t)n, s1, s2, ids + (size_t)i * IDENT, crcs[i]);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    if (views != NULL) {
        release_all(views, count);
    }
    PyMem_Free(pre);
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
    PyObject *seq, *keyseq, *identseq, *sizeseq, *givenseq = NULL, *outseq = NULL;
    if (!PyArg_ParseTuple(args, "OOOO|OO", &seq, &keyseq, &identseq, &sizeseq, &givenseq,
                          &outseq)) {
        return NULL;
    }
    if (outseq == Py_None) {
        outseq = NULL;
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
    uint64_t *given = NULL;
    PyObject *outfast = NULL;
    Py_buffer *outs = NULL;
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
    if ((given = read_presums(givenseq, count)) == NULL) {
        goto done;
    }
    if ((views = hold_all(fast, count, PyBUF_SIMPLE)) == NULL) {
        goto done;
    }
    if (outseq != NULL) { /* trailer only: one writable row of 3 uint64 per page */
        if ((outfast = PySequence_Fast(outseq, "verify's rows must be a sequence")) == NULL) {
            goto done;
        }
        if (PySequence_Fast_GET_SIZE(outfast) != count) {
            PyErr_SetString(PyExc_ValueError, "verify needs one row per buffer");
            goto done;
        }
        if ((outs = hold_all(outfast, count, PyBUF_WRITABLE)) == NULL) {
            goto done;
        }
        for (Py_ssize_t i = 0; i < count; i++) {
            if (outs[i].len < 24) {
                PyErr_Format(PyExc_ValueError, "row %zd holds %zd bytes, not 3 uint64", i,
                             outs[i].len);
                goto done;
            }
        }
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
                               ids + (size_t)i * IDENT, crcs[i], given + 3 * i,
                               outs != NULL ? (uint8_t *)outs[i].buf : NULL);
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
    if (outs != NULL) {
        release_all(outs, count);
    }
    Py_XDECREF(outfast);
    PyMem_Free(crcs);
    PyMem_Free(ids);
    PyMem_Free(got);
    PyMem_Free(codes);
    PyMem_Free(given);
    Py_DECREF(sizes);
    Py_DECREF(idents);
    Py_DECREF(keys);
    Py_DECREF(fast);
    return result;
}

/* ------------------------------------------------------- sums taken by the copy (fused) */

/* the int64 page ids of ``obj`` (a C-contiguous buffer); -1 (error set) on failure */
/* Whether ``extent`` bytes at ``page * stride`` lie within ``len`` bytes, computed without
 * overflow (``page`` from the caller: any value; ``stride`` > 0, ``extent`` >= 0). */
static int span_fits(int64_t page, Py_ssize_t stride, Py_ssize_t extent, Py_ssize_t len)
{
    if (page < 0 || extent < 0 || extent > len) {
        return 0;
    }
    return (uint64_t)page <= (uint64_t)((len - extent) / stride);
}

/* ``nseg`` segments of ``seg`` bytes, ``stride`` apart: their byte count (``*n``) and the
 * extent from the first byte to the last (``*extent``); 0 on overflow or a bad geometry. */
static int segments(Py_ssize_t seg, Py_ssize_t nseg, Py_ssize_t stride, Py_ssize_t *n,
                    Py_ssize_t *extent)
{
    if (seg <= 0 || nseg <= 0 || stride < 0 || nseg > PY_SSIZE_T_MAX / seg) {
        return 0;
    }
    if (stride > 0 && nseg - 1 > (PY_SSIZE_T_MAX - seg) / stride) {
        return 0;
    }
    *n = seg * nseg;
    *extent = seg + (nseg - 1) * stride;
    return 1;
}

static int hold_ids(PyObject *obj, Py_buffer *b, const char *what)
{
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    if (b->itemsize != 8 || b->format == NULL || (strcmp(b->format, "l") != 0 &&
                                                  strcmp(b->format, "q") != 0 &&
                                                  strcmp(b->format, "<q") != 0 &&
                                                  strcmp(b->format, "=q") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be int64 page ids", what);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* the table a copy writes its sums to: None, or a writable buffer of rows * 3 uint64 */
static int hold_table(PyObject *obj, Py_buffer *b)
{
    if (obj == Py_None) {
        b->obj = NULL;
        b->buf = NULL;
        b->len = 0;
        return 0;
    }
    return PyObject_GetBuffer(obj, b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS);
}

static void put_sum(Py_buffer *table, int64_t row, uint64_t s1, uint64_t s2, uint64_t n)
{
    uint64_t *r = (uint64_t *)table->buf + 3 * row;
    r[0] = s1;
    r[1] = s2;
    r[2] = n;
}

/* gather_sum(src, seg_bytes, nseg, seg_stride, src_pages, dst, slot_bytes, dst_pages, table)
 *
 * The CPU device->host page copy with the page checksum taken in the same pass.  Source page
 * s is ``nseg`` segments of ``seg_bytes`` at ``src + j * seg_stride + s * seg_bytes`` (the device
 * layout [layers, 2, pages, elems]: one segment per layer and K/V); destination page d is the
 * contiguous payload of ``nseg * seg_bytes`` at ``dst + d * slot_bytes`` (a host pool slot).
 * Each 16 KiB block of the payload is gathered and then summed at once, while it is still in
 * the L1 cache, so the checksum costs no second read of memory.  ``table`` (None, or a buffer
 * of rows x 3 uint64) gets (S1, S2, payload bytes) in row d; without one no sum is taken (a
 * plain gather).  Runs without the GIL. */
typedef struct {
    const uint8_t *src;
    uint8_t *dst;
    const int64_t *si, *di;
    Py_ssize_t seg, nseg, seg_stride, slot;
    Py_buffer *table;
} gather_part;

static void gather_range(void *arg, Py_ssize_t first, Py_ssize_t last)
{
    gather_part *g = (gather_part *)arg;
    Py_ssize_t seg = g->seg, n = g->seg * g->nseg;
    if (g->table->buf == NULL) { /* no table: a plain gather, one memcpy per segment */
        for (Py_ssize_t i = first; i < last; i++) {
            const uint8_t *from = g->src + g->si[i] * seg;
            uint8_t *to = g->dst + g->di[i] * g->slot;
            for (Py_ssize_t j = 0; j < g->nseg; j++) {
                memcpy(to + j * seg, from + j * g->seg_stride, (size_t)seg);
            }
        }
        return;
    }
    for (Py_ssize_t i = first; i < last; i++) {
        const uint8_t *from = g->src + g->si[i] * seg;
        uint8_t *to = g->dst + g->di[i] * g->slot;
        uint64_t s1 = 0, s2 = 0;
        Py_ssize_t pos = 0, block = 0;
        while (pos < n) {
            Py_ssize_t j = pos / seg, off = pos % seg;
            Py_ssize_t end = (pos / FL_BLOCK_BYTES + 1) * FL_BLOCK_BYTES;
            Py_ssize_t piece = seg - off;
            if (pos + piece > end) {
                piece = end - pos;
            }
            if (pos + piece > n) {
                piece = n - pos;
            }
            memcpy(to + pos, from + j * g->seg_stride + off, (size_t)piece);
            pos += piece;
            if (pos % FL_BLOCK_BYTES == 0) { /* a whole block landed: sum it while in L1 */
                fl_blocks(to, block, block + 1, &s1, &s2);
                block++;
            }
        }
        fl_finish(to, n, &s1, &s2);
        if (g->table->buf != NULL) {
            put_sum(g->table, g->di[i], s1, s2, (uint64_t)n);
        }
    }
}

/* at least this many bytes per thread of a gather_sum (a thread costs tens of microseconds) */
#define GATHER_BYTES_PER_THREAD (2 << 20)
#define GATHER_MAX_THREADS 16

/* threads for a copy of ``count`` pages of ``n`` bytes over up to ``threads`` threads: at
 * least GATHER_BYTES_PER_THREAD each, one at least */
static int copy_parts(int threads, Py_ssize_t count, Py_ssize_t n)
{
    Py_ssize_t parts = threads < 1 ? 1 : (threads > GATHER_MAX_THREADS ? GATHER_MAX_THREADS : threads);
    Py_ssize_t by_size =
        count > PY_SSIZE_T_MAX / n ? PY_SSIZE_T_MAX : count * n / GATHER_BYTES_PER_THREAD;
    if (parts > by_size) {
        parts = by_size < 1 ? 1 : by_size;
    }
    if (parts > count) {
        parts = count < 1 ? 1 : count;
    }
    return (int)parts;
}

static PyObject *gather_sum(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *srcobj, *srcids, *dstobj, *dstids, *tableobj;
    Py_ssize_t seg, nseg, seg_stride, slot;
    int threads = 1;
    long long relief_ns = 0;
    if (!PyArg_ParseTuple(args, "OnnnOOnOO|iL", &srcobj, &seg, &nseg, &seg_stride, &srcids,
                          &dstobj, &slot, &dstids, &tableobj, &threads, &relief_ns)) {
        return NULL;
    }
    Py_buffer src = {0}, dst = {0}, sp = {0}, dp = {0}, table = {0};
    int held = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(srcobj, &src, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    held = 1;
    if (PyObject_GetBuffer(dstobj, &dst, PyBUF_WRITABLE) < 0) {
        goto done;
    }
    held = 2;
    if (hold_ids(srcids, &sp, "src_pages") < 0) {
        goto done;
    }
    held = 3;
    if (hold_ids(dstids, &dp, "dst_pages") < 0) {
        goto done;
    }
    held = 4;
    if (hold_table(tableobj, &table) < 0) {
        goto done;
    }
    held = 5;
    Py_ssize_t count = sp.len / 8;
    Py_ssize_t n = 0, extent = 0;
    if (dp.len / 8 != count) {
        PyErr_SetString(PyExc_ValueError, "src_pages and dst_pages differ in length");
        goto done;
    }
    if (!segments(seg, nseg, seg_stride, &n, &extent) || n > slot || slot <= 0) {
        PyErr_Format(PyExc_ValueError, "bad geometry: seg %zd x %zd, stride %zd, slot %zd", seg,
                     nseg, seg_stride, slot);
        goto done;
    }
    const Py_ssize_t row = 3 * (Py_ssize_t)sizeof(uint64_t);
    const int64_t *si = (const int64_t *)sp.buf, *di = (const int64_t *)dp.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t s = si[i], d = di[i];
        if (!span_fits(s, seg, extent, src.len) || !span_fits(d, slot, n, dst.len) ||
            (table.buf != NULL && !span_fits(d, row, row, table.len))) {
            PyErr_Format(PyExc_IndexError, "page pair %zd (%lld -> %lld) out of range", i,
                         (long long)s, (long long)d);
            goto done;
        }
    }
    gather_part work = {(const uint8_t *)src.buf, (uint8_t *)dst.buf, si, di, seg, nseg,
                        seg_stride, slot, &table};
    int parts = copy_parts(threads, count, n);
    Py_BEGIN_ALLOW_THREADS
    ir_execute(gather_range, &work, count, n, parts, (int64_t)relief_ns);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    if (held >= 5 && table.obj != NULL) {
        PyBuffer_Release(&table);
    }
    if (held >= 4) {
        PyBuffer_Release(&dp);
    }
    if (held >= 3) {
        PyBuffer_Release(&sp);
    }
    if (held >= 2) {
        PyBuffer_Release(&dst);
    }
    PyBuffer_Release(&src);
    return result;
}

/* scatter_check(src, slot_bytes, src_pages, dst, seg_bytes, nseg, seg_stride, dst_pages,
 *               expect, threads) -> the position of the first page that failed, or -1
 *
 * The CPU host->device page copy of a load-back, with the deferred verification of pages a
 * Mooncake prefetch read unverified (storage/deferred.py) taken in the same pass: gather_sum
 * the other way.  Source page s is the contiguous payload of ``nseg * seg_bytes`` at
 * ``src + s * slot_bytes`` (a host pool slot); destination page d is ``nseg`` segments at
 * ``dst + j * seg_stride + d * seg_bytes`` (the device layout).  Each 16 KiB block of the payload
 * is summed and then scattered while it is in L1.  ``expect`` (None, or count x 3 uint64, by
 * position): where a row's bytes are not 0 the page's (S1, S2, bytes) must equal it; a thread
 * stops at the first page that does not (that page was copied: its device page must be freed
 * unread), so the result is the first failure in the order of the pages.  Runs without the
 * GIL. */
typedef struct {
    const uint8_t *src;
    uint8_t *dst;
    const int64_t *si, *di;
    Py_ssize_t seg, nseg, seg_stride, slot;
    Py_ssize_t bad; /* atomic: the first page that failed so far, or PY_SSIZE_T_MAX */
    const uint64_t *expect;
} scatter_part;

static void scatter_range(void *arg, Py_ssize_t first, Py_ssize_t last)
{
    scatter_part *g = (scatter_part *)arg;
    Py_ssize_t seg = g->seg, n = g->seg * g->nseg;
    for (Py_ssize_t i = first; i < last; i++) {
        const uint8_t *from = g->src + g->si[i] * g->slot;
        uint8_t *to = g->dst + g->di[i] * seg;
        const uint64_t *want = g->expect != NULL ? g->expect + 3 * i : NULL;
        int check = want != NULL && want[2] != 0;
        uint64_t s1 = 0, s2 = 0;
        Py_ssize_t pos = 0, block = 0;
        while (pos < n) {
            Py_ssize_t end = (pos / FL_BLOCK_BYTES + 1) * FL_BLOCK_BYTES;
            if (end > n) {
                end = n;
            }
            if (check && end - pos == FL_BLOCK_BYTES) { /* a whole block: sum it, then copy */
                fl_blocks(from, block, block + 1, &s1, &s2);
                block++;
            }
            for (Py_ssize_t p = pos; p < end;) {
                Py_ssize_t j = p / seg, off = p % seg, piece = seg - off;
                if (p + piece > end) {
                    piece = end - p;
                }
                memcpy(to + j * g->seg_stride + off, from + p, (size_t)piece);
                p += piece;
            }
            pos = end;
        }
        if (check) {
            fl_finish(from, n, &s1, &s2);
            if (want[2] != (uint64_t)n || want[0] != s1 || want[1] != s2) {
                Py_ssize_t seen = __atomic_load_n(&g->bad, __ATOMIC_ACQUIRE);
                while (i < seen && !__atomic_compare_exchange_n(&g->bad, &seen, i, 0,
                                                                __ATOMIC_ACQ_REL,
                                                                __ATOMIC_ACQUIRE)) {
                }
                return; /* the rest of this chunk is not copied (freed unread) */
            }
        }
    }
}

static PyObject *scatter_check(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *srcobj, *srcids, *dstobj, *dstids, *expobj;
    Py_ssize_t seg, nseg, seg_stride, slot;
    int threads = 1;
    long long relief_ns = 0;
    if (!PyArg_ParseTuple(args, "OnOOnnnOO|iL", &srcobj, &slot, &srcids, &dstobj, &seg, &nseg,
                          &seg_stride, &dstids, &expobj, &threads, &relief_ns)) {
        return NULL;
    }
    Py_buffer src = {0}, dst = {0}, sp = {0}, dp = {0}, exp = {0};
    int held = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(srcobj, &src, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    held = 1;
    if (PyObject_GetBuffer(dstobj, &dst, PyBUF_WRITABLE) < 0) {
        goto done;
    }
    held = 2;
    if (hold_ids(srcids, &sp, "src_pages") < 0) {
        goto done;
    }
    held = 3;
    if (hold_ids(dstids, &dp, "dst_pages") < 0) {
        goto done;
    }
    held = 4;
    if (expobj != Py_None && PyObject_GetBuffer(expobj, &exp, PyBUF_C_CONTIGUOUS) < 0) {
        goto done;
    }
    held = 5;
    Py_ssize_t count = sp.len / 8;
    Py_ssize_t n = 0, extent = 0;
    if (dp.len / 8 != count) {
        PyErr_SetString(PyExc_ValueError, "src_pages and dst_pages differ in length");
        goto done;
    }
    if (exp.obj != NULL && exp.len / (3 * (Py_ssize_t)sizeof(uint64_t)) < count) {
        PyErr_SetString(PyExc_ValueError, "expect needs one (S1, S2, bytes) row per page");
        goto done;
    }
    if (!segments(seg, nseg, seg_stride, &n, &extent) || n > slot || slot <= 0) {
        PyErr_Format(PyExc_ValueError, "bad geometry: seg %zd x %zd, stride %zd, slot %zd", seg,
                     nseg, seg_stride, slot);
        goto done;
    }
    const int64_t *si = (const int64_t *)sp.buf, *di = (const int64_t *)dp.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t s = si[i], d = di[i];
        if (!span_fits(s, slot, n, src.len) || !span_fits(d, seg, extent, dst.len)) {
            PyErr_Format(PyExc_IndexError, "page pair %zd (%lld -> %lld) out of range", i,
                         (long long)s, (long long)d);
            goto done;
        }
    }
    scatter_part work = {(const uint8_t *)src.buf, (uint8_t *)dst.buf, si, di, seg, nseg,
                         seg_stride, slot, PY_SSIZE_T_MAX, (const uint64_t *)exp.buf};
    int parts = copy_parts(threads, count, n);
    Py_BEGIN_ALLOW_THREADS
    ir_execute(scatter_range, &work, count, n, parts, (int64_t)relief_ns);
    Py_END_ALLOW_THREADS
    Py_ssize_t bad = work.bad == PY_SSIZE_T_MAX ? -1 : work.bad;
    result = PyLong_FromSsize_t(bad);
done:
    if (held >= 5 && exp.obj != NULL) {
        PyBuffer_Release(&exp);
    }
    if (held >= 4) {
        PyBuffer_Release(&dp);
    }
    if (held >= 3) {
        PyBuffer_Release(&sp);
    }
    if (held >= 2) {
        PyBuffer_Release(&dst);
    }
    PyBuffer_Release(&src);
    return result;
}

/* slot_sums(dst, slot_bytes, nbytes, pages, table): the sums of the first ``nbytes`` of each
 * slot ``pages[i]`` of ``dst`` (rows ``slot_bytes`` apart) into row pages[i] of ``table``
 * (a CUDA copy's pinned destination, summed by its waiter thread right after its event). */
static PyObject *slot_sums(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *dstobj, *ids, *tableobj;
    Py_ssize_t slot, n;
    if (!PyArg_ParseTuple(args, "OnnOO", &dstobj, &slot, &n, &ids, &tableobj)) {
        return NULL;
    }
    Py_buffer dst = {0}, dp = {0}, table = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(dstobj, &dst, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (hold_ids(ids, &dp, "pages") < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (PyObject_GetBuffer(tableobj, &table, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        goto done2;
    }
    Py_ssize_t count = dp.len / 8;
    const int64_t *di = (const int64_t *)dp.buf;
    if (n <= 0 || slot < n) {
        PyErr_Format(PyExc_ValueError, "bad geometry: %zd bytes of %zd-byte slots", n, slot);
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        const Py_ssize_t row = 3 * (Py_ssize_t)sizeof(uint64_t);
        if (!span_fits(di[i], slot, n, dst.len) || !span_fits(di[i], row, row, table.len)) {
            PyErr_Format(PyExc_IndexError, "page %lld out of range", (long long)di[i]);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t s1, s2;
        fl_sum((const uint8_t *)dst.buf + di[i] * slot, n, &s1, &s2);
        put_sum(&table, di[i], s1, s2, (uint64_t)n);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&table);
done2:
    PyBuffer_Release(&dp);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"gather_sum", gather_sum, METH_VARARGS,
     "Device->host page copy (CPU) with each page's checksum taken in the same pass."},
    {"slot_sums", slot_sums, METH_VARARGS, "Checksums of host slots into a per-page table."},
    {"scatter_check", scatter_check, METH_VARARGS,
     "Host->device page copy (CPU) verifying pages against expected checksums in the same pass."},
    {"idle_ready", idle_ready, METH_NOARGS, "Whether a copy now would run on idle helpers."},
    {"idle_forget", idle_forget, METH_NOARGS, "Forget the idle helpers' starvation history."},
    {"idle_stats", idle_stats, METH_NOARGS,
     "(copies run on idle helpers, copies their caller relieved, chunks it took)."},
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
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "IDLE_INLINE_BYTES", IR_INLINE_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
