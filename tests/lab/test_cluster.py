"""The multi-site cluster tool: specs parsed strictly; a real cluster (network namespaces, shaped
veth links, a Ray node in each) comes up, is labelled by site, and goes down leaving nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from streamrl.lab import cluster as C


def test_sites_and_links_parse_and_bad_specs_name_the_bad_part():
    sites = C.parse_sites("A:1,B:2:H20")
    assert [(s.name, s.nodes, s.gpu_type) for s in sites] == [("A", 1, None), ("B", 2, "H20")]
    assert C.parse_links("A-B:200mbit", sites)[0].rate_bytes_per_s == 25e6
    for bad, word in [("A:x", "'x'"), ("A:1,A:2", "twice"), ("", "empty"), ("A:0", "1-16")]:
        with pytest.raises(C.ClusterError, match=word):
            C.parse_sites(bad)
    for bad, word in [("A-C:1gbit", "'C'"), ("A-B:fast", "'fast'"), ("", "unconnected"), ("A-A:1mbit", "itself")]:
        with pytest.raises(C.ClusterError, match=word):
            C.parse_links(bad, sites)


def _procs_with(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line]


@pytest.mark.slow
def test_the_cluster_comes_up_labelled_by_site_and_its_link_is_shaped(two_sites):  # tests/lab/conftest.py
    cl = two_sites
    assert [(n.name, n.site) for n in cl.nodes] == [("A0", "A"), ("B0", "B"), ("B1", "B")]
    script = ("import ray, json; ray.init(address='auto', logging_level='ERROR'); "
              "print(json.dumps(sorted(k for n in ray.nodes() if n['Alive'] for k in n['Resources'] "
              "if k.startswith(('site_', 'node_')))))")
    out = subprocess.run(cl.exec_argv([sys.executable, "-c", script]), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == '["node_A0", "node_B0", "node_B1", "site_A", "site_B", "site_B"]'
    link = cl.link("A", "B")
    assert link.measured_bytes_per_s is not None and link.measured_bytes_per_s <= 1.15 * C.link_rate(link)
    before = cl.link_bytes("A", "B")["A->B"]
    C.measure_link(cl, link, megabytes=4)
    assert cl.link_bytes("A", "B")["A->B"] - before >= 4 * 2**20  # the counters see what crossed


@pytest.mark.slow
def test_down_leaves_no_namespace_link_or_process_even_for_a_half_built_cluster():
    why = C.unavailable()
    if why:
        pytest.skip(f"no multi-site cluster here: {why}")
    name = f"h{os.getpid() % 1000}"
    sites = C.parse_sites("A:1,B:1")
    with pytest.raises(C.ClusterError):  # tc refuses this rate: up fails midway and cleans up
        C.up(sites, [C.LinkSpec("A", "B", "0bit")], name=name, measure=False)
    assert not C._leftovers(name)
    cl = C.up(sites, C.parse_links("A-B:1gbit", sites), name=name, measure=False)
    try:
        assert _procs_with(cl.root)  # Ray nodes run with their temp dir under the cluster's root
    finally:
        removed = C.down(name, cl.root)
    assert removed["netns"] == 2 and not C._leftovers(name)
    assert not _procs_with(cl.root) and not os.path.exists(cl.root)
