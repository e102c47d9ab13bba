/* ``PrefixIndex``'s storage (index.py) in hash tables of machine words.
 *
 * Why C, and why not Python dicts driven from C: the KV-event intake records every block an engine
 * stores and removes, tens of thousands a second at 256 engines, into an index of millions of blocks.
 * Python dicts cost a Python int per hash, a float or a tuple per entry and a cache miss or two per
 * insert and delete, and the garbage collector walks them; measured, they were most of the intake's
 * cost per block even when driven from C (docs/scheduling.md, "The native-speed question"). Here a
 * block is one 32-byte node in its engine's LRU list plus one 24-byte owner record; no Python
 * object exists per block.
 *
 * The semantics are index.py's Python form, which stays as the fallback and the reference:
 * ``tests/unit/test_prefix_index.py`` runs both on the same random histories and compares the LRU
 * order and last-use times of every engine, the owners (and their order), the leaves, the shared
 * count and every match.
 *
 * Layout: nodes (one per engine and block) live in one pool and are found through one open-addressed
 * table keyed by (engine, hash); each engine chains its nodes oldest to newest. Owner records (one per
 * distinct block) live in a second open-addressed table keyed by hash. Both use linear probing with
 * backward-shift deletion, so no tombstones accumulate under the intake's constant churn.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_index.h"
#include "_tables.h"

#define NIL UINT32_MAX

/* 32 bytes, so that in a pool aligned to the cache line no node straddles two lines (at 40, half of
 * them did: a second cache miss for each node the intake touches). */
typedef struct {
    int64_t hash;
    double time;         /* last use */
    uint32_t engine;
    uint32_t prev, next; /* the engine's LRU list (oldest first); ``next`` chains the free list */
    uint32_t stamp;      /* the last ``add`` call that moved it (``next_epoch``), its low bit set if that
                          * call created it (tells new blocks from held ones) */
} Node;
_Static_assert(sizeof(Node) == 32, "a node is half a cache line");

typedef struct {
    int64_t hash;
    uint32_t first;      /* the owner when there is one */
    uint16_t count;      /* owners; 0: an empty slot */
    uint8_t leaf;        /* no block new to the index has continued this one */
    uint8_t pad;
    uint32_t *more;      /* count > 1: all owners, in the order they came */
} Owner;

typedef struct {
    uint32_t head, tail; /* oldest, newest */
    uint32_t count;
    int present;         /* has an LRU list (``engines()``), until cleared */
} Engine;

/* A node table slot: the node's index (low half; NIL: empty) and the low 32 bits of its key (high
 * half). Why the key's bits: probing and backward-shift deletion then find a slot's home without
 * reading its node, which is a cache miss of its own in a pool of millions (the table never has 2**32
 * slots: ``table_grow`` stops there, so a home is ``tag & mask``). */
typedef uint64_t Slot;
#define EMPTY_SLOT UINT64_MAX

static inline uint32_t slot_node(Slot s) { return (uint32_t)s; }
static inline uint32_t slot_tag(Slot s) { return (uint32_t)(s >> 32); }
static inline Slot make_slot(uint32_t node, uint64_t key) { return ((uint64_t)(uint32_t)key << 32) | node; }

typedef struct {
    PyObject_HEAD
    Node *nodes;
    uint32_t nodes_cap, nodes_used, free_list;
    Slot *table;         /* node index and key tag per slot (``Slot``) */
    uint64_t table_mask;
    uint64_t table_used;
    Owner *owners;
    uint64_t owners_mask;
    uint64_t owners_used;
    Engine *engines;
    uint32_t engines_cap, engines_n;
    PyObject *names;     /* list: engine id -> name */
    PyObject *ids;       /* dict: name -> engine id */
    PyObject *order;     /* dict: present engines in the order they came (``engines()``) */
    long shared;         /* blocks with several owners */
    uint32_t epoch;      /* the current ``add`` call */
    int huge;            /* big tables on transparent huge pages (``big_calloc``) */
    uint8_t *mark;       /* scratch for ``match``: one byte per engine id */
    uint32_t *scratch;   /* scratch for ``add``: node per position (``match``: which hashes are read) */
    int64_t *hscratch;   /* scratch for ``add``, ``remove``, ``match``: the hashes, converted */
    Py_ssize_t scratch_cap;
} Index;

static inline uint64_t
node_key(uint32_t engine, int64_t hash)
{
    return mix((uint64_t)hash ^ ((uint64_t)engine * 0x9e3779b97f4a7c15ULL));
}

/* --- the node table ------------------------------------------------------------------------- */

static uint64_t
node_find_slot(Index *ix, uint32_t engine, int64_t hash)
{
    uint64_t key = node_key(engine, hash);
    uint32_t tag = (uint32_t)key;
    uint64_t i = key & ix->table_mask;
    for (;;) {
        Slot s = ix->table[i];
        uint32_t n = slot_node(s);
        if (n == NIL) return i;
        if (slot_tag(s) == tag && ix->nodes[n].hash == hash && ix->nodes[n].engine == engine) return i;
        i = (i + 1) & ix->table_mask;
    }
}

/* A run's table slots, then the nodes they point to, asked for before any is used: the run's blocks
 * are independent lookups in tables far larger than the caches, and this lets their misses overlap
 * instead of waiting one after the other. */
static void
prefetch_nodes(Index *ix, uint32_t engine, const int64_t *hs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) touch(&ix->table[node_key(engine, hs[i]) & ix->table_mask]);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t x = slot_node(ix->table[node_key(engine, hs[i]) & ix->table_mask]);
        if (x != NIL) touch(&ix->nodes[x]);
    }
}

