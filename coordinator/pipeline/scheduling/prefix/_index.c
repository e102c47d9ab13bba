/* ``PrefixIndex.add`` and ``PrefixIndex.remove`` (index.py) over the index's own dicts, in one C call.
 *
 * Why C: the KV-event intake records every block an engine stores and removes (tens of thousands a
 * second at 256 engines); in Python each call built a dict, a set and several iterators around the
 * dict operations themselves, which made ``add`` about half the intake's cost per block. These
 * functions do exactly what the Python form does (index.py keeps it as the fallback and the reference
 * ``tests/unit/test_prefix_index.py`` compares them against): the same containers, the same final
 * order of each engine's LRU dict, the same owners, leaves and shared count.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Add ``engine`` to the owners of ``h`` (``_add_owner``); returns the change of the shared count, or
 * -1000 on error. */
static int
add_owner(PyObject *owners_of, PyObject *h, PyObject *owners, PyObject *engine)
{
    if (PyUnicode_Check(owners)) {
        int same = PyObject_RichCompareBool(owners, engine, Py_EQ);
        if (same < 0) return -1000;
        if (same) return 0;
        PyObject *pair = PyTuple_Pack(2, owners, engine);
        if (pair == NULL) return -1000;
        int rc = PyDict_SetItem(owners_of, h, pair);
        Py_DECREF(pair);
        return rc < 0 ? -1000 : 1;
    }
    if (!PyTuple_Check(owners)) {
        PyErr_SetString(PyExc_TypeError, "a block's owners are a str or a tuple");
        return -1000;
    }
    int has = PySequence_Contains(owners, engine);
    if (has < 0) return -1000;
    if (has) return 0;
    Py_ssize_t n = PyTuple_GET_SIZE(owners);
    PyObject *more = PyTuple_New(n + 1);
    if (more == NULL) return -1000;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyTuple_GET_ITEM(owners, i);
        Py_INCREF(o);
        PyTuple_SET_ITEM(more, i, o);
    }
    Py_INCREF(engine);
    PyTuple_SET_ITEM(more, n, engine);
    int rc = PyDict_SetItem(owners_of, h, more);
    Py_DECREF(more);
    return rc < 0 ? -1000 : 0;
}

/* The call's first four arguments (``blocks, owners, leaves, engine``) after checking them and the
 * count; NULL (an exception set) if they are not what the index holds. */
static PyObject *const *
index_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage)
{
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    if (!PyDict_CheckExact(args[0]) || !PyDict_CheckExact(args[1]) || !PySet_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "blocks and owners are dicts, leaves a set");
        return NULL;
    }
    return args;
}

/* add(blocks, owners, leaves, engine, hashes, parent, now) -> change of the shared count.
 * ``blocks``: the engine's LRU dict; each hash is moved to its fresh end, the chain's tail first (a
 * hash met twice keeps the place of its last occurrence, as ``dict(zip(reversed(hashes), ...))``).
 * Blocks the engine did not hold before get it as an owner; a block new to the index continues the
 * block before it (which stops being a leaf) and is a leaf itself (``_own_each``). */
static PyObject *
add(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (index_args(args, nargs, 7, "add(blocks, owners, leaves, engine, hashes, parent, now)") == NULL)
        return NULL;
    PyObject *blocks = args[0], *owners_of = args[1], *leaves = args[2], *engine = args[3];
    PyObject *parent = args[5], *now = args[6];
    PyObject *seq = PySequence_Fast(args[4], "hashes must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **hashes = PySequence_Fast_ITEMS(seq);
    PyObject *fresh = PySet_New(NULL);    /* hashes already moved by this call */
    PyObject *held = PySet_New(NULL);     /* hashes the engine held before this call */
    long shared = 0;
    if (fresh == NULL || held == NULL) goto fail;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        PyObject *h = hashes[i];
        int seen = PySet_Contains(fresh, h);
        if (seen < 0) goto fail;
        if (seen) continue;
        if (PySet_Add(fresh, h) < 0) goto fail;
        PyObject *old = PyDict_GetItemWithError(blocks, h);
        if (old != NULL) {
            if (PySet_Add(held, h) < 0 || PyDict_DelItem(blocks, h) < 0) goto fail;
        } else if (PyErr_Occurred()) {
            goto fail;
        }
        if (PyDict_SetItem(blocks, h, now) < 0) goto fail;
    }
    if (PySet_GET_SIZE(held) < PySet_GET_SIZE(fresh)) {
        PyObject *prev = parent;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *h = hashes[i];
            int was = PySet_Contains(held, h);
            if (was < 0) goto fail;
            if (!was) {
                PyObject *owners = PyDict_GetItemWithError(owners_of, h);
                if (owners == NULL) {
                    if (PyErr_Occurred()) goto fail;
                    if (PyDict_SetItem(owners_of, h, engine) < 0) goto fail;
                    if (prev != Py_None && PySet_Discard(leaves, prev) < 0) goto fail;
                    if (PySet_Add(leaves, h) < 0) goto fail;
                } else {
                    Py_INCREF(owners);   /* add_owner may replace it in the dict */
                    int delta = add_owner(owners_of, h, owners, engine);
                    Py_DECREF(owners);
                    if (delta == -1000) goto fail;
                    shared += delta;
                }
            }
            prev = h;
        }
    }
    Py_DECREF(fresh);
    Py_DECREF(held);
    Py_DECREF(seq);
    return PyLong_FromLong(shared);
