/* Batched page-file reads and writes for FileStorage, in C: the optional fast path of
 * aiocache_kv/storage/page_file.py (whose read_into() is the reference and says what a read
 * is).  A read of one page is four system calls (open, fstat, preadv, close); from Python each
 * releases and re-takes the GIL, and with the event loop and a second worker wanting it too,
 * every re-take waits its turn.  Here a whole batch runs with the GIL released once.
 *
 * read_pages(reads) -> list of (status, value), one per read.
 *   reads: a list of (dir_fd, name: bytes, header: writable buffer, slot: writable buffer).
 *   Each name is opened relative to dir_fd with O_RDONLY | O_NOFOLLOW | O_NONBLOCK |
 *   O_CLOEXEC, must be a regular file (fstat), and is read with preadv into header, slot and
 *   one byte past the slot, from offset 0 until the three are full or the file ends.
 *   status 0: read, value = bytes read (header + slot + at most one more);
 *   status 1: no such file;
 *   status 2: not a regular file (a link, FIFO, socket, device or directory) or no permission;
 *   status 3: any other failure, value = errno.
 * Nothing else is touched: the caller checks the header and verifies the slot.
 *
 * read_pages(reads, True) also sums each page as it arrives (the integrity pass fused into the
 * read): the slot is read in pieces of at most SUM_PIECE bytes, and each complete 16 KiB block
 * of its payload (the slot less its 72-byte trailer) is summed right after its piece landed,
 * while it is still in the cache, with the block-Fletcher checksum of integrity.py
 * (_fletcher.h).  Each result is then (status, value, S1, S2, bytes summed): bytes summed is the
 * payload's length where the read filled the slot, else 0 (the caller then has no sum).
 *
 * read_named(shard_fds, suffix, names, keys, slots) -> list of (status, value, S1, S2, bytes
 * summed), one per page: read_pages(reads, True) of the pages of a FileStorage get, each
 * file's name and shard as write_named below makes them and its header read into memory of
 * its own and judged here (page_file.judge: status 4 bad length, 5 bad magic, 6 another key;
 * 0 only for a page read in full with the right header, summed).  A shard descriptor < 0 is
 * status 3 with value = -descriptor.  page_file.read_chunk() page by page is the reference.
 *
 * write_named(shard_fds, suffix, names, keys, parents, slots) -> list of int, one per page.
 *   The pages of a FileStorage put, each file's name, shard and header made here, not in
 *   Python.  names[i]: a str of NAME_HEX lowercase hex digits; the file is names[i] + suffix
 *   (bytes) in the directory shard_fds[int(names[i][:2], 16)] (a list of 256 ints: a
 *   descriptor, or -errno for a shard that cannot be used: then that is the page's result and
 *   nothing is touched).  The header is page_file.header_for(keys[i], parents[i]): MAGIC, the
 *   key's length (u32, little-endian), the parent's 20-byte digest (parents[i]: None, or a
 *   name as above) or zeros, then the key (bytes).  slots[i]: any buffer.  Each file is created
 *   with O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, mode 0644 (so an
 *   existing name of any kind, a link included, is never opened), and header + slot are
 *   written with writev, continued after a short write.  value >= 0: written, value = the
 *   file size; value < 0: -errno.  A file this call created and failed to fill is unlinked; on
 *   EEXIST nothing was created and nothing is touched.  page_file.write_named() is the
 *   reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#include <string.h>

#include "_fletcher.h"

#define TRAILER 72
/* bytes of the slot one preadv reads when summing: well inside the 2 MiB L2 of the project
 * machine, and a multiple of the 16 KiB checksum block */
#define SUM_PIECE (256 * 1024)

#ifndef O_CLOEXEC
#define O_CLOEXEC 0
#endif

enum { READ_OK = 0, READ_MISSING = 1, READ_NOT_REGULAR = 2, READ_FAILED = 3 };

typedef struct {
    int dir_fd;
    const char *name;
    Py_buffer header;
    Py_buffer slot;
    int status;
    long long value;
    int sum; /* sum the payload as it arrives */
    uint64_t s1, s2, summed;
} page_read;