static inline uint32_t
node_get(Index *ix, uint32_t engine, int64_t hash)
{
    return slot_node(ix->table[node_find_slot(ix, engine, hash)]);
}

static int
table_grow(Index *ix)
{
    uint64_t cap = (ix->table_mask + 1) * 2;
    Slot *old = ix->table;
    uint64_t old_cap = ix->table_mask + 1;
    if (cap > ((uint64_t)1 << 32)) {   /* a home is the tag's low bits: ``Slot`` */
        PyErr_SetString(PyExc_MemoryError, "the prefix index is full");
        return -1;
    }
    Slot *t = big_calloc(cap * sizeof(Slot), ix->huge);
    if (t == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(t, 0xff, cap * sizeof(Slot));
    uint64_t mask = cap - 1;
    for (uint64_t i = 0; i < old_cap; i++) {   /* keys are distinct: each goes to the first free slot */
        Slot s = old[i];
        if (slot_node(s) == NIL) continue;
        uint64_t j = slot_tag(s) & mask;
        while (slot_node(t[j]) != NIL) j = (j + 1) & mask;
        t[j] = s;
    }
    ix->table = t;
    ix->table_mask = mask;
    big_free(old, old_cap * sizeof(Slot));
    return 0;
}

static void
table_delete_slot(Index *ix, uint64_t i)
{
    /* backward-shift deletion for linear probing */
    uint64_t mask = ix->table_mask;
    uint64_t j = i;
    ix->table[i] = EMPTY_SLOT;
    for (;;) {
        j = (j + 1) & mask;
        Slot s = ix->table[j];
        if (slot_node(s) == NIL) break;
        uint64_t home = slot_tag(s) & mask;
        /* move the slot into the hole at i if its home is not within (i, j] cyclically */
        if (fills_hole(home, i, j, mask)) {
            ix->table[i] = s;
            ix->table[j] = EMPTY_SLOT;
            i = j;
        }
    }
    ix->table_used--;
}

static uint32_t
node_alloc(Index *ix)
{
    if (ix->free_list != NIL) {
        uint32_t n = ix->free_list;
        ix->free_list = ix->nodes[n].next;
        return n;
    }
    if (ix->nodes_used == ix->nodes_cap) {
        uint64_t cap = (uint64_t)ix->nodes_cap * 2;
        if (cap >= NIL) {
            PyErr_SetString(PyExc_MemoryError, "the prefix index is full");
            return NIL;
        }
        Node *more = big_realloc(ix->nodes, (size_t)ix->nodes_cap * sizeof(Node), cap * sizeof(Node),
                                 ix->huge);
        if (more == NULL) {
            PyErr_NoMemory();
            return NIL;
        }
        ix->nodes = more;
        ix->nodes_cap = (uint32_t)cap;
    }
    return ix->nodes_used++;
}

static inline void
lru_unlink(Index *ix, uint32_t n)
{
    Node *x = &ix->nodes[n];
    Engine *e = &ix->engines[x->engine];
    if (x->prev != NIL) ix->nodes[x->prev].next = x->next; else e->head = x->next;
    if (x->next != NIL) ix->nodes[x->next].prev = x->prev; else e->tail = x->prev;
}

static inline void
lru_append(Index *ix, uint32_t n)
{
    Node *x = &ix->nodes[n];
    Engine *e = &ix->engines[x->engine];
    x->prev = e->tail;
    x->next = NIL;
    if (e->tail != NIL) ix->nodes[e->tail].next = n; else e->head = n;
    e->tail = n;
}

/* --- the owner table ------------------------------------------------------------------------ */

static uint64_t
owner_find_slot(Index *ix, int64_t hash)
{
    uint64_t i = mix((uint64_t)hash) & ix->owners_mask;
    for (;;) {
        Owner *o = &ix->owners[i];
        if (o->count == 0 || o->hash == hash) return i;
        i = (i + 1) & ix->owners_mask;
    }
}

static void
prefetch_owners(Index *ix, const int64_t *hs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) touch(&ix->owners[mix((uint64_t)hs[i]) & ix->owners_mask]);
}

static inline Owner *
owner_get(Index *ix, int64_t hash)
{
    Owner *o = &ix->owners[owner_find_slot(ix, hash)];
    return o->count ? o : NULL;
}

