/* The prefix index's C face (``_index.c``), for the KV-event mirror's batch apply (``_mirror.c``) to
 * write blocks without building a Python int per hash: ``PyCapsule_Import(INDEX_CAPSULE, 0)``. Each
 * call is the ``Index`` method of the same name; -1 means a Python exception is set. */
#ifndef PREFIX_INDEX_H
#define PREFIX_INDEX_H

#include <stdint.h>

#define INDEX_CAPSULE "coordinator.pipeline.scheduling.prefix._index._C_API"

typedef struct {
    int (*check)(PyObject *obj);   /* whether ``obj`` is an ``Index`` */
    /* ``add(engine, hashes, parent if has_parent, now)``, then ``trim(engine, capacity, -inf)``. */
    int (*add)(PyObject *ix, PyObject *engine, const int64_t *hashes, Py_ssize_t n, int has_parent,
               int64_t parent, double now, long long capacity);
    int (*remove)(PyObject *ix, PyObject *engine, const int64_t *hashes, Py_ssize_t n);
    int (*clear)(PyObject *ix, PyObject *engine);
} IndexAPI;

#endif
