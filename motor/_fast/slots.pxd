# cython: language_level=3
"""Reading and writing the ``__slots__`` members of Python objects at their byte offset, for
compiled code that reads the same attributes of many objects of one type (header only:
each module that cimports this gets the functions).

A ``__slots__`` entry is a member descriptor of the type (``T_OBJECT_EX``: an object
pointer at a fixed offset in the instance). :c:func:`motor_member_offset` finds the one the
type's ordinary attribute lookup finds for a name (``_PyType_Lookup``, the MRO, as
``PyObject_GenericGetAttr`` does), or -1 when the attribute is anything else (a property,
a class attribute, an instance dict entry) or the type has its own ``__getattribute__``
(``tp_getattro``) or ``__setattr__`` (``tp_setattro``): then the caller uses the ordinary
``getattr`` / ``setattr``. :c:func:`motor_type_tag`: the type's version tag, which CPython
clears on any change of the type or its bases (a cached offset is kept while it is
unchanged and not 0). :c:func:`motor_slot`: the member's object (borrowed; NULL when
unset). :c:func:`motor_slot_set`: store ``v`` there as the member descriptor's setter does
(a new reference stored, the old one released).
"""
from cpython.object cimport PyTypeObject
from cpython.ref cimport PyObject

cdef extern from *:
    """
    #include "structmember.h"
    static Py_ssize_t motor_member_offset(PyTypeObject *tp, PyObject *name) {
        PyObject *d;
        PyMemberDef *m;
        if (tp->tp_getattro != PyObject_GenericGetAttr) return -1;
        if (tp->tp_setattro != PyObject_GenericSetAttr) return -1;
        d = _PyType_Lookup(tp, name);
        if (d == NULL || Py_TYPE(d) != &PyMemberDescr_Type) return -1;
        if (!PyType_IsSubtype(tp, PyDescr_TYPE(d))) return -1;
        m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type != T_OBJECT_EX || (m->flags & READONLY)) return -1;
        return m->offset;
    }
    static inline unsigned int motor_type_tag(PyTypeObject *tp) {
        return tp->tp_version_tag;
    }
    static inline PyObject *motor_slot(PyObject *o, Py_ssize_t off) {
        return *(PyObject **)((char *)o + off);
    }
    static inline void motor_slot_set(PyObject *o, Py_ssize_t off, PyObject *v) {
        PyObject **p = (PyObject **)((char *)o + off);
        PyObject *old = *p;
        Py_INCREF(v);
        *p = v;
        Py_XDECREF(old);
    }
    """
    Py_ssize_t motor_member_offset(PyTypeObject *tp, object name) noexcept
    unsigned int motor_type_tag(PyTypeObject *tp) noexcept
    PyObject *motor_slot(PyObject *o, Py_ssize_t off) noexcept
    void motor_slot_set(PyObject *o, Py_ssize_t off, PyObject *v) noexcept