static void read_one(page_read *r)
{
    int fd;
    do {
        fd = openat(r->dir_fd, r->name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT) {
            r->status = READ_MISSING;
        } else if (e == ELOOP || e == ENXIO || e == EMLINK || e == EACCES || e == EPERM) {
            r->status = READ_NOT_REGULAR;
        } else {
            r->status = READ_FAILED;
            r->value = e;
        }
        return;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        r->status = READ_FAILED;
        r->value = errno;
        close(fd);
        return;
    }
    if (!S_ISREG(st.st_mode)) {
        r->status = READ_NOT_REGULAR;
        close(fd);
        return;
    }
    char extra[1];
    char *parts[3] = {(char *)r->header.buf, (char *)r->slot.buf, extra};
    size_t sizes[3] = {(size_t)r->header.len, (size_t)r->slot.len, 1};
    size_t want = sizes[0] + sizes[1];
    size_t got = 0;
    /* summing: the payload's complete blocks summed so far */
    Py_ssize_t payload = r->slot.len > TRAILER ? r->slot.len - TRAILER : 0;
    Py_ssize_t blocks = 0, nblocks = payload / FL_BLOCK_BYTES;
    uint64_t s1 = 0, s2 = 0;
    for (;;) {
        struct iovec iov[3];
        int cnt = 0;
        size_t skip = got;
        /* summing: stop this read at the next SUM_PIECE boundary of the slot */
        size_t limit = (size_t)-1;
        if (r->sum) {
            size_t at = got > sizes[0] ? got - sizes[0] : 0;
            size_t stop = (at / SUM_PIECE + 1) * SUM_PIECE;
            if (stop < sizes[1]) {
                limit = sizes[0] + stop - got;
            }
        }
        for (int i = 0; i < 3 && limit > 0; i++) {
            if (skip >= sizes[i]) {
                skip -= sizes[i];
                continue;
            }
            size_t len = sizes[i] - skip;
            if (len > limit) {
                len = limit;
            }
            iov[cnt].iov_base = parts[i] + skip;
            iov[cnt].iov_len = len;
            limit -= len;
            skip = 0;
            cnt++;
        }
        ssize_t n = preadv(fd, iov, cnt, (off_t)got);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            r->status = READ_FAILED;
            r->value = errno;
            close(fd);
            return;
        }
        if (n == 0) {
            break; /* end of file: a short (truncated) file */
        }
        got += (size_t)n;
        if (r->sum && got > sizes[0]) { /* sum the blocks that are complete now, still hot */
            size_t at = got - sizes[0];
            Py_ssize_t ready = (Py_ssize_t)(at < (size_t)payload ? at : (size_t)payload);
            Py_ssize_t upto = ready / FL_BLOCK_BYTES;
            fl_blocks((const uint8_t *)r->slot.buf, blocks, upto, &s1, &s2);
            blocks = upto;
        }
        if (got >= want) {
            break; /* header and slot full (and perhaps the byte past them) */
        }
    }
    close(fd);
    r->status = READ_OK;
    r->value = (long long)got;
    if (r->sum && got == want && payload > 0 && blocks == nblocks) {
        fl_finish((const uint8_t *)r->slot.buf, payload, &s1, &s2);
        r->s1 = s1;
        r->s2 = s2;
        r->summed = (uint64_t)payload;
    }
}

