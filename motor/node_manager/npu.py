"""NPU sampling with Ascend's ``npu-smi``: health, temperature, power, memory, AI-core use per chip.

Commands (each run with a timeout; a hung ``npu-smi`` is killed):

* ``npu-smi info``: the status table, two lines per chip::

    | NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
    | Chip [Phy-ID|Device]      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
    | 0     910B3               | OK            | 94.3        53                0    / 0             |
    | 0                         | 0000:C1:00.0  | 0           0    / 0          4487 / 65536         |

  910B has no second column under ``Chip``; A3 (``Ascend910``, two dies per card) has
  ``Phy-ID`` and shows Power ``-`` on the second die; 310P has ``Device`` and no HBM column
  (its ``Memory-Usage`` is the device memory). ``NA`` / ``-`` values are None. The process
  table that follows is ignored.
* ``npu-smi info -t usages -i <card>``: ``Key : Value`` lines per chip of the card, each
  chip's block ending with ``Chip ID``; motor reads ``Aicore Usage Rate(%)`` (and the HBM
  rates) from it. This is the AI-core query of the virtual-inference busy check.

Device numbering: a chip's *device* id (what ``ASCEND_RT_VISIBLE_DEVICES`` names) is the
``Device`` column where there is one (310P), else ``Phy-ID`` (A3), else its position in the
table (910B: one chip per card, cards in order). No ``npu-smi`` on the machine = the feature
is off, logged once.
"""
from __future__ import annotations

import asyncio
import logging
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from motor.aio import cancel_and_wait
from motor.config.schema import NpuConfig

logger = logging.getLogger(__name__)

_PAIR = re.compile(r"(\d+)\s*/\s*(\d+)")


@dataclass
class ChipInfo:
    """One chip (die) as ``npu-smi info`` shows it."""
    npu: int                         #: card id (``-i``)
    chip: int                        #: chip on the card
    device: int                      #: logical device id (see the module doc)
    name: str = ""
    health: str = ""
    bus_id: str = ""
    power_w: float | None = None
    temp_c: float | None = None
    aicore_pct: float | None = None
    hbm_used_mb: int | None = None
    hbm_total_mb: int | None = None
    memory_used_mb: int | None = None    #: DDR (910B/A3: 0 / 0) or the device memory (310P)
    memory_total_mb: int | None = None

    @property
    def healthy(self) -> bool:
        return self.health.upper() == "OK"

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class ChipUsage:
    """One chip's block of ``npu-smi info -t usages -i <card>``."""
    npu: int
    chip: int
    aicore_pct: float | None = None
    hbm_usage_pct: float | None = None
    hbm_capacity_mb: int | None = None
    raw: dict[str, str] = field(default_factory=dict)


def _num(s: str) -> float | None:
    s = s.strip()
    try:
        return float(s)
    except ValueError:
        return None  # NA, -, empty


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_info(text: str) -> list[ChipInfo]:
    """Chips of an ``npu-smi info`` table, in table order (see the module doc)."""
    chips: list[ChipInfo] = []
    second_col = ""          # "", "phy-id" or "device": what follows Chip in the 2nd header line
    pending: list[str] | None = None  # the first line of a chip, waiting for its second
    for line in text.splitlines():
        s = line.strip()
        if not s.startswith("|"):
            pending = None  # a separator: a chip's two lines are adjacent
            continue
        cells = _cells(s)
        if len(cells) < 3:
            continue
        head = cells[0].split()
        if head[:2] == ["NPU", "Name"]:
            continue
        if head and head[0] == "Chip":
            second_col = head[1].lower() if len(head) > 1 else ""
            continue
        if head[:2] == ["NPU", "Chip"] or "Process id" in s:
            break  # the process table: done
        if not head or not head[0].isdigit():
            continue
        if pending is None:
            if len(head) >= 2 and not head[1].isdigit():
                pending = cells
            continue
        # second line of a chip
        first, pending = pending, None
        try:
            npu = int(first[0].split()[0])
            chip = int(head[0])
        except ValueError:
            continue
        extra = int(head[1]) if len(head) > 1 and head[1].isdigit() else None
        info = ChipInfo(npu=npu, chip=chip, device=len(chips),
                        name=" ".join(first[0].split()[1:]), health=first[1], bus_id=cells[1])
        if extra is not None and second_col in ("device", "phy-id"):
            info.device = extra
        t = first[2].split()
        if len(t) >= 2:
            info.power_w, info.temp_c = _num(t[0]), _num(t[1])
        stats = cells[2]
        info.aicore_pct = _num(stats.split()[0]) if stats.split() else None
        pairs = [(int(a), int(b)) for a, b in _PAIR.findall(stats)]
        if pairs:
            info.memory_used_mb, info.memory_total_mb = pairs[0]
        if len(pairs) > 1:
            info.hbm_used_mb, info.hbm_total_mb = pairs[1]
        chips.append(info)
    return chips


