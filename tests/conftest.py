"""Shared fixtures: one Ray instance and one tiny policy checkpoint per pytest session (per worker).

Both are slow to build (Ray starts processes; the policy is SFT-trained), so a test that uses
either must carry ``@pytest.mark.slow`` (``make test-fast`` runs ``-m "not slow"``: pure logic
only); collection fails, naming the tests, when one does not.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SLOW_FIXTURES = ("ray_session", "tiny_policy_dir", "two_sites")

# Modules whose tests run on one pytest-xdist worker (`make test` runs two): the namespace cluster
# uses fixed addresses (10.77.0.0/16), so two workers must not bring one up at the same time.
ONE_WORKER_MODULES = ("tests/lab/test_cluster.py", "tests/lab/test_multisite.py")


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """Tests go one by one to whichever worker is free, except ONE_WORKER_MODULES, which go
    together as one unit (xdist's own ``--dist loadgroup`` marks nothing under pytest 9)."""
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerForTheCluster(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "netns" if nodeid.split("::")[0] in ONE_WORKER_MODULES else nodeid

    return OneWorkerForTheCluster(config, log)


def pytest_collection_modifyitems(config, items):
    unmarked = [item.nodeid for item in items if set(SLOW_FIXTURES) & set(getattr(item, "fixturenames", ()))
                and item.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError(f"tests using {SLOW_FIXTURES} must be marked @pytest.mark.slow: {unmarked}")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    """A tiny policy (tokenizer + Qwen2) briefly trained on the synthetic task: enough to emit
    end-of-sequence and well-formed chains, far from good. Built once per session."""
    import torch

    from streamrl.config import PolicyConfig
    from streamrl.models.sft import make_policy

    torch.set_num_threads(2)
    path = tmp_path_factory.mktemp("policy") / "tiny"
    cfg = PolicyConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                       sft_steps=60, sft_batch_size=16, sft_lr=3e-3)
    make_policy(cfg, str(path), seed=0, probe_size=0)
    return str(path)
