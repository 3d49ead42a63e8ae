"""Child-process helpers shared by ``motor up`` (:mod:`motor.cluster`) and the node manager's
engine supervisor (:mod:`motor.node_manager.supervisor`): death signal, process groups, the
restart backoff, exit statuses as people read them, log tails."""
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


def describe_exit(status: int | None) -> str:
    """An exit status as people read it: ``status 1``, ``signal 9 (SIGKILL)``, ``running``
    (``status`` as :attr:`subprocess.Popen.returncode` gives it: negative = killed by that
    signal)."""
    if status is None:
        return "running"
    if status < 0:
        import signal
        try:
            name = signal.Signals(-status).name
        except ValueError:
            return f"signal {-status}"
        return f"signal {-status} ({name})"
    return f"status {status}"


def tail_lines(path: str, n: int = 20, offset: int = 0, max_bytes: int = 256 * 1024) -> list[str]:
    """The last ``n`` lines of the file ``path`` written at or after byte ``offset`` (the
    start of one run's output in a log that several runs append to); at most the last
    ``max_bytes`` of it are read. ``[]`` when the file cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            start = max(offset, end - max_bytes, 0)
            f.seek(start)
            data = f.read(end - start)
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    if start > offset and lines:
        lines = lines[1:]  # the first one is cut
    return [ln for ln in lines if ln.strip()][-n:]


def backoff_delay(n: int, initial_s: float, max_s: float) -> float:
    """Delay before the ``n``-th consecutive restart (n >= 1)."""
    factor: int = 2 ** max(0, n - 1)   # int ** int is Any to mypy (a negative power is a float)
    return min(initial_s * factor, max_s)


def _pgrp_members(pgid: int) -> list[int] | None:
    """Live (non-zombie) processes of group ``pgid`` from /proc, or None without /proc."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rfind(b")") + 2:].split()
        if len(rest) > 2 and int(rest[2]) == pgid and rest[0] != b"Z":
            out.append(pid)
    return out


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a live (non-zombie) member."""
    members = _pgrp_members(pgid)
    if members is not None:
        return bool(members)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
