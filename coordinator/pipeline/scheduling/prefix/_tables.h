/* What the prefix index's open-addressed tables share (``_index.c``, ``_mirror.c``): linear probing
 * with backward-shift deletion, so no tombstones pile up under the intake's constant churn. */
#ifndef PREFIX_TABLES_H
#define PREFIX_TABLES_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* splitmix64's finaliser: our hashes are random already, but vLLM's ints and tests' need not be. */
static inline uint64_t
mix(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

/* Load the line at ``p`` now and drop the value: how a run's slots are asked for before any is used,
 * so that their cache misses overlap. Why a load and not ``__builtin_prefetch``: a CPU may drop a
 * prefetch (under a TLB miss, for one), never a load; measured applying 256 engines' batches at
 * steady state, 0.96x the cost per block (six runs in turn, each one faster). ``p`` must be in bounds. */
static inline void
touch(const void *p)
{
    __asm__ volatile("" ::"r"(*(const volatile char *)p));
}

/* Backward-shift deletion: whether the entry at ``j`` (home slot ``home``) moves into the hole at
 * ``i``, i.e. its home is not cyclically within (i, j]. */
static inline int
fills_hole(uint64_t home, uint64_t i, uint64_t j, uint64_t mask)
{
    return ((j - home) & mask) >= ((j - i) & mask);
}

/* ``n`` zeroed items of ``size`` bytes at a cache line's start (NULL: out of memory; free with
 * ``free``). Why: the heap aligns to 16 bytes, and an item of 32 or 16 bytes that straddles two lines
 * costs a second cache miss per probe. */
static inline void *
line_calloc(size_t n, size_t size)
{
    void *p = NULL;
    if (n && size > SIZE_MAX / n) return NULL;
    if (posix_memalign(&p, 64, n * size ? n * size : 1)) return NULL;
    memset(p, 0, n * size);
    return p;
}

/* Tables of many megabytes, zeroed, on transparent huge pages where the kernel has them. Why: every
 * probe into a table far larger than the caches is a cache miss, and on 4 KiB pages a TLB miss too, a
 * page walk of its own (two nested ones in a VM); 2 MiB pages cover a whole index with a few dozen TLB
 * entries. Kernels default to huge pages only where asked (``transparent_hugepage=madvise``), hence
 * the ``madvise`` (``huge``: ``scheduling.prefix.huge_pages``). Smaller tables stay on the heap (a huge
 * page each would waste memory). Free with ``big_free`` and the same size. */
#define BIG_TABLE_BYTES ((size_t)2 << 20)

static inline void *
big_calloc(size_t size, int huge)
{
    if (size < BIG_TABLE_BYTES) return line_calloc(1, size);
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    if (huge) (void)madvise(p, size, MADV_HUGEPAGE);   /* advice: without huge pages the table still works */
#else
    (void)huge;
#endif
    return p;
}

static inline void
big_free(void *p, size_t size)
{
    if (p == NULL) return;
    if (size < BIG_TABLE_BYTES) free(p);
    else munmap(p, size);
}

/* A copy of the ``size`` bytes at ``src``, allocated as ``big_calloc`` allocates. */
static inline void *
big_copy(const void *src, size_t size, int huge)
{
    void *q = big_calloc(size, huge);
    if (q != NULL && size) memcpy(q, src, size);
    return q;
}

/* ``old`` bytes of ``p`` carried into a table of ``size`` bytes (the rest zeroed); NULL leaves ``p``. */
static inline void *
big_realloc(void *p, size_t old, size_t size, int huge)
{
    void *q = big_calloc(size, huge);
    if (q == NULL) return NULL;
    if (p != NULL) memcpy(q, p, old < size ? old : size);
    big_free(p, old);
    return q;
}

#endif
