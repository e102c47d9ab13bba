/* The block-hash chain's C face (``_chain.c``), for other extensions to call without Python objects:
 * ``PyCapsule_Import(CHAIN_CAPSULE, 0)`` gives a ``ChainAPI``. The KV-event mirror's batch apply
 * (``_mirror.c``) hashes the token ids it reads straight from the wire with it. */
#ifndef CONTRACTS_CHAIN_H
#define CONTRACTS_CHAIN_H

#include <stdint.h>

#define CHAIN_CAPSULE "coordinator.contracts._chain._C_API"

typedef struct {
    /* ``hashing.block_hashes`` without media over ``n_blocks * block_size`` token hashes (a token id
     * below 2**61 - 1 is its own hash): block k's hash into ``out[k]``. -1 if a depth is out of range. */
    int (*chain)(const uint64_t *hashes, Py_ssize_t n_blocks, Py_ssize_t block_size, int64_t seed,
                 Py_ssize_t start, int64_t *out);
} ChainAPI;

#endif