static PyObject *read_pages(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *arg;
    int sum = 0;
    if (!PyArg_ParseTuple(args, "O|p", &arg, &sum)) {
        return NULL;
    }
    if (!PyList_CheckExact(arg)) {
        PyErr_SetString(PyExc_TypeError, "read_pages needs a list of reads");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    page_read *reads = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(page_read));
    if (reads == NULL) {
        return PyErr_NoMemory();
    }
    Py_ssize_t ready = 0; /* reads whose two buffers are held */
    PyObject *out = NULL;
    for (; ready < n; ready++) {
        PyObject *item = PyList_GET_ITEM(arg, ready);
        page_read *r = &reads[ready];
        r->sum = sum;
        PyObject *name;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) {
            PyErr_SetString(PyExc_TypeError, "a read is (dir_fd, name, header, slot)");
            goto done;
        }
        r->dir_fd = (int)PyLong_AsLong(PyTuple_GET_ITEM(item, 0));
        if (r->dir_fd == -1 && PyErr_Occurred()) {
            goto done;
        }
        name = PyTuple_GET_ITEM(item, 1);
        if (!PyBytes_Check(name)) {
            PyErr_SetString(PyExc_TypeError, "a read's name must be bytes");
            goto done;
        }
        r->name = PyBytes_AS_STRING(name); /* the list keeps the bytes alive */
        if ((Py_ssize_t)strlen(r->name) != PyBytes_GET_SIZE(name)) {
            PyErr_SetString(PyExc_ValueError, "a read's name contains a NUL byte");
            goto done;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 2), &r->header, PyBUF_WRITABLE) < 0) {
            goto done;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 3), &r->slot, PyBUF_WRITABLE) < 0) {
            PyBuffer_Release(&r->header);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        read_one(&reads[i]);
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    if (out == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        page_read *r = &reads[i];
        PyObject *t = sum ? Py_BuildValue("iLKKK", r->status, r->value, (unsigned long long)r->s1,
                                          (unsigned long long)r->s2,
                                          (unsigned long long)r->summed)
                          : Py_BuildValue("iL", r->status, r->value);
        if (t == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, t);
    }
done:
    for (Py_ssize_t i = 0; i < ready; i++) {
        PyBuffer_Release(&reads[i].header);
        PyBuffer_Release(&reads[i].slot);
    }
    PyMem_Free(reads);
    return out;
}

typedef struct {
    int dir_fd;
    const char *name;
    Py_buffer header;
    Py_buffer slot;
    long long value;
} page_write;

static void write_one(page_write *w)
{
    int fd;
    do {
        fd = openat(w->dir_fd, w->name,
                    O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        w->value = -(long long)errno;
        return;
    }
    const char *parts[2] = {(const char *)w->header.buf, (const char *)w->slot.buf};
    size_t sizes[2] = {(size_t)w->header.len, (size_t)w->slot.len};
    size_t want = sizes[0] + sizes[1];
    size_t done = 0;
    int err = 0;
    while (done < want) {
        struct iovec iov[2];
        int cnt = 0;
        size_t skip = done;
        for (int i = 0; i < 2; i++) {
            if (skip >= sizes[i]) {
                skip -= sizes[i];
                continue;
            }
            iov[cnt].iov_base = (void *)(parts[i] + skip);
            iov[cnt].iov_len = sizes[i] - skip;
            skip = 0;
            cnt++;
        }
        ssize_t n = writev(fd, iov, cnt);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            err = errno;
            break;
        }
        if (n == 0) {
            err = EIO; /* no progress: give up rather than spin */
            break;
        }
        done += (size_t)n;
    }
    if (close(fd) != 0 && err == 0 && errno != EINTR) {
        err = errno;
    }
    if (err != 0) {
        unlinkat(w->dir_fd, w->name, 0); /* ours (O_EXCL): the name itself, quietly */
        w->value = -(long long)err;
        return;
    }
    w->value = (long long)want;
}

#define NAME_HEX 40
#define DIGEST 20
#define HEAD_FIXED (4 + 4 + DIGEST)
#define MAX_NAME 255

static int hex_value(char c)
{
    if (c >= '0' && c <= '9') {
        return c - '0';
    }
    if (c >= 'a' && c <= 'f') {
        return c - 'a' + 10;
    }
    return -1;
}

/* the NAME_HEX lowercase hex digits of str ``obj`` (NULL: not such a str; error set) */
static const char *hex_name(PyObject *obj, const char *what, Py_ssize_t i)
{
    Py_ssize_t len;
    const char *p = PyUnicode_Check(obj) ? PyUnicode_AsUTF8AndSize(obj, &len) : NULL;
    if (p == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "%s %zd must be a str", what, i);
        }
        return NULL;
    }
    if (len != NAME_HEX) {
        PyErr_Format(PyExc_ValueError, "%s %zd has %zd characters, not %d", what, i, len,
                     NAME_HEX);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < len; k++) {
        if (hex_value(p[k]) < 0) {
            PyErr_Format(PyExc_ValueError, "%s %zd is not lowercase hex", what, i);
            return NULL;
        }
    }
    return p;
}

