/* kvconductor/c/answers.h: an answer's Python objects made in C (_index_answers.pxi).
 * Included after Python.h (Cython's generated module includes it first). */
#ifndef KVC_ANSWERS_H
#define KVC_ANSWERS_H

/* A dict with room for n entries (no rehash while it fills): CPython's presized dict
 * where the build has it (CPython < 3.13 exports it), else an empty one. */
#if PY_VERSION_HEX < 0x030D0000 && !defined(PYPY_VERSION)
#define kvc_dict_presized(n) _PyDict_NewPresized(n)
#else
#define kvc_dict_presized(n) PyDict_New()
#endif

#endif /* KVC_ANSWERS_H */