static int
owners_grow(Index *ix)
{
    uint64_t old_cap = ix->owners_mask + 1, cap = old_cap * 2;
    Owner *old = ix->owners;
    Owner *t = big_calloc(cap * sizeof(Owner), ix->huge);
    if (t == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ix->owners = t;
    ix->owners_mask = cap - 1;
    for (uint64_t i = 0; i < old_cap; i++)
        if (old[i].count) ix->owners[owner_find_slot(ix, old[i].hash)] = old[i];
    big_free(old, old_cap * sizeof(Owner));
    return 0;
}

static void
owner_delete_slot(Index *ix, uint64_t i)
{
    uint64_t mask = ix->owners_mask, j = i;
    PyMem_Free(ix->owners[i].more);
    memset(&ix->owners[i], 0, sizeof(Owner));
    for (;;) {
        j = (j + 1) & mask;
        Owner *o = &ix->owners[j];
        if (o->count == 0) break;
        uint64_t home = mix((uint64_t)o->hash) & mask;
        if (fills_hole(home, i, j, mask)) {
            ix->owners[i] = *o;
            memset(o, 0, sizeof(Owner));
            i = j;
        }
    }
    ix->owners_used--;
}

static inline int
owner_has(const Owner *o, uint32_t engine)
{
    if (o->count == 1) return o->first == engine;
    for (uint16_t k = 0; k < o->count; k++)
        if (o->more[k] == engine) return 1;
    return 0;
}

/* ``_add_owner``: ``engine`` joins the owners of an indexed block. */
static int
owner_add(Index *ix, Owner *o, uint32_t engine)
{
    if (owner_has(o, engine)) return 0;
    if (o->count == UINT16_MAX) return 0;   /* more engines than a fleet has: keep the first ones */
    uint32_t *more = PyMem_Realloc(o->more, (size_t)(o->count + 1) * sizeof(uint32_t));
    if (more == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (o->count == 1) {
        more[0] = o->first;
        ix->shared++;
    }
    more[o->count++] = engine;
    o->more = more;
    return 0;
}

/* ``_disown``: ``engine`` leaves the owners of ``hash``; the block leaves the index with its last. */
static void
disown(Index *ix, int64_t hash, uint32_t engine)
{
    uint64_t i = owner_find_slot(ix, hash);
    Owner *o = &ix->owners[i];
    if (o->count == 0) return;
    if (o->count == 1) {
        if (o->first == engine) owner_delete_slot(ix, i);
        return;
    }
    uint16_t kept = 0;
    for (uint16_t k = 0; k < o->count; k++)
        if (o->more[k] != engine) o->more[kept++] = o->more[k];
    if (kept == o->count) return;
    o->count = kept;
    o->first = o->more[0];
    if (kept == 1) {
        PyMem_Free(o->more);
        o->more = NULL;
        ix->shared--;
    }
}

/* --- engines -------------------------------------------------------------------------------- */

/* The engine's id, created if ``create``; NIL (no exception) if unknown and not created. */
static uint32_t
engine_id(Index *ix, PyObject *name, int create)
{
    if (!PyUnicode_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "an engine is named by a str");
        return NIL;
    }
    PyObject *id = PyDict_GetItemWithError(ix->ids, name);
    if (id != NULL) return (uint32_t)PyLong_AsUnsignedLong(id);
    if (PyErr_Occurred() || !create) return NIL;
    if (ix->engines_n == ix->engines_cap) {
        uint32_t cap = ix->engines_cap * 2;
        Engine *e = PyMem_Realloc(ix->engines, cap * sizeof(Engine));
        uint8_t *m = PyMem_Realloc(ix->mark, cap);
        if (e == NULL || m == NULL) {
            if (e != NULL) ix->engines = e;
            if (m != NULL) ix->mark = m;
            PyErr_NoMemory();
            return NIL;
        }
        ix->engines = e;
        ix->mark = m;
        memset(ix->mark + ix->engines_cap, 0, cap - ix->engines_cap);
        ix->engines_cap = cap;
    }
    uint32_t n = ix->engines_n;
    PyObject *num = PyLong_FromUnsignedLong(n);
    if (num == NULL) return NIL;
    int rc = PyDict_SetItem(ix->ids, name, num);
    Py_DECREF(num);
    if (rc < 0 || PyList_Append(ix->names, name) < 0) return NIL;
    ix->engines[n] = (Engine){NIL, NIL, 0, 0};
    ix->engines_n++;
    return n;
}

static int
make_present(Index *ix, uint32_t e)
{
    if (ix->engines[e].present) return 0;
    ix->engines[e].present = 1;
    return PyDict_SetItem(ix->order, PyList_GET_ITEM(ix->names, e), Py_None);
}

/* Drop node ``n`` (held by its engine) and its engine's ownership of the block. */
static void
drop_node_at(Index *ix, uint32_t n, uint64_t slot)
{
    Node *x = &ix->nodes[n];
    uint32_t e = x->engine;
    int64_t h = x->hash;
    lru_unlink(ix, n);
    table_delete_slot(ix, slot);
    ix->engines[e].count--;
    x->next = ix->free_list;
    ix->free_list = n;
    disown(ix, h, e);
}

static void
drop_node(Index *ix, uint32_t n)
{
    drop_node_at(ix, n, node_find_slot(ix, ix->nodes[n].engine, ix->nodes[n].hash));
}

static uint32_t
next_epoch(Index *ix)
{
    if (++ix->epoch == (uint32_t)1 << 31) {   /* wrapped: no node may look moved or created by a later call */
        for (uint32_t n = 0; n < ix->nodes_used; n++) ix->nodes[n].stamp = 0;
        ix->epoch = 1;
    }
    return ix->epoch << 1;   /* a call's stamp: even and never 0; a node it creates gets ``stamp | 1`` */
}

/* --- hash arguments ------------------------------------------------------------------------- */

static inline int
as_hash(PyObject *obj, int64_t *out)
{
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)v;
    return 0;
}

/* --- the type ------------------------------------------------------------------------------- */

static void
Index_dealloc(Index *ix)
{
    if (ix->owners != NULL)
        for (uint64_t i = 0; i <= ix->owners_mask; i++) PyMem_Free(ix->owners[i].more);
    big_free(ix->owners, (size_t)(ix->owners_mask + 1) * sizeof(Owner));
    big_free(ix->nodes, (size_t)ix->nodes_cap * sizeof(Node));
    big_free(ix->table, (size_t)(ix->table_mask + 1) * sizeof(Slot));
    PyMem_Free(ix->engines);
    PyMem_Free(ix->mark);
    PyMem_Free(ix->scratch);
    PyMem_Free(ix->hscratch);
    Py_XDECREF(ix->names);
    Py_XDECREF(ix->ids);
    Py_XDECREF(ix->order);
    Py_TYPE(ix)->tp_free((PyObject *)ix);
}

