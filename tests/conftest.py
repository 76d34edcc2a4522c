import os

import pytest


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
