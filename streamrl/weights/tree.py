"""Who sends each receiver its copy of the weights: the broadcast tree (pure, no Ray).

``plan_tree(source, receivers, method)`` returns, for every receiver, its parent: ``None`` for
the publisher (the trainer), else the name of a receiver that already holds the version and
re-publishes its local copy (a relay). ``naive``: every receiver fetches from the publisher;
``tree`` (PAPER.md §3.5, the default): one copy per node and one per remote site over the slow
link (``plan_tree``). Invariants: receivers are served in the order of ``levels(parents)``, a
parent before its children; ``crossings`` counts the copies a plan sends across sites.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("naive", "tree")


@dataclass(frozen=True)
class Location:
    """Where a process runs: its Ray node and that node's site (``""`` when unlabelled)."""

    node: str
    """A node label (``A0``) or Ray node id: equal for processes on one node."""
    site: str = ""


def plan_tree(source: Location, receivers: dict[str, Location], method: str = "tree",
              fanout: int = 2) -> dict[str, str | None]:
    """``{receiver: parent}`` (``None`` = the publisher).

    - ``naive``: every receiver fetches from the publisher: one copy per receiver crosses the
      link to its site.
    - ``tree``: per node, one *leader* (the first receiver there by name) fetches and the node's
      other receivers read the leader's copy (same node: shared memory, no network). Per remote
      site, one leader is the site's *relay*: the only one that fetches from the publisher, so
      one copy crosses the slow link per site. The site's other leaders form a ``fanout``-ary
      tree under the relay (leader k's parent is leader (k-1) // fanout), so no single sender
      carries every copy; in the publisher's own site the publisher is the tree's root.
    """
    if method not in METHODS:
        raise ValueError(f"weight transfer method {method!r}: choose one of {', '.join(METHODS)}")
    if fanout < 1:
        raise ValueError(f"fanout must be >= 1, got {fanout}")
    if method == "naive":
        return {name: None for name in receivers}
    parents: dict[str, str | None] = {}
    leaders: dict[str, str] = {}  # node -> its leader
    for name in sorted(receivers):
        node = receivers[name].node
        if node in leaders:
            parents[name] = leaders[node]
        elif node == source.node:  # the publisher's node: its copy is local already
            parents[name] = None
        else:
            leaders[node] = name
    by_site: dict[str, list[str]] = {}
    for node, leader in sorted(leaders.items(), key=lambda kv: kv[1]):
        by_site.setdefault(receivers[leader].site, []).append(leader)
    for site, names in by_site.items():
        if site == source.site:  # the publisher roots this site's tree: position 0 is the publisher
            chain: list[str | None] = [None, *names]
        else:  # the relay (first leader) fetches from the publisher, the rest hang below it
            chain = list(names)
            parents[names[0]] = None
        for k in range(1, len(chain)):
            parents[chain[k]] = chain[(k - 1) // fanout]
    return parents


def levels(parents: dict[str, str | None]) -> list[list[str]]:
    """Receivers grouped by depth (those fed by the publisher first); raises on a cycle."""
    depth: dict[str, int] = {}

    def d(name: str, seen: tuple = ()) -> int:
        if name in depth:
            return depth[name]
        if name in seen:
            raise ValueError(f"weight tree has a cycle through {name!r}")
        parent = parents[name]
        depth[name] = 0 if parent is None else d(parent, seen + (name,)) + 1
        return depth[name]

    for name in parents:
        d(name)
    out: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for name in sorted(parents):
        out[depth[name]].append(name)
    return out


def crossings(parents: dict[str, str | None], source: Location, receivers: dict[str, Location]) -> dict[str, int]:
    """Copies that cross each site boundary (``"A->B": 1``): the plan's slow-link traffic."""
    out: dict[str, int] = {}
    for name, parent in parents.items():
        src = source if parent is None else receivers[parent]
        dst = receivers[name]
        if src.site != dst.site:
            key = f"{src.site}->{dst.site}"
            out[key] = out.get(key, 0) + 1
    return out
