"""Placement: which node and GPUs each trainer rank and generation instance gets.

``plan_placement(cfg)`` is a pure function of the config (no Ray, no torch): it checks that the
cluster described in ``placement.nodes`` can hold the run and assigns every worker a node and GPU
indices, first fit (the order: ``plan_placement``). Invariants: a generation instance lies inside
one node and never on a GPU the trainer holds (disaggregated); each ``Bundle`` is exactly what a
live run asks Ray for (``PlacementPlan``); a plan that does not fit fails here with a
``ConfigError`` naming the key and the numbers, instead of Ray waiting forever for resources that
never come, and ``check_cluster`` fails before any actor exists when no node carries a label the
plan pins a worker to. ``streamrl train CONFIG --dry-run`` prints the plan on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from streamrl.config import Config, ConfigError


@dataclass(frozen=True)
class Bundle:
    """One worker's share of the cluster."""

    role: str
    """``trainer-rank-<r>`` or ``gen-<i>``."""
    resources: dict[str, float]
    """The Ray bundle: ``{"CPU": c, "GPU": g, "<gpu_type>": g}`` plus any pinning label. A
    heterogeneous cluster is expressed with Ray custom resources (start the H20 nodes with
    ``--resources='{"H20": 8}'``)."""
    node: str
    """Planned node, ``<gpu_type>-<index>`` (``local`` on CPU)."""
    gpus: tuple[int, ...] = ()
    """Planned GPU indices on that node."""


@dataclass(frozen=True)
class Node:
    name: str
    gpu_type: str
    gpus: int
    cpus: int


@dataclass(frozen=True)
class PlacementPlan:
    """The plan a live run follows: the trainer bundles become the placement group of
    ``trainer.fsdp.FSDPTrainerGroup``, and generation instance ``gen-<i>`` asks Ray for bundle
    ``i``'s resources as actor options (``sgs.service``)."""

    device: str
    nodes: tuple[Node, ...]
    trainer: tuple[Bundle, ...]
    trainer_strategy: str
    """Ray placement-group strategy of the trainer ranks: STRICT_PACK (one node) or PACK."""
    generation: tuple[Bundle, ...]
    notes: tuple[str, ...] = field(default=())

    def gpus_used(self) -> dict[str, int]:
        used: dict[str, int] = {}
        for b in self.trainer + self.generation:
            if not b.gpus:
                continue
            gpu_type = b.node.rsplit("-", 1)[0]
            used[gpu_type] = used.get(gpu_type, 0) + len(b.gpus)
        return used


def plan_placement(cfg: Config) -> PlacementPlan:
    """Assign every worker a node and GPUs, first fit, in this order:

    trainer: ``trainer_gpus`` FSDP2 ranks on GPUs labelled ``trainer_gpu_type`` (any type when
             unset), one node if one can hold them all (Ray strategy STRICT_PACK, NVLink), else
             packed over as few nodes as possible (PACK);
    generation: ``num_instances`` vLLM instances of ``gen_gpus_per_instance`` GPUs each, every
             instance inside one node (tensor parallelism stays on NVLink), on GPUs labelled
             ``gen_gpu_type``, never on a GPU the trainer holds.

    On CPU (``_plan_cpu``) there are no GPUs: only CPU bundles."""
    if cfg.placement.device == "cpu":
        return _plan_cpu(cfg)
    return _plan_gpu(cfg)


PIN_AMOUNT = 0.001
"""How much of a ``node_<N>`` / ``site_<S>`` label resource a pinned actor asks for: enough to
restrict where Ray may place it, too little to limit how many actors share the node. Pinning
(``placement.trainer_node`` / ``trainer_site`` / ``gen_nodes`` / ``gen_sites``) adds it to a
bundle; ``streamrl cluster up`` labels its nodes so, and ``streamrl plan --cluster`` writes such a
plan."""


def _pin(node: str | None, site: str | None) -> dict[str, float]:
    """The label resource that pins an actor to ``node``, else to ``site``, else nothing."""
    if node:
        return {f"node_{node}": PIN_AMOUNT}
    if site:
        return {f"site_{site}": PIN_AMOUNT}
    return {}


