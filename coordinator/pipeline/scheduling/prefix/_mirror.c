/* ``KvEventMirror``'s translation table (kv_events.py) in hash tables of machine words.
 *
 * Why C: every engine block an engine stores is remembered as "engine hash -> our hashes of it and
 * the depth after it" until the engine removes it, and every hash of ours carries a count of the
 * engine blocks that map to it. In Python that was a dict entry, two tuples and a Python int per hash
 * (~250 bytes per engine block, a million blocks at 256 engines) and a set and a dict beside them,
 * walked by the garbage collector; and the intake did it tens of thousands of times a second. Here an
 * engine block is one 32-byte entry (plus an array when it spans several of our blocks) and a hash of
 * ours one 16-byte count.
 *
 * The semantics are ``_PyTranslation``'s (kv_events.py), which stays as the fallback and the reference
 * ``tests/unit/test_kv_events.py`` holds this one to. Engine hashes are vLLM's ints (taken modulo
 * 2**64) or sha256 bytes, keyed by their low 64 bits: what vLLM itself keeps of them when it publishes
 * ints.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <errno.h>
#include <string.h>
#include <sys/socket.h>

#include "../../../contracts/_chain.h"
#include "_index.h"
#include "_tables.h"

/* 32 bytes in a table aligned to the cache line (``line_calloc``), so that no entry straddles two
 * lines: a probe reads the first 16 (key, group, per), and at 48 bytes half the entries of a table
 * spanned two lines, a second cache miss per lookup in a table far larger than the caches. */
typedef struct {
    uint64_t key;        /* the engine hash, low 64 bits */
    int32_t group;       /* the KV cache group */
    uint32_t per;        /* our hashes; 0: an empty slot */
    int64_t depth;       /* our blocks from the prompt's start through this one */
    union {
        int64_t one;     /* our hash, when ``per`` is 1 */
        int64_t *many;   /* our hashes, when ``per`` > 1 */
    } ours;
} Entry;
_Static_assert(sizeof(Entry) == 32, "an entry is half a cache line");

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
    /* scratch of ``apply_batch``: a batch's events, their engine hashes and tokens, our hashes */
    struct WireEvent *wev;
    uint64_t *wkeys, *wtok;
    int64_t *wours;
    Py_ssize_t wev_cap, wkeys_cap, wtok_cap, wours_cap;
} Translation;

static PyTypeObject TranslationType;

static inline uint64_t
entry_home(uint64_t key, int32_t group, uint64_t mask)
{
    return mix(key ^ ((uint64_t)(uint32_t)group * 0x9e3779b97f4a7c15ULL)) & mask;
}

static inline const int64_t *
entry_ours(const Entry *e)
{
    return e->per == 1 ? &e->ours.one : e->ours.many;
}

static inline void
entry_free(Entry *e)
{
    if (e->per > 1) PyMem_Free(e->ours.many);
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
    entry_free(&t->entries[i]);
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
    Entry *fresh = line_calloc(cap, sizeof(Entry));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->entries = fresh;
    t->entries_mask = cap - 1;
    for (uint64_t i = 0; i < old_cap; i++)
        if (old[i].per) t->entries[entry_slot(t, old[i].group, old[i].key)] = old[i];
    free(old);
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
    Count *fresh = line_calloc(cap, sizeof(Count));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->counts = fresh;
    t->counts_mask = cap - 1;
    for (uint64_t i = 0; i < old_cap; i++)
        if (old[i].count) t->counts[count_slot(t, old[i].hash)] = old[i];
    free(old);
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
        for (uint64_t i = 0; i <= t->entries_mask; i++) entry_free(&t->entries[i]);
}

static void
Translation_dealloc(Translation *t)
{
    Translation_free_all(t);
    free(t->entries);
    free(t->counts);
    PyMem_Free(t->keys);
    PyMem_Free(t->ours);
    PyMem_Free(t->freed);
    PyMem_Free(t->wev);
    PyMem_Free(t->wkeys);
    PyMem_Free(t->wtok);
    PyMem_Free(t->wours);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int
Translation_reset(Translation *t)
{
    Translation_free_all(t);
    free(t->entries);
    free(t->counts);
    t->entries_mask = t->counts_mask = 255;
    t->entries_used = t->counts_used = 0;
    t->entries = line_calloc(t->entries_mask + 1, sizeof(Entry));
    t->counts = line_calloc(t->counts_mask + 1, sizeof(Count));
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

/* A run's entry slots asked for before any is used, so that their misses overlap (``_index.c``'s
 * ``prefetch_nodes``). */
static void
prefetch_entries(Translation *t, int32_t group, const uint64_t *keys, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) touch(&t->entries[entry_home(keys[i], group, t->entries_mask)]);
}

/* The entry of a block the engine reported, or NULL. */
static const Entry *
find_entry(Translation *t, int32_t group, uint64_t key)
{
    const Entry *e = &t->entries[entry_slot(t, group, key)];
    return e->per ? e : NULL;
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
    const Entry *e = find_entry(t, group, key);
    if (e == NULL) Py_RETURN_NONE;
    return Py_BuildValue("(LL)", (long long)entry_ours(e)[e->per - 1], (long long)e->depth);
}

/* ``store`` over machine words: engine block ``i`` (key ``keys[i]``) is ``ours[i*per:(i+1)*per]``.
 * ``keys`` and ``ours`` must not be the table's own scratch that this call grows (they are not). */
static int
store_words(Translation *t, int32_t group, const uint64_t *keys, Py_ssize_t n, const int64_t *ours,
            uint32_t per, long long start)
{
    Py_ssize_t m = n * (Py_ssize_t)per;
    if (grow_entries(t, (uint64_t)n) < 0 || grow_counts(t, (uint64_t)m) < 0) return -1;
    prefetch_entries(t, group, keys, n);
    for (Py_ssize_t i = 0; i < m; i++) touch(&t->counts[mix((uint64_t)ours[i]) & t->counts_mask]);
    int64_t **arrays = NULL;   /* allocated before any change, so a failure changes nothing */
    if (per > 1) {
        arrays = PyMem_Calloc((size_t)(n ? n : 1), sizeof(int64_t *));
        if (arrays == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            arrays[i] = PyMem_Malloc((size_t)per * sizeof(int64_t));
            if (arrays[i] == NULL) {
                for (Py_ssize_t j = 0; j < i; j++) PyMem_Free(arrays[j]);
                PyMem_Free(arrays);
                PyErr_NoMemory();
                return -1;
            }
        }
    }
    uint32_t stamp = next_epoch(t);
    /* blocks reported again give up their old mapping first */
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t slot = entry_slot(t, group, keys[i]);
        Entry *e = &t->entries[slot];
        if (e->per == 0) continue;
        const int64_t *old = entry_ours(e);
        for (uint32_t k = 0; k < e->per; k++) release(t, old[k]);
        entry_delete(t, slot);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t slot = entry_slot(t, group, keys[i]);
        Entry *e = &t->entries[slot];
        if (e->per) entry_free(e);   /* met twice in this call: the last one counts */
        else t->entries_used++;
        *e = (Entry){keys[i], group, per, (int64_t)(start + (long long)(i + 1) * per), {0}};
        if (per == 1) e->ours.one = ours[i];
        else {
            e->ours.many = arrays[i];
            memcpy(e->ours.many, &ours[i * per], (size_t)per * sizeof(int64_t));
        }
    }
    PyMem_Free(arrays);
    for (Py_ssize_t i = 0; i < m; i++) {
        Count *c = &t->counts[count_slot(t, ours[i])];
        if (c->count == 0) {
            *c = (Count){ours[i], 1, stamp};
            t->counts_used++;
        } else if (c->stamp != stamp) {
            c->count++;
            c->stamp = stamp;
        }
    }
    return 0;
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
    if (store_words(t, group, t->keys, n, t->ours, (uint32_t)per, start) < 0) goto fail;
    Py_DECREF(eseq);
    Py_DECREF(oseq);
    Py_RETURN_NONE;
fail:
    Py_DECREF(eseq);
    Py_DECREF(oseq);
    return NULL;
}

