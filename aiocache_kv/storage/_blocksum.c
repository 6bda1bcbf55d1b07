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

static PyMethodDef methods[] = {
    {"sums", sums, METH_VARARGS, "Block-Fletcher (S1, S2) of the first nbytes of each buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_blocksum", "Page checksums in C.", -1, methods, NULL, NULL,
    NULL, NULL,
};

PyMODINIT_FUNC PyInit__blocksum(void) { return PyModule_Create(&module); }
