# Included by _index.pyx: a MatchRows answer as the Python objects a caller reads, built in
# C (docs/api.md, "Reading an answer in Python"): the scores map of a router, the row
# tuples, the ``DpHit`` rows and the V3 body. No Python loop and no Python object per row
# beyond the row's own: the (instance_id, dp_rank) key tuple, the instance id and the DP
# key string of a group are the ones its name table (``GroupNames``, or its twin) made
# once, when the group was named; counts below 257 are CPython's cached ints.
# The twin of every function here: ``kvconductor/_py/rows.py``.
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_DECREF, Py_INCREF
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM


cdef extern from "kvconductor/c/encode.h":
    uint64_t kvc_sat_u32_mul(uint64_t a, uint64_t b) noexcept nogil


cdef extern from "kvconductor/c/answers.h":
    dict kvc_dict_presized(Py_ssize_t n)


cdef extern from "Python.h":
    ctypedef PyObject* (*allocfunc)(PyTypeObject* tp, Py_ssize_t n)
    void* PyType_GetSlot(PyTypeObject* tp, int slot) except? NULL
    enum:
        Py_tp_alloc


cdef list _names_keys(MatchRows r, names, bint dp_keys):
    """``names.keys`` (group id -> its (instance_id, dp_rank) tuple), checked to name every
    group of ``r`` (its last group is its largest); with ``dp_keys`` ``names.dp_keys``
    (group id -> ``str(dp_rank)``) is checked too. ``IndexError``: a stale name table."""
    cdef list keys = names.keys
    cdef size_t n = <size_t>len(keys), last
    if dp_keys:
        n = min(n, <size_t>len(<list>names.dp_keys))
    if r.n:
        last = r.data[4 * (r.n - 1)]
        if last >= n:
            raise IndexError(f"group {last} has no name ({n} named)")
    return keys


cdef inline object _key(list keys, const uint32_t* d, size_t i):
    """Row ``i``'s (instance_id, dp_rank), the table's own tuple (checked by _names_keys)."""
    return keys[<Py_ssize_t>d[4 * i]]


cdef dict _answer_scores(MatchRows r, list keys):
    cdef dict out = kvc_dict_presized(<Py_ssize_t>r.n)
    cdef size_t i
    cdef const uint32_t* d = r.data
    for i in range(r.n):
        out[_key(keys, d, i)] = _row_total(d, i)
    return out


cdef object _answer_row(PyTypeObject* tp, tuple key, const uint32_t* d, size_t i):
    """``(instance_id, dp_rank, npu, cpu, disk)`` of row ``i`` as a ``tp`` (NULL: a plain
    tuple): a tuple subclass of no other field is allocated as ``tuple.__new__(tp, row)``
    does (its ``tp_alloc``), without calling its ``__new__``."""
    cdef object a = key[0]
    cdef object b = key[1]
    cdef object n = d[4 * i + 1]
    cdef object c = d[4 * i + 2]
    cdef object k = d[4 * i + 3]
    cdef object t
    cdef PyObject* p
    if tp == NULL:
        t = PyTuple_New(5)
    else:
        p = (<allocfunc>PyType_GetSlot(tp, Py_tp_alloc))(tp, 5)
        if p == NULL:
            raise MemoryError()
        t = <object>p
        Py_DECREF(t)            # the cast took a reference of its own
    Py_INCREF(a)
    PyTuple_SET_ITEM(t, 0, a)
    Py_INCREF(b)
    PyTuple_SET_ITEM(t, 1, b)
    Py_INCREF(n)
    PyTuple_SET_ITEM(t, 2, n)
    Py_INCREF(c)
    PyTuple_SET_ITEM(t, 3, c)
    Py_INCREF(k)
    PyTuple_SET_ITEM(t, 4, k)
    return t


cdef PyTypeObject* _row_type(cls) except? NULL:
    """The type of the rows :func:`_answer_rows` makes of ``cls`` (NULL: plain tuples).
    ``TypeError`` unless ``cls`` is ``tuple`` or a subclass adding no field (a NamedTuple:
    no ``__dict__``, no slot, the tuple's own layout)."""
    if cls is tuple:
        return NULL
    if not (isinstance(cls, type) and issubclass(cls, tuple)
            and cls.__basicsize__ == tuple.__basicsize__
            and cls.__itemsize__ == tuple.__itemsize__ and cls.__dictoffset__ == 0):
        raise TypeError(f"{cls!r} is not a tuple subclass of the tuple's own layout")
    return <PyTypeObject*>cls


cdef list _answer_rows(MatchRows r, list keys, PyTypeObject* tp):
    cdef list out = PyList_New(<Py_ssize_t>r.n)
    cdef size_t i
    cdef const uint32_t* d = r.data
    cdef object row
    for i in range(r.n):
        row = _answer_row(tp, <tuple>_key(keys, d, i), d, i)
        Py_INCREF(row)
        PyList_SET_ITEM(out, <Py_ssize_t>i, row)
    return out


cdef dict _dp_match(uint64_t matched, const uint32_t* d, size_t i):
    return {"matched_tokens": matched, "npu_blocks": d[4 * i + 1], "cpu_blocks": d[4 * i + 2],
            "disk_blocks": d[4 * i + 3]}


cdef dict _answer_v3(MatchRows r, list keys, list dp_keys, str tenant, uint64_t bs):
    """The V3 body: instances in the order of their first row, each instance's DPs in row
    order, ``longest_matched`` the largest of its DPs' ``matched_tokens`` (the keys of
    ``kvconductor.schema``'s ``InstanceMatch`` and ``DpMatch``)."""
    cdef dict out = {}
    cdef dict inst = None
    cdef dict dps = None
    cdef object name
    cdef object last = None
    cdef uint64_t m, longest = 0
    cdef size_t i, g
    cdef const uint32_t* d = r.data
    for i in range(r.n):
        g = d[4 * i]
        name = (<tuple>keys[<Py_ssize_t>g])[0]
        if name is not last:
            if inst is not None:
                inst["longest_matched"] = longest
            inst = out.get(name)
            if inst is None:
                dps = {}
                inst = out[name] = {"longest_matched": 0, "DP": dps}
                longest = 0
            else:               # an instance whose groups are not adjacent
                dps = <dict>inst["DP"]
                longest = inst["longest_matched"]
            last = name
        m = kvc_sat_u32_mul(_row_total(d, i), bs)
        dps[dp_keys[<Py_ssize_t>g]] = _dp_match(m, d, i)
        if m > longest:
            longest = m
    if inst is not None:
        inst["longest_matched"] = longest
    return {tenant: out}