/* ``remove`` over machine words: the hashes freed go to ``t->freed`` (their count into ``*freed``);
 * returns the engine blocks found, or -1. */
static Py_ssize_t
remove_words(Translation *t, int32_t group, const uint64_t *keys, Py_ssize_t n, Py_ssize_t *freed)
{
    Py_ssize_t found = 0;
    *freed = 0;
    prefetch_entries(t, group, keys, n);
    for (Py_ssize_t i = 0; i < n; i++) {   /* the counts of the entries' hashes, as far as they are at home */
        const Entry *e = &t->entries[entry_home(keys[i], group, t->entries_mask)];
        if (e->per == 1) touch(&t->counts[mix((uint64_t)e->ours.one) & t->counts_mask]);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t slot = entry_slot(t, group, keys[i]);
        Entry *e = &t->entries[slot];
        if (e->per == 0) continue;
        found++;
        if (room((void **)&t->freed, &t->freed_cap, *freed + e->per, sizeof(int64_t)) < 0) return -1;
        const int64_t *ours = entry_ours(e);
        for (uint32_t k = 0; k < e->per; k++)
            if (release(t, ours[k])) t->freed[(*freed)++] = ours[k];
        entry_delete(t, slot);
    }
    return found;
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
    Py_ssize_t n = load_keys(t, seq), freed = 0;
    Py_DECREF(seq);
    if (n < 0) return NULL;
    Py_ssize_t found = remove_words(t, group, t->keys, n, &freed);
    if (found < 0) return NULL;
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

/* --- a published batch, applied without Python objects ---------------------------------------- */

/* Why parse msgpack here rather than with msgspec: the intake's cost per block was the Python between
 * the calls (a decoded event object, lists of ints, three method calls per event), not the tables.
 * Only the shape vLLM publishes for a model without LoRA or media is read here (every medium: the
 * engine's own cache and its offload tiers): anything else (extra keys, bytes hashes, an unknown field
 * or event, a malformed batch) makes ``apply_batch`` return None before it changes anything, and the
 * caller decodes the batch with msgspec and applies it in Python (kv_events.py), which stays the
 * reference. */

enum { EV_STORED = 1, EV_REMOVED = 2, EV_CLEARED = 3 };

typedef struct WireEvent {
    int kind;
    int32_t group;
    const char *medium;            /* NULL: nil */
    uint32_t medium_len;
    int has_parent;
    uint64_t parent;
    long long block_size;
    Py_ssize_t keys, n_keys;       /* into ``wkeys`` */
    Py_ssize_t tokens, n_tokens;   /* into ``wtok`` */
} WireEvent;

typedef struct {
    const uint8_t *p, *end;
} Reader;

static inline uint64_t
big_endian(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* A length behind a one-byte header: ``fix`` headers carry it in their low bits (``fix_mask``);
 * ``h16``/``h32`` are followed by 2 or 4 bytes of it. -1: not this kind of object, or truncated. */
static inline int
read_length(Reader *r, uint8_t fix_lo, uint8_t fix_mask, uint8_t h8, uint8_t h16, uint8_t h32,
            uint32_t *n)
{
    if (r->p >= r->end) return -1;
    uint8_t b = *r->p;
    int width;
    if ((b & (uint8_t)~fix_mask) == fix_lo) {
        *n = b & fix_mask;
        r->p++;
        return 0;
    }
    if (h8 && b == h8) width = 1;
    else if (b == h16) width = 2;
    else if (b == h32) width = 4;
    else return -1;
    if (r->end - r->p < 1 + width) return -1;
    *n = (uint32_t)big_endian(r->p + 1, width);
    r->p += 1 + width;
    return 0;
}

static inline int
read_array(Reader *r, uint32_t *n)
{
    return read_length(r, 0x90, 0x0f, 0, 0xdc, 0xdd, n);
}

static inline int
read_map(Reader *r, uint32_t *n)
{
    return read_length(r, 0x80, 0x0f, 0, 0xde, 0xdf, n);
}

static inline int
read_str(Reader *r, const char **s, uint32_t *n)
{
    if (read_length(r, 0xa0, 0x1f, 0xd9, 0xda, 0xdb, n) < 0 || (uint64_t)(r->end - r->p) < *n) return -1;
    *s = (const char *)r->p;
    r->p += *n;
    return 0;
}

/* nil: consumed, 1; anything else: left, 0. */
static inline int
read_nil(Reader *r)
{
    if (r->p < r->end && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

/* A non-negative integer (msgpack's positive fixint or uint 8-64). */
static inline int
read_uint(Reader *r, uint64_t *v)
{
    if (r->p >= r->end) return -1;
    uint8_t b = *r->p;
    if (b <= 0x7f) {
        *v = b;
        r->p++;
        return 0;
    }
    int width = b == 0xcc ? 1 : b == 0xcd ? 2 : b == 0xce ? 4 : b == 0xcf ? 8 : 0;
    if (width == 0 || r->end - r->p < 1 + width) return -1;
    *v = big_endian(r->p + 1, width);
    r->p += 1 + width;
    return 0;
}

/* An integer of either sign that fits in a long long. */
static inline int
read_int(Reader *r, long long *v)
{
    if (r->p >= r->end) return -1;
    uint8_t b = *r->p;
    if (b >= 0xe0) {
        *v = (int8_t)b;
        r->p++;
        return 0;
    }
    int width = b == 0xd0 ? 1 : b == 0xd1 ? 2 : b == 0xd2 ? 4 : b == 0xd3 ? 8 : 0;
    if (width) {
        if (r->end - r->p < 1 + width) return -1;
        uint64_t u = big_endian(r->p + 1, width);
        int shift = 64 - 8 * width;   /* sign-extend */
        *v = (long long)((int64_t)(u << shift) >> shift);
        r->p += 1 + width;
        return 0;
    }
    uint64_t u;
    if (read_uint(r, &u) < 0 || u > (uint64_t)INT64_MAX) return -1;
    *v = (long long)u;
    return 0;
}

/* An array of non-negative integers below ``limit`` appended to ``*buf`` (at ``*used``). */
static int
read_uints(Reader *r, uint64_t **buf, Py_ssize_t *cap, Py_ssize_t *used, Py_ssize_t *n, uint64_t limit)
{
    uint32_t len;
    if (read_array(r, &len) < 0 || (uint64_t)(r->end - r->p) < len) return -1;
    if (room((void **)buf, cap, *used + (Py_ssize_t)len, sizeof(uint64_t)) < 0) return -2;
    uint64_t *out = *buf + *used;
    for (uint32_t i = 0; i < len; i++)
        if (read_uint(r, &out[i]) < 0 || out[i] >= limit) return -1;
    *n = len;
    *used += len;
    return 0;
}

static inline int
key_is(const char *k, uint32_t n, const char *name)
{
    return strlen(name) == n && memcmp(k, name, n) == 0;
}

enum {
    F_HASHES = 1 << 0, F_PARENT = 1 << 1, F_TOKENS = 1 << 2, F_BLOCK_SIZE = 1 << 3, F_LORA_ID = 1 << 4,
    F_MEDIUM = 1 << 5, F_LORA_NAME = 1 << 6, F_EXTRA = 1 << 7, F_GROUP = 1 << 8, F_STORED_ONLY = 1 << 9,
    F_REMOVED_TOO = 1 << 10,
    STORED_NEEDS = F_HASHES | F_PARENT | F_TOKENS | F_BLOCK_SIZE | F_LORA_ID | F_MEDIUM | F_LORA_NAME,
    REMOVED_NEEDS = F_HASHES | F_MEDIUM,
    REMOVED_MAY = F_HASHES | F_MEDIUM | F_GROUP | F_REMOVED_TOO,
};

/* A token id is its own hash below 2**61 - 1 (``_chain.c``); anything larger: Python's path. */
#define TOKEN_LIMIT ((((uint64_t)1) << 61) - 1)

/* One event of the batch into ``ev`` (its ints into the scratch). -1: not the common shape; -2: an
 * exception is set. */
static int
read_event(Translation *t, Reader *r, WireEvent *ev, Py_ssize_t *keys_used, Py_ssize_t *tok_used)
{
    uint32_t fields;
    if (read_map(r, &fields) < 0) return -1;
    memset(ev, 0, sizeof(*ev));
    unsigned seen = 0;
    for (uint32_t f = 0; f < fields; f++) {
        const char *k, *v;
        uint32_t kn, vn;
        int rc = 0;
        if (read_str(r, &k, &kn) < 0) return -1;
        if (key_is(k, kn, "type")) {
            if (read_str(r, &v, &vn) < 0) return -1;
            ev->kind = key_is(v, vn, "BlockStored") ? EV_STORED : key_is(v, vn, "BlockRemoved") ? EV_REMOVED
                       : key_is(v, vn, "AllBlocksCleared") ? EV_CLEARED : 0;
            if (ev->kind == 0) return -1;
        } else if (key_is(k, kn, "block_hashes")) {
            ev->keys = *keys_used;
            rc = read_uints(r, &t->wkeys, &t->wkeys_cap, keys_used, &ev->n_keys, UINT64_MAX);
            seen |= F_HASHES;
        } else if (key_is(k, kn, "parent_block_hash")) {
            ev->has_parent = !read_nil(r);
            if (ev->has_parent && read_uint(r, &ev->parent) < 0) return -1;
            seen |= F_PARENT;
        } else if (key_is(k, kn, "token_ids")) {
            ev->tokens = *tok_used;
            rc = read_uints(r, &t->wtok, &t->wtok_cap, tok_used, &ev->n_tokens, TOKEN_LIMIT);
            seen |= F_TOKENS;
        } else if (key_is(k, kn, "block_size")) {
            if (read_int(r, &ev->block_size) < 0) return -1;
            seen |= F_BLOCK_SIZE;
        } else if (key_is(k, kn, "extra_keys")) {
            /* vLLM publishes one entry per block, nil for a block with none: only those are read here
             * (a salt, LoRA, media or prompt embeds take Python's path) */
            uint32_t entries;
            if (!read_nil(r)) {
                if (read_array(r, &entries) < 0) return -1;
                for (uint32_t i = 0; i < entries; i++)
                    if (!read_nil(r)) return -1;
            }
            seen |= F_EXTRA;
        } else if (key_is(k, kn, "lora_id") || key_is(k, kn, "lora_name")) {
            if (!read_nil(r)) return -1;   /* LoRA: Python's path */
            seen |= kn == 7 ? F_LORA_ID : F_LORA_NAME;
        } else if (key_is(k, kn, "medium")) {
            if (!read_nil(r)) {
                if (read_str(r, &ev->medium, &ev->medium_len) < 0) return -1;
                for (uint32_t i = 0; i < ev->medium_len; i++)   /* tiers match upper-cased: ASCII here */
                    if ((unsigned char)ev->medium[i] >= 0x80) return -1;
            }
            seen |= F_MEDIUM;
        } else if (key_is(k, kn, "group_idx")) {
            long long g = 0;
            if (!read_nil(r) && (read_int(r, &g) < 0 || g < 0 || g > INT32_MAX)) return -1;
            ev->group = (int32_t)g;
            seen |= F_GROUP;
        } else if (key_is(k, kn, "locality") || key_is(k, kn, "ownership")) {
            if (!read_nil(r) && read_str(r, &v, &vn) < 0) return -1;
            seen |= F_REMOVED_TOO;
        } else if (key_is(k, kn, "kv_cache_spec_kind") || key_is(k, kn, "session_id")) {
            if (!read_nil(r) && read_str(r, &v, &vn) < 0) return -1;
            seen |= F_STORED_ONLY;
        } else if (key_is(k, kn, "kv_cache_spec_sliding_window")) {
            long long w;
            if (!read_nil(r) && read_int(r, &w) < 0) return -1;
            seen |= F_STORED_ONLY;
        } else {
            return -1;   /* a field this reader does not know */
        }
        if (rc) return rc;
    }
    switch (ev->kind) {
    case EV_STORED:
        return (seen & STORED_NEEDS) == STORED_NEEDS ? 0 : -1;
    case EV_REMOVED:
        return (seen & REMOVED_NEEDS) == REMOVED_NEEDS && (seen & ~(unsigned)REMOVED_MAY) == 0 ? 0 : -1;
    case EV_CLEARED:
        return seen == 0 ? 0 : -1;
    default:
        return -1;
    }
}

/* The whole batch into ``t->wev``: its event count, -1 if it is not the common shape, -2 on an
 * exception. Nothing of the translation changes. */
static Py_ssize_t
read_batch(Translation *t, const uint8_t *data, Py_ssize_t size, Py_ssize_t our_block_size)
{
    Reader r = {data, data + size};
    uint32_t top, n;
    if (read_array(&r, &top) < 0 || (top != 2 && top != 3)) return -1;
    if (r.p >= r.end || (*r.p != 0xcb && *r.p != 0xca)) return -1;   /* ts: a float */
    Py_ssize_t ts_size = *r.p == 0xcb ? 9 : 5;
    if (r.end - r.p < ts_size) return -1;
    r.p += ts_size;
    if (read_array(&r, &n) < 0) return -1;
    if (room((void **)&t->wev, &t->wev_cap, (Py_ssize_t)n, sizeof(WireEvent)) < 0) return -2;
    Py_ssize_t keys_used = 0, tok_used = 0;
    for (uint32_t i = 0; i < n; i++) {
        WireEvent *ev = &t->wev[i];
        int rc = read_event(t, &r, ev, &keys_used, &tok_used);
        if (rc) return rc;
        if (ev->kind == EV_STORED && ev->n_tokens
            && (ev->block_size <= 0 || ev->block_size % our_block_size)) return -1;   /* warned there */
    }
    if (top == 3) {   /* data_parallel_rank */
        long long rank;
        if (!read_nil(&r) && read_int(&r, &rank) < 0) return -1;
    }
    return r.p == r.end ? (Py_ssize_t)n : -1;
}

static const IndexAPI *index_api;
static const ChainAPI *chain_api;

#define MAX_MEDIA 8

/* One medium of the mirror: its name (NULL: the engine's own cache, whose events say "GPU" or
 * nothing), its translation, its index and that index's capacity. */
typedef struct {
    const char *name;
    Py_ssize_t name_len;
    Translation *trans;
    PyObject *index;
    long long capacity;
} Medium;

/* Where an event of ``medium`` goes: its ``Medium``, or -1 (neither the primary nor a kept tier).
 * Tiers are named as ``tier_name`` does: upper case. */
static int
medium_of(const WireEvent *ev, const Medium *media, int n_media)
{
    if (ev->medium == NULL || (ev->medium_len == 3 && memcmp(ev->medium, "GPU", 3) == 0)) return 0;
    for (int m = 1; m < n_media; m++) {
        if (media[m].name_len != (Py_ssize_t)ev->medium_len) continue;
        uint32_t i = 0;
        while (i < ev->medium_len && Py_TOUPPER((unsigned char)ev->medium[i]) == (unsigned char)media[m].name[i])
            i++;
        if (i == ev->medium_len) return m;
    }
    return -1;
}

static int
load_media(PyObject *arg, Medium *media, int *n_media)
{
    if (!PyTuple_Check(arg) || PyTuple_GET_SIZE(arg) < 1 || PyTuple_GET_SIZE(arg) > MAX_MEDIA) {
        PyErr_SetString(PyExc_TypeError, "media: a tuple of 1 to 8 (name, Translation, Index, capacity)");
        return -1;
    }
    *n_media = (int)PyTuple_GET_SIZE(arg);
    for (int m = 0; m < *n_media; m++) {
        PyObject *one = PyTuple_GET_ITEM(arg, m);
        if (!PyTuple_Check(one) || PyTuple_GET_SIZE(one) != 4) {
            PyErr_SetString(PyExc_TypeError, "a medium is (name, Translation, Index, capacity)");
            return -1;
        }
        PyObject *name = PyTuple_GET_ITEM(one, 0), *trans = PyTuple_GET_ITEM(one, 1);
        Medium *md = &media[m];
        md->index = PyTuple_GET_ITEM(one, 2);
        md->name = NULL;
        md->name_len = 0;
        if ((m == 0) != (name == Py_None) || !PyObject_TypeCheck(trans, &TranslationType)
            || !index_api->check(md->index)) {
            PyErr_SetString(PyExc_TypeError, "media: the primary first (name None), then named tiers");
            return -1;
        }
        if (m > 0 && (md->name = PyUnicode_AsUTF8AndSize(name, &md->name_len)) == NULL) return -1;
        md->trans = (Translation *)trans;
        md->capacity = PyLong_AsLongLong(PyTuple_GET_ITEM(one, 3));
        if (md->capacity == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* The parent's last hash of ours and depth: from the run's own medium, else from any other (an engine
 * hash names the same tokens in every medium). */
static const Entry *
find_parent(const Medium *media, int n_media, int own, int32_t group, uint64_t parent)
{
    const Entry *p = find_entry(media[own].trans, group, parent);
    for (int m = 0; p == NULL && m < n_media; m++)
        if (m != own) p = find_entry(media[m].trans, group, parent);
    return p;
}

/* What applying batches did, as ``apply_batch`` returns it. */
typedef struct {
    Py_ssize_t stored, tier_stored, removed, clears, unknown, no_tokens, other;
    long long engine_block_size;
} Counts;

/* Everything a batch is applied with besides the batch. */
typedef struct {
    Medium media[MAX_MEDIA];
    int n_media;
    PyObject *engine;
    Py_ssize_t block_size;
    int64_t root;
    double now;
} Target;

/* ``args``: media, engine, block_size, root_seed, now. */
static int
load_target(PyObject *const *args, Target *to)
{
    if (load_media(args[0], to->media, &to->n_media) < 0) return -1;
    to->engine = args[1];
    if (!PyUnicode_Check(to->engine)) {
        PyErr_SetString(PyExc_TypeError, "an engine is named by a str");
        return -1;
    }
    to->block_size = PyLong_AsSsize_t(args[2]);
    if (to->block_size == -1 && PyErr_Occurred()) return -1;
    long long root = PyLong_AsLongLong(args[3]);
    if (root == -1 && PyErr_Occurred()) return -1;
    to->root = (int64_t)root;
    to->now = PyFloat_AsDouble(args[4]);
    if (to->now == -1.0 && PyErr_Occurred()) return -1;
    if (to->block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return -1;
    }
    return 0;
}

/* One published batch applied to ``to``, its effects added to ``c``: 1; 0 if it is not the common
 * shape (nothing changed); -1 with an exception. */
static int
apply_words(const Target *to, const uint8_t *data, Py_ssize_t size, Counts *c)
{
    const Medium *media = to->media;
    int n_media = to->n_media;
    PyObject *engine = to->engine;
    Py_ssize_t bs = to->block_size;
    Translation *t = media[0].trans;   /* its scratch holds the batch */
    Py_ssize_t n = read_batch(t, data, size, bs);
    if (n == -1) return 0;
    if (n < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        const WireEvent *ev = &t->wev[i];
        if (ev->kind == EV_CLEARED) {   /* it carries no medium, and a reset clears the tiers too */
            c->clears++;
            for (int m = 0; m < n_media; m++)
                if (Translation_reset(media[m].trans) < 0 || index_api->clear(media[m].index, engine) < 0)
                    return -1;
            continue;
        }
        int at = medium_of(ev, media, n_media);
        if (at < 0) {
            c->other++;
            continue;
        }
        Translation *tr = media[at].trans;
        PyObject *index = media[at].index;
        const uint64_t *keys = t->wkeys + ev->keys;
        if (ev->kind == EV_REMOVED) {
            /* vLLM sends one BlockRemoved per evicted block: the removals that follow in the same medium
             * and group (``read_batch`` lays each event's keys after the last one's) are removed in one
             * pass, so that their cache misses overlap as a run's do. The same effects as one by one: the
             * translation and the index are apart, and each is changed in the events' order. */
            Py_ssize_t n_keys = ev->n_keys;
            while (i + 1 < n) {
                const WireEvent *next = &t->wev[i + 1];
                if (next->kind != EV_REMOVED || next->group != ev->group || medium_of(next, media, n_media) != at)
                    break;
                n_keys += next->n_keys;
                i++;
            }
            Py_ssize_t freed;
            Py_ssize_t found = remove_words(tr, ev->group, keys, n_keys, &freed);
            if (found < 0) return -1;
            if (at == 0) c->removed += found;
            if (freed && index_api->remove(index, engine, tr->freed, freed) < 0) return -1;
            continue;
        }
        if (ev->n_tokens == 0) {   /* an offload tier's placeholder: nothing to hash */
            c->no_tokens++;
            continue;
        }
        if (at == 0) c->engine_block_size = ev->block_size;
        int64_t seed = to->root;
        long long start = 0;
        if (ev->has_parent) {
            const Entry *p = find_parent(media, n_media, at, ev->group, ev->parent);
            if (p == NULL) {   /* missed event, or a partial tail's parent inside an engine block */
                c->unknown++;
                continue;
            }
            seed = entry_ours(p)[p->per - 1];
            start = p->depth;
        }
        Py_ssize_t blocks = ev->n_tokens / ev->block_size;
        if (blocks > ev->n_keys) blocks = ev->n_keys;
        if (blocks == 0) continue;
        uint32_t per = (uint32_t)(ev->block_size / bs);
        Py_ssize_t m = blocks * per;
        if (room((void **)&t->wours, &t->wours_cap, m, sizeof(int64_t)) < 0) return -1;
        if (chain_api->chain(t->wtok + ev->tokens, m, bs, seed, (Py_ssize_t)start, t->wours) < 0) {
            PyErr_SetString(PyExc_OverflowError, "depth out of range");
            return -1;
        }
        if (store_words(tr, ev->group, keys, blocks, t->wours, per, start) < 0) return -1;
        if (at == 0) c->stored += blocks;
        else c->tier_stored += blocks;
        if (index_api->add(index, engine, t->wours, m, ev->has_parent, seed, to->now, media[at].capacity) < 0)
            return -1;
    }
    return 1;
}

static PyObject *
counts_tuple(const Counts *c)
{
    return Py_BuildValue("(nnnnnnnL)", c->stored, c->tier_stored, c->removed, c->clears, c->unknown,
                         c->no_tokens, c->other, c->engine_block_size);
}

/* apply_batch(payload, media, engine, block_size, root_seed, now): the published batch ``payload``
 * applied to the mirror's ``media`` under ``engine``, as ``KvEventMirror.apply_payload`` would: each
 * event to its medium's translation and index (see ``load_media``), re-hashed at ``block_size`` from
 * ``root_seed`` for a root run, each add trimmed to its index's capacity (negative: no bound), at
 * ``now``. Returns ``(blocks stored in the engine's cache, blocks stored in tiers, blocks removed from
 * the engine's cache, clears, runs of unknown parent, runs without tokens, events of other media,
 * the last block size the engine's cache stored or -1)``, or None -- nothing changed -- when the
 * batch is not the common shape or the other extensions are missing. */
static PyObject *
apply_batch(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "apply_batch(payload, media, engine, block_size, root_seed, now)");
        return NULL;
    }
    if (index_api == NULL || chain_api == NULL) Py_RETURN_NONE;
    Target to;
    if (load_target(args + 1, &to) < 0) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    Counts c = {0, 0, 0, 0, 0, 0, 0, -1};
    int rc = apply_words(&to, (const uint8_t *)view.buf, view.len, &c);
    PyBuffer_Release(&view);
    if (rc < 0) return NULL;
    if (rc == 0) Py_RETURN_NONE;
    return counts_tuple(&c);
}

/* --- the feed's drain, over libzmq ----------------------------------------------------------- */

/* Why receive here: with a batch applied in one call, pyzmq's receive (three frame objects and their
 * bytes per message) and the loop around it were a fifth of the intake's CPU. libzmq is the one pyzmq
 * loaded (libzmq_receive.py finds its functions); nothing is linked at build time, and without it
 * the feed receives in Python as before. */

typedef struct {
    uint64_t _[8];   /* libzmq's zmq_msg_t: 64 opaque bytes since 4.0 */
} ZmqMsg;

#define ZMQ_DONTWAIT_ 1
#define ZMQ_EVENTS_ 15
#define ZMQ_POLLIN_ 1
#define MAX_FRAMES 8

static struct {
    int (*msg_init)(ZmqMsg *);
    int (*msg_recv)(ZmqMsg *, void *, int);
    void *(*msg_data)(ZmqMsg *);
    size_t (*msg_size)(const ZmqMsg *);
    int (*msg_more)(const ZmqMsg *);
    int (*msg_close)(ZmqMsg *);
    int (*getsockopt)(void *, int, void *, size_t *);
    int (*errno_)(void);
} zmq_fns;

/* bind_zmq(msg_init, msg_recv, msg_data, msg_size, msg_more, msg_close, getsockopt, errno): libzmq's
 * functions by address. */
static PyObject *
bind_zmq(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    void *fns[8];
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "bind_zmq takes the addresses of 8 libzmq functions");
        return NULL;
    }
    for (int i = 0; i < 8; i++) {
        fns[i] = PyLong_AsVoidPtr(args[i]);
        if (fns[i] == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a libzmq function's address is 0");
            return NULL;
        }
    }
    memcpy(&zmq_fns, fns, sizeof(zmq_fns));
    Py_RETURN_NONE;
}

static void
close_frames(ZmqMsg *frames, int n)
{
    for (int i = 0; i < n; i++) zmq_fns.msg_close(&frames[i]);
}

/* One message, framed as libzmq_receive.receive frames it: three frames whatever their ``more`` flags
 * (fewer if the socket runs dry), then the rest while the last says more. Returns the frame count (0: none
 * waiting), or -1 with an exception. */
static int
receive(void *sock, ZmqMsg *frames, int *extra)
{
    int n = 0;
    ZmqMsg spare;
    *extra = 0;
    for (;;) {
        ZmqMsg *f = n < MAX_FRAMES ? &frames[n] : &spare;
        zmq_fns.msg_init(f);
        if (zmq_fns.msg_recv(f, sock, ZMQ_DONTWAIT_) < 0) {
            int err = zmq_fns.errno_();
            zmq_fns.msg_close(f);
            if (err == EAGAIN) return n;   /* nothing waiting, or a message of fewer than three frames */
            close_frames(frames, n);
            PyErr_Format(PyExc_OSError, "libzmq receive failed (errno %d)", err);
            return -1;
        }
        int more = zmq_fns.msg_more(f);
        if (f == &spare) {   /* past what is kept: counted (handed back empty) */
            zmq_fns.msg_close(f);
            (*extra)++;
        } else {
            n++;
        }
        if (n + *extra >= 3 && !more) return n;
    }
}

/* drain(socket, last_seq, max_messages, media, engine, block_size, root_seed, now): applies the
 * socket's waiting messages while each is the next in sequence and ``apply_batch`` takes it, up to
 * ``max_messages``. Returns ``(last_seq, messages applied, counts as apply_batch's, the message it
 * stopped at as a list of frames or None, whether more is waiting)``; a message handed back was
 * received but not applied (a gap, a restart, bad framing, a batch Python must decode): the caller
 * handles it. Reading ``EVENTS`` at the end re-arms ZMQ's edge-triggered descriptor. */
static PyObject *
drain(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "drain(socket, last_seq, max_messages, media, engine, block_size, root_seed, now)");
        return NULL;
    }
    if (zmq_fns.msg_recv == NULL || index_api == NULL || chain_api == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "drain needs bind_zmq and the index's and chain's extensions");
        return NULL;
    }
    void *sock = PyLong_AsVoidPtr(args[0]);
    if (sock == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "no socket");
        return NULL;
    }
    long long last = PyLong_AsLongLong(args[1]);
    if (last == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t budget = PyLong_AsSsize_t(args[2]);
    if (budget == -1 && PyErr_Occurred()) return NULL;
    Target to;
    if (load_target(args + 3, &to) < 0) return NULL;
    Counts c = {0, 0, 0, 0, 0, 0, 0, -1};
    Py_ssize_t applied = 0;
    PyObject *held = Py_NewRef(Py_None);
    ZmqMsg frames[MAX_FRAMES];
    while (applied < budget) {
        int extra;
        int n = receive(sock, frames, &extra);
        if (n < 0) goto fail;
        if (n == 0) break;
        int rc = 0;
        if (n == 3 && extra == 0 && zmq_fns.msg_size(&frames[1]) == 8) {
            uint64_t seq = big_endian(zmq_fns.msg_data(&frames[1]), 8);
            if (seq <= INT64_MAX && last < INT64_MAX && (long long)seq == last + 1) {
                rc = apply_words(&to, zmq_fns.msg_data(&frames[2]), (Py_ssize_t)zmq_fns.msg_size(&frames[2]), &c);
                if (rc < 0) {
                    close_frames(frames, n);
                    goto fail;
                }
                if (rc) last = (long long)seq;
            }
        }
        if (rc) {
            applied++;
            close_frames(frames, n);
            continue;
        }
        Py_DECREF(held);   /* handed back whole (frames past MAX_FRAMES are counted as empty ones) */
        held = PyList_New(n + extra);
        if (held == NULL) {
            close_frames(frames, n);
            goto fail;
        }
        for (int i = 0; i < n + extra; i++) {
            PyObject *b = i < n ? PyBytes_FromStringAndSize(zmq_fns.msg_data(&frames[i]),
                                                            (Py_ssize_t)zmq_fns.msg_size(&frames[i]))
                                : PyBytes_FromStringAndSize(NULL, 0);
            if (b == NULL) {
                close_frames(frames, n);
                goto fail;
            }
            PyList_SET_ITEM(held, i, b);
        }
        close_frames(frames, n);
        break;
    }
    int events = 0;
    size_t size = sizeof(events);
    if (zmq_fns.getsockopt(sock, ZMQ_EVENTS_, &events, &size) < 0) {
        PyErr_Format(PyExc_OSError, "libzmq getsockopt(EVENTS) failed (errno %d)", zmq_fns.errno_());
        goto fail;
    }
    PyObject *counts = counts_tuple(&c);
    if (counts == NULL) goto fail;
    return Py_BuildValue("(LnNNO)", last, applied, counts, held, (events & ZMQ_POLLIN_) ? Py_True : Py_False);
fail:
    Py_XDECREF(held);
    return NULL;
}

