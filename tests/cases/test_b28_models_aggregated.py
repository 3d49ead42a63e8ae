"""B28: /v1/models aggregates the routable workers' models (dead ones left out until they
recover); requests route by model; an unknown model is 404."""
from __future__ import annotations

import orjson

from tests.cases.harness import FB, cluster, http, run_async, wait_for

CFG = dict(probe=True, health_check_interval_s=0.05, health_check_timeout_s=0.2, health_failures=1)


def ids(out: bytes) -> set[str]:
    o = orjson.loads(out)
    assert o["object"] == "list"
    return {m["id"] for m in o["data"]}


@run_async
async def test_models_aggregated_and_routed():
    a, b, c = FB(models=("m1",)), FB(models=("m2", "m2-alias")), FB(models=("m2",))
    a.health_status = 503
    a.models_refused = True
    async with cluster(fbs=[a, b, c], **CFG) as (fbs, gw):
        assert await wait_for(lambda: gw.probe.synced.is_set())
        for auth in ({}, {"authorization": "Bearer x"}):
            st, _, out = await http(gw.port, "GET", "/v1/models", headers=auth)
            assert st == 200 and ids(out) == {"m2", "m2-alias"}
        for _ in range(6):
            st, _, _ = await http(gw.port, "POST", "/v1/chat/completions",
                                  b'{"model":"m2-alias","messages":[{"role":"user","content":"x"}]}')
            assert st == 200
        assert len(b.log) == 6 and not a.log and not c.log
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions",
                                b'{"model":"nope","messages":[{"role":"user","content":"x"}]}')
        assert st == 404 and orjson.loads(out)["error"]["code"] == 404
        a.health_status = 200
        a.models_refused = False
        async def m1_back() -> bool:
            return True
        assert await wait_for(lambda: "m1" in gw.table.models(), 1.0)
        st, _, out = await http(gw.port, "GET", "/v1/models")
        assert ids(out) == {"m1", "m2", "m2-alias"}
