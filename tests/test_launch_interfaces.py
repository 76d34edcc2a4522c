"""The launch core's declared interfaces (launch/interfaces.py): each one fails here when a side breaks it."""

from __future__ import annotations

import os
import pickle
import signal

import pytest

from notebook_accel.launch.doctor import StackCollector
from notebook_accel.launch.handle import LaunchHandle
from notebook_accel.launch.interfaces import (
    StackSource,
    UsageSource,
    WorkerBackend,
    WorkerProcess,
    WorkerStart,
    start_each,
)
from notebook_accel.launch.plan import LaunchPlan, resolve_plan
from notebook_accel.launch.procs import LocalProcess, LocalProcesses
from notebook_accel.launch.request import LaunchRequest
from notebook_accel.launch.states import State
from notebook_accel.launch.usage import UsageSampler
from notebook_accel.nodes.remote import NodeGroup
from notebook_accel.nodes.workers import RemoteStacks, RemoteUsage, RemoteWorkerProcess
from notebook_accel.utils._worker_channel import FRAME_HEADER
from tests.launcher_helpers import Collect


class FakeProcess(WorkerProcess):
    """A worker that ran at once, in memory: it wrote its line and its value, then ended with code 0."""

    def __init__(self, start: WorkerStart) -> None:
        self.pid = 4_000_000 + start.spec.rank  # no such process
        self.exitcode = None
        self.signals: list[int] = []
        rank = start.spec.rank
        os.write(start.stdout, f"hello from {rank}\n".encode())
        body = pickle.dumps(("ok", rank * 10))
        os.write(start.result, FRAME_HEADER.pack(len(body)) + body)
        self.sentinel, write_end = os.pipe()
        os.write(write_end, b"x")
        os.close(write_end)

    def poll(self) -> int | None:
        self.exitcode = 0
        return 0

    def signal_group(self, signum: int) -> None:
        self.signals.append(signum)

    def kill_and_reap(self) -> None:
        self.exitcode = -signal.SIGKILL

    def kill_leftovers(self) -> None:
        pass

    def close(self) -> None:
        if self.sentinel is not None:
            os.close(self.sentinel)
        self.sentinel = None


class FakeStacks(StackSource):
    def __init__(self) -> None:
        self.closes = 0

    def path(self, rank: int) -> str:
        return ""

    def collect(self, targets):
        return {}

    def closed(self) -> bool:
        return self.closes > 0

    def close(self) -> None:
        self.closes += 1


class FakeUsage(UsageSource):
    def due(self, now: float) -> bool:
        return False

    def sample(self, status) -> None:
        status.rss = 123

    def forget(self, pid) -> None:
        pass


class FakeBackend(WorkerBackend):
    """Ranks that run nowhere: the handle must supervise them through the interfaces alone."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.started: list[FakeProcess] = []
        self.methods: list[str] = []
        self.stacks = FakeStacks()

    def _one(self, method: str, start: WorkerStart) -> WorkerProcess:
        if start.spec.rank == self.fail_at:
            raise OSError(f"rank {start.spec.rank} cannot start")
        proc = FakeProcess(start)
        self.started.append(proc)
        return proc

    def start(self, method, starts):
        self.methods.append(method)
        return start_each(self._one, method, starts)

    def stack_source(self) -> StackSource:
        return self.stacks

    def usage_source(self) -> UsageSource:
        return FakeUsage()

    def close(self) -> None:
        pass


def _plan(n: int = 3) -> LaunchPlan:
    request = LaunchRequest(function=print, num_processes=n, force_cpu=True)
    plan = resolve_plan(request)
    return plan


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_handle_supervises_a_fake_in_memory_backend():
    backend = FakeBackend()
    sink = Collect()
    handle = LaunchHandle(_plan(3), print, sinks=[sink], backend=backend)
    handle._start(threaded=False)
    handle._run_here()
    assert handle.result() == [0, 10, 20]
    assert backend.methods == ["fork"]
    assert sorted(line.text for line in sink.lines) == ["hello from 0", "hello from 1", "hello from 2"]
    assert [s.state for s in handle.status()] == [State.SUCCEEDED] * 3
    assert [s.rss for s in handle.status()] == [123] * 3  # read from the backend's usage source
    assert handle.pids == [4_000_000, 4_000_001, 4_000_002]
    assert backend.stacks.closes == 1 and all(p.sentinel is None for p in backend.started)


def test_a_backend_that_cannot_start_every_rank_leaves_nothing_behind():
    backend = FakeBackend(fail_at=2)
    before = _fd_count()
    handle = LaunchHandle(_plan(3), print, backend=backend)
    with pytest.raises(OSError, match="rank 2 cannot start"):
        handle._start(threaded=False)
    # start_each took down the two that started; the handle closed every pipe and its stack source.
    assert [p.exitcode for p in backend.started] == [-signal.SIGKILL] * 2
    assert all(p.sentinel is None for p in backend.started)
    assert backend.stacks.closes == 1 and _fd_count() == before


@pytest.mark.parametrize(
    ("base", "member"),
    [
        (WorkerProcess, "poll"),
        (WorkerProcess, "signal_group"),
        (WorkerProcess, "kill_and_reap"),
        (WorkerProcess, "kill_leftovers"),
        (WorkerProcess, "close"),
        (StackSource, "collect"),
        (StackSource, "closed"),
        (UsageSource, "sample"),
        (WorkerBackend, "start"),
        (WorkerBackend, "stack_source"),
        (WorkerBackend, "usage_source"),
        (WorkerBackend, "close"),
    ],
)
def test_an_implementation_missing_a_member_cannot_be_made(base, member):
    fakes = {
        WorkerProcess: FakeProcess,
        StackSource: FakeStacks,
        UsageSource: FakeUsage,
        WorkerBackend: FakeBackend,
    }
    complete = {k: v for k, v in vars(fakes[base]).items() if not k.startswith("__")}
    broken = type("Broken", (base,), {k: v for k, v in complete.items() if k != member})
    with pytest.raises(TypeError, match=f"abstract method.*{member}"):
        object.__new__(broken)


@pytest.mark.parametrize(
    ("implementation", "interface"),
    [
        (LocalProcess, WorkerProcess),
        (RemoteWorkerProcess, WorkerProcess),
        (StackCollector, StackSource),
        (RemoteStacks, StackSource),
        (UsageSampler, UsageSource),
        (RemoteUsage, UsageSource),
        (LocalProcesses, WorkerBackend),
        (NodeGroup, WorkerBackend),
    ],
)
def test_both_sides_implement_every_interface(implementation, interface):
    assert issubclass(implementation, interface)
    assert not implementation.__abstractmethods__, f"{implementation.__name__} leaves abstract members"


def test_a_local_process_has_a_public_pidfd_and_signals_through_the_interface():
    backend = LocalProcesses()
    assert isinstance(backend.stack_source(), StackCollector) and isinstance(
        backend.usage_source(), UsageSampler
    )
    pid = os.fork()
    if pid == 0:
        signal.pause()
        os._exit(0)
    proc = LocalProcess(pid)
    try:
        assert proc.pidfd is not None and proc.pidfd == proc.sentinel
        assert proc.poll() is None
        proc.terminate()
        while proc.poll() is None:
            pass
        assert proc.exitcode == -signal.SIGTERM
    finally:
        proc.kill_and_reap()
        proc.close()
    assert proc.sentinel is None
