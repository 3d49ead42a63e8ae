"""Producer process for tests/unit/_fast/test_ring.py.

Run with ``runpy.run_path(__file__, init_globals=..., run_name="__ring_worker__")`` as a
multiprocessing (spawn) target, so the child does not need to import the test package.
Globals: NAME, N, LOSSLESS, START (Event), SEED.
"""
import random
import struct
import time
import zlib

from motor._fast.ring import RECORD_USER, Ring


def record(seq: int, size: int) -> bytes:
    """[u64 seq][u32 crc32(body)][body of `size` bytes derived from seq]."""
    body = (struct.pack("<Q", seq) * (size // 8 + 1))[:size]
    return struct.pack("<QI", seq, zlib.crc32(body)) + body


def produce(name: str, n: int, lossless: bool, start, seed: int) -> None:
    rnd = random.Random(seed)
    r = Ring.attach(name)
    start.wait(30)
    for seq in range(n):
        rec = record(seq, rnd.randrange(0, 200))
        if lossless:
            while not r.try_push(RECORD_USER, rec):
                pass
        else:
            r.push(RECORD_USER, rec)
    # The end record waits for room, so a final gap is announced before it.
    while not r.try_push(RECORD_USER + 1, b"end"):
        time.sleep(0.0005)
    r.close()


if __name__ == "__ring_worker__":
    produce(NAME, N, LOSSLESS, START, SEED)  # noqa: F821 (injected globals)
