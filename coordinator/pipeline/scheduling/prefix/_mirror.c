/* ``KvEventMirror``'s translation table (kv_events.py) in hash tables of machine words.
 *
 * Why C: every engine block an engine stores is remembered as "engine hash -> our hashes of it and
 * the depth after it" until the engine removes it, and every hash of ours carries a count of the
 * engine blocks that map to it. In Python that was a dict entry, two tuples and a Python int per hash
 * (~250 bytes per engine block, a million blocks at 256 engines) and a set and a dict beside them,
 * walked by the garbage collector; and the intake did it tens of thousands of times a second. Here an
 * engine block is one 48-byte entry (plus an array when it spans several of our blocks) and a hash of
 * ours one 16-byte count.
 *
 * The semantics are ``_PyTranslation``'s (kv_events.py), which stays as the fallback and the reference
 * ``tests/unit/test_kv_events.py`` holds this one to. Engine hashes are vLLM's ints (taken modulo
 * 2**64) or sha256 bytes, keyed by their low 64 bits: what vLLM itself keeps of them when it publishes
 * ints.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_tables.h"

typedef struct {
    uint64_t key;        /* the engine hash, low 64 bits */
    int64_t depth;       /* our blocks from the prompt's start through this one */
    int64_t one;         /* our hash, when ``per`` is 1 */
    int64_t *many;       /* our hashes, when ``per`` > 1 */
    int32_t group;       /* the KV cache group */
    uint32_t per;        /* our hashes; 0: an empty slot */
    uint32_t stamp;      /* the ``store`` call that wrote it */
    uint32_t pad;
} Entry;

typedef struct {
    int64_t hash;
    uint32_t count;      /* engine blocks mapping to it; 0: an empty slot */
    uint32_t stamp;      /* the last ``store`` call that counted it */
} Count;

typedef struct {
    PyObject_HEAD
    Entry *entries;
    uint64_t entries_mask, entries_used;
    Count *counts;
    uint64_t counts_mask, counts_used;
    uint32_t epoch;
    uint64_t *keys;      /* scratch: converted arguments, before anything changes */
    int64_t *ours;
    Py_ssize_t keys_cap, ours_cap;
    int64_t *freed;      /* scratch: hashes whose engine blocks all left */
    Py_ssize_t freed_cap;
} Translation;

static inline uint64_t
entry_home(uint64_t key, int32_t group, uint64_t mask)
{
    return mix(key ^ ((uint64_t)(uint32_t)group * 0x9e3779b97f4a7c15ULL)) & mask;
}

static inline const int64_t *
entry_ours(const Entry *e)
{
    return e->per == 1 ? &e->one : e->many;
}

static uint64_t
entry_slot(Translation *t, int32_t group, uint64_t key)
{
    uint64_t i = entry_home(key, group, t->entries_mask);
    for (;;) {
        Entry *e = &t->entries[i];
        if (e->per == 0 || (e->key == key && e->group == group)) return i;
        i = (i + 1) & t->entries_mask;
    }
}

static void
entry_delete(Translation *t, uint64_t i)
{
    uint64_t mask = t->entries_mask, j = i;
    PyMem_Free(t->entries[i].many);
    memset(&t->entries[i], 0, sizeof(Entry));
    for (;;) {
        j = (j + 1) & mask;
        Entry *e = &t->entries[j];
        if (e->per == 0) break;
        uint64_t home = entry_home(e->key, e->group, mask);
        if (fills_hole(home, i, j, mask)) {
            t->entries[i] = *e;
            memset(e, 0, sizeof(Entry));
            i = j;
        }
    }
    t->entries_used--;
}

static uint64_t
count_slot(Translation *t, int64_t hash)
{
    uint64_t i = mix((uint64_t)hash) & t->counts_mask;
    for (;;) {
        Count *c = &t->counts[i];
        if (c->count == 0 || c->hash == hash) return i;
        i = (i + 1) & t->counts_mask;
    }
}

static void
count_delete(Translation *t, uint64_t i)
{
    uint64_t mask = t->counts_mask, j = i;
    memset(&t->counts[i], 0, sizeof(Count));
    for (;;) {
        j = (j + 1) & mask;
        Count *c = &t->counts[j];
        if (c->count == 0) break;
        uint64_t home = mix((uint64_t)c->hash) & mask;
        if (fills_hole(home, i, j, mask)) {
            t->counts[i] = *c;
            memset(c, 0, sizeof(Count));
            i = j;
        }
    }
    t->counts_used--;
}