def trainer_labels(cfg: Config) -> dict[str, float]:
    """The label resources that pin the trainer (``placement.trainer_node`` / ``trainer_site``)."""
    return _pin(cfg.placement.trainer_node, cfg.placement.trainer_site)


def gen_labels(cfg: Config, index: int) -> dict[str, float]:
    """The label resources that pin generation instance ``index`` (round robin over
    ``placement.gen_nodes``, else ``gen_sites``); replacements and elastic additions continue the
    round robin."""
    nodes, sites = cfg.placement.gen_nodes, cfg.placement.gen_sites
    return _pin(nodes[index % len(nodes)] if nodes else None, sites[index % len(sites)] if sites else None)


def _where(labels: dict[str, float], default: str) -> str:
    """A bundle's planned place for display: ``A0``, ``site B`` or the default."""
    for key in labels:
        kind, _, name = key.partition("_")
        return name if kind == "node" else f"site {name}"
    return default


def check_cluster(plan: PlacementPlan, resources: dict[str, float]) -> None:
    """Fail, naming what is missing, when a pinned worker asks for a node or site label that no
    node of the running cluster carries (``resources``: ``ray.cluster_resources()``). Called
    after Ray starts and before any actor exists, so an unsatisfiable plan costs no work."""
    missing: dict[str, list[str]] = {}
    for b in plan.trainer + plan.generation:
        for key in b.resources:
            if key.startswith(("node_", "site_")) and key not in resources:
                missing.setdefault(key, []).append(b.role)
    if missing:
        have = sorted(k for k in resources if k.startswith(("node_", "site_")))
        detail = "; ".join(f"{k} (for {', '.join(v[:3])}{' ...' if len(v) > 3 else ''})" for k, v in missing.items())
        raise ConfigError(f"placement: the cluster has no node with {detail}; its labels: "
                          f"{', '.join(have) or 'none (start nodes with streamrl cluster up, or ray start --resources)'}")


def elastic_max(cfg: Config) -> int:
    """The most instances an elastic run may hold: ``generation.max_instances``, default one
    more than it starts with."""
    g = cfg.generation
    return g.max_instances if g.max_instances is not None else g.num_instances + 1


def _plan_cpu(cfg: Config) -> PlacementPlan:
    """The trainer is one bundle of ``trainer.threads`` CPUs, or with ``trainer.backend=fsdp``
    ``trainer.fsdp_ranks`` bundles of ``trainer.fsdp_rank_cpus`` each (gloo ranks; fractions let a
    2-core machine hold two ranks and an instance); each instance is one CPU bundle."""
    g, t = cfg.generation, cfg.trainer
    node = Node("local", "cpu", 0, cfg.cluster.num_cpus)
    pin = trainer_labels(cfg)
    if t.backend == "fsdp":
        trainer = tuple(Bundle(f"trainer-rank-{r}", {"CPU": float(t.fsdp_rank_cpus), **pin}, _where(pin, node.name))
                        for r in range(t.fsdp_ranks))
        trainer_desc = f"trainer.fsdp_ranks ({t.fsdp_ranks}) x trainer.fsdp_rank_cpus ({t.fsdp_rank_cpus:g})"
    else:
        trainer = (Bundle("trainer-rank-0", {"CPU": float(t.threads), **pin}, _where(pin, node.name)),)
        trainer_desc = f"trainer.threads ({t.threads})"
    count = max(g.num_instances, elastic_max(cfg)) if g.elastic else g.num_instances
    cpus = g.cpus_per_instance if g.cpus_per_instance is not None else float(g.threads_per_instance)
    labels = [gen_labels(cfg, i) for i in range(count)]
    gen = tuple(Bundle(f"gen-{i}", {"CPU": cpus, **g.resources, **pin_i}, _where(pin_i, node.name))
                for i, pin_i in enumerate(labels))
    need = sum(b.resources["CPU"] for b in trainer + gen)
    notes = []
    if cfg.mode == "colocated":
        notes.append("colocated: one worker time-shares generation and training")
        if pin or cfg.placement.gen_nodes or cfg.placement.gen_sites:
            raise ConfigError("placement.trainer_node/trainer_site/gen_nodes/gen_sites place separate trainer and "
                              f"generation workers: mode={cfg.mode!r} has one worker (use a disaggregated mode)")
    elif need > cfg.cluster.num_cpus and cfg.cluster.address is None:
        raise ConfigError(f"placement: {trainer_desc} + generation."
                          f"{'max_instances' if g.elastic else 'num_instances'} ({count}) x "
                          f"generation.{'cpus_per_instance' if g.cpus_per_instance else 'threads_per_instance'} "
                          f"({cpus:g}) = {need:g} CPUs, but "
                          f"cluster.num_cpus={cfg.cluster.num_cpus}")
    if t.backend == "fsdp":
        notes.append(f"trainer: FSDP2 over {t.fsdp_ranks} CPU ranks (gloo), placement group PACK; the trainer actor "
                     "that drives them reserves no CPU")
    return PlacementPlan("cpu", (node,), trainer, "PACK", gen, tuple(notes))


