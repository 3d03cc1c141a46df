"""``cluster``: the Ray cluster a run starts or joins, and the options every actor gets."""

from __future__ import annotations

from pydantic import Field

from streamrl.config.base import _Section


class ClusterConfig(_Section):
    address: str | None = None
    """existing Ray cluster address; None starts a local one"""
    num_cpus: int = Field(2, ge=1)
    """CPUs of the local Ray cluster"""
    ship_package: bool = True
    """with cluster.address: send this streamrl package to every node through Ray's runtime environment (nodes need
    Python and the dependencies only)"""
    ray_task_events: bool = False
    """let Ray record an event per actor call (its dashboard's task list); off by default: the GCS keeps them and
    grows with the run, and the run's own timeline records the stages"""

    def actor_options(self) -> dict:
        """Ray options every actor of a run is created with."""
        return {"enable_task_events": self.ray_task_events}