/* --- the feed's drain, over our own ZMTP reader (zmtp.py) ------------------------------------- */

/* Why: a libzmq socket is served by libzmq's I/O thread, which wakes for every TCP arrival and
 * signals the reader; at 256 engines that thread and its signalling were a third of the intake's CPU.
 * Here the feed's own socket is read by the drain itself, and ZMTP's frames are parsed in place. */

#define ZMTP_CHUNK 65536          /* zmtp.CHUNK */
#define ZMTP_MAX_FRAME (64u << 20) /* zmtp.MAX_FRAME */

enum { STREAM_DRAINED = 0, STREAM_MORE = 1, STREAM_PYTHON = 2, STREAM_CLOSED = 3 };

/* The plain message (no command, at most MAX_FRAMES frames) at ``p[0:size]``: its frames' offsets and
 * sizes. Returns the bytes it spans, 0 while it is incomplete, -1 if the head is anything else (a
 * command, reserved flags, a frame past the limit, too many frames: zmtp.py's ``take`` reads it). */
static Py_ssize_t
zmtp_message(const uint8_t *p, Py_ssize_t size, Py_ssize_t *starts, Py_ssize_t *lens, int *n)
{
    Py_ssize_t at = 0;
    *n = 0;
    for (;;) {
        if (size - at < 2) return 0;
        uint8_t flags = p[at];
        if (flags & ~3u) return -1;
        uint64_t len;
        Py_ssize_t start;
        if (flags & 2u) {
            if (size - at < 9) return 0;
            len = big_endian(p + at + 1, 8);
            start = at + 9;
        } else {
            len = p[at + 1];
            start = at + 2;
        }
        if (len > ZMTP_MAX_FRAME || *n == MAX_FRAMES) return -1;
        if ((uint64_t)(size - start) < len) return 0;
        starts[*n] = start;
        lens[*n] = (Py_ssize_t)len;
        (*n)++;
        at = start + (Py_ssize_t)len;
        if (!(flags & 1u)) return at;
    }
}