static int
grow_entries(Translation *t, uint64_t need)
{
    uint64_t cap = t->entries_mask + 1;
    if ((t->entries_used + need) * 2 <= cap) return 0;
    while ((t->entries_used + need) * 2 > cap) cap *= 2;
    Entry *old = t->entries;
    uint64_t old_cap = t->entries_mask + 1;
    Entry *fresh = PyMem_Calloc(cap, sizeof(Entry));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->entries = fresh;
    t->entries_mask = cap - 1;
    for (uint64_t i = 0; i < old_cap; i++)
        if (old[i].per) t->entries[entry_slot(t, old[i].group, old[i].key)] = old[i];
    PyMem_Free(old);
    return 0;
}

static int
grow_counts(Translation *t, uint64_t need)
{
    uint64_t cap = t->counts_mask + 1;
    if ((t->counts_used + need) * 2 <= cap) return 0;
    while ((t->counts_used + need) * 2 > cap) cap *= 2;
    Count *old = t->counts;
    uint64_t old_cap = t->counts_mask + 1;
    Count *fresh = PyMem_Calloc(cap, sizeof(Count));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->counts = fresh;
    t->counts_mask = cap - 1;
    for (uint64_t i = 0; i < old_cap; i++)
        if (old[i].count) t->counts[count_slot(t, old[i].hash)] = old[i];
    PyMem_Free(old);
    return 0;
}

static int
room(void **buf, Py_ssize_t *cap, Py_ssize_t n, size_t size)
{
    if (n <= *cap) return 0;
    void *more = PyMem_Realloc(*buf, (size_t)n * size);
    if (more == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *buf = more;
    *cap = n;
    return 0;
}

/* An engine hash's key: an int modulo 2**64, or the low 64 bits of a bytes hash (big-endian). */
static int
engine_key(PyObject *obj, uint64_t *out)
{
    if (PyLong_Check(obj)) {
        *out = (uint64_t)PyLong_AsUnsignedLongLongMask(obj);
        return (*out == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
    }
    if (PyBytes_Check(obj)) {
        const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(obj);
        Py_ssize_t n = PyBytes_GET_SIZE(obj), from = n > 8 ? n - 8 : 0;
        uint64_t v = 0;
        for (Py_ssize_t i = from; i < n; i++) v = (v << 8) | b[i];
        *out = v;
        return 0;
    }
    PyErr_SetString(PyExc_TypeError, "an engine block hash is an int or bytes");
    return -1;
}

static inline int
our_hash(PyObject *obj, int64_t *out)
{
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)v;
    return 0;
}

/* Convert ``seq``'s engine hashes into ``t->keys``; returns their count, or -1. */
static Py_ssize_t
load_keys(Translation *t, PyObject *seq)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (room((void **)&t->keys, &t->keys_cap, n, sizeof(uint64_t)) < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (engine_key(items[i], &t->keys[i]) < 0) return -1;
    return n;
}

static uint32_t
next_epoch(Translation *t)
{
    if (++t->epoch == 0) {   /* wrapped: nothing may look written by a later call */
        for (uint64_t i = 0; i <= t->entries_mask; i++) t->entries[i].stamp = 0;
        for (uint64_t i = 0; i <= t->counts_mask; i++) t->counts[i].stamp = 0;
        t->epoch = 1;
    }
    return t->epoch;
}

/* One engine block fewer maps to ``hash``; returns 1 if none does any more (or none did). */
static int
release(Translation *t, int64_t hash)
{
    uint64_t i = count_slot(t, hash);
    Count *c = &t->counts[i];
    if (c->count == 0) return 1;
    if (--c->count == 0) {
        count_delete(t, i);
        return 1;
    }
    return 0;
}

/* --- the type ------------------------------------------------------------------------------- */

static void
Translation_free_all(Translation *t)
{
    if (t->entries != NULL)
        for (uint64_t i = 0; i <= t->entries_mask; i++) PyMem_Free(t->entries[i].many);
}

static void
Translation_dealloc(Translation *t)
{
    Translation_free_all(t);
    PyMem_Free(t->entries);
    PyMem_Free(t->counts);
    PyMem_Free(t->keys);
    PyMem_Free(t->ours);
    PyMem_Free(t->freed);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int
Translation_reset(Translation *t)
{
    Translation_free_all(t);
    PyMem_Free(t->entries);
    PyMem_Free(t->counts);
    t->entries_mask = t->counts_mask = 255;
    t->entries_used = t->counts_used = 0;
    t->entries = PyMem_Calloc(t->entries_mask + 1, sizeof(Entry));
    t->counts = PyMem_Calloc(t->counts_mask + 1, sizeof(Count));
    if (t->entries == NULL || t->counts == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static PyObject *
Translation_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Translation() takes no arguments");
        return NULL;
    }
    Translation *t = (Translation *)type->tp_alloc(type, 0);
    if (t != NULL && Translation_reset(t) < 0) Py_CLEAR(t);
    return (PyObject *)t;
}

static int
as_group(PyObject *obj, int32_t *out)
{
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (int32_t)v;
    return 0;
}

/* parent(group, engine_hash) -> (our last hash, depth) of a block the engine reported, or None. */
static PyObject *
Translation_parent(Translation *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "parent(group, engine_hash)");
        return NULL;
    }
    int32_t group;
    uint64_t key;
    if (as_group(args[0], &group) < 0 || engine_key(args[1], &key) < 0) return NULL;
    Entry *e = &t->entries[entry_slot(t, group, key)];
    if (e->per == 0) Py_RETURN_NONE;
    return Py_BuildValue("(LL)", (long long)entry_ours(e)[e->per - 1], (long long)e->depth);
}

