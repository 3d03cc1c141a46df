"""A multi-site Ray cluster on one Linux host: network namespaces joined by shaped links.

Each Ray node runs in its own network namespace (``<name>-<site><i>``, e.g. ``srl-B1``) with one
veth into its site's bridge; sites' bridges are joined by a veth pair per link, shaped in both
directions. The first node of the first site is the Ray head; the driver of a run must run
inside the head's namespace (``streamrl cluster run -- CMD``, or ``Cluster.exec_argv``).

Invariants: nothing outside the namespaces can reach or be reached (one flat 10.77.0.0/16
segment, no routing, bridges without an address); a link's bytes are read from its veths'
interface counters (``link_bytes``), never computed; ``down`` removes everything with the
cluster's prefix, so a lost state file or a half-built cluster leaves nothing behind. ``up``
writes ``<root>/cluster.json``, ``load`` reads it. Needs root and ``ip netns`` (``unavailable()``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from streamrl.errors import UserError

SUBNET = "10.77"
GCS_PORT = 6379


class ClusterError(UserError):
    """A cluster spec the host cannot build, or a command that needs a cluster that is not there."""


@dataclass(frozen=True)
class SiteSpec:
    name: str
    nodes: int
    gpu_type: str | None = None


@dataclass(frozen=True)
class LinkSpec:
    a: str
    b: str
    rate: str
    """A ``tc`` rate, e.g. ``200mbit``."""

    @property
    def rate_bytes_per_s(self) -> float:
        return parse_rate(self.rate)


@dataclass
class NodeInfo:
    name: str
    """``<site><index>``: ``A0`` is the head."""
    site: str
    netns: str
    ip: str
    host_dev: str
    """The veth end in the root namespace (a port of the site's bridge)."""
    resources: dict[str, float]
    temp_dir: str


@dataclass
class LinkInfo:
    a: str
    b: str
    rate: str
    dev_a: str
    """veth end on site ``a``'s bridge: its tx counter is bytes sent from a to b."""
    dev_b: str
    measured_bytes_per_s: float | None = None


@dataclass
class Cluster:
    name: str
    root: str
    sites: list[SiteSpec]
    nodes: list[NodeInfo]
    links: list[LinkInfo]
    cpus_per_node: int
    address: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def head(self) -> NodeInfo:
        return self.nodes[0]

    def site_nodes(self, site: str) -> list[NodeInfo]:
        return [n for n in self.nodes if n.site == site]

    def link(self, a: str, b: str) -> LinkInfo:
        for link in self.links:
            if {link.a, link.b} == {a, b}:
                return link
        raise ClusterError(f"no link between sites {a} and {b} (links: "
                           f"{', '.join(f'{x.a}-{x.b}' for x in self.links) or 'none'})")

    def link_bytes(self, a: str, b: str) -> dict[str, int]:
        """Bytes that have crossed the a-b link so far, per direction, from the interface counters."""
        link = self.link(a, b)
        dev_from_a, dev_from_b = (link.dev_a, link.dev_b) if link.a == a else (link.dev_b, link.dev_a)
        return {f"{a}->{b}": _tx_bytes(dev_from_a), f"{b}->{a}": _tx_bytes(dev_from_b)}

    def exec_argv(self, argv: list[str], node: str | None = None) -> list[str]:
        """``argv`` run inside ``node``'s namespace (the head's by default), with RAY_ADDRESS set."""
        info = self.node(node) if node else self.head
        return ["ip", "netns", "exec", info.netns, "env", f"RAY_ADDRESS={self.address}", *argv]

    def node(self, name: str) -> NodeInfo:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ClusterError(f"no node {name!r} in cluster {self.name} (nodes: {', '.join(n.name for n in self.nodes)})")

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "Cluster":
        return Cluster(d["name"], d["root"], [SiteSpec(**s) for s in d["sites"]], [NodeInfo(**n) for n in d["nodes"]],
                       [LinkInfo(**x) for x in d["links"]], d["cpus_per_node"], d.get("address", ""),
                       d.get("extra", {}))

    def report(self) -> str:
        lines = [f"cluster {self.name}: Ray head {self.address} (in netns {self.head.netns}); state {self.root}/cluster.json"]
        lines.append(f"  {'node':<6} {'site':<5} {'netns':<12} {'ip':<13} resources")
        for n in self.nodes:
            res = ", ".join(f"{k}={v:g}" for k, v in sorted(n.resources.items()))
            lines.append(f"  {n.name:<6} {n.site:<5} {n.netns:<12} {n.ip:<13} {res}")
        for link in self.links:
            meas = (f"measured {link.measured_bytes_per_s * 8 / 1e6:.0f} mbit/s "
                    f"({link.measured_bytes_per_s / link_rate(link):.0%} of the limit)"
                    if link.measured_bytes_per_s else "not measured")
            lines.append(f"  link {link.a}-{link.b}: tbf {link.rate} each way ({link.dev_a} / {link.dev_b}); {meas}")
        return "\n".join(lines)


def link_rate(link: LinkInfo) -> float:
    return parse_rate(link.rate)


_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")


def parse_rate(rate: str) -> float:
    """Bytes per second of a ``tc`` rate such as ``200mbit``."""
    m = _RATE.match(rate.strip().lower())
    if not m:
        raise ClusterError(f"link rate {rate!r}: expected a number and bit|kbit|mbit|gbit, e.g. 200mbit")
    scale = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]
    return float(m.group(1)) * scale / 8