/* the 256 shard descriptors of list ``fdlist`` into ``fds``; -1 with an exception set */
static int shard_table(PyObject *fdlist, int *fds)
{
    if (PyList_GET_SIZE(fdlist) != 256) {
        PyErr_SetString(PyExc_ValueError, "256 shard descriptors are needed");
        return -1;
    }
    for (int k = 0; k < 256; k++) {
        long v = PyLong_AsLong(PyList_GET_ITEM(fdlist, k));
        if (v == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (v < INT_MIN || v > INT_MAX) {
            PyErr_Format(PyExc_ValueError, "shard descriptor %d out of range", k);
            return -1;
        }
        fds[k] = (int)v;
    }
    return 0;
}

static int check_suffix(const char *suffix, Py_ssize_t suffix_len)
{
    if ((Py_ssize_t)strlen(suffix) != suffix_len || NAME_HEX + suffix_len > MAX_NAME) {
        PyErr_SetString(PyExc_ValueError, "bad suffix (a NUL byte, or too long)");
        return -1;
    }
    return 0;
}

/* the bytes the headers of ``keys`` (n bytes objects) take, into *room; -1 with an
 * exception set when a key is not bytes or is too long */
static int key_room(PyObject *keys, Py_ssize_t n, size_t *room)
{
    *room = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyBytes_Check(key)) {
            PyErr_Format(PyExc_TypeError, "key %zd must be bytes", i);
            return -1;
        }
        if ((size_t)PyBytes_GET_SIZE(key) > UINT32_MAX) {
            PyErr_Format(PyExc_ValueError, "key %zd is too long", i);
            return -1;
        }
        *room += HEAD_FIXED + (size_t)PyBytes_GET_SIZE(key);
    }
    return 0;
}

/* ``name`` (NAME_HEX digits) + ``suffix``, NUL-terminated, into ``dst`` */
static void file_name_of(char *dst, const char *name, const char *suffix, Py_ssize_t suffix_len)
{
    memcpy(dst, name, NAME_HEX);
    memcpy(dst + NAME_HEX, suffix, (size_t)suffix_len);
    dst[NAME_HEX + suffix_len] = '\0';
}

/* What write_named and read_named both check and allocate first: the shard table into
 * ``fds``, the suffix, the keys' header room, one block of text for every page's file
 * name (``name_room`` bytes each, then the headers), and ``*items``: ``n`` zeroed records
 * of ``item_size`` bytes (free both with PyMem_Free).  NULL with an exception set (nothing
 * allocated). */
static char *named_text(PyObject *fdlist, const char *suffix, Py_ssize_t suffix_len,
                        PyObject *keys, Py_ssize_t n, int *fds, size_t *name_room,
                        size_t item_size, void **items)
{
    size_t head_room;
    if (shard_table(fdlist, fds) < 0 || check_suffix(suffix, suffix_len) < 0 ||
        key_room(keys, n, &head_room) < 0) {
        return NULL;
    }
    *name_room = (size_t)(NAME_HEX + suffix_len + 1);
    char *text = PyMem_Malloc(*name_room * (size_t)(n > 0 ? n : 1) + head_room + 1);
    *items = PyMem_Calloc(n > 0 ? (size_t)n : 1, item_size);
    if (text == NULL || *items == NULL) {
        PyMem_Free(text);
        PyMem_Free(*items);
        *items = NULL;
        PyErr_NoMemory();
        return NULL;
    }
    return text;
}

/* Page ``i``'s file name (``names[i]`` checked: 40 lowercase hex digits) + suffix, written
 * into its place in ``text`` and returned, with its shard's descriptor in ``*fd``; NULL
 * with an exception set. */
static char *page_file_name(PyObject *names, Py_ssize_t i, char *text, size_t name_room,
                            const char *suffix, Py_ssize_t suffix_len, const int *fds, int *fd)
{
    const char *name = hex_name(PyList_GET_ITEM(names, i), "name", i);
    if (name == NULL) {
        return NULL;
    }
    char *fname = text + name_room * (size_t)i;
    file_name_of(fname, name, suffix, suffix_len);
    *fd = fds[hex_value(name[0]) * 16 + hex_value(name[1])];
    return fname;
}

