/* ARC's four lists as one hash table and intrusive doubly linked lists: the compiled core of
 * `tiering.policies.arc.ARCPolicy` (its docstring has the algorithm; the tests hold it to a
 * plain Python reference, tests/tiering/arc_reference.py).
 *
 * One dict maps each key, resident or ghost, to its node; a node sits on one of T1, T2, B1,
 * B2 (least recent at the head). A key moving between lists (T1 -> T2 on a touch, T1 -> B1 on
 * an eviction, B1 -> T2 on a ghost hit) is relinked without touching the dict: a Python
 * rendering pays two OrderedDict operations for each such move.
 *
 * Runs on its owner's thread, under the GIL. A call that could run Python code while node
 * pointers are held (a key's __eq__, a container's __contains__) is guarded: a policy method
 * called from inside it raises RuntimeError instead of changing the lists under the caller.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

enum { T1 = 0, T2 = 1, B1 = 2, B2 = 3 };

typedef struct Node {
    PyObject_HEAD
    PyObject *key;   /* strong */
    PyObject *value; /* strong; NULL for a ghost */
    struct Node *prev;
    struct Node *next;
    int list;
} Node;

typedef struct {
    Node *head; /* least recent */
    Node *tail;
    Py_ssize_t size;
} List;

typedef struct {
    PyObject_HEAD
    PyObject *map; /* dict: key -> Node (strong) */
    List lists[4];
    Py_ssize_t capacity;
    double p;
    int busy;
} ARC;

static void
node_dealloc(Node *node)
{
    Py_XDECREF(node->key);
    Py_XDECREF(node->value);
    PyObject_Free(node);
}

static PyTypeObject NodeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tiering.policies._arc.Node",
    .tp_basicsize = sizeof(Node),
    .tp_dealloc = (destructor)node_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
};

static inline void
unlink_node(ARC *self, Node *node)
{
    List *list = &self->lists[node->list];
    if (node->prev != NULL)
        node->prev->next = node->next;
    else
        list->head = node->next;
    if (node->next != NULL)
        node->next->prev = node->prev;
    else
        list->tail = node->prev;
    node->prev = node->next = NULL;
    list->size--;
}

static inline void
append_node(ARC *self, Node *node, int which)
{
    List *list = &self->lists[which];
    node->list = which;
    node->next = NULL;
    node->prev = list->tail;
    if (list->tail != NULL)
        list->tail->next = node;
    else
        list->head = node;
    list->tail = node;
    list->size++;
}

/* Unlink a node and drop it from the dict (which frees it). 0, or -1 with an exception. */
static int
delete_node(ARC *self, Node *node)
{
    PyObject *key = node->key;
    int rc;
    unlink_node(self, node);
    Py_INCREF(key);
    self->busy = 1;
    rc = PyDict_DelItem(self->map, key);
    self->busy = 0;
    Py_DECREF(key);
    return rc;
}

static int
guard(ARC *self)
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError,
                        "ARC policy called again from inside one of its own calls");
        return -1;
    }
    return 0;
}

/* The node of a key, borrowed, or NULL (an exception set when the lookup failed). */
static inline Node *
find(ARC *self, PyObject *key)
{
    Node *node;
    self->busy = 1;
    node = (Node *)PyDict_GetItemWithError(self->map, key);
    self->busy = 0;
    return node;
}

static inline int
resident(Node *node)
{
    return node != NULL && node->list <= T2;
}

/* Drop the least recent ghosts: from B1 while |T1| + |B1| > c, then from B2 while the four
 * lists hold more than 2c keys. */
static int
trim_ghosts(ARC *self)
{
    List *l = self->lists;
    Py_ssize_t over = l[T1].size + l[B1].size - self->capacity;
    while (over-- > 0 && l[B1].head != NULL) {
        if (delete_node(self, l[B1].head) < 0)
            return -1;
    }
    over = l[T1].size + l[T2].size + l[B1].size + l[B2].size - 2 * self->capacity;
    while (over-- > 0 && l[B2].head != NULL) {
        if (delete_node(self, l[B2].head) < 0)
            return -1;
    }
    return 0;
}

static int
ARC_init(ARC *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity", NULL};
    Py_ssize_t capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &capacity))
        return -1;
    if (capacity <= 0) {
        PyErr_Format(PyExc_ValueError, "policy capacity must be positive, got %zd", capacity);
        return -1;
    }
    if (self->map != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ARC is initialized once");
        return -1;
    }
    self->map = PyDict_New();
    if (self->map == NULL)
        return -1;
    self->capacity = capacity;
    self->p = 0.0;
    return 0;
}

