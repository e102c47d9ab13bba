/* The text prompt's block-hash chain (coordinator/contracts/hashing.py) in one C loop.
 *
 * Why C: the KV-event intake re-hashes every block an engine stores (tens of thousands a second at
 * 256 engines) and a 100k-token decision hashes 6,250 blocks; in Python each block costs a tuple, a
 * hash call and NumPy's per-call overhead. This computes exactly what ``block_hashes`` does without
 * media: block k's term is ``hash((start + k, *block))`` -- CPython's tuple hash, reproduced below
 * from Objects/tupleobject.c (the xxHash-style combination CPython has used since 3.8), over
 * ``PyObject_Hash`` of each element -- and the chain is the running sum of the terms plus ``seed``,
 * wrapping at 64 bits. ``tests/unit/test_hashing.py`` holds it to the Python form bit for bit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_chain.h"

#if SIZEOF_PY_UHASH_T != 8
#error "the chain's hashes are 64-bit: build on a 64-bit CPython"
#endif

#define XXPRIME_1 ((Py_uhash_t)11400714785074694791ULL)
#define XXPRIME_2 ((Py_uhash_t)14029467366897019727ULL)
#define XXPRIME_5 ((Py_uhash_t)2870177450012600261ULL)
#define XXROTATE(x) (((x) << 31) | ((x) >> 33))

/* hash(token): a token id is a non-negative int below 2**61 - 1, whose hash is itself; anything else
 * (a negative or huge int, an int subclass) takes CPython's own hash. ``(Py_uhash_t)-1``: an error. */
static inline Py_uhash_t
token_hash(PyObject *o)
{
    if (PyLong_CheckExact(o)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (!overflow && v >= 0 && v < ((1LL << 61) - 1)) return (Py_uhash_t)v;
    }
    return (Py_uhash_t)PyObject_Hash(o);
}

/* The chain over token hashes already taken (``token_hash``): ``n_blocks`` blocks of ``block_size``
 * from ``hashes``, the first at depth ``start``, continuing ``seed``; -1 (no exception set) if a depth
 * is out of range. The one copy of the arithmetic: ``chain`` and the capsule's callers use it. */
static int
chain_words(const uint64_t *hashes, Py_ssize_t n_blocks, Py_ssize_t block_size, int64_t seed,
            Py_ssize_t start, int64_t *out)
{
    if (start < 0 || (size_t)(start + n_blocks) >= (((size_t)1 << 61) - 1)) return -1;
    /* The tuple's length term, as tuplehash adds it after the lanes. */
    Py_uhash_t tail = (Py_uhash_t)(block_size + 1) ^ (XXPRIME_5 ^ 3527539UL);
    uint64_t running = (uint64_t)seed;
    for (Py_ssize_t k = 0; k < n_blocks; k++) {
        Py_uhash_t acc = XXPRIME_5;
        /* Lane 0: hash(depth). A non-negative int below 2**61 - 1 hashes to itself. */
        acc += (Py_uhash_t)(start + k) * XXPRIME_2;
        acc = XXROTATE(acc);
        acc *= XXPRIME_1;
        const uint64_t *block = hashes + k * block_size;
        for (Py_ssize_t i = 0; i < block_size; i++) {
            acc += (Py_uhash_t)block[i] * XXPRIME_2;
            acc = XXROTATE(acc);
            acc *= XXPRIME_1;
        }
        acc += tail;
        if (acc == (Py_uhash_t)-1) acc = 1546275796;
        running += (uint64_t)acc;
        out[k] = (int64_t)running;
    }
    return 0;
}

static PyObject *
chain(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "chain(token_ids, block_size, seed, start)");
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[1]);
    if (block_size == -1 && PyErr_Occurred()) return NULL;
    if (block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    long long seed = PyLong_AsLongLong(args[2]);
    if (seed == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t start = PyLong_AsSsize_t(args[3]);
    if (start == -1 && PyErr_Occurred()) return NULL;
    if (start < 0) {
        PyErr_SetString(PyExc_ValueError, "start must not be negative");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "token_ids must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq) / block_size;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = NULL;
    uint64_t *hashes = PyMem_Malloc((size_t)(n * block_size + 1) * sizeof(uint64_t));
    int64_t *words = PyMem_Malloc((size_t)(n + 1) * sizeof(int64_t));
    if (hashes == NULL || words == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n * block_size; i++) {
        Py_uhash_t h = token_hash(items[i]);
        if (h == (Py_uhash_t)-1) goto done;
        hashes[i] = h;
    }
    if (chain_words(hashes, n, block_size, (int64_t)seed, start, words) < 0) {
        PyErr_SetString(PyExc_OverflowError, "depth out of range");
        goto done;
    }
    out = PyList_New(n);
    if (out == NULL) goto done;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *v = PyLong_FromLongLong((long long)words[k]);
        if (v == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, k, v);
    }
done:
    PyMem_Free(hashes);
    PyMem_Free(words);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL,
     "chain(token_ids, block_size, seed, start) -> the text chain's block hashes (hashing.block_hashes)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chain", "The block-hash chain of a text prompt, in C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

static const ChainAPI api = {chain_words};

PyMODINIT_FUNC
PyInit__chain(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *capsule = PyCapsule_New((void *)&api, CHAIN_CAPSULE, NULL);
    int rc = capsule == NULL ? -1 : PyModule_AddObjectRef(m, "_C_API", capsule);
    Py_XDECREF(capsule);
    if (rc < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