/* ``buf[:pos]`` was taken: it leaves the buffer. */
static int
drop_taken(PyObject *buf, Py_ssize_t pos)
{
    if (pos == 0) return 0;
    char *b = PyByteArray_AS_STRING(buf);
    Py_ssize_t len = PyByteArray_GET_SIZE(buf);
    memmove(b, b + pos, (size_t)(len - pos));
    return PyByteArray_Resize(buf, len - pos);
}

/* The messages at the head of ``buf`` (a bytearray: what was received and not yet taken), reading the
 * non-blocking socket ``fd`` into it when they run out, each applied to ``to`` while it is the next
 * after ``*last`` and ``apply_words`` takes it, up to ``budget``; what it did not take stays in ``buf``.
 * Effects go to ``c`` and ``*applied``; the message it stopped at (taken, not applied: the caller
 * handles it) to ``*held`` as a list of frames. Returns the stream's state: ``STREAM_DRAINED`` the
 * socket is read dry and no whole message waits, ``STREAM_MORE`` more may wait (the budget ran out, or
 * a message was handed back), ``STREAM_PYTHON`` the head is for zmtp.py to read (a command, or not a
 * plain message), ``STREAM_CLOSED`` the stream ended or failed (reconnect); -1 with an exception. */
static int
stream_drain(long fd, PyObject *buf, long long *last_io, Py_ssize_t budget, const Target *to, Counts *c,
             Py_ssize_t *applied_out, PyObject **held)
{
    if (!PyByteArray_Check(buf)) {
        PyErr_SetString(PyExc_TypeError, "the buffer is a bytearray");
        return -1;
    }
    long long last = *last_io;
    Py_ssize_t applied = 0, pos = 0;
    int state = STREAM_DRAINED, dry = 0;
    Py_ssize_t starts[MAX_FRAMES], lens[MAX_FRAMES];
    *held = NULL;
    for (;;) {
        if (applied >= budget) {
            state = STREAM_MORE;
            break;
        }
        const uint8_t *base = (const uint8_t *)PyByteArray_AS_STRING(buf);
        Py_ssize_t len = PyByteArray_GET_SIZE(buf);
        int nf;
        Py_ssize_t took = zmtp_message(base + pos, len - pos, starts, lens, &nf);
        if (took < 0) {
            state = STREAM_PYTHON;
            break;
        }
        if (took == 0) {   /* incomplete: read more, once the last read left the socket dry no more */
            if (dry) break;
            if (drop_taken(buf, pos) < 0) goto fail;
            len -= pos;
            pos = 0;
            if (PyByteArray_Resize(buf, len + ZMTP_CHUNK) < 0) goto fail;
            char *room_at = PyByteArray_AS_STRING(buf);
            ssize_t got;
            do {
                got = recv((int)fd, room_at + len, ZMTP_CHUNK, MSG_DONTWAIT);
            } while (got < 0 && errno == EINTR);
            int err = errno;
            if (PyByteArray_Resize(buf, len + (got > 0 ? got : 0)) < 0) goto fail;
            if (got == 0 || (got < 0 && err != EAGAIN && err != EWOULDBLOCK)) {
                state = STREAM_CLOSED;
                break;
            }
            if (got < 0) break;
            if (got < ZMTP_CHUNK) dry = 1;
            continue;
        }
        const uint8_t *m = base + pos;
        int rc = 0;
        if (nf == 3 && lens[1] == 8) {
            uint64_t seq = big_endian(m + starts[1], 8);
            if (seq <= INT64_MAX && last < INT64_MAX && (long long)seq == last + 1) {
                rc = apply_words(to, m + starts[2], lens[2], c);
                if (rc < 0) goto fail;
                if (rc) last = (long long)seq;
            }
        }
        pos += took;
        if (rc) {
            applied++;
            continue;
        }
        PyObject *frames = PyList_New(nf);   /* handed back whole */
        if (frames == NULL) goto fail;
        for (int i = 0; i < nf; i++) {
            PyObject *b = PyBytes_FromStringAndSize((const char *)m + starts[i], lens[i]);
            if (b == NULL) {
                Py_DECREF(frames);
                goto fail;
            }
            PyList_SET_ITEM(frames, i, b);
        }
        *held = frames;
        state = STREAM_MORE;
        break;
    }
    *last_io = last;
    *applied_out = applied;
    if (drop_taken(buf, pos) < 0) {
        Py_CLEAR(*held);
        return -1;
    }
    return state;
fail:
    *last_io = last;   /* what was applied stays applied, and leaves the buffer even so */
    *applied_out = applied;
    if (pos) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (drop_taken(buf, pos) < 0) PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
    return -1;
}

