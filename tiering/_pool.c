/* The store path of `tiering.primary.PrimaryPool` in C: `prepare_store` and `complete_store`,
 * on the pool's own containers (the `ref` dict, the `busy` and `writing` sets, the free list),
 * so that everything else in the class reads and writes them as before. The Python methods
 * are the same algorithm; they run where this was not built, and the tests hold both to the
 * same answers.
 *
 * What it saves is the temporaries of the Python version (the dict that orders and dedupes the
 * keys, the dict of new keys, the tuples of victims): a key offered to the pool costs the
 * probes of the pool's own tables and the policy's work, nothing more.
 *
 * Runs on the pool's owner's thread, under the GIL. The policy is called through its Python
 * methods (`evict`, `insert_many`, `remove`); no borrowed reference is held across them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *WRITING; /* -1 */
static PyObject *READY;   /* 0 */

static int
is_ready(PyObject *value)
{
    return value == READY || (PyLong_CheckExact(value) && PyLong_AsLong(value) == 0);
}

/* Undo the marks of an infeasible or failed call: the new keys out of `writing`, the lent
 * keys out of `busy`. */
static void
unmark(PyObject *writing, PyObject *new, PyObject *busy, PyObject *lent)
{
    PyObject *type, *value, *tb;
    Py_ssize_t i;
    PyErr_Fetch(&type, &value, &tb);
    for (i = 0; new != NULL && i < PyList_GET_SIZE(new); i++)
        if (PySet_Discard(writing, PyList_GET_ITEM(new, i)) < 0)
            PyErr_Clear();
    for (i = 0; lent != NULL && i < PyList_GET_SIZE(lent); i++)
        if (PySet_Discard(busy, PyList_GET_ITEM(lent, i)) < 0)
            PyErr_Clear();
    PyErr_Restore(type, value, tb);
}

/* prepare_store(ref, busy, writing, free, policy, keys): None when there are not enough free
 * or evictable slots (nothing changed), else (new keys, their slots, evicted keys, their
 * slots) as tuples; `()` when every key is resident already. */
