/* The block-Fletcher page checksum (aiocache_kv/storage/integrity.py: the reference), shared
 * by _blocksum.c and _pageio.c so that a sum taken while the bytes are copied (a fused
 * device->host copy, a page read) is the very sum seal and verify compute.
 *
 * Payload as little-endian 64-bit words; s_b = the sum of block b (2048 words, 16 KiB) mod
 * 2**64; S1 = sum(s_b), S2 = sum((b + 1) * s_b); a partial last block is one more block; a tail
 * of n % 8 bytes counts as the word (its little-endian value + 1) at position nwords / 2048 + 2.
 *
 * Incremental use: fl_blocks() over the complete blocks as they arrive (in order), then
 * fl_finish() once for whatever follows the last complete block.
 */
#ifndef AIOCACHE_KV_FLETCHER_H
#define AIOCACHE_KV_FLETCHER_H

#include <stdint.h>
#include <string.h>

#define FL_BLOCK_WORDS 2048
#define FL_BLOCK_BYTES (FL_BLOCK_WORDS * 8)

static inline uint64_t fl_load_le64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* The block loop is built twice where the compiler can (GCC on x86-64: an AVX2 clone picked at
 * load time on CPUs that have it, else the baseline SSE2 build): on data in the L2 cache (a
 * page just copied or read) the AVX2 build sums at ~70-85 GB/s, the SSE2 one at ~19 (measured
 * on the project machine), so a checksum taken inside a copy costs next to nothing. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define FL_CLONES __attribute__((target_clones("avx2", "default"), noinline))
#else
#define FL_CLONES
#endif

/* add complete blocks b0 .. b1 - 1 of the payload at p */
FL_CLONES static void fl_blocks(const uint8_t *p, Py_ssize_t b0, Py_ssize_t b1, uint64_t *s1,
                                uint64_t *s2)
{
    for (Py_ssize_t b = b0; b < b1; b++) {
        const uint8_t *q = p + (size_t)b * FL_BLOCK_BYTES;
        uint64_t s = 0;
        for (int w = 0; w < FL_BLOCK_WORDS; w++) {
            s += fl_load_le64(q + (size_t)w * 8);
        }
        *s1 += s;
        *s2 += (uint64_t)(b + 1) * s;
    }
}

/* add what follows the complete blocks of an n-byte payload (its partial block and tail) */
static inline void fl_finish(const uint8_t *p, Py_ssize_t n, uint64_t *s1, uint64_t *s2)
{
    Py_ssize_t nwords = n / 8, nblocks = nwords / FL_BLOCK_WORDS;
    if (nwords % FL_BLOCK_WORDS) {
        uint64_t s = 0;
        for (Py_ssize_t w = nblocks * FL_BLOCK_WORDS; w < nwords; w++) {
            s += fl_load_le64(p + (size_t)w * 8);
        }
        *s1 += s;
        *s2 += (uint64_t)(nblocks + 1) * s;
    }
    if (n % 8) {
        uint64_t extra = 0;
        for (Py_ssize_t i = n - 1; i >= nwords * 8; i--) {
            extra = (extra << 8) | p[i];
        }
        extra += 1;
        *s1 += extra;
        *s2 += (uint64_t)(nwords / FL_BLOCK_WORDS + 2) * extra;
    }
}

static inline void fl_sum(const uint8_t *p, Py_ssize_t n, uint64_t *s1, uint64_t *s2)
{
    *s1 = 0;
    *s2 = 0;
    fl_blocks(p, 0, n / FL_BLOCK_BYTES, s1, s2);
    fl_finish(p, n, s1, s2);
}

#endif