/* store(group, engine_hashes, ours, per, start): engine block ``i`` is ``ours[i*per:(i+1)*per]``, at
 * depth ``start + (i+1)*per``. A block reported again first gives up its old mapping (its hashes stay
 * in the index: the caller refreshes it); each distinct hash of ours counts one engine block more. */
static PyObject *
Translation_store(Translation *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "store(group, engine_hashes, ours, per, start)");
        return NULL;
    }
    int32_t group;
    if (as_group(args[0], &group) < 0) return NULL;
    long per = PyLong_AsLong(args[3]);
    if (per == -1 && PyErr_Occurred()) return NULL;
    long long start = PyLong_AsLongLong(args[4]);
    if (start == -1 && PyErr_Occurred()) return NULL;
    if (per <= 0 || per > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "per must be positive");
        return NULL;
    }
    PyObject *eseq = PySequence_Fast(args[1], "engine_hashes must be a sequence");
    if (eseq == NULL) return NULL;
    PyObject *oseq = PySequence_Fast(args[2], "ours must be a sequence");
    if (oseq == NULL) {
        Py_DECREF(eseq);
        return NULL;
    }
    Py_ssize_t n = load_keys(t, eseq), m = PySequence_Fast_GET_SIZE(oseq);
    if (n < 0) goto fail;
    if (m != n * per) {
        PyErr_SetString(PyExc_ValueError, "ours must hold per hashes for each engine block");
        goto fail;
    }
    if (room((void **)&t->ours, &t->ours_cap, m, sizeof(int64_t)) < 0) goto fail;
    PyObject **items = PySequence_Fast_ITEMS(oseq);
    for (Py_ssize_t i = 0; i < m; i++)
        if (our_hash(items[i], &t->ours[i]) < 0) goto fail;
    if (grow_entries(t, (uint64_t)n) < 0 || grow_counts(t, (uint64_t)m) < 0) goto fail;
    int64_t **arrays = NULL;   /* allocated before any change, so a failure changes nothing */
    if (per > 1) {
        arrays = PyMem_Calloc((size_t)(n ? n : 1), sizeof(int64_t *));
        if (arrays == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            arrays[i] = PyMem_Malloc((size_t)per * sizeof(int64_t));
            if (arrays[i] == NULL) {
                for (Py_ssize_t j = 0; j < i; j++) PyMem_Free(arrays[j]);
                PyMem_Free(arrays);
                PyErr_NoMemory();
                goto fail;
            }
        }
    }
    uint32_t stamp = next_epoch(t);
    /* blocks reported again give up their old mapping first */
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t slot = entry_slot(t, group, t->keys[i]);
        Entry *e = &t->entries[slot];
        if (e->per == 0) continue;
        const int64_t *old = entry_ours(e);
        for (uint32_t k = 0; k < e->per; k++) release(t, old[k]);
        entry_delete(t, slot);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t slot = entry_slot(t, group, t->keys[i]);
        Entry *e = &t->entries[slot];
        if (e->per) PyMem_Free(e->many);   /* met twice in this call: the last one counts */
        else t->entries_used++;
        *e = (Entry){t->keys[i], (int64_t)(start + (long long)(i + 1) * per), 0, NULL, group, (uint32_t)per,
                     stamp, 0};
        if (per == 1) e->one = t->ours[i];
        else {
            e->many = arrays[i];
            memcpy(e->many, &t->ours[i * per], (size_t)per * sizeof(int64_t));
        }
    }
    PyMem_Free(arrays);
    for (Py_ssize_t i = 0; i < m; i++) {
        Count *c = &t->counts[count_slot(t, t->ours[i])];
        if (c->count == 0) {
            *c = (Count){t->ours[i], 1, stamp};
            t->counts_used++;
        } else if (c->stamp != stamp) {
            c->count++;
            c->stamp = stamp;
        }
    }
    Py_DECREF(eseq);
    Py_DECREF(oseq);
    Py_RETURN_NONE;
fail:
    Py_DECREF(eseq);
    Py_DECREF(oseq);
    return NULL;
}

