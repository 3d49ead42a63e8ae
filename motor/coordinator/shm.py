"""Named shared-memory segments of a multi-worker coordinator: plain ``mmap`` of a file in
``/dev/shm`` (no resource tracker), created by the supervisor, attached by the workers and
the feed, unlinked at exit. The load table (:mod:`motor.coordinator.loadtable`) and the rate
table (:mod:`motor.coordinator.ratetable`) lay their arrays over one each."""
from __future__ import annotations

import mmap
import os


def segment_path(name: str, what: str) -> str:
    """``/dev/shm/<name>``.

    Raises
    ------
    ValueError
        for an empty name or one with ``/`` (``what`` names the table in the message).
    """
    if not name or "/" in name:
        raise ValueError(f"{what} name is expected without '/', got {name!r}")
    return f"/dev/shm/{name}"


def create_segment(path: str, size: int) -> mmap.mmap:
    """A new zeroed segment of ``size`` bytes (mode 0600); fails if ``path`` exists.

    Raises
    ------
    FileExistsError
        when ``path`` exists; ``OSError`` when it cannot be sized or mapped (the file is
        removed again).
    """
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return mm


def attach_segment(path: str) -> mmap.mmap:
    """Map an existing segment whole.

    Raises
    ------
    FileNotFoundError
        when ``path`` does not exist.
    """
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


def unlink_segment(path: str) -> None:
    """Remove the segment's file (mappings stay valid until closed); gone already is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
