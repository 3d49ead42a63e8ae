from __future__ import annotations

from collections.abc import Iterator

import pytest

from .helpers import SimThread, post_json


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("sim-model"))


@pytest.fixture(scope="module")
def sim(model_dir: str) -> Iterator[SimThread]:
    """A fast simulator (time scale 0.05) with prompt-token details on."""
    with SimThread(model_dir, engine={"time_scale": 0.05}, enable_prompt_tokens_details=True) as s:
        yield s


@pytest.fixture
def sim_nofault(sim: SimThread) -> Iterator[SimThread]:
    """The module's simulator, with the fault reset to none afterwards."""
    yield sim
    status, _ = post_json(sim.port, "/admin/fault", {"mode": "none"})
    assert status == 200
