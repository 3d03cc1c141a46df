"""`streamrl cluster up|down|status|run`: a multi-site Ray cluster on this host (network
namespaces joined by shaped links, see ``streamrl.lab.cluster``)."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("cluster", help="a multi-site Ray cluster on this host: network namespaces, shaped links")
    csub = p.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND")
    p.set_defaults(group_parser=p)
    u = csub.add_parser("up", help="build the sites and links, start a Ray node in each namespace, measure the links")
    u.add_argument("--sites", default="A:1,B:2", help="NAME:NODES[:TYPE],... (default A:1,B:2); the first node of "
                                                     "the first site is the Ray head")
    u.add_argument("--link", default="A-B:200mbit", help="SITE-SITE:RATE,... shaped with tbf each way "
                                                         "(default A-B:200mbit); the links must form a tree")
    u.add_argument("--cpus-per-node", type=int, default=1, help="logical CPUs each Ray node offers (1)")
    u.add_argument("--object-store-mb", type=int, default=512, help="object store of each node, MB (512)")
    u.add_argument("--no-measure", action="store_true", help="skip the bandwidth measurement of each link")
    u.set_defaults(handler="streamrl.commands.cluster:run_up")
    d = csub.add_parser("down", help="kill the cluster's processes, delete its namespaces, links and state")
    d.set_defaults(handler="streamrl.commands.cluster:run_down")
    s = csub.add_parser("status", help="the nodes, links and bytes that crossed each link so far")
    s.set_defaults(handler="streamrl.commands.cluster:run_status")
    r = csub.add_parser("run", help="run a command inside the head's namespace with RAY_ADDRESS set "
                                    "(e.g. streamrl cluster run -- streamrl train CONFIG cluster.address=auto)")
    r.add_argument("--node", default=None, help="run in this node's namespace instead of the head's (e.g. B0)")
    r.add_argument("argv", nargs=argparse.REMAINDER, help="the command (after --)")
    r.set_defaults(handler="streamrl.commands.cluster:run_run")
    for q in (u, d, s, r):
        q.add_argument("--name", default="srl", help="cluster name, the prefix of its namespaces and links (srl)")


def run_up(args) -> int:
    from streamrl.lab import cluster as c

    sites = c.parse_sites(args.sites)
    links = c.parse_links(args.link, sites)
    cl = c.up(sites, links, name=args.name, cpus_per_node=args.cpus_per_node,
              object_store_mb=args.object_store_mb, measure=not args.no_measure)
    print(cl.report())
    print(f"run a driver inside it: streamrl cluster run -- streamrl train CONFIG cluster.address=auto; "
          f"stop it: streamrl cluster down --name {args.name}")
    return 0


def run_down(args) -> int:
    from streamrl.lab import cluster as c

    removed = c.down(args.name)
    print(f"cluster {args.name}: killed {removed['processes']} processes, removed {removed['netns']} namespaces "
          f"and {removed['links']} links")
    return 0


def run_status(args) -> int:
    from streamrl.lab import cluster as c

    cl = c.load(args.name)
    print(cl.report())
    for link in cl.links:
        counts = cl.link_bytes(link.a, link.b)
        print("  crossed so far: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in counts.items()))
    return 0


def run_run(args) -> int:
    import subprocess

    from streamrl.lab import cluster as c

    cl = c.load(args.name)
    argv = args.argv[1:] if args.argv and args.argv[0] == "--" else args.argv
    if not argv:
        from streamrl.errors import UserError

        raise UserError("streamrl cluster run: give the command after --, e.g. streamrl cluster run -- streamrl train ...")
    return subprocess.call(cl.exec_argv(argv, args.node))
