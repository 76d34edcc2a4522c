import os

import pytest

# The suite is written for CI's machine, which has no GPU. On a machine with one, the tests not marked
# `cuda` would get CUDA by default (nccl ranks, device maps onto the GPU), and the ranks they fork would
# meet torch's fork limits once any test had used CUDA or autograd. So the GPU is hidden (before torch
# first looks) unless a session asks for the cuda tests alone: NOTEBOOK_ACCEL_TEST_CUDA=1 python -m pytest
# -m cuda (scripts/gpu_checks.sh runs both sessions on a GPU machine).
CUDA_SESSION = os.environ.get("NOTEBOOK_ACCEL_TEST_CUDA") == "1"
if not CUDA_SESSION:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


# The files that take longest (seconds of a serial run on CI's 2 cores, from --durations), run first: the
# suite's two workers (pyproject addopts: -n 2 --dist loadfile --no-loadscope-reorder) take whole files in
# collection order, so no long file starts last and runs alone at the end. (xdist's own order, by number of
# tests, put the one-test binder build last.) A file missing here only runs later; keep the longest listed.
_LONG_FILES = (
    "tests/test_cluster_eight_nodes.py",  # 210 s
    "tests/test_binder.py",  # 182
    "tests/test_nodes_faults.py",  # 149
    "tests/test_faults.py",  # 120
    "tests/test_browser.py",  # 101
    "tests/test_nodes_launch.py",  # 98
    "tests/test_interactive_cluster.py",  # 90
    "tests/test_interactive.py",  # 81
    "tests/test_launcher_nodes.py",  # 67
    "tests/clients/test_trainer_clients.py",  # 56
    "tests/test_launcher.py",  # 52
    "tests/test_cli_commands.py",  # 48
    "tests/clients/test_trainer_launcher.py",  # 45
    "tests/test_interactive_nodes.py",  # 40
    "tests/test_accelerator_import.py",  # 38
    "notebooks/sharded_training.ipynb",  # 37
    "tests/test_docs.py",  # 36
)


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(_LONG_FILES)}
    items.sort(key=lambda item: order.get(item.nodeid.split("::", 1)[0], len(order)))  # stable: in-file order kept
    _mark_quick(items)
    if not CUDA_SESSION:
        return
    only_cuda = pytest.mark.skip(reason="NOTEBOOK_ACCEL_TEST_CUDA=1: this session runs the tests marked cuda")
    for item in items:
        if item.get_closest_marker("cuda") is None:
            item.add_marker(only_cuda)


def _mark_quick(items):
    """Mark the quick lane (`pytest -m quick`): the tests tests/quick_lane.py's rule and table name."""
    from tests.quick_lane import is_quick

    quick = pytest.mark.quick
    for item in items:
        path = item.nodeid.split("::", 1)
        if len(path) < 2 or not path[0].startswith("tests/"):
            continue  # the notebooks' cells
        module = path[0][len("tests/") : -len(".py")]
        if is_quick(module, path[1].split("[", 1)[0], item.get_closest_marker("slow") is not None):
            item.add_marker(quick)


@pytest.fixture(autouse=True)
def _isolate_process_state():
    """Restore os.environ and forget the state singletons after every test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    from tests._dist import reset_state_singletons

    reset_state_singletons()
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except ImportError:
        pass


@pytest.fixture()
def no_launch_leaks():
    """Fail the test if it left processes, notebook_accel threads or open fds behind (launcher tests)."""
    from tests.launcher_helpers import Snapshot

    snap = Snapshot()
    yield
    snap.assert_clean()


@pytest.fixture(scope="session")
def ns_cluster():
    """Two nodes as network namespaces with real sshd and Slurm daemons (tests/ns_cluster.py), once per run.

    Skips, saying why, where the machine cannot build it (not root, no `ip netns`, slurm-wlm/munge/
    openssh-server missing); torn down at the end of the session (daemons by pid, namespaces, bridge).
    """
    from tests.ns_cluster import NsCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = NsCluster(2).start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def ns_cluster8():
    """Eight nodes of the namespace cluster (n1..n8), built only in a run that selects a test using it.

    Beside ``ns_cluster`` (its own subnet, daemons and ports); it leaves ``SLURM_CONF`` alone, so the
    two-node tests keep talking to theirs: a test of this one sets it from ``client_env()``.
    """
    from tests.ns_cluster import NsCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = NsCluster(8, export_slurm_conf=False).start()
    try:
        yield cluster
    finally:
        cluster.close()
