"""Every vLLM argv motor generates is accepted by the real ``vllm serve`` argument parser of
the vLLM CPU venv (parse only, no engine started): union (one rank, DP ranks with external
load balancing), PD prefill / decode (NixlConnector on cuda / cpu nodes, the vLLM-Ascend
Mooncake connectors on ascend nodes), and an instance spanning nodes (DP master and headless
node, issue 16), so a flag renamed upstream fails CI instead of a deployment.

The parser is built as ``vllm serve`` builds it (``vllm/entrypoints/cli/main.py``: a
``FlexibleArgumentParser`` with the ``serve`` subcommand of
``vllm.entrypoints.cli.serve.ServeSubcommand``), then ``ServeSubcommand.validate`` and
``AsyncEngineArgs.from_cli_args`` run on the parsed namespace (what ``vllm serve`` does before
it starts anything). The venv: ``${MOTOR_VLLM_VENV:-~/.cache/motor/venv-vllm}`` (.ci/run's
real-engine lane); skipped without it unless ``MOTOR_REQUIRE_REAL_ENGINE=1``.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from motor.config import parse_config
from motor.node_manager.engines import plan_node
from tests.integration.test_real_vllm import vllm_python

pytestmark = pytest.mark.real_engine

#: run in the vLLM venv: parse each argv (``serve`` + flags) and report the errors
PARSE = r'''
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

cmd = ServeSubcommand()
parser = FlexibleArgumentParser(description="vLLM CLI")
sub = parser.add_subparsers(required=False, dest="subparser")
cmd.subparser_init(sub)
out = {}
for name, argv in json.load(open(sys.argv[1])).items():
    try:
        args = parser.parse_args(argv)
        cmd.validate(args)
        AsyncEngineArgs.from_cli_args(args)
        out[name] = None
    except SystemExit as e:
        out[name] = f"the parser exited with {e.code}"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
json.dump(out, open(sys.argv[2], "w"))
'''


def _vllm(kind: str = "vllm", **kw: Any) -> dict[str, Any]:
    return {"kind": kind, "model": "/models/tiny", "served_model_name": "tiny", **kw}


def argvs() -> dict[str, list[str]]:
    """Every argv shape motor's planner gives a vLLM engine, by name."""
    span = {"nodes": ["m1", "m2"], "dp_size_local": 2, "master_port": 13345}
    configs = {
        "union": ("union", [{"name": "n", "platform": "cpu", "engines": [
            _vllm(name="one"), _vllm(name="dp", dp_size=2, base_port=18200,
                                     engine_config={"max_model_len": 512})]}]),
        "pd-nixl": ("pd_prefill_first", [{"name": "n", "platform": "cuda", "engines": [
            _vllm(name="p", role="prefill"), _vllm(name="d", role="decode", base_port=18200)]}]),
        "pd-ascend-v1": ("pd_prefill_first", [{"name": "n", "platform": "ascend",
                                               "host": "10.0.0.1", "engines": [
            _vllm(name="p", role="prefill", tp_size=2),
            _vllm(name="d", role="decode", dp_size=2, base_port=18200)]}]),
        "pd-ascend-layerwise": ("pd_decode_first", [{"name": "n", "platform": "ascend",
                                                     "engines": [
            _vllm(name="p", role="prefill"), _vllm(name="d", role="decode", base_port=18200)]}]),
        "multinode": ("union", [
            {"name": f"m{i}", "host": f"10.0.0.{i}", "platform": "cuda", "engines": [
                _vllm(name="big", dp_size=4, host=f"10.0.0.{i}", span=span,
                      engine_config={"enable_expert_parallel": True})]} for i in (1, 2)]),
    }
    out: dict[str, list[str]] = {}
    for name, (mode, nodes) in configs.items():
        cfg = parse_config({"coordinator": {"mode": mode}, "nodes": nodes})
        for node in cfg.nodes:
            for plan in plan_node(node, cfg):
                for proc in plan.processes:
                    assert proc.argv[:2] == ["vllm", "serve"], proc.argv
                    out[f"{name}: {proc.name}"] = ["serve", *proc.argv[2:]]
    return out


def test_every_vllm_argv_parses_with_the_real_parser(tmp_path: Path) -> None:
    py = vllm_python()
    if py is None:
        if os.environ.get("MOTOR_REQUIRE_REAL_ENGINE") == "1":
            pytest.fail("MOTOR_REQUIRE_REAL_ENGINE=1 but no vLLM venv (MOTOR_VLLM_VENV)")
        pytest.skip("no vLLM CPU venv (MOTOR_VLLM_VENV, ~/.cache/motor/venv-vllm)")
    cases = argvs()
    headless = [a for a in cases.values() if "--headless" in a]
    assert len(headless) == 1 and "--data-parallel-start-rank" in headless[0]
    (tmp_path / "parse.py").write_text(PARSE)
    (tmp_path / "argv.json").write_text(json.dumps(cases))
    r = subprocess.run([py, str(tmp_path / "parse.py"), str(tmp_path / "argv.json"),
                        str(tmp_path / "out.json")], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path,
                       env=dict(os.environ, VLLM_LOGGING_LEVEL="WARNING"))
    assert r.returncode == 0, r.stderr[-3000:]
    errors = {k: v for k, v in json.loads((tmp_path / "out.json").read_text()).items() if v}
    assert errors == {}, "\n".join(f"{k}: {v}\n  argv: {cases[k]}" for k, v in errors.items())
    assert set(json.loads((tmp_path / "out.json").read_text())) == set(cases)
