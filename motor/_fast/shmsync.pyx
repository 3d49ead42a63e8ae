# cython: language_level=3
"""Memory ordering between processes that share a mapping (the coordinator's load table).

:func:`full_fence` is a sequentially consistent fence (C11 ``atomic_thread_fence
(memory_order_seq_cst)``, GCC ``__atomic_thread_fence``; ``mfence`` on x86-64, ``dmb ish``
on aarch64). Between a process's store to its own row of a shared table and its loads of
the other rows, it makes the store visible to the others before the loads read (a plain
store may wait in the CPU's store buffer while later loads run, even on x86-64's TSO),
so two processes that each count first and then read each other's counts (Dekker's
pattern) cannot both miss the other's count: at least one of them sees both.
"""

cdef extern from *:
    """
    static inline void motor_full_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
    """
    void motor_full_fence() nogil


def full_fence() -> None:
    """A sequentially consistent memory fence (module doc); about 20-40 ns."""
    motor_full_fence()