def _plan_gpu(cfg: Config) -> PlacementPlan:
    p, g = cfg.placement, cfg.generation
    if not p.nodes:
        raise ConfigError("placement.nodes is empty: describe the GPU cluster (gpu_type, nodes, gpus_per_node) "
                          "for placement.device=cuda")
    nodes = tuple(Node(f"{grp.gpu_type}-{i}", grp.gpu_type, grp.gpus_per_node, grp.cpus_per_node)
                  for grp in p.nodes for i in range(grp.nodes))
    free = {n.name: list(range(n.gpus)) for n in nodes}
    cpus_free = {n.name: n.cpus for n in nodes}

    def candidates(gpu_type: str | None) -> list[Node]:
        return [n for n in nodes if gpu_type is None or n.gpu_type == gpu_type]

    def capacity(gpu_type: str | None) -> int:
        return sum(len(free[n.name]) for n in candidates(gpu_type))

    def take(node: Node, k: int, role: str) -> Bundle:
        gpus = tuple(free[node.name][:k])
        del free[node.name][:k]
        cpus_free[node.name] -= p.cpus_per_gpu * k
        if cpus_free[node.name] < 0:
            raise ConfigError(f"placement: node {node.name} has {node.cpus} CPUs, fewer than placement.cpus_per_gpu="
                              f"{p.cpus_per_gpu} x its {node.gpus} GPUs")
        return Bundle(role, {"CPU": float(p.cpus_per_gpu * k), "GPU": float(k), node.gpu_type: float(k)}, node.name, gpus)

    # Trainer: one node if possible, else fill the emptiest nodes first.
    kind = p.trainer_gpu_type
    if capacity(kind) < p.trainer_gpus:
        raise ConfigError(f"placement: the trainer needs placement.trainer_gpus={p.trainer_gpus} GPUs of type "
                          f"{kind or 'any'}, the cluster has {capacity(kind)} ({_describe(nodes)})")
    one = [n for n in candidates(kind) if len(free[n.name]) >= p.trainer_gpus]
    trainer: list[Bundle] = []
    if one:
        node = one[0]
        trainer = [take(node, 1, f"trainer-rank-{r}") for r in range(p.trainer_gpus)]
        strategy = "STRICT_PACK"
    else:
        strategy = "PACK"
        for r in range(p.trainer_gpus):
            node = max(candidates(kind), key=lambda n: len(free[n.name]))
            trainer.append(take(node, 1, f"trainer-rank-{r}"))

    # Generation: whole instances inside one node each.
    tp, gkind = p.gen_gpus_per_instance, p.gen_gpu_type
    if not candidates(gkind):
        raise ConfigError(f"placement.gen_gpu_type={gkind!r}: no node of that type in placement.nodes ({_describe(nodes)})")
    if not any(n.gpus >= tp for n in candidates(gkind)):
        raise ConfigError(f"placement.gen_gpus_per_instance={tp} is more than any {gkind or ''} node's GPUs "
                          f"({_describe(candidates(gkind) or nodes)})")
    gen: list[Bundle] = []
    for i in range(g.num_instances):
        fits = [n for n in candidates(gkind) if len(free[n.name]) >= tp]
        if not fits:
            raise ConfigError(f"placement: generation.num_instances={g.num_instances} x placement.gen_gpus_per_instance="
                              f"{tp} GPUs of type {gkind or 'any'} do not fit beside the trainer's "
                              f"{p.trainer_gpus}: only {i} instances fit ({_describe(nodes)})")
        gen.append(take(fits[0], tp, f"gen-{i}"))
    pin = trainer_labels(cfg)
    trainer = [replace(b, resources={**b.resources, **pin}) for b in trainer]
    gen = [replace(b, resources={**b.resources, **gen_labels(cfg, i)}) for i, b in enumerate(gen)]
    notes = [f"trainer: FSDP2 over {p.trainer_gpus} ranks, {p.trainer_dtype}, placement group {strategy}",
             f"generation: {g.num_instances} vLLM instances x {tp} GPUs (tensor parallel {tp})"]
    if kind and gkind and kind != gkind:
        notes.append(f"heterogeneous: trainer on {kind}, generation on {gkind} (weights cross node types each "
                     "iteration)")
    return PlacementPlan("cuda", nodes, tuple(trainer), strategy, tuple(gen), tuple(notes))