static PyObject *write_named(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *fdlist, *names, *keys, *parents, *slots;
    const char *suffix;
    Py_ssize_t suffix_len;
    if (!PyArg_ParseTuple(args, "O!y#O!O!O!O!", &PyList_Type, &fdlist, &suffix, &suffix_len,
                          &PyList_Type, &names, &PyList_Type, &keys, &PyList_Type, &parents,
                          &PyList_Type, &slots)) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(names);
    if (PyList_GET_SIZE(keys) != n || PyList_GET_SIZE(parents) != n ||
        PyList_GET_SIZE(slots) != n) {
        PyErr_SetString(PyExc_ValueError, "write_named needs one key, parent and slot a name");
        return NULL;
    }
    /* per page: its file name (with suffix, NUL-terminated), then its header */
    int fds[256];
    size_t name_room;
    page_write *writes;
    char *text = named_text(fdlist, suffix, suffix_len, keys, n, fds, &name_room,
                            sizeof(page_write), (void **)&writes);
    if (text == NULL) {
        return NULL;
    }
    Py_ssize_t ready = 0; /* pages whose slot is held */
    PyObject *out = NULL;
    char *heads = text + name_room * (size_t)n;
    for (; ready < n; ready++) {
        Py_ssize_t i = ready;
        page_write *w = &writes[i];
        int fd;
        char *fname = page_file_name(names, i, text, name_room, suffix, suffix_len, fds, &fd);
        if (fname == NULL) {
            goto done;
        }
        PyObject *parent = PyList_GET_ITEM(parents, i);
        const char *pname = NULL;
        if (parent != Py_None && (pname = hex_name(parent, "parent", i)) == NULL) {
            goto done;
        }
        PyObject *key = PyList_GET_ITEM(keys, i);
        uint32_t klen = (uint32_t)PyBytes_GET_SIZE(key);
        unsigned char *h = (unsigned char *)heads;
        memcpy(h, "AKV3", 4);
        h[4] = (unsigned char)(klen & 0xff);
        h[5] = (unsigned char)((klen >> 8) & 0xff);
        h[6] = (unsigned char)((klen >> 16) & 0xff);
        h[7] = (unsigned char)((klen >> 24) & 0xff);
        for (int k = 0; k < DIGEST; k++) {
            h[8 + k] = pname == NULL ? 0
                                     : (unsigned char)(hex_value(pname[2 * k]) * 16 +
                                                       hex_value(pname[2 * k + 1]));
        }
        memcpy(h + HEAD_FIXED, PyBytes_AS_STRING(key), klen);
        if (PyObject_GetBuffer(PyList_GET_ITEM(slots, i), &w->slot, PyBUF_SIMPLE) < 0) {
            goto done;
        }
        /* a header of our own memory, seen through a Py_buffer so write_one takes it */
        w->header.buf = heads;
        w->header.len = HEAD_FIXED + (Py_ssize_t)klen;
        w->header.obj = NULL;
        heads += HEAD_FIXED + klen;
        w->dir_fd = fd;
        w->name = fname;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (writes[i].dir_fd < 0) { /* a shard that cannot be used: its -errno */
            writes[i].value = writes[i].dir_fd;
        } else {
            write_one(&writes[i]);
        }
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    if (out == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(writes[i].value);
        if (v == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, v);
    }
done:
    for (Py_ssize_t i = 0; i < ready; i++) {
        PyBuffer_Release(&writes[i].slot);
    }
    PyMem_Free(text);
    PyMem_Free(writes);
    return out;
}

enum { JUDGED_BAD_LENGTH = 4, JUDGED_BAD_MAGIC = 5, JUDGED_BAD_KEY = 6 };

/* page_file.judge() of a read that filled r->header (HEAD_FIXED + klen bytes) and the slot */
static int judge_read(const page_read *r, const char *key, uint32_t klen)
{
    const unsigned char *h = (const unsigned char *)r->header.buf;
    long long got = r->value, want = (long long)r->header.len + (long long)r->slot.len;
    if (got < HEAD_FIXED) {
        return JUDGED_BAD_LENGTH;
    }
    if (memcmp(h, "AKV3", 4) != 0) {
        return JUDGED_BAD_MAGIC;
    }
    uint32_t stored = (uint32_t)h[4] | (uint32_t)h[5] << 8 | (uint32_t)h[6] << 16 |
                      (uint32_t)h[7] << 24;
    if (stored != klen || got < (long long)r->header.len ||
        memcmp(h + HEAD_FIXED, key, klen) != 0) {
        return JUDGED_BAD_KEY;
    }
    if (got != want) {
        return JUDGED_BAD_LENGTH;
    }
    return READ_OK;
}

static PyObject *read_named(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *fdlist, *names, *keys, *slots;
    const char *suffix;
    Py_ssize_t suffix_len;
    if (!PyArg_ParseTuple(args, "O!y#O!O!O!", &PyList_Type, &fdlist, &suffix, &suffix_len,
                          &PyList_Type, &names, &PyList_Type, &keys, &PyList_Type, &slots)) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(names);
    if (PyList_GET_SIZE(keys) != n || PyList_GET_SIZE(slots) != n) {
        PyErr_SetString(PyExc_ValueError, "read_named needs one key and one slot a name");
        return NULL;
    }
    int fds[256];
    size_t name_room;
    page_read *reads;
    char *text = named_text(fdlist, suffix, suffix_len, keys, n, fds, &name_room,
                            sizeof(page_read), (void **)&reads);
    if (text == NULL) {
        return NULL;
    }
    Py_ssize_t ready = 0; /* reads whose slot is held */
    PyObject *out = NULL;
    char *heads = text + name_room * (size_t)n;
    for (; ready < n; ready++) {
        Py_ssize_t i = ready;
        page_read *r = &reads[i];
        char *fname =
            page_file_name(names, i, text, name_room, suffix, suffix_len, fds, &r->dir_fd);
        if (fname == NULL) {
            goto done;
        }
        if (PyObject_GetBuffer(PyList_GET_ITEM(slots, i), &r->slot, PyBUF_WRITABLE) < 0) {
            goto done;
        }
        Py_ssize_t klen = PyBytes_GET_SIZE(PyList_GET_ITEM(keys, i));
        r->header.buf = heads; /* our memory, seen through a Py_buffer for read_one */
        r->header.len = HEAD_FIXED + klen;
        r->header.obj = NULL;
        heads += HEAD_FIXED + klen;
        r->name = fname;
        r->sum = 1;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        page_read *r = &reads[i];
        if (r->dir_fd < 0) { /* a shard that cannot be used */
            r->status = READ_FAILED;
            r->value = -(long long)r->dir_fd;
        } else {
            read_one(r);
        }
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    if (out == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        page_read *r = &reads[i];
        PyObject *key = PyList_GET_ITEM(keys, i);
        int status = r->status;
        if (status == READ_OK) {
            status = judge_read(r, PyBytes_AS_STRING(key), (uint32_t)PyBytes_GET_SIZE(key));
        }
        unsigned long long summed = status == READ_OK ? (unsigned long long)r->summed : 0;
        PyObject *t = Py_BuildValue("iLKKK", status, r->value, (unsigned long long)r->s1,
                                    (unsigned long long)r->s2, summed);
        if (t == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, t);
    }
done:
    for (Py_ssize_t i = 0; i < ready; i++) {
        PyBuffer_Release(&reads[i].slot);
    }
    PyMem_Free(text);
    PyMem_Free(reads);
    return out;
}

static PyMethodDef methods[] = {
    {"read_pages", read_pages, METH_VARARGS,
     "Read page files in one batch, the GIL released (summing each as it arrives)."},
    {"read_named", read_named, METH_VARARGS,
     "Read a get's page files (names, shards, headers made and judged here), the GIL released."},
    {"write_named", write_named, METH_VARARGS,
     "Create a put's page files (names, shards, headers made here), the GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pageio", "Batched page-file reads and writes in C.", -1, methods, NULL, NULL,
    NULL, NULL,
};

PyMODINIT_FUNC PyInit__pageio(void) { return PyModule_Create(&module); }
