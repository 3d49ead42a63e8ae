"""``motor up``'s view of a config (motor/cluster.py): the engine endpoints it waits for and
the ports it checks before starting, for instances on one node and spanning nodes."""
from __future__ import annotations

from motor.cluster import Cluster
from motor.config.schema import ClusterConfig

SPAN = {"nodes": ["n1", "n2"], "dp_size_local": 2, "master_address": "127.0.0.1"}


def _cfg() -> ClusterConfig:
    big = {"name": "big", "kind": "sim", "model": "m", "count": 1, "dp_size": 4,
           "base_port": 20000, "span": SPAN}
    return ClusterConfig.model_validate({"nodes": [
        {"name": "n1", "platform": "cpu", "engines": [big, {
            "name": "small", "kind": "sim", "model": "m", "count": 2, "base_port": 21000}]},
        {"name": "n2", "platform": "cpu", "engines": [big]}]})


def test_a_spanning_instance_has_one_endpoint_on_its_master_node() -> None:
    c = Cluster(_cfg())
    assert c.endpoints_wanted == 1 + 2     # the DP master's API server + the two small ones


def test_busy_ports_checks_only_the_ports_that_open() -> None:
    """Ports base+1..base+3 of the spanning group never open (one API server on the master):
    something listening there is not reported; something on base is."""
    import socket

    from tests.support.procs import free_ports
    base = free_ports(4, consecutive=True)[0]
    cfg = _cfg()
    for n in cfg.nodes:
        n.engines[0].base_port = base
    cfg.nodes[0].engines[1].base_port = free_ports(2, consecutive=True)[0]
    with socket.socket() as other:
        other.bind(("127.0.0.1", base + 1))
        other.listen()
        assert Cluster(cfg).busy_ports() == []
    with socket.socket() as master:
        master.bind(("127.0.0.1", base))
        master.listen()
        assert Cluster(cfg).busy_ports() == [f"nodes[0].engines[0].base_port = {base} on "
                                             f"127.0.0.1"]
