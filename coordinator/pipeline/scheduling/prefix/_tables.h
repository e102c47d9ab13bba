/* What the prefix index's open-addressed tables share (``_index.c``, ``_mirror.c``): linear probing
 * with backward-shift deletion, so no tombstones pile up under the intake's constant churn. */
#ifndef PREFIX_TABLES_H
#define PREFIX_TABLES_H

#include <stdint.h>

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

/* Backward-shift deletion: whether the entry at ``j`` (home slot ``home``) moves into the hole at
 * ``i``, i.e. its home is not cyclically within (i, j]. */
static inline int
fills_hole(uint64_t home, uint64_t i, uint64_t j, uint64_t mask)
{
    return ((j - home) & mask) >= ((j - i) & mask);
}

#endif
