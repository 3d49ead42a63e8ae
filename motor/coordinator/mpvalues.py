"""A cheaper value class for prometheus-client's multiprocess mode, for the coordinator's
children (``coordinator.workers > 1``, :mod:`motor.coordinator.supervisor`).

In multiprocess mode every counter, gauge and histogram child of prometheus-client keeps
its value in a per-process file of ``PROMETHEUS_MULTIPROC_DIR`` (``counter_<pid>.db``,
``gauge_livesum_<pid>.db``, ...; the layout of :class:`prometheus_client.mmap_dict.
MmapedDict`), which ``/metrics`` of any worker sums. The library's value
(``MultiProcessValue``) takes a process-wide lock, calls ``os.getpid()`` (fork detection)
and looks the key up twice on every update: about 0.9 us for ``Counter.inc`` and 2.5 us
for ``Histogram.observe``, against 0.45 and 1.0 us in one process. A worker updates about
ten values per request (requests counter, end-to-end and per-instance histograms,
in-flight gauge up and down), so that was several microseconds per request that one
worker does not pay.

:class:`FastMmapedValue` writes the same bytes to the same files (the library's
:class:`~prometheus_client.mmap_dict.MmapedDict` creates the files and places each key;
the value's 16 bytes, value and timestamp doubles, are written whole at that key's
offset, as the library does), so the multiprocess collector reads them unchanged. What it
leaves out:

* the lock: the coordinator's processes update metrics from their event-loop thread
  only (the tokenizer threads of :mod:`motor.coordinator.tokenize` update none);
* fork detection: the supervisor starts its children with the ``spawn`` method and they
  do not fork; the pid is taken once, when the class is made (:func:`install`).

It reads two internals of ``MmapedDict``, ``_positions`` (key -> offset) and ``_m`` (the
current mapping), as of prometheus-client 0.26; ``tests/unit/coordinator/test_mpvalues.py``
reads the files back through the library's collector, so a change there fails the tests.

Install it with :func:`install` before the first metric is made (that is, before
:mod:`motor.coordinator.metrics` is imported): prometheus-client makes each value with
``prometheus_client.values.ValueClass``, chosen at its import from the environment.

When :mod:`motor._fast.metricvalue` is built, the value's update is compiled
(:class:`motor._fast.metricvalue.MmapValue`: the same 16 bytes at the same offset of the
file's current mapping, from C); the Python class here is the reference used otherwise.

One process (no ``PROMETHEUS_MULTIPROC_DIR``): :func:`install_in_process` (called by
:mod:`motor.coordinator.metrics` before its first metric) replaces the library's
``MutexValue`` with :class:`motor._fast.metricvalue.LocalValue`, a float updated by one C
``+=`` under the GIL (atomic for every thread, so no lock); without the extension the
library's class stays.
"""
from __future__ import annotations

import os
import struct
from typing import Any

from prometheus_client import values
from prometheus_client.mmap_dict import MmapedDict, mmap_key

try:
    from motor._fast import metricvalue as _metricvalue
except ImportError:  # pragma: no cover - the extension is not built
    _metricvalue = None  # type: ignore[assignment]

_PACK = struct.Struct("dd").pack


