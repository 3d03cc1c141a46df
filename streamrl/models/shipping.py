"""What a run on a multi-node Ray cluster ships instead of assuming shared storage.

    driver node                          other nodes
    policy.path --package_policy--> ray.put(PolicyPackage) --> actor: materialize_policy()
                                                               -> <node tmp>/streamrl-policies/<digest>/
    run.out_dir <--unpack_dir-- files returned by the trainer <-- TrainerActor.save(ship=True)
    run.out_dir --pack_dir-->  files sent to the trainer       --> TrainerActor.load(files)

Invariants: only the driver reads ``policy.path`` and the data files (prompts reach instances as
token ids) and only it writes ``run.out_dir``; a file travels as a byte string keyed by its
relative path; a directory is written to a temporary sibling and renamed into place, so a reader
never sees half of one. The package itself travels with Ray's runtime env (``cluster.ship_package``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path


def pack_dir(path: str | Path) -> dict[str, bytes]:
    """Every file under ``path`` as ``{relative path: bytes}``."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"no directory {str(root)!r} to pack")
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def unpack_dir(files: dict[str, bytes], path: str | Path, replace: bool = True) -> Path:
    """Write ``files`` as the directory ``path`` via a renamed temporary, replacing what was
    there (``replace=False``: an existing directory stays, and the rename raises ``OSError``)."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        for rel, data in files.items():
            target = tmp / rel
            if not target.resolve().is_relative_to(tmp.resolve()):
                raise ValueError(f"refusing to write {rel!r} outside {dest}")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        if dest.exists() and replace:
            old = dest.with_name(f".{dest.name}.old.{os.getpid()}")
            dest.rename(old)
            tmp.rename(dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


@dataclass(frozen=True)
class PolicyPackage:
    """A policy checkpoint directory as bytes, named by the digest of its content."""

    name: str
    """The directory's name on the driver (for messages)."""
    digest: str
    files: dict[str, bytes]

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.files.values())


def package_policy(path: str | Path) -> PolicyPackage:
    files = pack_dir(path)
    h = hashlib.sha256()
    for rel, data in files.items():
        h.update(rel.encode())
        h.update(hashlib.sha256(data).digest())
    return PolicyPackage(Path(path).name, h.hexdigest()[:16], files)


def materialize_policy(source) -> str:
    """A local directory holding the policy: ``source`` itself when it is a path, else the
    package written once per node under the node's temporary directory (concurrent actors on
    one node race harmlessly: the first rename wins, the others find it there)."""
    if not isinstance(source, PolicyPackage):
        return str(source)
    dest = Path(tempfile.gettempdir()) / "streamrl-policies" / source.digest
    if not (dest / "config.json").is_file():
        try:
            unpack_dir(source.files, dest, replace=False)
        except OSError:
            if not (dest / "config.json").is_file():  # not a lost race: a real failure
                raise
    return str(dest)