/* --- one engine's feed, drained alone or in the gathered sweep --------------------------------- */

/* Why a type: the gathered sweep (``sweep``) drains every ready feed in one call, with no Python frame
 * per feed; each feed's position in its stream and what its drains applied must then live here. At
 * 256 engines the Python around one feed's drain (the sweep's loop, the subscriber's and the mirror's
 * methods, the results' tuples) was 14 % of a busy indexer's CPU (docs/scheduling.md). */
typedef struct {
    PyObject_HEAD
    PyObject *media;       /* ``Target``'s media point into it: kept alive */
    PyObject *engine;
    Target target;         /* parsed once; ``now`` set per drain */
    PyObject *buffer;      /* the connection's bytearray (zmtp.ZmtpSubscription.buffer), or None */
    long fd;
    long long last;        /* the last sequence number applied, when ``has_last`` */
    int has_last;
    char live;             /* the sweep may drain it; Python clears it while it handles the feed itself */
    Py_ssize_t budget;     /* messages per drain */
    Py_ssize_t batches;    /* what drains applied since ``take_counts`` */
    Counts counts;
    PyObject *held;        /* what the sweep stopped at, for the next ``drain``: (frames or None, state) */
    PyObject *err_type, *err_value, *err_tb;   /* an exception the sweep met, raised by the next ``drain`` */
} Feed;

