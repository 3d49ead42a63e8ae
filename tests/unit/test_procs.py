"""motor.procs.die_with_parent: the child goes when the process that started it dies."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

PARENT = """
import signal, subprocess, sys
from motor.procs import die_with_parent
c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                     preexec_fn=die_with_parent(signal.SIGKILL, new_session={new_session}))
print(c.pid, flush=True)
sys.stdin.read()   # until the test kills us
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (reaped by init later) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
@pytest.mark.parametrize("new_session", [False, True])
def test_child_killed_when_parent_dies(new_session: bool) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(new_session=new_session)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              start_new_session=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
        if new_session:
            assert os.getsid(child) == child != os.getsid(parent.pid)
        else:
            assert os.getsid(child) == os.getsid(parent.pid)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(child)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        for pipe in (parent.stdin, parent.stdout):
            if pipe is not None:
                pipe.close()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)
