"""One two-site cluster (network namespaces, a shaped veth link, a Ray node in each) for every lab
test that needs one: bringing it up and down costs about 16 s, so the cluster tool's tests and the
multi-site runs share it. Site A has one node, site B two, each node 2 CPUs; the A-B link is
shaped to 200 mbit/s and measured once at start."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def two_sites():
    from streamrl.lab import cluster as C

    why = C.unavailable()
    if why:
        pytest.skip(f"no multi-site cluster here: {why}")
    name = f"t{os.getpid() % 1000}"
    specs = C.parse_sites("A:1,B:2")
    cl = C.up(specs, C.parse_links("A-B:200mbit", specs), name=name, cpus_per_node=2)
    try:
        yield cl
    finally:
        C.down(name, cl.root)