def parse_sites(text: str) -> list[SiteSpec]:
    """``A:1,B:2`` (or ``A:1:H800,B:2:H20`` with a device-type label) -> site specs."""
    sites = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        bits = part.split(":")
        if len(bits) not in (2, 3) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9]{0,2}", bits[0]):
            raise ClusterError(f"--sites entry {part!r}: expected NAME:NODES[:TYPE], NAME a letter and up to 2 more "
                               "letters or digits (e.g. A:1,B:2)")
        try:
            count = int(bits[1])
        except ValueError:
            raise ClusterError(f"--sites entry {part!r}: node count {bits[1]!r} is not an integer") from None
        if not 1 <= count <= 16:
            raise ClusterError(f"--sites entry {part!r}: node count must be 1-16, got {count}")
        sites.append(SiteSpec(bits[0], count, bits[2] if len(bits) == 3 else None))
    if not sites:
        raise ClusterError("--sites is empty: give at least one site, e.g. A:1,B:2")
    names = [s.name for s in sites]
    if len(set(names)) != len(names):
        raise ClusterError(f"--sites names a site twice: {text!r}")
    return sites


def parse_links(text: str, sites: list[SiteSpec]) -> list[LinkSpec]:
    """``A-B:200mbit[,A-C:1gbit]``; the links must join the sites into a tree (a cycle of
    bridges would loop frames)."""
    names = {s.name for s in sites}
    links = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        m = re.fullmatch(r"([A-Za-z0-9]+)-([A-Za-z0-9]+):(\S+)", part)
        if not m:
            raise ClusterError(f"--link entry {part!r}: expected SITE-SITE:RATE, e.g. A-B:200mbit")
        a, b, rate = m.groups()
        for s in (a, b):
            if s not in names:
                raise ClusterError(f"--link entry {part!r}: site {s!r} is not in --sites ({', '.join(sorted(names))})")
        if a == b:
            raise ClusterError(f"--link entry {part!r} joins a site to itself")
        parse_rate(rate)
        links.append(LinkSpec(a, b, rate))
    # A tree: |links| = |sites| - 1 and connected.
    parent = {s: s for s in names}

    def find(x):
        while parent[x] != x:
            x = parent[x]
        return x

    for link in links:
        ra, rb = find(link.a), find(link.b)
        if ra == rb:
            raise ClusterError(f"--link {link.a}-{link.b} closes a cycle; the links must form a tree")
        parent[ra] = rb
    roots = {find(s) for s in names}
    if len(roots) > 1:
        raise ClusterError(f"--link leaves sites unconnected: give a link for every site (sites {', '.join(sorted(names))})")
    return links