fail:
    Py_XDECREF(fresh);
    Py_XDECREF(held);
    Py_DECREF(seq);
    return NULL;
}

/* remove(blocks, owners, leaves, engine, hashes) -> change of the shared count (``remove`` and
 * ``_disown_all``): each hash the engine's LRU dict holds leaves it, and ``engine`` leaves its owners
 * (the block leaves the index, and the leaves, with its last owner). */
static PyObject *
remove_(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (index_args(args, nargs, 5, "remove(blocks, owners, leaves, engine, hashes)") == NULL)
        return NULL;
    PyObject *blocks = args[0], *owners_of = args[1], *leaves = args[2], *engine = args[3];
    PyObject *seq = PySequence_Fast(args[4], "hashes must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **hashes = PySequence_Fast_ITEMS(seq);
    long shared = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = hashes[i];
        int in = PyDict_Contains(blocks, h);
        if (in < 0) goto fail;
        if (!in) continue;
        if (PyDict_DelItem(blocks, h) < 0) goto fail;
        PyObject *owners = PyDict_GetItemWithError(owners_of, h);
        if (owners == NULL) {
            if (PyErr_Occurred()) goto fail;
            continue;
        }
        if (PyUnicode_Check(owners)) {
            int same = PyObject_RichCompareBool(owners, engine, Py_EQ);
            if (same < 0) goto fail;
            if (same) {
                if (PyDict_DelItem(owners_of, h) < 0 || PySet_Discard(leaves, h) < 0) goto fail;
            }
        } else if (PyTuple_Check(owners)) {
            Py_ssize_t m = PyTuple_GET_SIZE(owners), kept = 0;
            PyObject *rest = PyTuple_New(m);
            if (rest == NULL) goto fail;
            for (Py_ssize_t j = 0; j < m; j++) {
                PyObject *o = PyTuple_GET_ITEM(owners, j);
                int same = PyObject_RichCompareBool(o, engine, Py_EQ);
                if (same < 0) {
                    Py_DECREF(rest);
                    goto fail;
                }
                if (!same) {
                    Py_INCREF(o);
                    PyTuple_SET_ITEM(rest, kept++, o);
                }
            }
            if (kept == m) {   /* not an owner of it */
                Py_DECREF(rest);
                continue;
            }
            int rc;
            if (kept == 1) {
                shared -= 1;
                rc = PyDict_SetItem(owners_of, h, PyTuple_GET_ITEM(rest, 0));
            } else {
                if (_PyTuple_Resize(&rest, kept) < 0) goto fail;
                rc = PyDict_SetItem(owners_of, h, rest);
            }
            Py_DECREF(rest);
            if (rc < 0) goto fail;
        }
    }
    Py_DECREF(seq);
    return PyLong_FromLong(shared);
fail:
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef methods[] = {
    {"add", (PyCFunction)(void (*)(void))add, METH_FASTCALL,
     "add(blocks, owners, leaves, engine, hashes, parent, now) -> change of the shared count"},
    {"remove", (PyCFunction)(void (*)(void))remove_, METH_FASTCALL,
     "remove(blocks, owners, leaves, engine, hashes) -> change of the shared count"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_index", "PrefixIndex.add and .remove over its dicts, in C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__index(void)
{
    return PyModule_Create(&module);
}