static PyTypeObject FeedType;

static void
Feed_dealloc(Feed *f)
{
    Py_XDECREF(f->media);
    Py_XDECREF(f->engine);
    Py_XDECREF(f->buffer);
    Py_XDECREF(f->held);
    Py_XDECREF(f->err_type);
    Py_XDECREF(f->err_value);
    Py_XDECREF(f->err_tb);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static const Counts NO_COUNTS = {0, 0, 0, 0, 0, 0, 0, -1};

/* Feed(media, engine, block_size, root_seed, max_messages) */
static PyObject *
Feed_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Feed() takes positional arguments");
        return NULL;
    }
    if (index_api == NULL || chain_api == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Feed needs the index's and chain's extensions");
        return NULL;
    }
    if (PyTuple_GET_SIZE(args) != 5) {
        PyErr_SetString(PyExc_TypeError, "Feed(media, engine, block_size, root_seed, max_messages)");
        return NULL;
    }
    Py_ssize_t budget = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, 4));
    if (budget == -1 && PyErr_Occurred()) return NULL;
    if (budget < 1) {
        PyErr_SetString(PyExc_ValueError, "max_messages must be positive");
        return NULL;
    }
    PyObject *targs[5] = {PyTuple_GET_ITEM(args, 0), PyTuple_GET_ITEM(args, 1), PyTuple_GET_ITEM(args, 2),
                          PyTuple_GET_ITEM(args, 3), NULL};
    PyObject *zero = PyFloat_FromDouble(0.0);
    if (zero == NULL) return NULL;
    targs[4] = zero;
    Feed *f = (Feed *)type->tp_alloc(type, 0);
    if (f == NULL) {
        Py_DECREF(zero);
        return NULL;
    }
    int rc = load_target(targs, &f->target);
    Py_DECREF(zero);
    if (rc < 0) {
        Py_DECREF(f);
        return NULL;
    }
    f->media = Py_NewRef(targs[0]);
    f->engine = Py_NewRef(targs[1]);
    f->buffer = Py_NewRef(Py_None);
    f->fd = -1;
    f->budget = budget;
    f->counts = NO_COUNTS;
    return (PyObject *)f;
}