static PyObject *
Index_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"huge_pages", NULL};
    int huge = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p:Index", kwlist, &huge)) return NULL;
    Index *ix = (Index *)type->tp_alloc(type, 0);
    if (ix == NULL) return NULL;
    ix->huge = huge;
    ix->nodes_cap = 1024;
    ix->nodes = big_calloc(ix->nodes_cap * sizeof(Node), ix->huge);
    ix->free_list = NIL;
    ix->table_mask = 2047;
    ix->table = big_calloc((ix->table_mask + 1) * sizeof(Slot), ix->huge);
    ix->owners_mask = 2047;
    ix->owners = big_calloc((ix->owners_mask + 1) * sizeof(Owner), ix->huge);
    ix->engines_cap = 16;
    ix->engines = PyMem_Malloc(ix->engines_cap * sizeof(Engine));
    ix->mark = PyMem_Calloc(ix->engines_cap, 1);
    ix->names = PyList_New(0);
    ix->ids = PyDict_New();
    ix->order = PyDict_New();
    if (ix->nodes == NULL || ix->table == NULL || ix->owners == NULL || ix->engines == NULL
        || ix->mark == NULL) {
        Py_DECREF(ix);
        return PyErr_NoMemory();
    }
    if (ix->names == NULL || ix->ids == NULL || ix->order == NULL) {
        Py_DECREF(ix);
        return NULL;
    }
    memset(ix->table, 0xff, (ix->table_mask + 1) * sizeof(Slot));
    return (PyObject *)ix;
}

static int
reserve_scratch(Index *ix, Py_ssize_t n)
{
    if (n <= ix->scratch_cap) return 0;
    uint32_t *s = PyMem_Realloc(ix->scratch, (size_t)n * sizeof(uint32_t));
    if (s == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ix->scratch = s;
    int64_t *hs = PyMem_Realloc(ix->hscratch, (size_t)n * sizeof(int64_t));
    if (hs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ix->hscratch = hs;
    ix->scratch_cap = n;
    return 0;
}

/* Room for ``n`` more blocks in both tables (load factor at most 1/2, for short probes) and scratch. */
static int
reserve(Index *ix, Py_ssize_t n)
{
    while ((ix->table_used + (uint64_t)n) * 2 > ix->table_mask + 1)
        if (table_grow(ix) < 0) return -1;
    while ((ix->owners_used + (uint64_t)n) * 2 > ix->owners_mask + 1)
        if (owners_grow(ix) < 0) return -1;
    return reserve_scratch(ix, n);
}

/* add(engine, hashes, parent, now): ``PrefixIndex.add`` without the trimming. Each hash moves to the
 * fresh end of the engine's LRU, the chain's tail first (a hash met twice keeps the place of its last
 * occurrence); blocks the engine did not hold get it as an owner; a block new to the index continues
 * the block before it (which stops being a leaf) and is a leaf itself. ``hs`` may be ``hscratch``
 * (``reserve`` keeps it where it is once it holds ``n``). */
static int
add_words(Index *ix, uint32_t e, const int64_t *hs, Py_ssize_t n, int has_parent, int64_t parent, double now)
{
    if (reserve(ix, n) < 0 || make_present(ix, e) < 0) return -1;
    prefetch_owners(ix, hs, n);   /* first: they need nothing loaded, so they overlap the nodes' two steps */
    prefetch_nodes(ix, e, hs, n);
    uint32_t *at = ix->scratch;
    uint32_t stamp = next_epoch(ix);
    Py_ssize_t created = 0;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {   /* the tail first */
        int64_t h = hs[i];
        uint64_t slot = node_find_slot(ix, e, h);
        uint32_t x = slot_node(ix->table[slot]);
        if (x == NIL) {
            x = node_alloc(ix);
            if (x == NIL) return -1;
            ix->nodes[x] = (Node){h, now, e, NIL, NIL, stamp | 1};
            ix->table[slot] = make_slot(x, node_key(e, h));
            ix->table_used++;
            ix->engines[e].count++;
            lru_append(ix, x);
            created++;
        } else if ((ix->nodes[x].stamp & ~1u) != stamp) {   /* held before: moves to the fresh end */
            lru_unlink(ix, x);
            ix->nodes[x].time = now;
            ix->nodes[x].stamp = stamp;
            lru_append(ix, x);
        }   /* else met again in this chain: it keeps the place of its last occurrence */
        at[i] = x;
    }
    if (created) {
        int prev_set = has_parent;
        int64_t prev = parent;
        for (Py_ssize_t i = 0; i < n; i++) {
            Node *x = &ix->nodes[at[i]];
            int64_t h = x->hash;
            if (x->stamp == (stamp | 1)) {   /* the engine did not hold it before this call */
                Owner *o = &ix->owners[owner_find_slot(ix, h)];
                if (o->count == 0) {   /* new to the index: continues ``prev``, and is a leaf */
                    *o = (Owner){h, e, 1, 1, 0, NULL};
                    ix->owners_used++;
                    if (prev_set) {
                        Owner *p = owner_get(ix, prev);
                        if (p != NULL) p->leaf = 0;
                    }
                } else if (owner_add(ix, o, e) < 0) {
                    return -1;
                }
            }
            prev = h;
            prev_set = 1;
        }
    }
    return 0;
}

static PyObject *
Index_add(Index *ix, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "add(engine, hashes, parent, now)");
        return NULL;
    }
    double now = PyFloat_AsDouble(args[3]);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    int has_parent = args[2] != Py_None;
    int64_t parent = 0;
    if (has_parent && as_hash(args[2], &parent) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[1], "hashes must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint32_t e = engine_id(ix, args[0], 1);
    if (e == NIL || reserve(ix, n) < 0) goto fail;
    int64_t *hs = ix->hscratch;
    for (Py_ssize_t i = 0; i < n; i++)
        if (as_hash(items[i], &hs[i]) < 0) goto fail;
    if (add_words(ix, e, hs, n, has_parent, parent, now) < 0) goto fail;
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    Py_DECREF(seq);
    return NULL;
}

/* The engine's id if it holds an LRU list, else NIL; -1 with an exception for a bad name. */
static int
held_engine(Index *ix, PyObject *name, uint32_t *out)
{
    *out = engine_id(ix, name, 0);
    if (*out == NIL && PyErr_Occurred()) return -1;
    if (*out != NIL && !ix->engines[*out].present) *out = NIL;
    return 0;
}

static void
remove_words(Index *ix, uint32_t e, const int64_t *hs, Py_ssize_t n)
{
    if (e == NIL || !ix->engines[e].count) return;
    prefetch_owners(ix, hs, n);
    prefetch_nodes(ix, e, hs, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t slot = node_find_slot(ix, e, hs[i]);
        uint32_t x = slot_node(ix->table[slot]);
        if (x != NIL) drop_node_at(ix, x, slot);
    }
}

/* remove(engine, hashes): each block the engine holds leaves its LRU, and the engine its owners. */
static PyObject *
Index_remove(Index *ix, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "remove(engine, hashes)");
        return NULL;
    }
    uint32_t e;
    if (held_engine(ix, args[0], &e) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[1], "hashes must be iterable");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (e != NIL && ix->engines[e].count) {
        if (reserve_scratch(ix, n) < 0) goto fail;
        int64_t *hs = ix->hscratch;
        for (Py_ssize_t i = 0; i < n; i++)
            if (as_hash(items[i], &hs[i]) < 0) goto fail;
        remove_words(ix, e, hs, n);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    Py_DECREF(seq);
    return NULL;
}