static void
clear_lists(ARC *self)
{
    int i;
    for (i = 0; i < 4; i++) {
        self->lists[i].head = self->lists[i].tail = NULL;
        self->lists[i].size = 0;
    }
}

static void
ARC_dealloc(ARC *self)
{
    clear_lists(self);
    Py_XDECREF(self->map);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
ARC_get(ARC *self, PyObject *key)
{
    Node *node;
    if (guard(self) < 0)
        return NULL;
    node = find(self, key);
    if (node == NULL && PyErr_Occurred())
        return NULL;
    if (!resident(node))
        Py_RETURN_NONE;
    Py_INCREF(node->value);
    return node->value;
}

static PyObject *
ARC_get_many(ARC *self, PyObject *keys)
{
    PyObject *iter, *key, *out;
    if (guard(self) < 0)
        return NULL;
    iter = PyObject_GetIter(keys);
    if (iter == NULL)
        return NULL;
    out = PyList_New(0);
    if (out == NULL) {
        Py_DECREF(iter);
        return NULL;
    }
    while ((key = PyIter_Next(iter)) != NULL) {
        Node *node = find(self, key);
        PyObject *value = resident(node) ? node->value : Py_None;
        Py_DECREF(key);
        if (node == NULL && PyErr_Occurred())
            break;
        if (PyList_Append(out, value) < 0)
            break;
    }
    Py_DECREF(iter);
    if (PyErr_Occurred()) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* Cases II-IV of the paper for each key, in order; ghosts are trimmed before a ghost hit
 * when an insert since the last trim may have pushed them over their bounds (the hit's case
 * depends on whether the key is still a ghost, and p on the ghosts' sizes), and at the end. */
static int
insert_keys(ARC *self, PyObject **keys, PyObject **values, Py_ssize_t n)
{
    List *l = self->lists;
    double c = (double)self->capacity;
    int untrimmed = 0;
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        PyObject *key = keys[i], *value = values[i];
        Node *node = find(self, key);
        if (node == NULL && PyErr_Occurred())
            return -1;
        if (resident(node)) {
            PyErr_SetString(PyExc_ValueError, "insert of a key that is already resident");
            return -1;
        }
        if (node != NULL) { /* a ghost */
            if (untrimmed) {
                if (trim_ghosts(self) < 0)
                    return -1;
                untrimmed = 0;
                node = find(self, key);
                if (node == NULL && PyErr_Occurred())
                    return -1;
            }
            if (node != NULL) {
                if (node->list == B1) { /* case II: T1 was too small */
                    double step = (double)l[B2].size / (double)l[B1].size;
                    self->p = fmin(c, self->p + (step > 1.0 ? step : 1.0));
                }
                else { /* case III: T2 was too small */
                    double step = (double)l[B1].size / (double)l[B2].size;
                    self->p = fmax(0.0, self->p - (step > 1.0 ? step : 1.0));
                }
                unlink_node(self, node);
                Py_INCREF(value);
                node->value = value;
                append_node(self, node, T2);
                continue;
            }
        }
        node = PyObject_New(Node, &NodeType); /* case IV */
        if (node == NULL)
            return -1;
        Py_INCREF(key);
        node->key = key;
        node->value = NULL;
        node->prev = node->next = NULL;
        self->busy = 1;
        if (PyDict_SetItem(self->map, key, (PyObject *)node) < 0) {
            self->busy = 0;
            Py_DECREF(node);
            return -1;
        }
        self->busy = 0;
        Py_DECREF(node); /* the dict holds it */
        Py_INCREF(value);
        node->value = value;
        append_node(self, node, T1);
        untrimmed = 1;
    }
    if (untrimmed)
        return trim_ghosts(self);
    return 0;
}

static PyObject *
ARC_insert(ARC *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *key, *value;
    if (guard(self) < 0)
        return NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "insert(key, value)");
        return NULL;
    }
    key = args[0];
    value = args[1];
    if (insert_keys(self, &key, &value, 1) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
ARC_insert_many(ARC *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *keys, *values;
    int rc;
    if (guard(self) < 0)
        return NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "insert_many(keys, values)");
        return NULL;
    }
    keys = PySequence_Fast(args[0], "insert_many: keys must be a sequence");
    if (keys == NULL)
        return NULL;
    values = PySequence_Fast(args[1], "insert_many: values must be a sequence");
    if (values == NULL) {
        Py_DECREF(keys);
        return NULL;
    }
    if (PySequence_Fast_GET_SIZE(keys) != PySequence_Fast_GET_SIZE(values)) {
        PyErr_SetString(PyExc_ValueError, "insert_many: as many values as keys are needed");
        rc = -1;
    }
    else {
        rc = insert_keys(self, PySequence_Fast_ITEMS(keys), PySequence_Fast_ITEMS(values),
                         PySequence_Fast_GET_SIZE(keys));
    }
    Py_DECREF(keys);
    Py_DECREF(values);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
ARC_remove(ARC *self, PyObject *key)
{
    Node *node;
    PyObject *value;
    if (guard(self) < 0)
        return NULL;
    node = find(self, key);
    if (node == NULL && PyErr_Occurred())
        return NULL;
    if (!resident(node)) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    value = node->value;
    node->value = NULL; /* the reference moves to the caller */
    if (delete_node(self, node) < 0) {
        Py_DECREF(value);
        return NULL;
    }
    return value;
}

static PyObject *
ARC_touch(ARC *self, PyObject *keys)
{
    PyObject *iter, *key;
    if (guard(self) < 0)
        return NULL;
    iter = PyObject_GetIter(keys);
    if (iter == NULL)
        return NULL;
    while ((key = PyIter_Next(iter)) != NULL) {
        Node *node = find(self, key);
        Py_DECREF(key);
        if (node == NULL) {
            if (PyErr_Occurred())
                break;
            continue;
        }
        if (node->list == T2 || node->list == T1) {
            unlink_node(self, node);
            append_node(self, node, T2);
        }
    }
    Py_DECREF(iter);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* Whether a key is in `protected`: 1, 0, or -1 with an exception. */
static inline int
is_protected(ARC *self, PyObject *protected, PyObject *key)
{
    int rc;
    self->busy = 1;
    rc = PyAnySet_Check(protected) ? PySet_Contains(protected, key)
                                   : PySequence_Contains(protected, key);
    self->busy = 0;
    return rc;
}

/* Append up to `want` unprotected nodes of a list, from `*from` on, to `out`; `*from` is left
 * at the node after the last one examined. The count appended, or -1 with an exception. */
static Py_ssize_t
scan(ARC *self, Node **from, Py_ssize_t want, PyObject *protected, Node **out)
{
    Py_ssize_t got = 0;
    Node *node = *from;
    while (got < want && node != NULL) {
        int rc = is_protected(self, protected, node->key);
        if (rc < 0)
            return -1;
        if (!rc)
            out[got++] = node;
        node = node->next;
    }
    *from = node;
    return got;
}

/* REPLACE applied n times: the first ceil(|T1| - p) victims from T1 (while |T1| > p), the rest
 * from T2; when a list has nothing evictable left, its share falls to the other. Every victim
 * is chosen before anything changes; ghosts are trimmed by the next insert. */
static PyObject *
ARC_evict(ARC *self, PyObject *const *args, Py_ssize_t nargs)
{
    List *l = self->lists;
    Py_ssize_t n, from_t1, got1, got2, more, i;
    PyObject *protected, *out = NULL;
    Node **victims = NULL, *scan1, *scan2;
    double share;
    if (guard(self) < 0)
        return NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "evict(n, protected)");
        return NULL;
    }
    n = PyNumber_AsSsize_t(args[0], PyExc_OverflowError);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "evict: n must be at least 0, got %zd", n);
        return NULL;
    }
    protected = args[1];
    if (n > l[T1].size + l[T2].size)
        Py_RETURN_NONE;
    if (n == 0)
        return PyList_New(0);
    share = ceil((double)l[T1].size - self->p);
    from_t1 = share > 0 ? (Py_ssize_t)share : 0;
    if (from_t1 > n)
        from_t1 = n;
    victims = PyMem_Malloc(sizeof(Node *) * (size_t)n * 2);
    if (victims == NULL)
        return PyErr_NoMemory();
    /* victims[0 .. got1) from T1, victims[n .. n + got2) from T2 */
    scan1 = l[T1].head;
    scan2 = l[T2].head;
    got1 = scan(self, &scan1, from_t1, protected, victims);
    if (got1 < 0)
        goto done;
    got2 = scan(self, &scan2, n - got1, protected, victims + n);
    if (got2 < 0)
        goto done;
    if (got1 + got2 < n) {
        more = scan(self, &scan1, n - got1 - got2, protected, victims + got1);
        if (more < 0)
            goto done;
        got1 += more;
        if (got1 + got2 < n) {
            Py_INCREF(Py_None);
            out = Py_None;
            goto done;
        }
    }
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (i = 0; i < n; i++) {
        Node *node = i < got1 ? victims[i] : victims[n + i - got1];
        PyObject *pair = PyTuple_New(2);
        if (pair == NULL) { /* nothing has moved yet: give up cleanly */
            Py_CLEAR(out);
            goto done;
        }
        Py_INCREF(node->key);
        Py_INCREF(node->value);
        PyTuple_SET_ITEM(pair, 0, node->key);
        PyTuple_SET_ITEM(pair, 1, node->value);
        PyList_SET_ITEM(out, i, pair);
    }
    for (i = 0; i < n; i++) {
        Node *node = i < got1 ? victims[i] : victims[n + i - got1];
        Py_CLEAR(node->value);
        unlink_node(self, node);
        append_node(self, node, i < got1 ? B1 : B2);
    }
