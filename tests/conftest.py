import sys, os
sys.path.insert(0, os.path.dirname(__file__))
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # scripts/test.sh runs the suite on 2 xdist workers (one per core of the machines it runs on):
    # each worker, and every process it starts, gets one OpenMP thread that sleeps when idle, since
    # processes whose thread teams outnumber the cores run many times slower.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The longest files first: xdist hands each worker a whole file at a time in collection order, and a long
# file handed out last leaves the other worker idle until it ends (the demo alone takes most of a run).
LONGEST_FIRST = ("test_demo.py", "test_multiturn.py", "test_dist_async.py", "test_faults_ranks.py", "test_experiments.py",
                 "test_families.py", "test_nodes.py", "test_slurm.py", "test_dist.py", "test_budget.py", "test_reference.py", "test_lora.py", "test_e2e.py", "test_async_e2e.py", "test_faults_runs.py", "test_server.py",
                 "test_cli.py", "test_faults_state.py", "test_faults_writes.py", "test_async_ranks.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))      # stable: the rest keep their order


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialised tiny Qwen2 (2M parameters, byte tokenizer), built offline once."""
    from lit_ess.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def vllm_engines(tiny_model_dir):
    """vLLM engines by key, all kept alive until the module ends: destroying an in-process vLLM engine
    tears down process-wide state that the other live engines still use."""
    from lit_ess.engines import VLLMConfig

    cache = {}

    def get(key="default", **kwargs):
        if key not in cache:
            cache[key] = VLLMConfig(**kwargs).build(tiny_model_dir)
        return cache[key]

    yield get
    cache.clear()


@pytest.fixture(scope="module")
def vllm_engine(vllm_engines):
    return vllm_engines()