def fast_value_class(directory: str, pid: int, compiled: bool | None = None) -> type:
    """A value class writing to ``<directory>/<type>_<pid>.db`` (the files of
    prometheus-client's ``MultiProcessValue`` for process ``pid``).

    ``compiled``: whether the updates are the compiled ones
    (:class:`motor._fast.metricvalue.MmapValue`); None: when the extension is built.

    Raises
    ------
    ImportError
        ``compiled=True`` without the extension.
    """
    files: dict[str, MmapedDict] = {}

    def _file(typ: str, multiprocess_mode: str) -> MmapedDict:
        prefix = f"{typ}_{multiprocess_mode}" if typ == "gauge" else typ
        f = files.get(prefix)
        if f is None:
            f = files[prefix] = MmapedDict(os.path.join(directory, f"{prefix}_{pid}.db"))
        return f

    if compiled is None:
        compiled = _metricvalue is not None
    if compiled:
        if _metricvalue is None:
            raise ImportError("motor._fast.metricvalue is not built")

        class FastMmapedValueC(_metricvalue.MmapValue):
            """A float kept in this process's multiprocess file, written at every change
            (compiled update)."""

            __slots__ = ()

            def __init__(self, typ: str, metric_name: str, name: str, labelnames: Any,
                         labelvalues: Any, help_text: str, multiprocess_mode: str = "",
                         **kwargs: Any) -> None:
                f = _file(typ, multiprocess_mode)
                key = mmap_key(metric_name, name, labelnames, labelvalues, help_text)
                v, ts = f.read_value(key)   # places the key (may grow and remap the file)
                self.bind(f, f._positions[key], v, ts)

        FastMmapedValueC.__name__ = FastMmapedValueC.__qualname__ = "FastMmapedValue"
        return FastMmapedValueC

    class FastMmapedValue:
        """A float kept in this process's multiprocess file, written at every change."""

        _multiprocess = True
        __slots__ = ("_file", "_key", "_pos", "_timestamp", "_value")

        def __init__(self, typ: str, metric_name: str, name: str, labelnames: Any,
                     labelvalues: Any, help_text: str, multiprocess_mode: str = "",
                     **kwargs: Any) -> None:
            f = _file(typ, multiprocess_mode)
            self._file = f
            self._key = mmap_key(metric_name, name, labelnames, labelvalues, help_text)
            # places the key in the file (may grow and remap it: the offset stays)
            v, ts = f.read_value(self._key)
            self._value: float = v
            self._timestamp: float = ts
            self._pos: int = f._positions[self._key]

        def _write(self) -> None:
            pos = self._pos
            # one slice assignment of both doubles (never a partly written value), through
            # the file's current mapping (it is remapped when it grows)
            self._file._m[pos:pos + 16] = _PACK(self._value, self._timestamp)

        def inc(self, amount: float) -> None:
            self._value += amount
            self._timestamp = 0.0
            pos = self._pos
            self._file._m[pos:pos + 16] = _PACK(self._value, 0.0)

        def set(self, value: float, timestamp: float | None = None) -> None:
            self._value = value
            self._timestamp = timestamp or 0.0
            self._write()

        def set_exemplar(self, exemplar: Any) -> None:
            return   # not kept in multiprocess mode (as in prometheus-client)

        def get(self) -> float:
            return self._value

        def get_exemplar(self) -> None:
            return None

    return FastMmapedValue


def install() -> bool:
    """Use :class:`FastMmapedValue` for every prometheus value made from now on in this
    process, when ``PROMETHEUS_MULTIPROC_DIR`` is set; returns whether it was installed.
    Call it before :mod:`motor.coordinator.metrics` is imported; when this process has a
    file in the directory already (some value was made with the library's class) nothing
    is installed, since two objects placing keys in one file would overwrite each other's."""
    d = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not d:
        return False
    pid = os.getpid()
    try:
        if any(f.endswith(f"_{pid}.db") for f in os.listdir(d)):
            # some value was made already, with the library's own file object: two
            # objects placing keys in one file would overwrite each other's
            return False
    except OSError:
        return False
    values.ValueClass = fast_value_class(d, pid)
    return True


def install_in_process() -> bool:
    """One process (no ``PROMETHEUS_MULTIPROC_DIR``): make every prometheus value from now
    on a :class:`motor._fast.metricvalue.LocalValue` (no lock, module docstring) instead of
    the library's ``MutexValue``; returns whether it was installed (not in multiprocess
    mode, not without the extension, not over another class someone installed)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") or _metricvalue is None:
        return False
    if values.ValueClass is _metricvalue.LocalValue:
        return True
    if values.ValueClass is not values.MutexValue:
        return False
    values.ValueClass = _metricvalue.LocalValue
    return True


__all__ = ["fast_value_class", "install", "install_in_process"]