done:
    PyMem_Free(victims);
    return out;
}

static PyObject *
ARC_clear(ARC *self, PyObject *Py_UNUSED(ignored))
{
    if (guard(self) < 0)
        return NULL;
    clear_lists(self);
    PyDict_Clear(self->map);
    self->p = 0.0;
    Py_RETURN_NONE;
}

static PyObject *
ARC_lists(ARC *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyTuple_New(4);
    int i;
    if (out == NULL)
        return NULL;
    for (i = 0; i < 4; i++) {
        PyObject *keys = PyList_New(self->lists[i].size);
        Node *node;
        Py_ssize_t j = 0;
        if (keys == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        for (node = self->lists[i].head; node != NULL; node = node->next) {
            Py_INCREF(node->key);
            PyList_SET_ITEM(keys, j++, node->key);
        }
        PyTuple_SET_ITEM(out, i, keys);
    }
    return out;
}

static Py_ssize_t
ARC_len(ARC *self)
{
    return self->lists[T1].size + self->lists[T2].size;
}

static int
ARC_contains(ARC *self, PyObject *key)
{
    Node *node;
    if (guard(self) < 0)
        return -1;
    node = find(self, key);
    if (node == NULL && PyErr_Occurred())
        return -1;
    return resident(node);
}

static PyObject *
ARC_get_p(ARC *self, void *Py_UNUSED(closure))
{
    return PyFloat_FromDouble(self->p);
}

static int
ARC_set_p(ARC *self, PyObject *value, void *Py_UNUSED(closure))
{
    double p;
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "p cannot be deleted");
        return -1;
    }
    p = PyFloat_AsDouble(value);
    if (p == -1.0 && PyErr_Occurred())
        return -1;
    self->p = p;
    return 0;
}