static PyObject *
prepare_store(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *ref, *busy, *writing, *free, *policy, *seq;
    PyObject *new = NULL, *lent = NULL, *victims = NULL, *evicted = NULL, *evicted_slots = NULL;
    PyObject *slots = NULL, *result = NULL, *call = NULL, *new_tuple = NULL, *slot_tuple = NULL;
    Py_ssize_t n_keys, i, n, have, shortfall;
    (void)module;
    if (nargs != 6 || !PyDict_CheckExact(args[0]) || !PyAnySet_CheckExact(args[1]) ||
        !PyAnySet_CheckExact(args[2]) || !PyList_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "prepare_store(ref: dict, busy: set, writing: set, free: list, policy, keys)");
        return NULL;
    }
    ref = args[0], busy = args[1], writing = args[2], free = args[3], policy = args[4];
    seq = PySequence_Fast(args[5], "keys must be iterable");
    if (seq == NULL)
        return NULL;
    n_keys = PySequence_Fast_GET_SIZE(seq);
    new = PyList_New(0);
    lent = PyList_New(0);
    if (new == NULL || lent == NULL)
        goto fail;
    /* Which keys are new, in order and once each: `writing` marks them as they are found (a
     * key met again is in it, or resident), and loses them again if the call cannot go on. */
    for (i = 0; i < n_keys; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i), *r;
        Py_ssize_t before;
        Py_INCREF(key);
        r = PyDict_GetItemWithError(ref, key);
        if (r != NULL) {
            /* resident: a ready one is protected while this call evicts */
            int rc = is_ready(r) ? PyList_Append(lent, key) : 0;
            Py_DECREF(key);
            if (rc < 0)
                goto fail_new;
            continue;
        }
        if (PyErr_Occurred()) {
            Py_DECREF(key);
            goto fail_new;
        }
        before = PySet_GET_SIZE(writing);
        if (PySet_Add(writing, key) < 0) {
            Py_DECREF(key);
            goto fail_new;
        }
        if (PySet_GET_SIZE(writing) != before && PyList_Append(new, key) < 0) {
            PySet_Discard(writing, key);
            Py_DECREF(key);
            goto fail_new;
        }
        Py_DECREF(key);
    }
    n = PyList_GET_SIZE(new);
    if (n == 0) {
        Py_DECREF(seq);
        Py_DECREF(new);
        Py_DECREF(lent);
        return PyTuple_New(0);
    }
    have = PyList_GET_SIZE(free);
    shortfall = n - have;
    if (shortfall > 0) {
        /* the lent keys join `busy` (counted once each), then the policy chooses victims */
        Py_ssize_t busy_before = PySet_GET_SIZE(busy), nlent, evictable;
        PyObject *marked = PyList_New(0);
        if (marked == NULL)
            goto fail_new;
        for (i = 0; i < PyList_GET_SIZE(lent); i++) {
            PyObject *key = PyList_GET_ITEM(lent, i);
            Py_ssize_t before = PySet_GET_SIZE(busy);
            if (PySet_Add(busy, key) < 0 ||
                (PySet_GET_SIZE(busy) != before && PyList_Append(marked, key) < 0)) {
                unmark(writing, NULL, busy, marked);
                Py_DECREF(marked);
                goto fail_new;
            }
        }
        Py_SETREF(lent, marked);
        nlent = PySet_GET_SIZE(busy) - busy_before;
        evictable = PyDict_GET_SIZE(ref) - busy_before - nlent;
        if (shortfall > evictable) {
            unmark(writing, new, busy, lent);
            Py_DECREF(seq);
            Py_DECREF(new);
            Py_DECREF(lent);
            Py_RETURN_NONE;
        }
        {
            PyObject *count = PyLong_FromSsize_t(shortfall);
            if (count == NULL)
                goto fail_marked;
            victims = PyObject_CallMethod(policy, "evict", "NO", count, busy);
        }
        unmark(writing, NULL, busy, lent); /* the lent keys leave `busy` in any case */
        Py_CLEAR(lent);
        if (victims == NULL)
            goto fail_new;
        if (victims != Py_None) /* any sequence of (key, slot) pairs, as the Python path takes */
            Py_SETREF(victims, PySequence_Fast(victims, "evict must return a sequence or None"));
        if (victims == NULL)
            goto fail_new;
        if (victims == Py_None || PySequence_Fast_GET_SIZE(victims) != shortfall) {
            PyErr_Format(PyExc_AssertionError, "policy refused to evict %zd evictable keys",
                         shortfall);
            goto fail_new;
        }
        evicted = PyTuple_New(shortfall);
        evicted_slots = PyTuple_New(shortfall);
        if (evicted == NULL || evicted_slots == NULL)
            goto fail_new;
        for (i = 0; i < shortfall; i++) {
            PyObject *pair = PySequence_Fast(PySequence_Fast_GET_ITEM(victims, i),
                                             "a victim is not a (key, slot) pair");
            if (pair == NULL)
                goto fail_new;
            if (PySequence_Fast_GET_SIZE(pair) != 2) {
                Py_DECREF(pair);
                PyErr_SetString(PyExc_AssertionError, "a victim is not a (key, slot) pair");
                goto fail_new;
            }
            Py_INCREF(PySequence_Fast_GET_ITEM(pair, 0));
            PyTuple_SET_ITEM(evicted, i, PySequence_Fast_GET_ITEM(pair, 0));
            Py_INCREF(PySequence_Fast_GET_ITEM(pair, 1));
            PyTuple_SET_ITEM(evicted_slots, i, PySequence_Fast_GET_ITEM(pair, 1));
            Py_DECREF(pair);
        }
        Py_CLEAR(victims);
        for (i = 0; i < shortfall; i++) {
            if (PyDict_DelItem(ref, PyTuple_GET_ITEM(evicted, i)) < 0 ||
                PyList_Append(free, PyTuple_GET_ITEM(evicted_slots, i)) < 0)
                goto fail_new; /* a broken invariant: the policy evicted a key the pool lacks */
        }
        have = PyList_GET_SIZE(free);
    }
    else {
        Py_CLEAR(lent);
        evicted = PyTuple_New(0);
        evicted_slots = PyTuple_New(0);
        if (evicted == NULL || evicted_slots == NULL)
            goto fail_new;
    }
    /* the free list is a stack: its end is the next slot out */
    slots = PyList_New(n);
    if (slots == NULL)
        goto fail_new;
    for (i = 0; i < n; i++) {
        PyObject *slot = PyList_GET_ITEM(free, have - 1 - i);
        Py_INCREF(slot);
        PyList_SET_ITEM(slots, i, slot);
    }
    if (PyList_SetSlice(free, have - n, have, NULL) < 0)
        goto fail_new;
    for (i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(new, i);
        if (PyDict_SetItem(ref, key, WRITING) < 0 || PySet_Add(busy, key) < 0)
            goto fail;
    }
    call = PyObject_CallMethod(policy, "insert_many", "OO", new, slots);
    if (call == NULL)
        goto fail;
    Py_DECREF(call);
    new_tuple = PyList_AsTuple(new);
    slot_tuple = PyList_AsTuple(slots);
    if (new_tuple != NULL && slot_tuple != NULL)
        result = PyTuple_Pack(4, new_tuple, slot_tuple, evicted, evicted_slots);
    Py_XDECREF(new_tuple);
    Py_XDECREF(slot_tuple);
    Py_DECREF(seq);
    Py_DECREF(new);
    Py_DECREF(slots);
    Py_DECREF(evicted);
    Py_DECREF(evicted_slots);
    return result;