def _describe(nodes) -> str:
    groups: dict[str, list[int]] = {}
    for n in nodes:
        groups.setdefault(n.gpu_type, []).append(n.gpus)
    return ", ".join(f"{len(v)} x {k} node(s) with {v[0]} GPUs" for k, v in groups.items())


def format_plan(plan: PlacementPlan) -> str:
    lines = [f"placement plan ({plan.device})", f"  {'worker':<16} {'node':<12} {'gpus':<14} resources"]
    for b in plan.trainer + plan.generation:
        gpus = ",".join(map(str, b.gpus)) or "-"
        res = ", ".join(f"{k}={v:g}" for k, v in b.resources.items())
        lines.append(f"  {b.role:<16} {b.node:<12} {gpus:<14} {res}")
    used = plan.gpus_used()
    for n in plan.nodes:
        if n.gpus:
            taken = sum(len(b.gpus) for b in plan.trainer + plan.generation if b.node == n.name)
            lines.append(f"  node {n.name}: {taken}/{n.gpus} GPUs used")
    if used:
        lines.append("  GPUs by type: " + ", ".join(f"{k}={v}" for k, v in sorted(used.items())))
    lines += [f"  note: {note}" for note in plan.notes]
    return "\n".join(lines)


def plan_file_from_split(row: dict, gen_gpu_type: str | None = None, train_gpu_type: str | None = None) -> dict:
    """The config sections of an Algorithm 1 split (``streamrl plan``'s row) for
    ``streamrl train --plan FILE``: the trainer's GPUs, the instance count and tensor parallelism."""
    placement = {"device": "cuda", "trainer_gpus": int(row["train_gpus"]), "gen_gpus_per_instance": int(row["gen_tp"])}
    if train_gpu_type:
        placement["trainer_gpu_type"] = train_gpu_type
    if gen_gpu_type:
        placement["gen_gpu_type"] = gen_gpu_type
    return {"placement": placement, "generation": {"num_instances": int(row["gen_instances"])}}


def plan_file_for_sites(nodes: list[tuple[str, str]], train_site: str | None = None,
                        instances: int | None = None) -> dict:
    """The config sections that place a run on a labelled cluster (``nodes``: ``(name, site)``
    in order): the trainer on the first node of ``train_site`` (default: the first site), the
    generation instances round robin over the other sites' nodes (every node when there is one
    site), ``instances`` of them (default: one per such node)."""
    if not nodes:
        raise ConfigError("placement: the cluster has no nodes")
    sites = list(dict.fromkeys(site for _, site in nodes))
    train_site = train_site or sites[0]
    if train_site not in sites:
        raise ConfigError(f"placement: no site {train_site!r} in the cluster (sites: {', '.join(sites)})")
    trainer = next(name for name, site in nodes if site == train_site)
    gen = [name for name, site in nodes if site != train_site] or [name for name, _ in nodes]
    count = instances or len(gen)
    return {"placement": {"trainer_node": trainer, "gen_nodes": gen[:count] if count < len(gen) else gen},
            "generation": {"num_instances": count}}
