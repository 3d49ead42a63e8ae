"""Child-process helpers shared by ``motor up`` and the node manager's engine supervisor."""
from __future__ import annotations

import os
from collections.abc import Callable

#: prctl option that sends the child a signal when its parent thread dies (linux/prctl.h)
PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux / no libc symbol
        return None


# resolved at import, in the parent: the child of a fork in a threaded process must not import
# or take locks (an import lock held by another thread at fork time deadlocks the child, and
# the parent then waits for its exec forever)
_PRCTL = _load_prctl()


def die_with_parent(sig: int, new_session: bool = False) -> Callable[[], None]:
    """A ``preexec_fn`` for :class:`subprocess.Popen` that makes the child receive ``sig``
    when the process that started it dies (``PR_SET_PDEATHSIG``; nothing where prctl is
    missing), after ``setsid()`` when ``new_session``. The returned function only makes
    system calls: safe between fork and exec."""
    prctl = _PRCTL

    def preexec() -> None:  # pragma: no cover - runs in the child before exec
        if new_session:
            os.setsid()
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, sig)
    return preexec
