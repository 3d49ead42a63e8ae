"""The .pyi stubs of motor._fast type-check with mypy and name exactly the compiled public API."""
from __future__ import annotations

import ast
import glob
import importlib
import os

import pytest

FAST = os.path.join(os.path.dirname(__file__), "..", "..", "..", "motor", "_fast")
STUBS = sorted(glob.glob(os.path.join(FAST, "*.pyi")))


def test_stubs_exist_for_every_module():
    pyx = {os.path.basename(p)[:-4] for p in glob.glob(os.path.join(FAST, "*.pyx"))}
    assert pyx and pyx == {os.path.basename(p)[:-4] for p in STUBS}


def test_stubs_typecheck_with_mypy():
    api = pytest.importorskip("mypy.api")
    out, err, status = api.run(["--no-incremental", "--cache-dir", os.devnull, *STUBS])
    assert status == 0, out + err


@pytest.mark.parametrize("stub", STUBS, ids=os.path.basename)
def test_stub_names_exist_in_compiled_module(stub):
    mod = importlib.import_module("motor._fast." + os.path.basename(stub)[:-4])
    tree = ast.parse(open(stub).read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    public = {n for n in names if not n.startswith("_")}
    missing = [n for n in public if not hasattr(mod, n)]
    assert not missing, f"stub names missing in the compiled module: {missing}"
