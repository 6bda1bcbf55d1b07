/* The page-id checks of _fastcheck.c on raw int64/uint8 buffers: no Python API, so each is
 * a plain loop the compiler can vectorize.  _fastcheck.c parses the arguments, takes the
 * buffers and reports what these return; the Python reference of each is in fastcheck.py.
 * Included after Python.h (sizes are Py_ssize_t).
 */
#ifndef AIOCACHE_KV_PAGECHECK_H
#define AIOCACHE_KV_PAGECHECK_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* 1 when s[k] == first + k for each k < n: an OR of differences, so the loop vectorizes */
static inline int is_run(const int64_t *s, Py_ssize_t n, int64_t first)
{
    uint64_t off = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        off |= (uint64_t)s[k] ^ ((uint64_t)first + (uint64_t)k);
    }
    return off == 0;
}

/* 1 when each of the n bytes at b is v: eight at a time */
static inline int all_bytes(const uint8_t *b, Py_ssize_t n, uint8_t v)
{
    const uint64_t w = 0x0101010101010101ULL * v;
    uint64_t acc = 0;
    Py_ssize_t k = 0;
    for (; k + 8 <= n; k += 8) {
        uint64_t x;
        memcpy(&x, b + k, 8);
        acc |= x ^ w;
    }
    for (; k < n; k++) {
        acc |= (uint64_t)(b[k] ^ v);
    }
    return acc == 0;
}

/* out[k] = first + k for each k < n (not inlined: inlined, gcc 12 no longer vectorizes it) */
#if defined(__GNUC__)
__attribute__((noinline))
#endif
static void fill_run(int64_t *restrict out, Py_ssize_t n, int64_t first)
{
    for (Py_ssize_t k = 0; k < n; k++) {
        out[k] = first + k;
    }
}

/* slot_pages on raw buffers: see slot_pages() */
static inline long slot_pages_core(const int64_t *s, Py_ssize_t n, long long p, long long limit,
                            int64_t *o, Py_ssize_t on)
{
    if (n % p != 0 || on != n / p) {
        return 2;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < 0 || s[i] >= limit) {
            return 1;
        }
    }
    if (p == 1) { /* no runs to check, and no division per slot */
        memcpy(o, s, (size_t)n * 8);
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i += p) {
        int64_t first = s[i];
        if (first % p != 0) {
            return 2;
        }
        for (long long j = 1; j < p; j++) {
            if (s[i + j] != first + j) {
                return 2;
            }
        }
        o[i / p] = first / p;
    }
    return 0;
}

/* first_repeat on raw buffers (sets *bad_id for an id outside stamp) */
static inline Py_ssize_t first_repeat_core(const int64_t *pg, Py_ssize_t n, int64_t *st,
                                    Py_ssize_t size, long long epoch, int *bad_id)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t id = pg[i];
        if (id < 0 || id >= size) {
            *bad_id = 1;
            return -1;
        }
        if (st[id] == epoch) {
            return i;
        }
        st[id] = epoch;
    }
    return -1;
}

/* held_check on raw buffers: returns first_bad, sets *differing (and *bad_id for an id outside
 * state) */
static inline Py_ssize_t held_check_core(const int64_t *pg, Py_ssize_t n, const int64_t *ex,
                                  Py_ssize_t d, const uint8_t *state, Py_ssize_t size, int held,
                                  Py_ssize_t *differing, int *bad_id)
{
    Py_ssize_t bad = -1;
    if (d > n) {
        d = n;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t id = pg[i];
        if (id < 0 || id >= size) {
            *bad_id = 1;
            return -1;
        }
        int same = i < d && id == ex[i];
        if (i < d && !same) {
            (*differing)++;
        }
        if (!same && state[id] != held && bad < 0) {
            bad = i;
        }
    }
    return bad;
}

/* insert_pages()'s checks in one pass over the slots, for the common case of an insert
 * that passes all of them: returns 1 with out and *differing filled in, or 0 at the first
 * thing amiss, with the stamps it wrote set back below epoch's reach (so the three passes
 * of insert_pages() can find exactly what and where, with the same epoch).  Stamps only ever
 * hold epochs, which the caller counts down: epoch + 1 is never asked for again. */
static inline int insert_fast(const int64_t *s, Py_ssize_t ns, long long p, long long limit,
                       int64_t *out, Py_ssize_t n, const int64_t *ex, Py_ssize_t d,
                       const uint8_t *state, Py_ssize_t state_size, int held, int64_t *st,
                       Py_ssize_t stamp_size, long long epoch, Py_ssize_t *differing)
{
    if (ns % p != 0 || n != ns / p) {
        return 0;
    }
    if (d > n) {
        d = n;
    }
    Py_ssize_t size = state_size < stamp_size ? state_size : stamp_size;
    Py_ssize_t diff = 0, i = 0;
    if (d == 0 && ns > 0 && s[0] >= 0 && s[0] % p == 0) {
        /* the commonest case, only new pages from one alloc: the slots are one run, so the
         * pages are one run of distinct ids (no stamps) */
        const int64_t id0 = s[0] / p;
        if (is_run(s, ns, s[0]) && s[0] <= limit - ns && id0 <= size - n &&
            all_bytes(state + id0, n, (uint8_t)held)) {
            if (p == 1) { /* the ids are the slots */
                memcpy(out, s, (size_t)n * 8);
            } else {
                fill_run(out, n, id0);
            }
            *differing = 0;
            return 1;
        }
    }
    if (p == 1 && d == 0) { /* the common case, only new pages: the loop below, pared */
        uint64_t lim = (uint64_t)(limit < size ? limit : size);
        for (; i < n; i++) {
            int64_t id = s[i];
            if ((uint64_t)id >= lim || st[id] == epoch || state[id] != held) {
                break;
            }
            st[id] = epoch;
            out[i] = id;
        }
    }
    for (; i < n; i++) {
        int64_t first = s[i * p];
        if ((uint64_t)first >= (uint64_t)limit || (uint64_t)first + (uint64_t)(p - 1) >=
                                                      (uint64_t)limit) {
            break;
        }
        int64_t id = first;
        if (p > 1) {
            if (first % p != 0) {
                break;
            }
            const int64_t *run = s + i * p;
            long long j = 1;
            while (j < p && run[j] == first + j) {
                j++;
            }
            if (j < p) {
                break;
            }
            id = first / p;
        }
        if (id >= size || st[id] == epoch) {
            break;
        }
        int same = i < d && id == ex[i];
        if (!same && state[id] != held) {
            break;
        }
        st[id] = epoch;
        diff += i < d && !same;
        out[i] = id;
    }
    if (i == n) {
        *differing = diff;
        return 1;
    }
    for (Py_ssize_t k = 0; k < i; k++) {
        st[out[k]] = epoch + 1;
    }
    return 0;
}

/* out[i * p + j] = pages[i] * p + j for the n pages: one run of slots when the pages are one
 * run of ids (an alloc's, the common case), else page by page */
static inline void page_slots_core(const int64_t *pages, Py_ssize_t n, long long p, int64_t *out)
{
    if (n > 0 && is_run(pages, n, pages[0])) {
        fill_run(out, n * p, pages[0] * p);
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t base = pages[i] * p;
        for (long long j = 0; j < p; j++) {
            *out++ = base + j;
        }
    }
}

#endif