/* clear(engine): the engine lost everything or left; it is no longer among ``engines()``. */
static int
clear_engine(Index *ix, PyObject *name)
{
    uint32_t e;
    if (held_engine(ix, name, &e) < 0) return -1;
    if (e == NIL) return 0;
    while (ix->engines[e].head != NIL) drop_node(ix, ix->engines[e].head);
    ix->engines[e].present = 0;
    return PyDict_DelItem(ix->order, name);
}

static PyObject *
Index_clear(Index *ix, PyObject *name)
{
    if (clear_engine(ix, name) < 0) return NULL;
    Py_RETURN_NONE;
}

static void
trim_words(Index *ix, uint32_t e, long long capacity, double oldest)
{
    if (e == NIL) return;
    Engine *en = &ix->engines[e];
    while (capacity >= 0 && en->count > (uint64_t)capacity) drop_node(ix, en->head);
    while (en->head != NIL && ix->nodes[en->head].time < oldest) drop_node(ix, en->head);
}

/* trim(engine, capacity, oldest): drop the engine's oldest blocks past ``capacity`` (negative: no
 * bound), then those last used before ``oldest``. Last-use times never decrease along the LRU. */
static PyObject *
Index_trim(Index *ix, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "trim(engine, capacity, oldest)");
        return NULL;
    }
    uint32_t e;
    if (held_engine(ix, args[0], &e) < 0) return NULL;
    long long capacity = PyLong_AsLongLong(args[1]);
    if (capacity == -1 && PyErr_Occurred()) return NULL;
    double oldest = PyFloat_AsDouble(args[2]);
    if (oldest == -1.0 && PyErr_Occurred()) return NULL;
    trim_words(ix, e, capacity, oldest);
    Py_RETURN_NONE;
}

/* expire(oldest) -> the oldest last use left (inf if none): drops, for every engine, the blocks last
 * used before ``oldest``. */
static PyObject *
Index_expire(Index *ix, PyObject *arg)
{
    double oldest = PyFloat_AsDouble(arg);
    if (oldest == -1.0 && PyErr_Occurred()) return NULL;
    double floor = INFINITY;
    for (uint32_t e = 0; e < ix->engines_n; e++) {
        Engine *en = &ix->engines[e];
        if (!en->present) continue;
        while (en->head != NIL && ix->nodes[en->head].time < oldest) drop_node(ix, en->head);
        if (en->head != NIL && ix->nodes[en->head].time < floor) floor = ix->nodes[en->head].time;
    }
    return PyFloat_FromDouble(floor);
}

/* A match's hashes, read from the caller's Python ints when a probe first needs them: a gallop probes
 * about 2 log2(n) depths per engine, and converting all n first (~13 ns each for 63-bit ints, 6,250 at
 * 100k tokens) cost more than the match itself. */
typedef struct {
    PyObject **items;
    int64_t *hs;
    uint8_t *done;   /* whether ``hs[i]`` holds ``items[i]`` */
} Hashes;

static inline int
hash_at(Hashes *z, Py_ssize_t i, int64_t *out)
{
    if (!z->done[i]) {
        if (as_hash(z->items[i], &z->hs[i]) < 0) return -1;
        z->done[i] = 1;
    }
    *out = z->hs[i];
    return 0;
}

/* Whether every engine marked in ``mark`` (``live`` of them) owns ``hash``. */
static inline int
holds_all(Index *ix, int64_t hash, uint32_t live)
{
    Owner *o = owner_get(ix, hash);
    if (o == NULL) return 0;
    if (o->count == 1) return live == 1 && ix->mark[o->first];
    uint32_t found = 0;
    for (uint16_t k = 0; k < o->count; k++) found += ix->mark[o->more[k]];
    return found == live;
}