def parse_usages(text: str, npu: int | None = None) -> list[ChipUsage]:
    """Per-chip blocks of ``npu-smi info -t usages -i <card>`` (each block ends with ``Chip ID``)."""
    out: list[ChipUsage] = []
    cur: dict[str, str] = {}
    card = npu
    for line in text.splitlines():
        if ":" not in line:
            continue
        k, _, v = line.partition(":")
        k, v = k.strip(), v.strip()
        if k == "NPU ID":
            card = int(v) if v.isdigit() else card
            continue
        cur[k] = v
        if k == "Chip ID":
            u = ChipUsage(npu=card if card is not None else -1,
                          chip=int(v) if v.isdigit() else len(out), raw=cur)
            u.aicore_pct = _num(cur.get("Aicore Usage Rate(%)", ""))
            u.hbm_usage_pct = _num(cur.get("HBM Usage Rate(%)", ""))
            cap = _num(cur.get("HBM Capacity(MB)", ""))
            u.hbm_capacity_mb = int(cap) if cap is not None else None
            out.append(u)
            cur = {}
    return out


def parse_watch(text: str) -> list[dict[str, float | int | None]]:
    """Rows of ``npu-smi info watch`` (``NpuID ChipId Pwr Temp AICore AICpu CtrlCpu Mem MemBW``)."""
    keys = ("npu", "chip", "power_w", "temp_c", "aicore_pct", "aicpu_pct", "ctrlcpu_pct",
            "memory_pct", "memory_bw_pct")
    rows = []
    for line in text.splitlines():
        t = line.split()
        if len(t) != len(keys) or not t[0].isdigit():
            continue
        row: dict[str, float | int | None] = {}
        for k, v in zip(keys, t):
            row[k] = int(v) if k in ("npu", "chip") else _num(v)
        rows.append(row)
    return rows


def visible_devices(env: dict[str, str], var: str = "ASCEND_RT_VISIBLE_DEVICES") -> list[int] | None:
    """Device ids named by ``var`` in ``env`` (None: not set, i.e. all devices)."""
    v = env.get(var)
    if v is None:
        return None
    out = []
    for part in v.split(","):
        part = part.strip()
        if part.isdigit():
            out.append(int(part))
    return out