def unavailable() -> str | None:
    """Why a cluster cannot be built on this host (``None`` when it can)."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool!r} (iproute2) is not installed"
    probe = f"srlprobe{os.getpid() % 10000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def _tx_bytes(dev: str) -> int:
    """Bytes sent by ``dev``, a device of the host's (root) network namespace. Read from
    ``/proc/1/net/dev`` (init's namespace), so that a process inside one of the cluster's
    namespaces (a driver run with ``cluster run``) reads the same counters."""
    for line in Path("/proc/1/net/dev").read_text().splitlines()[2:]:
        name, _, rest = line.partition(":")
        if name.strip() == dev:
            return int(rest.split()[8])  # receive: 8 fields, then transmit bytes
    raise ClusterError(f"no network device {dev!r} on this host (is the cluster up?)")


def node_rx_bytes(node: NodeInfo) -> int:
    """Bytes delivered to ``node`` so far: what its host-side veth end has sent into it."""
    return _tx_bytes(node.host_dev)


def _shape(dev: str, rate: str, netns: str | None = None) -> None:
    """Shape ``dev``'s egress to ``rate`` with ``tbf`` (the token-bucket qdisc: ``netem`` is not
    needed and often absent)."""
    bps = parse_rate(rate)
    # Burst: 10 ms at the rate, at least 64 KB so that segmentation-offloaded frames pass.
    burst = max(int(bps / 100), 65536)
    pre = ["ip", "netns", "exec", netns] if netns else []
    _sh(*pre, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
        "latency", "200ms")


def _ray_bin() -> str:
    ray = Path(sys.executable).with_name("ray")
    return str(ray) if ray.exists() else (shutil.which("ray") or "ray")


def up(sites: list[SiteSpec], links: list[LinkSpec], name: str = "srl", cpus_per_node: int = 1,
       object_store_mb: int = 512, measure: bool = True, root: str | None = None) -> Cluster:
    """Build the namespaces, bridges and shaped links, start a Ray node in every namespace, wait
    until the head sees them all, and measure each link. On any failure everything built so far
    is removed before the error propagates."""
    why = unavailable()
    if why:
        raise ClusterError(f"cannot build a cluster here: {why}")
    if not re.fullmatch(r"[a-z][a-z0-9]{0,3}", name):
        raise ClusterError(f"cluster name {name!r}: 1-4 lowercase letters or digits, starting with a letter")
    root = root or f"/tmp/{name}-cluster"
    if Path(root, "cluster.json").exists() or _leftovers(name):
        raise ClusterError(f"cluster {name!r} is already up (or left over): `streamrl cluster down --name {name}` first")
    nodes: list[NodeInfo] = []
    link_infos: list[LinkInfo] = []
    cluster = Cluster(name, root, sites, nodes, link_infos, cpus_per_node)
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        _write_state(cluster)  # early, so that `down` finds a half-built cluster
        for si, site in enumerate(sites):
            br = f"{name}-br{site.name}"
            _sh("ip", "link", "add", br, "type", "bridge")
            _sh("ip", "link", "set", br, "up")
            for i in range(site.nodes):
                node = f"{site.name}{i}"
                ns, host_dev = f"{name}-{node}", f"{name}-{node}"
                ip = f"{SUBNET}.{si + 1}.{i + 1}"
                _sh("ip", "netns", "add", ns)
                _sh("ip", "link", "add", host_dev, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _sh("ip", "link", "set", host_dev, "master", br)
                _sh("ip", "link", "set", host_dev, "up")
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
                _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/16", "dev", "eth0")
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
                # A default route, so that Ray's own "which address is mine" probe finds eth0.
                _sh("ip", "netns", "exec", ns, "ip", "route", "add", "default", "dev", "eth0")
                # Ray custom resources: site_<S> (one per CPU, so {"site_B": 1} lands in site B),
                # node_<S><i> and, when the site names a device type, <type>, as ``placement`` uses.
                res = {f"site_{site.name}": float(cpus_per_node), f"node_{node}": 1.0}
                if site.gpu_type:
                    res[site.gpu_type] = float(cpus_per_node)
                nodes.append(NodeInfo(node, site.name, ns, ip, host_dev, res, f"{root}/{node}"))
        for link in links:
            dev_a, dev_b = f"{name}-{link.a}{link.b}", f"{name}-{link.b}{link.a}"
            _sh("ip", "link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
            for dev, site in ((dev_a, link.a), (dev_b, link.b)):
                _sh("ip", "link", "set", dev, "master", f"{name}-br{site}")
                _sh("ip", "link", "set", dev, "up")
                _shape(dev, link.rate)
            link_infos.append(LinkInfo(link.a, link.b, link.rate, dev_a, dev_b))
        _write_state(cluster)
        _wait_reachable(nodes)
        cluster.address = f"{nodes[0].ip}:{GCS_PORT}"
        for n in nodes:
            _start_ray(n, cluster, object_store_mb)
        _wait_nodes(cluster, len(nodes))
        if measure:
            for link in link_infos:
                link.measured_bytes_per_s = measure_link(cluster, link)
        _write_state(cluster)
        return cluster
    except BaseException:
        down(name, root)
        raise


def _write_state(cluster: Cluster) -> None:
    Path(cluster.root, "cluster.json").write_text(json.dumps(cluster.to_json(), indent=1))


def load(name: str = "srl", root: str | None = None) -> Cluster:
    path = Path(root or f"/tmp/{name}-cluster", "cluster.json")
    if not path.exists():
        raise ClusterError(f"no cluster {name!r} is up (no {path}): `streamrl cluster up` first")
    return Cluster.from_json(json.loads(path.read_text()))


_PROBE = """
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[1])
for ip in sys.argv[2:]:
    while True:
        try:
            socket.create_connection((ip, 9), timeout=1).close()
            break
        except ConnectionRefusedError:  # a reset came back: the node answers
            break
        except OSError:
            if time.monotonic() > deadline:
                print(ip)
                sys.exit(1)
            time.sleep(0.2)