/* Whether block ``i`` is held by ``engine`` (NIL: by every marked engine); -1 on a bad hash. */
static inline int
is_held(Index *ix, Hashes *z, Py_ssize_t i, uint32_t engine, uint32_t live)
{
    int64_t h;
    if (hash_at(z, i, &h) < 0) return -1;
    return engine == NIL ? holds_all(ix, h, live) : node_get(ix, engine, h) != NIL;
}

/* ``_run_end``: the first depth past ``lo`` whose block is not held (``n`` if all are), given that
 * ``hashes[lo]`` is and that what is held is a leading run: gallop, then bisect. ``engine`` NIL: held
 * by every marked engine. -1 if a probed hash is not an int64. */
static Py_ssize_t
run_end(Index *ix, Hashes *z, Py_ssize_t n, Py_ssize_t lo, uint32_t engine, uint32_t live)
{
    Py_ssize_t good = lo, step = 1, bad = n;
    while (good + step < bad) {
        int held = is_held(ix, z, good + step, engine, live);
        if (held < 0) return -1;
        if (held) {
            good += step;
            step *= 2;
        } else {
            bad = good + step;
            break;
        }
    }
    while (bad - good > 1) {
        Py_ssize_t mid = (good + bad) / 2;
        int held = is_held(ix, z, mid, engine, live);
        if (held < 0) return -1;
        if (held) good = mid; else bad = mid;
    }
    return bad;
}

static int
set_depth(Index *ix, PyObject *out, uint32_t e, Py_ssize_t depth)
{
    PyObject *v = PyLong_FromSsize_t(depth);
    if (v == NULL) return -1;
    int rc = PyDict_SetItem(out, PyList_GET_ITEM(ix->names, e), v);
    Py_DECREF(v);
    return rc;
}

/* match(hashes) -> {engine: leading blocks held}, as ``PrefixIndex.match``. */
static PyObject *
Index_match(Index *ix, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "hashes must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyDict_New();
    if (out == NULL || n == 0) goto done;
    if (reserve_scratch(ix, n) < 0) goto fail;
    for (Py_ssize_t i = 0; i < n; i++)   /* the types up front (cheap); the values when probed */
        if (!PyLong_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "a block hash must be an int, not %.100s",
                         Py_TYPE(items[i])->tp_name);
            goto fail;
        }
    Hashes z = {items, ix->hscratch, (uint8_t *)ix->scratch};
    memset(z.done, 0, (size_t)n);
    int64_t h0;
    if (hash_at(&z, 0, &h0) < 0) goto fail;
    Owner *first = owner_get(ix, h0);
    if (first == NULL) goto done;
    uint32_t one = first->first;
    const uint32_t *live = first->count == 1 ? &one : first->more;
    uint32_t k = first->count;
    /* copied: the owner table does not change during a match, but the list is read after probes */
    uint32_t *engines = PyMem_Malloc(k * sizeof(uint32_t));
    if (engines == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    memcpy(engines, live, k * sizeof(uint32_t));
    for (uint32_t j = 0; j < k; j++) ix->mark[engines[j]] = 1;
    Py_ssize_t bad = run_end(ix, &z, n, 0, NIL, k);
    int64_t hb;
    int rc = bad < 0 ? -1 : 0;
    if (rc == 0 && bad >= n) {
        for (uint32_t j = 0; j < k && rc == 0; j++) rc = set_depth(ix, out, engines[j], n);
    } else if (rc == 0 && (rc = hash_at(&z, bad, &hb)) == 0) {
        Owner *o = owner_get(ix, hb);
        for (uint32_t j = 0; j < k && rc == 0; j++) {
            uint32_t e = engines[j];
            if (o != NULL && owner_has(o, e)) continue;
            rc = set_depth(ix, out, e, bad);
        }
        for (uint32_t j = 0; j < k && rc == 0; j++) {
            uint32_t e = engines[j];
            if (o == NULL || !owner_has(o, e)) continue;
            Py_ssize_t end = run_end(ix, &z, n, bad, e, 0);
            rc = end < 0 ? -1 : set_depth(ix, out, e, end);
        }
    }
    for (uint32_t j = 0; j < k; j++) ix->mark[engines[j]] = 0;
    PyMem_Free(engines);
    if (rc < 0) goto fail;
done:
    Py_DECREF(seq);
    return out;   /* NULL if the dict could not be made */
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* run_from(engine, hashes, lo) -> the first depth at or past ``lo`` whose block the engine does not
 * hold (``lo`` if it does not hold ``hashes[lo]``), as ``PrefixIndex.run_from``. */
static PyObject *
Index_run_from(Index *ix, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "run_from(engine, hashes, lo)");
        return NULL;
    }
    Py_ssize_t lo = PyLong_AsSsize_t(args[2]);
    if (lo == -1 && PyErr_Occurred()) return NULL;
    if (lo < 0) {
        PyErr_SetString(PyExc_ValueError, "lo must be >= 0");
        return NULL;
    }
    uint32_t e;
    if (held_engine(ix, args[0], &e) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[1], "hashes must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), end = lo;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (e != NIL && lo < n) {
        if (reserve_scratch(ix, n) < 0) goto fail;
        Hashes z = {items, ix->hscratch, (uint8_t *)ix->scratch};
        memset(z.done, 0, (size_t)n);
        int held = is_held(ix, &z, lo, e, 0);
        if (held < 0) goto fail;
        if (held && (end = run_end(ix, &z, n, lo, e, 0)) < 0) goto fail;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(end);
fail:
    Py_DECREF(seq);
    return NULL;
}

