"""The counted-cost gate catches a slower build (``bench/cost_gate.py``).

A copy of ``motor/_fast/hashing.c`` compiled without optimisation (``-O0``) stands in for a
change that made block hashing slower; the gate, run on it against a baseline measured on
the installed build a moment before, must fail and name the figure. Needs valgrind; skipped
without it unless ``MOTOR_REQUIRE_VALGRIND=1`` (CI), where a missing valgrind fails.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

if shutil.which("valgrind") is None:
    if os.environ.get("MOTOR_REQUIRE_VALGRIND") == "1":
        raise RuntimeError("valgrind is required (MOTOR_REQUIRE_VALGRIND=1): apt-get install valgrind")
    pytest.skip("valgrind not installed (Debian package valgrind)", allow_module_level=True)


def _gate():
    spec = importlib.util.spec_from_file_location("cost_gate", HERE / "cost_gate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _slow_hashing(out_dir: Path) -> Path:
    """motor._fast.hashing compiled at -O0 from the C file the build generated."""
    src = ROOT / "motor" / "_fast" / "hashing.c"
    assert src.exists(), f"{src} is made by the build (pip install -e .)"
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    so = out_dir / f"hashing{suffix}"
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    cmd = cc + ["-O0", "-shared", "-fPIC", "-w", f"-I{sysconfig.get_paths()['include']}",
                f"-I{np.get_include()}", f"-I{ROOT / 'motor' / '_fast'}", "-DMOTOR_DEBUG=0",
                "-DNPY_NO_DEPRECATED_API=NPY_1_7_API_VERSION", str(src), "-o", str(so)]
    subprocess.run(cmd, check=True, timeout=300)
    return so


def test_gate_fails_on_a_slower_build(tmp_path, capsys):
    gate = _gate()
    baseline = tmp_path / "baseline.json"
    assert gate.main(["--only", "hashing", "--update", "--baseline", str(baseline)]) == 0
    base = json.loads(baseline.read_text())["figures"]["hashing.block_hashes"]
    assert base > 100_000                          # 32768 tokens hashed: not an empty count
    # the same build again: the count is exact, the gate passes
    assert gate.main(["--only", "hashing", "--baseline", str(baseline)]) == 0
    capsys.readouterr()
    fast_dir = tmp_path / "slow"
    fast_dir.mkdir()
    _slow_hashing(fast_dir)
    status = gate.main(["--only", "hashing", "--baseline", str(baseline),
                        "--fast-dir", str(fast_dir), "--json", str(tmp_path / "now.json")])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "hashing.block_hashes" in out and "<- grew" in out
    assert "1 figure(s) grew by more than 5 %" in out
    slow = json.loads((tmp_path / "now.json").read_text())["hashing.block_hashes"]
    assert slow > base * 1.05


def test_table_marks_growth_and_new_figures():
    gate = _gate()
    text, grew = gate.table({"a": 100, "b": 100, "c": 100}, {"a": 106, "b": 104, "c": 90,
                                                             "d": 5}, 5.0)
    assert grew == ["a"]
    lines = {ln.split()[0]: ln for ln in text.splitlines()[1:]}
    assert "+6.0%" in lines["a"] and "<- grew" in lines["a"]
    assert "+4.0%" in lines["b"] and "grew" not in lines["b"]
    assert "-10.0%" in lines["c"] and "--update" in lines["c"]
    assert lines["d"].split()[-1] == "new"


def test_usage_errors_exit_2():
    r = subprocess.run([sys.executable, str(HERE / "cost_gate.py"), "--only", "nothing"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--only matches no figure" in r.stderr