static void
add_counts(Counts *to, const Counts *c)
{
    to->stored += c->stored;
    to->tier_stored += c->tier_stored;
    to->removed += c->removed;
    to->clears += c->clears;
    to->unknown += c->unknown;
    to->no_tokens += c->no_tokens;
    to->other += c->other;
    if (c->engine_block_size >= 0) to->engine_block_size = c->engine_block_size;
}

/* One drain of the feed at ``now``: its state, the message it stopped at in ``*held``; -1 with an
 * exception. */
static int
feed_drain(Feed *f, double now, PyObject **held)
{
    if (!f->has_last) {
        PyErr_SetString(PyExc_RuntimeError, "a feed drains from a known position (last_seq)");
        return -1;
    }
    f->target.now = now;
    Counts c = NO_COUNTS;
    Py_ssize_t applied = 0;
    int state = stream_drain(f->fd, f->buffer, &f->last, f->budget, &f->target, &c, &applied, held);
    if (applied) {
        f->batches += applied;
        add_counts(&f->counts, &c);
    }
    return state;
}

/* drain(now) -> (frames or None, state): what the last sweep stopped at if anything, else one drain
 * (``stream_drain``). An exception the sweep met is raised here. */
static PyObject *
Feed_drain(Feed *f, PyObject *arg)
{
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    if (f->err_type != NULL) {
        PyErr_Restore(f->err_type, f->err_value, f->err_tb);
        f->err_type = f->err_value = f->err_tb = NULL;
        return NULL;
    }
    if (f->held != NULL) {
        PyObject *out = f->held;
        f->held = NULL;
        return out;
    }
    PyObject *held;
    int state = feed_drain(f, now, &held);
    if (state < 0) return NULL;
    return Py_BuildValue("(Ni)", held != NULL ? held : Py_NewRef(Py_None), state);
}