fail_marked:
    unmark(writing, NULL, busy, lent);
fail_new:
    unmark(writing, new, NULL, NULL);
fail:
    Py_XDECREF(seq);
    Py_XDECREF(new);
    Py_XDECREF(lent);
    Py_XDECREF(victims);
    Py_XDECREF(evicted);
    Py_XDECREF(evicted_slots);
    Py_XDECREF(slots);
    return NULL;
}

/* complete_store(ref, busy, writing, keys, ok): the keys, once each and in order, as a tuple;
 * or a list holding the first key that is not being written, nothing changed. On
 * success the keys are READY; on failure they leave `ref` and the caller frees their slots. */
static PyObject *
complete_store(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *ref, *busy, *writing, *seq, *done = NULL, *result;
    Py_ssize_t n_keys, i;
    int ok;
    (void)module;
    if (nargs != 5 || !PyDict_CheckExact(args[0]) || !PyAnySet_CheckExact(args[1]) ||
        !PyAnySet_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "complete_store(ref: dict, busy: set, writing: set, keys, ok)");
        return NULL;
    }
    ref = args[0], busy = args[1], writing = args[2];
    ok = PyObject_IsTrue(args[4]);
    if (ok < 0)
        return NULL;
    seq = PySequence_Fast(args[3], "keys must be iterable");
    if (seq == NULL)
        return NULL;
    n_keys = PySequence_Fast_GET_SIZE(seq);
    for (i = 0; i < n_keys; i++) { /* every key first: a misuse changes nothing */
        int rc = PySet_Contains(writing, PySequence_Fast_GET_ITEM(seq, i));
        if (rc < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        if (rc == 0) {
            PyObject *misused = PyList_New(1);
            if (misused != NULL) {
                Py_INCREF(PySequence_Fast_GET_ITEM(seq, i));
                PyList_SET_ITEM(misused, 0, PySequence_Fast_GET_ITEM(seq, i));
            }
            Py_DECREF(seq);
            return misused;
        }
    }
    done = PyList_New(0);
    if (done == NULL)
        goto fail;
    for (i = 0; i < n_keys; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        int rc = PySet_Discard(writing, key); /* 0: met already (a duplicate) */
        if (rc < 0)
            goto fail;
        if (rc == 0)
            continue;
        if (PySet_Discard(busy, key) < 0 || PyList_Append(done, key) < 0)
            goto fail;
        if (ok ? PyDict_SetItem(ref, key, READY) : PyDict_DelItem(ref, key))
            goto fail;
    }
    result = PyList_AsTuple(done);
    Py_DECREF(done);
    Py_DECREF(seq);
    return result;

fail:
    Py_XDECREF(done);
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef methods[] = {
    {"prepare_store", (PyCFunction)(void (*)(void))prepare_store, METH_FASTCALL,
     "prepare_store(ref, busy, writing, free, policy, keys): PrimaryPool.prepare_store's work."},
    {"complete_store", (PyCFunction)(void (*)(void))complete_store, METH_FASTCALL,
     "complete_store(ref, busy, writing, keys, ok): PrimaryPool.complete_store's work."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_pool",
    .m_doc = "The store path of tiering.primary.PrimaryPool, compiled.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__pool(void)
{
    WRITING = PyLong_FromLong(-1);
    READY = PyLong_FromLong(0);
    if (WRITING == NULL || READY == NULL)
        return NULL;
    return PyModule_Create(&module);
}