/* remove(group, engine_hashes) -> (engine blocks found, our hashes no engine block maps to any more). */
static PyObject *
Translation_remove(Translation *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "remove(group, engine_hashes)");
        return NULL;
    }
    int32_t group;
    if (as_group(args[0], &group) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[1], "engine_hashes must be iterable");
    if (seq == NULL) return NULL;
    Py_ssize_t n = load_keys(t, seq), found = 0, freed = 0;
    Py_DECREF(seq);
    if (n < 0) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t slot = entry_slot(t, group, t->keys[i]);
        Entry *e = &t->entries[slot];
        if (e->per == 0) continue;
        found++;
        if (room((void **)&t->freed, &t->freed_cap, freed + e->per, sizeof(int64_t)) < 0) return NULL;
        const int64_t *ours = entry_ours(e);
        for (uint32_t k = 0; k < e->per; k++)
            if (release(t, ours[k])) t->freed[freed++] = ours[k];
        entry_delete(t, slot);
    }
    PyObject *gone = PyList_New(freed);
    if (gone == NULL) return NULL;
    for (Py_ssize_t i = 0; i < freed; i++) {
        PyObject *h = PyLong_FromLongLong(t->freed[i]);
        if (h == NULL) {
            Py_DECREF(gone);
            return NULL;
        }
        PyList_SET_ITEM(gone, i, h);
    }
    return Py_BuildValue("(nN)", found, gone);
}

static PyObject *
Translation_clear(Translation *t, PyObject *Py_UNUSED(ignored))
{
    if (Translation_reset(t) < 0) return NULL;
    Py_RETURN_NONE;
}

static Py_ssize_t
Translation_len(Translation *t)
{
    return (Py_ssize_t)t->entries_used;
}

/* state() -> ({(group, engine key): (our hashes, depth)}, {our hash: engine blocks}), for the tests. */
static PyObject *
Translation_state(Translation *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *entries = PyDict_New(), *counts = PyDict_New();
    if (entries == NULL || counts == NULL) goto fail;
    for (uint64_t i = 0; i <= t->entries_mask; i++) {
        Entry *e = &t->entries[i];
        if (e->per == 0) continue;
        PyObject *ours = PyTuple_New(e->per);
        if (ours == NULL) goto fail;
        for (uint32_t k = 0; k < e->per; k++) {
            PyObject *h = PyLong_FromLongLong(entry_ours(e)[k]);
            if (h == NULL) {
                Py_DECREF(ours);
                goto fail;
            }
            PyTuple_SET_ITEM(ours, k, h);
        }
        PyObject *key = Py_BuildValue("(iK)", (int)e->group, (unsigned long long)e->key);
        PyObject *value = Py_BuildValue("(NL)", ours, (long long)e->depth);
        int rc = key && value ? PyDict_SetItem(entries, key, value) : -1;
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (rc < 0) goto fail;
    }
    for (uint64_t i = 0; i <= t->counts_mask; i++) {
        Count *c = &t->counts[i];
        if (c->count == 0) continue;
        PyObject *key = PyLong_FromLongLong(c->hash), *value = PyLong_FromUnsignedLong(c->count);
        int rc = key && value ? PyDict_SetItem(counts, key, value) : -1;
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (rc < 0) goto fail;
    }
    return Py_BuildValue("(NN)", entries, counts);
fail:
    Py_XDECREF(entries);
    Py_XDECREF(counts);
    return NULL;
}

static PyMethodDef Translation_methods[] = {
    {"parent", (PyCFunction)(void (*)(void))Translation_parent, METH_FASTCALL,
     "parent(group, engine_hash) -> (our last hash, depth) or None"},
    {"store", (PyCFunction)(void (*)(void))Translation_store, METH_FASTCALL,
     "store(group, engine_hashes, ours, per, start): map a stored run's engine blocks to ours"},
    {"remove", (PyCFunction)(void (*)(void))Translation_remove, METH_FASTCALL,
     "remove(group, engine_hashes) -> (engine blocks found, our hashes now unmapped)"},
    {"clear", (PyCFunction)Translation_clear, METH_NOARGS, "clear(): forget every engine block"},
    {"state", (PyCFunction)Translation_state, METH_NOARGS,
     "state() -> (entries by (group, engine key), counts by our hash)"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Translation_as_sequence = {
    .sq_length = (lenfunc)Translation_len,
};

static PyTypeObject TranslationType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "coordinator.pipeline.scheduling.prefix._mirror.Translation",
    .tp_basicsize = sizeof(Translation),
    .tp_dealloc = (destructor)Translation_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One medium's engine block -> our hashes map, and the count of engine blocks per hash.",
    .tp_methods = Translation_methods,
    .tp_as_sequence = &Translation_as_sequence,
    .tp_new = Translation_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_mirror", "KvEventMirror's translation table in C (kv_events.py).", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__mirror(void)
{
    if (PyType_Ready(&TranslationType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Translation", (PyObject *)&TranslationType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