"""


def _wait_reachable(nodes: list[NodeInfo], timeout_s: float = 20.0) -> None:
    """Every node answers a TCP probe from the head (a refused connection counts: something
    answered), so the bridges and links carry traffic before Ray starts. No ping: it is not on
    every host."""
    head = nodes[0]
    r = _sh("ip", "netns", "exec", head.netns, sys.executable, "-c", _PROBE, str(timeout_s),
            *[n.ip for n in nodes[1:]], check=False)
    if r.returncode:
        bad = r.stdout.strip() or "?"
        raise ClusterError(f"node {bad} does not answer the head ({head.ip}) within {timeout_s:g} s")


def _start_ray(n: NodeInfo, cluster: Cluster, object_store_mb: int) -> None:
    Path(n.temp_dir).mkdir(parents=True, exist_ok=True)
    argv = [_ray_bin(), "start", f"--node-ip-address={n.ip}", f"--num-cpus={cluster.cpus_per_node}",
            f"--resources={json.dumps(n.resources)}", f"--temp-dir={n.temp_dir}",
            f"--object-store-memory={object_store_mb * 1024 * 1024}", "--disable-usage-stats"]
    if n is cluster.head:
        argv += ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
    else:
        argv += [f"--address={cluster.address}"]
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run(["ip", "netns", "exec", n.netns, *argv], capture_output=True, text=True, env=env, timeout=120)
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        raise ClusterError(f"ray start on node {n.name} failed:\n{tail}")


_COUNT_NODES = ("import ray, sys; ray.init(address='auto', logging_level='ERROR'); "
                "print(sum(1 for n in ray.nodes() if n['Alive']))")


def _wait_nodes(cluster: Cluster, want: int, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    seen = 0
    while time.monotonic() < deadline:
        r = subprocess.run(cluster.exec_argv([sys.executable, "-c", _COUNT_NODES]), capture_output=True, text=True,
                           timeout=60)
        if r.returncode == 0 and r.stdout.strip().splitlines():
            seen = int(r.stdout.strip().splitlines()[-1])
            if seen >= want:
                return
        time.sleep(1.0)
    raise ClusterError(f"only {seen} of {want} Ray nodes joined within {timeout_s:.0f} s")


_RECV = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""

_SEND = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); buf = b"\\0" * (1 << 20)
for _ in range(int(sys.argv[3])): s.sendall(buf)
s.close()
"""


def measure_link(cluster: Cluster, link: LinkInfo, megabytes: int | None = None) -> float:
    """Bytes/s of one TCP stream from the first node of site ``a`` to the first of site ``b``."""
    src, dst = cluster.site_nodes(link.a)[0], cluster.site_nodes(link.b)[0]
    mb = megabytes or max(4, min(64, int(link_rate(link) * 2 / 2**20)))  # ~2 s at the limit
    port = 6999
    recv = subprocess.Popen(["ip", "netns", "exec", dst.netns, sys.executable, "-c", _RECV, dst.ip, str(port)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout is not None
        recv.stdout.readline()
        _sh("ip", "netns", "exec", src.netns, sys.executable, "-c", _SEND, dst.ip, str(port), str(mb))
        out, _ = recv.communicate(timeout=120)
        nbytes, seconds = out.split()
        return int(nbytes) / float(seconds)
    finally:
        if recv.poll() is None:
            recv.kill()


def _leftovers(name: str) -> dict[str, list[str]]:
    ns = [line.split()[0] for line in _sh("ip", "netns", "list", check=False).stdout.splitlines()
          if line.split() and line.split()[0].startswith(f"{name}-")]
    links = [d for d in os.listdir("/sys/class/net") if d.startswith(f"{name}-")]
    return {k: v for k, v in (("netns", ns), ("links", links)) if v}


def down(name: str = "srl", root: str | None = None) -> dict[str, int]:
    """Kill every process in the cluster's namespaces, delete the namespaces, veths and bridges
    with its prefix and its state directory. Returns what was removed (counts)."""
    root = root or f"/tmp/{name}-cluster"
    left = _leftovers(name)
    killed = 0
    for ns in left.get("netns", []):
        pids = [int(p) for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while _sh("ip", "netns", "pids", ns, check=False).stdout.split() and time.monotonic() < deadline:
            time.sleep(0.1)
        _sh("ip", "netns", "del", ns, check=False)
    removed_links = 0
    for dev in _leftovers(name).get("links", []):  # veth pairs go with either end; bridges last
        if _sh("ip", "link", "del", dev, check=False).returncode == 0:
            removed_links += 1
    shutil.rmtree(root, ignore_errors=True)
    return {"processes": killed, "netns": len(left.get("netns", [])), "links": removed_links}