static PyObject *
ARC_get_capacity(ARC *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->capacity);
}

static PyMethodDef ARC_methods[] = {
    {"get", (PyCFunction)ARC_get, METH_O, "The value of a resident key, or None."},
    {"get_many", (PyCFunction)ARC_get_many, METH_O, "`get` of each key, in order."},
    {"insert", (PyCFunction)(void (*)(void))ARC_insert, METH_FASTCALL,
     "Make a key resident (cases II-IV)."},
    {"insert_many", (PyCFunction)(void (*)(void))ARC_insert_many, METH_FASTCALL,
     "`insert` of each key with its value, in order."},
    {"remove", (PyCFunction)ARC_remove, METH_O,
     "Drop a resident key (no ghost); its value. KeyError if it is not resident."},
    {"touch", (PyCFunction)ARC_touch, METH_O, "A use of each resident key, in order (case I)."},
    {"evict", (PyCFunction)(void (*)(void))ARC_evict, METH_FASTCALL,
     "evict(n, protected): n victims (key, value) in eviction order, or None."},
    {"clear", (PyCFunction)ARC_clear, METH_NOARGS, "Forget every key and ghost; p = 0."},
    {"lists", (PyCFunction)ARC_lists, METH_NOARGS, "T1, T2, B1, B2, least recent first."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ARC_getset[] = {
    {"p", (getter)ARC_get_p, (setter)ARC_set_p, "Target size of T1.", NULL},
    {"capacity", (getter)ARC_get_capacity, NULL, "The most resident keys.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods ARC_as_sequence = {
    .sq_length = (lenfunc)ARC_len,
    .sq_contains = (objobjproc)ARC_contains,
};

static PyTypeObject ARCType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tiering.policies._arc.ARC",
    .tp_doc = "ARC's lists and target (see tiering.policies.arc.ARCPolicy).",
    .tp_basicsize = sizeof(ARC),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ARC_init,
    .tp_dealloc = (destructor)ARC_dealloc,
    .tp_methods = ARC_methods,
    .tp_getset = ARC_getset,
    .tp_as_sequence = &ARC_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tiering.policies._arc",
    .m_doc = "The compiled core of kvtier's ARC eviction policy.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__arc(void)
{
    PyObject *m;
    if (PyType_Ready(&NodeType) < 0 || PyType_Ready(&ARCType) < 0)
        return NULL;
    m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ARCType);
    if (PyModule_AddObject(m, "ARC", (PyObject *)&ARCType) < 0) {
        Py_DECREF(&ARCType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