static PyObject *
owner_object(Index *ix, const Owner *o)
{
    if (o->count == 1) return Py_NewRef(PyList_GET_ITEM(ix->names, o->first));
    PyObject *t = PyTuple_New(o->count);
    if (t == NULL) return NULL;
    for (uint16_t k = 0; k < o->count; k++)
        PyTuple_SET_ITEM(t, k, Py_NewRef(PyList_GET_ITEM(ix->names, o->more[k])));
    return t;
}

/* owners(hash) -> the engines that hold the block, as a set. */
static PyObject *
Index_owners(Index *ix, PyObject *arg)
{
    int64_t h;
    if (as_hash(arg, &h) < 0) return NULL;
    Owner *o = owner_get(ix, h);
    PyObject *out = PySet_New(NULL);
    if (out == NULL || o == NULL) return out;
    for (uint16_t k = 0; k < o->count; k++) {
        uint32_t e = o->count == 1 ? o->first : o->more[k];
        if (PySet_Add(out, PyList_GET_ITEM(ix->names, e)) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* continues(hash) -> no indexed block continues it (a leaf, or not indexed). */
static PyObject *
Index_continues(Index *ix, PyObject *arg)
{
    int64_t h;
    if (as_hash(arg, &h) < 0) return NULL;
    Owner *o = owner_get(ix, h);
    return PyBool_FromLong(o == NULL || o->leaf);
}

static PyObject *
Index_blocks(Index *ix, PyObject *name)
{
    uint32_t e;
    if (held_engine(ix, name, &e) < 0) return NULL;
    return PyLong_FromUnsignedLong(e == NIL ? 0 : ix->engines[e].count);
}

static PyObject *
Index_engines(Index *ix, PyObject *Py_UNUSED(ignored))
{
    return PySequence_List(ix->order);
}

/* approx_bytes() -> the memory the index holds: its tables and pools, and the shared blocks' lists. */
static PyObject *
Index_approx_bytes(Index *ix, PyObject *Py_UNUSED(ignored))
{
    size_t total = sizeof(Index) + (size_t)ix->nodes_cap * sizeof(Node)
        + (size_t)(ix->table_mask + 1) * sizeof(Slot) + (size_t)(ix->owners_mask + 1) * sizeof(Owner)
        + (size_t)ix->engines_cap * (sizeof(Engine) + 1) + (size_t)ix->scratch_cap * 12
        + (size_t)ix->shared * 4 * sizeof(uint32_t);
    return PyLong_FromSize_t(total);
}

/* snapshot() -> ({engine: [(hash, last use), ...] oldest first}, {hash: owner or owners}, leaves,
 * shared count): the Python form's own containers, for the tests that compare the two. */
static PyObject *
Index_snapshot(Index *ix, PyObject *Py_UNUSED(ignored))
{
    PyObject *blocks = PyDict_New(), *owners = PyDict_New(), *leaves = PySet_New(NULL);
    if (blocks == NULL || owners == NULL || leaves == NULL) goto fail;
    for (uint32_t e = 0; e < ix->engines_n; e++) {
        if (!ix->engines[e].present) continue;
        PyObject *lru = PyList_New(0);
        if (lru == NULL) goto fail;
        int rc = PyDict_SetItem(blocks, PyList_GET_ITEM(ix->names, e), lru);
        Py_DECREF(lru);
        if (rc < 0) goto fail;
        for (uint32_t x = ix->engines[e].head; x != NIL; x = ix->nodes[x].next) {
            PyObject *item = Py_BuildValue("(Ld)", (long long)ix->nodes[x].hash, ix->nodes[x].time);
            if (item == NULL || PyList_Append(lru, item) < 0) {
                Py_XDECREF(item);
                goto fail;
            }
            Py_DECREF(item);
        }
    }
    for (uint64_t i = 0; i <= ix->owners_mask; i++) {
        Owner *o = &ix->owners[i];
        if (!o->count) continue;
        PyObject *key = PyLong_FromLongLong(o->hash), *value = owner_object(ix, o);
        int rc = key && value ? PyDict_SetItem(owners, key, value) : -1;
        if (rc == 0 && o->leaf) rc = PySet_Add(leaves, key);
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (rc < 0) goto fail;
    }
    PyObject *out = Py_BuildValue("(NNNl)", blocks, owners, leaves, ix->shared);
    return out;
fail:
    Py_XDECREF(blocks);
    Py_XDECREF(owners);
    Py_XDECREF(leaves);
    return NULL;
}

static void *
copied(const void *src, size_t size)
{
    void *out = PyMem_Malloc(size ? size : 1);
    if (out != NULL && size) memcpy(out, src, size);
    return out;
}

/* copy() -> an independent index holding the same (``copy.deepcopy`` of a ``PrefixIndex``). */
static PyObject *
Index_copy(Index *ix, PyObject *Py_UNUSED(ignored))
{
    Index *c = (Index *)Py_TYPE(ix)->tp_alloc(Py_TYPE(ix), 0);
    if (c == NULL) return NULL;
    c->nodes_cap = ix->nodes_cap;
    c->nodes_used = ix->nodes_used;
    c->free_list = ix->free_list;
    c->table_mask = ix->table_mask;
    c->table_used = ix->table_used;
    c->owners_mask = ix->owners_mask;
    c->owners_used = ix->owners_used;
    c->engines_cap = ix->engines_cap;
    c->engines_n = ix->engines_n;
    c->shared = ix->shared;
    c->epoch = ix->epoch;
    c->huge = ix->huge;
    c->nodes = big_copy(ix->nodes, (size_t)ix->nodes_cap * sizeof(Node), ix->huge);
    c->table = big_copy(ix->table, (size_t)(ix->table_mask + 1) * sizeof(Slot), ix->huge);
    c->owners = big_copy(ix->owners, (size_t)(ix->owners_mask + 1) * sizeof(Owner), ix->huge);
    c->engines = copied(ix->engines, (size_t)ix->engines_cap * sizeof(Engine));
    c->mark = PyMem_Calloc(ix->engines_cap, 1);
    if (c->owners != NULL)   /* its records must not share the lists of shared blocks */
        for (uint64_t i = 0; i <= c->owners_mask; i++) c->owners[i].more = NULL;
    if (c->nodes == NULL || c->table == NULL || c->owners == NULL || c->engines == NULL || c->mark == NULL) {
        Py_DECREF(c);
        return PyErr_NoMemory();
    }
    for (uint64_t i = 0; i <= c->owners_mask; i++) {
        const Owner *o = &ix->owners[i];
        if (o->count > 1 && (c->owners[i].more = copied(o->more, o->count * sizeof(uint32_t))) == NULL) {
            Py_DECREF(c);
            return PyErr_NoMemory();
        }
    }
    c->names = PyList_GetSlice(ix->names, 0, PyList_GET_SIZE(ix->names));
    c->ids = PyDict_Copy(ix->ids);
    c->order = PyDict_Copy(ix->order);
    if (c->names == NULL || c->ids == NULL || c->order == NULL) {
        Py_DECREF(c);
        return NULL;
    }
    return (PyObject *)c;
}

static PyMethodDef Index_methods[] = {
    {"copy", (PyCFunction)Index_copy, METH_NOARGS, "copy() -> an independent index holding the same"},
    {"add", (PyCFunction)(void (*)(void))Index_add, METH_FASTCALL,
     "add(engine, hashes, parent, now): record that the engine holds the chain (no trimming)"},
    {"remove", (PyCFunction)(void (*)(void))Index_remove, METH_FASTCALL,
     "remove(engine, hashes): the engine no longer holds these blocks"},
    {"clear", (PyCFunction)Index_clear, METH_O, "clear(engine): the engine holds nothing"},
    {"trim", (PyCFunction)(void (*)(void))Index_trim, METH_FASTCALL,
     "trim(engine, capacity, oldest): drop the oldest blocks past capacity, then those used before oldest"},
    {"expire", (PyCFunction)Index_expire, METH_O,
     "expire(oldest) -> the oldest last use left: drop every block used before oldest"},
    {"match", (PyCFunction)Index_match, METH_O, "match(hashes) -> {engine: leading blocks held}"},
    {"run_from", (PyCFunction)(void (*)(void))Index_run_from, METH_FASTCALL,
     "run_from(engine, hashes, lo) -> the first depth at or past lo whose block the engine does not hold"},
    {"owners", (PyCFunction)Index_owners, METH_O, "owners(hash) -> set of engines"},
    {"continues", (PyCFunction)Index_continues, METH_O,
     "continues(hash) -> whether no indexed block continues it"},
    {"blocks", (PyCFunction)Index_blocks, METH_O, "blocks(engine) -> blocks held"},
    {"engines", (PyCFunction)Index_engines, METH_NOARGS, "engines() -> engines with blocks recorded"},
    {"approx_bytes", (PyCFunction)Index_approx_bytes, METH_NOARGS, "approx_bytes() -> memory held"},
    {"snapshot", (PyCFunction)Index_snapshot, METH_NOARGS,
     "snapshot() -> (LRU lists, owners, leaves, shared count) as the Python form holds them"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "coordinator.pipeline.scheduling.prefix._index.Index",
    .tp_basicsize = sizeof(Index),
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "PrefixIndex's blocks, owners and leaves in hash tables of machine words.",
    .tp_methods = Index_methods,
    .tp_new = Index_new,
};

/* --- the C face (``_index.h``) ------------------------------------------------------------------ */

static int
api_check(PyObject *obj)
{
    return PyObject_TypeCheck(obj, &IndexType);
}

static int
api_add(PyObject *obj, PyObject *engine, const int64_t *hs, Py_ssize_t n, int has_parent, int64_t parent,
        double now, long long capacity)
{
    Index *ix = (Index *)obj;
    if (n == 0) return 0;
    uint32_t e = engine_id(ix, engine, 1);
    if (e == NIL || add_words(ix, e, hs, n, has_parent, parent, now) < 0) return -1;
    trim_words(ix, e, capacity, -INFINITY);
    return 0;
}

static int
api_remove(PyObject *obj, PyObject *engine, const int64_t *hs, Py_ssize_t n)
{
    Index *ix = (Index *)obj;
    uint32_t e;
    if (held_engine(ix, engine, &e) < 0) return -1;
    remove_words(ix, e, hs, n);
    return 0;
}

static int
api_clear(PyObject *obj, PyObject *engine)
{
    return clear_engine((Index *)obj, engine);
}

static const IndexAPI api = {api_check, api_add, api_remove, api_clear};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_index", "PrefixIndex's storage in C (index.py).", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__index(void)
{
    if (PyType_Ready(&IndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *capsule = PyCapsule_New((void *)&api, INDEX_CAPSULE, NULL);
    int rc = capsule == NULL ? -1 : PyModule_AddObjectRef(m, "_C_API", capsule);
    Py_XDECREF(capsule);
    if (rc < 0 || PyModule_AddObjectRef(m, "Index", (PyObject *)&IndexType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