async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Kill ``proc`` if it still runs, then read its pipes to their end and wait for it:
    its pipe transports are closed when this returns (``wait`` alone may leave them open
    until the loop next reads, and a loop closed before that fails to close)."""
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    await proc.communicate()

class NpuMonitor:
    """Samples ``npu-smi`` for one node: periodic ``info``, on-demand AI-core use.

    ``enabled`` is False when ``npu-smi`` is missing (or the config turns it off); every
    method then returns at once with nothing. ``chips`` is the last successful ``info``.
    """

    def __init__(self, cfg: NpuConfig | None = None, min_query_interval_s: float = 0.4) -> None:
        self.cfg = cfg or NpuConfig()
        self.smi: str | None = None
        if self.cfg.enabled is not False:
            self.smi = shutil.which(self.cfg.smi_path)
        self.chips: list[ChipInfo] = []
        self.sampled_at: float | None = None     #: monotonic time of ``chips``
        self.last_error: str | None = None
        self.errors = 0
        self.min_query_interval_s = min_query_interval_s
        self._usage: dict[int, tuple[float, list[ChipUsage]]] = {}
        self._usage_locks: dict[int, asyncio.Lock] = {}
        self._info_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._announced = False

    @property
    def enabled(self) -> bool:
        return self.smi is not None

    def announce(self) -> None:
        """Say once in the log whether sampling is on."""
        if self._announced:
            return
        self._announced = True
        if self.enabled:
            logger.info("NPU sampling on: %s every %g s", self.smi, self.cfg.interval_s)
        elif self.cfg.enabled is False:
            logger.info("NPU sampling off (npu.enabled: false)")
        elif self.cfg.enabled:
            logger.error("NPU sampling: %r not found on PATH: NPU sampling off", self.cfg.smi_path)
        else:
            logger.info("no %r on this machine: NPU sampling off", self.cfg.smi_path)

    # -------------------------------------------------------------- commands
    async def run_smi(self, *args: str) -> str:
        """Run ``npu-smi args`` with ``timeout_s``; returns stdout; raises on failure."""
        assert self.smi is not None
        start = asyncio.ensure_future(asyncio.create_subprocess_exec(
            self.smi, *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE))
        try:
            proc = await asyncio.shield(start)
        except BaseException:
            # cancelled while the process was starting (a node manager stopping): it may
            # start all the same; reap it, so that none of its pipes outlives the loop
            try:
                await _reap(await start)
            except Exception:  # noqa: BLE001 - it did not start: nothing to reap
                pass
            raise
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.cfg.timeout_s)
        except BaseException:
            await _reap(proc)
            raise
        if proc.returncode != 0:
            msg = (err or out).decode("utf-8", "replace").strip().splitlines()
            raise RuntimeError(f"npu-smi {' '.join(args)} exited with status {proc.returncode}"
                               + (f": {msg[-1]}" if msg else ""))
        return out.decode("utf-8", "replace")

    def _failed(self, what: str, e: BaseException) -> None:
        msg = f"no answer within {self.cfg.timeout_s:g} s" if isinstance(
            e, (asyncio.TimeoutError, TimeoutError)) else str(e) or type(e).__name__
        if self.last_error is None:
            logger.warning("npu-smi %s failed: %s (logged again only after a success)", what, msg)
        self.last_error = msg
        self.errors += 1

    def _ok(self) -> None:
        if self.last_error is not None:
            logger.info("npu-smi answers again")
        self.last_error = None

    async def sample_info(self) -> list[ChipInfo]:
        """Run ``npu-smi info`` and keep the result in :attr:`chips` (empty list on failure)."""
        if not self.enabled:
            return []
        async with self._info_lock:
            try:
                chips = parse_info(await self.run_smi("info"))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._failed("info", e)
                return []
            self._ok()
            self.chips, self.sampled_at = chips, time.monotonic()
            return chips

    async def card_usage(self, npu: int) -> list[ChipUsage]:
        """``npu-smi info -t usages -i npu``; callers within ``min_query_interval_s`` share one run."""
        lock = self._usage_locks.setdefault(npu, asyncio.Lock())
        async with lock:
            hit = self._usage.get(npu)
            if hit is not None and time.monotonic() - hit[0] < self.min_query_interval_s:
                return hit[1]
            try:
                usage = parse_usages(await self.run_smi("info", "-t", "usages", "-i", str(npu)), npu)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._failed("info -t usages", e)
                return []
            self._ok()
            self._usage[npu] = (time.monotonic(), usage)
            return usage

    async def aicore_pct(self, devices: Iterable[int] | None = None) -> float | None:
        """Highest AI-core use (%) over ``devices`` (None = every chip) right now; None = unknown."""
        if not self.enabled:
            return None
        chips = self.chips or await self.sample_info()
        if not chips:
            return None
        want = None if devices is None else set(devices)
        sel = [c for c in chips if want is None or c.device in want]
        if not sel:
            return None
        best: float | None = None
        for card in sorted({c.npu for c in sel}):
            usage = {u.chip: u for u in await self.card_usage(card)}
            for c in sel:
                if c.npu != card:
                    continue
                u = usage.get(c.chip)
                v = u.aicore_pct if u is not None else None
                if v is not None and (best is None or v > best):
                    best = v
        return best

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self.announce()
        if self.enabled and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="npu sampling")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await self.sample_info()
            await asyncio.sleep(self.cfg.interval_s)

    def snapshot(self) -> list[dict[str, object]]:
        """The last sample, one dict per chip (heartbeats, management API)."""
        return [c.as_dict() for c in self.chips]