/* take_counts() -> (batches, counts as apply_batch's): what drains applied since the last call. */
static PyObject *
Feed_take_counts(Feed *f, PyObject *Py_UNUSED(ignored))
{
    PyObject *counts = counts_tuple(&f->counts);
    if (counts == NULL) return NULL;
    Py_ssize_t batches = f->batches;
    f->batches = 0;
    f->counts = NO_COUNTS;
    return Py_BuildValue("(nN)", batches, counts);
}

static PyObject *
Feed_get_last_seq(Feed *f, void *Py_UNUSED(closure))
{
    if (!f->has_last) Py_RETURN_NONE;
    return PyLong_FromLongLong(f->last);
}

static int
Feed_set_last_seq(Feed *f, PyObject *value, void *Py_UNUSED(closure))
{
    if (value == NULL || value == Py_None) {
        f->has_last = 0;
        return 0;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred()) return -1;
    f->last = v;
    f->has_last = 1;
    return 0;
}

static PyObject *
Feed_get_buffer(Feed *f, void *Py_UNUSED(closure))
{
    return Py_NewRef(f->buffer);
}

static int
Feed_set_buffer(Feed *f, PyObject *value, void *Py_UNUSED(closure))
{
    if (value == NULL) value = Py_None;
    Py_SETREF(f->buffer, Py_NewRef(value));
    return 0;
}

static PyGetSetDef Feed_getset[] = {
    {"last_seq", (getter)Feed_get_last_seq, (setter)Feed_set_last_seq,
     "the last sequence number applied, or None before the first", NULL},
    {"buffer", (getter)Feed_get_buffer, (setter)Feed_set_buffer, "the connection's bytearray", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef Feed_members[] = {
    {"fd", T_LONG, offsetof(Feed, fd), 0, "the connection's socket (-1: none)"},
    {"live", T_BOOL, offsetof(Feed, live), 0, "whether the sweep may drain it"},
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef Feed_methods[] = {
    {"drain", (PyCFunction)Feed_drain, METH_O, "drain(now) -> (frames or None, state)"},
    {"take_counts", (PyCFunction)Feed_take_counts, METH_NOARGS,
     "take_counts() -> (batches, counts): what drains applied since the last call"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FeedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "coordinator.pipeline.scheduling.prefix._mirror.Feed",
    .tp_basicsize = sizeof(Feed),
    .tp_dealloc = (destructor)Feed_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One engine's feed over our ZMTP reader: its position, its connection, what it applied.",
    .tp_methods = Feed_methods,
    .tp_getset = Feed_getset,
    .tp_members = Feed_members,
    .tp_new = Feed_new,
};

/* sweep(ready, feeds, now) -> [fd, ...]: ``ready`` as ``epoll.poll`` returns it, ``feeds`` {fd: Feed}.
 * Drains each ready feed that is live, and returns the descriptors Python must drain itself: those of
 * no live feed, and those whose drain stopped at anything but a dry socket (a message handed back, a
 * command, a closed stream, the budget, an exception), which that feed's next ``drain`` returns. */
static PyObject *
sweep(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "sweep(ready: list, feeds: dict, now)");
        return NULL;
    }
    double now = PyFloat_AsDouble(args[2]);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    PyObject *ready = args[0], *feeds = args[1];
    PyObject *slow = PyList_New(0);
    if (slow == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ready); i++) {
        PyObject *item = PyList_GET_ITEM(ready, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 1) {
            PyErr_SetString(PyExc_TypeError, "ready: (fd, events) pairs");
            goto fail;
        }
        PyObject *fd = PyTuple_GET_ITEM(item, 0);
        PyObject *found = PyDict_GetItemWithError(feeds, fd);
        if (found == NULL && PyErr_Occurred()) goto fail;
        Feed *f = found != NULL && PyObject_TypeCheck(found, &FeedType) ? (Feed *)found : NULL;
        if (f != NULL && f->live && f->has_last && f->held == NULL && f->err_type == NULL) {
            PyObject *held;
            int state = feed_drain(f, now, &held);
            if (state == STREAM_DRAINED && held == NULL) continue;
            if (state < 0) PyErr_Fetch(&f->err_type, &f->err_value, &f->err_tb);
            else if ((f->held = Py_BuildValue("(Ni)", held != NULL ? held : Py_NewRef(Py_None), state)) == NULL)
                goto fail;
        }
        if (PyList_Append(slow, fd) < 0) goto fail;
    }
    return slow;
fail:
    Py_DECREF(slow);
    return NULL;
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

static PyMethodDef module_methods[] = {
    {"apply_batch", (PyCFunction)(void (*)(void))apply_batch, METH_FASTCALL,
     "apply_batch(payload, media, engine, block_size, root_seed, now) -> counts, or None"},
    {"bind_zmq", (PyCFunction)(void (*)(void))bind_zmq, METH_FASTCALL,
     "bind_zmq(*addresses): libzmq's functions for drain"},
    {"drain", (PyCFunction)(void (*)(void))drain, METH_FASTCALL,
     "drain(socket, last_seq, max_messages, media, engine, block_size, root_seed, now) -> ..."},
    {"sweep", (PyCFunction)(void (*)(void))sweep, METH_FASTCALL,
     "sweep(ready, feeds, now) -> the descriptors Python must drain itself"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_mirror", "KvEventMirror's translation table in C (kv_events.py).", -1,
    module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__mirror(void)
{
    if (PyType_Ready(&TranslationType) < 0 || PyType_Ready(&FeedType) < 0) return NULL;
    /* Without the index's or the chain's extension every batch takes Python's path (None). */
    index_api = PyCapsule_Import(INDEX_CAPSULE, 0);
    chain_api = index_api == NULL ? NULL : PyCapsule_Import(CHAIN_CAPSULE, 0);
    if (chain_api == NULL) {
        index_api = NULL;
        PyErr_Clear();
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Translation", (PyObject *)&TranslationType) < 0
        || PyModule_AddObjectRef(m, "Feed", (PyObject *)&FeedType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
