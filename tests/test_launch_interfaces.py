"""The launch core's declared interfaces (launch/interfaces.py): each one fails here when a side breaks it."""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
import types

import pytest

from notebook_accel.launch.doctor import StackCollector
from notebook_accel.launch.handle import LaunchHandle
from notebook_accel.launch.inbox import RankInbox
from notebook_accel.launch.interfaces import (
    RankEvents,
    RunView,
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
    handle.start(threaded=False)
    handle.run_here()
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
        handle.start(threaded=False)
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
        (RankEvents, "data"),
        (RankEvents, "end"),
        (RankEvents, "exited"),
    ],
)
def test_an_implementation_missing_a_member_cannot_be_made(base, member):
    fakes = {
        RankEvents: RankInbox,
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
        (RankInbox, RankEvents),
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


def _rank_function(address: str, listener_fd: int | None = None, gpus: tuple | None = None) -> None:
    pass


def test_a_persistent_request_takes_only_the_options_of_a_persistent_group():
    from notebook_accel.launch.request import DEFAULT_HANG_TIMEOUT

    request = LaunchRequest.persistent(_rank_function, ("",), num_processes=2, collapse_output=False)
    assert request.block is False and request.effective_hang_timeout == DEFAULT_HANG_TIMEOUT
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['max_restarts', 'timeout'\]; it takes gpus"):
        LaunchRequest.persistent(_rank_function, ("",), max_restarts=1, timeout=3)
    with pytest.raises(ValueError, match="start_method='thread' is not supported; choose one of fork"):
        LaunchRequest.persistent(_rank_function, ("",), start_method="thread")


def test_a_placement_is_known_by_its_type_not_by_its_methods():

    from notebook_accel.nodes.plan import placement_of
    from tests.nodes_helpers import LocalPlacement

    placement = LocalPlacement(("n1",))
    assert placement_of(placement) is placement
    duck = types.SimpleNamespace(
        **{name: getattr(placement, name) for name in ("hosts", "kernel_address", "start", "failure")}
    )
    with pytest.raises(TypeError, match=r"\(a SimpleNamespace\) is not one of the forms"):
        placement_of(duck)


def _run_view_members() -> set[str]:
    return set(RunView.__abstractmethods__) | set(RunView.__annotations__)


def test_both_handles_are_run_views_with_every_member():
    from notebook_accel.launch.restarts import RestartingHandle

    launch = LaunchHandle(_plan(2), print, backend=FakeBackend())
    restarting = RestartingHandle(lambda attempt, started: launch, 1, 0.1)
    for run in (launch, restarting):
        assert isinstance(run, RunView)
        missing = sorted(m for m in _run_view_members() if m not in dir(run))
        assert not missing, f"{type(run).__name__} lacks {missing}"
    broken = type("Broken", (RunView,), {m: None for m in RunView.__abstractmethods__ if m != "stacks"})
    with pytest.raises(TypeError, match="abstract method.*stacks"):
        object.__new__(broken)


def test_the_restarting_handle_reads_the_current_tries_members_from_that_try():
    from notebook_accel.launch.restarts import RestartingHandle

    tries: list[LaunchHandle] = []

    def start_attempt(attempt: int, started: float) -> LaunchHandle:
        handle = LaunchHandle(_plan(2), print, backend=FakeBackend(), attempt=attempt, run_id=f"try{attempt}")
        handle.start(threaded=False)
        tries.append(handle)
        return handle

    restarting = RestartingHandle(start_attempt, 1, 0.1)
    with pytest.raises(RuntimeError, match="has not started its first group yet"):
        restarting.status()
    restarting.start(threaded=False)
    restarting.run_here()
    assert restarting.result() == [0, 10]
    (only,) = tries
    assert restarting.plan is only.plan and restarting.run_id == "try1"
    assert restarting.pids == only.pids == [4_000_000, 4_000_001]
    assert [s.state for s in restarting.status()] == [State.SUCCEEDED] * 2
    assert restarting.bars() == only.bars() and restarting.metrics == only.metrics
    assert restarting.num_processes == 2 and restarting.stacks() == {}  # done: no live rank


def test_an_interactive_commands_bars_are_a_bar_source():
    from notebook_accel.interactive.cell_output import CommandBars
    from notebook_accel.launch.interfaces import BarSource

    handle = LaunchHandle(_plan(2), print, backend=FakeBackend())
    drawn: list = []
    bars = CommandBars(
        handle, lambda bundle, **kw: drawn.append(bundle) or types.SimpleNamespace(update=drawn.append)
    )
    assert isinstance(bars, BarSource) and not isinstance(bars, RunView)
    bars.close()
    broken = type("Broken", (BarSource,), {"bars": None, "add_done_callback": None})
    with pytest.raises(TypeError, match="abstract method.*subscribe_events"):
        broken()


# ---------------------------------------------------------------- a pushing backend (no pipe per rank)


class PushedProcess(WorkerProcess):
    """A rank that lives nowhere: a thread pushes its lines, its value, its streams' ends and its exit."""

    def __init__(self, start: WorkerStart, lines: int) -> None:
        self.pid, self.exitcode, self.sentinel = 5_000_000 + start.spec.rank, None, None
        self._inbox, self._rank, self._lines = start.inbox, start.spec.rank, lines
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        text = "".join(f"r{self._rank} {i}\n" for i in range(self._lines)).encode()
        step = 7 + self._rank  # chunks that cut lines anywhere
        for at in range(0, len(text), step):
            self._inbox.data(self, "stdout", text[at : at + step])
        body = pickle.dumps(("ok", self._rank * 10))
        self._inbox.data(self, "result", FRAME_HEADER.pack(len(body)) + body)
        for stream in ("stdout", "stderr", "result"):
            self._inbox.end(self, stream)
        self.exitcode = 0
        self._inbox.exited(self)

    def poll(self) -> int | None:
        return self.exitcode

    def signal_group(self, signum: int) -> None:
        pass

    def kill_and_reap(self) -> None:
        self.exitcode = -signal.SIGKILL

    def kill_leftovers(self) -> None:
        pass

    def close(self) -> None:
        pass


class PushingBackend(FakeBackend):
    """Ranks that push their events into the launch's inbox, as the ranks of other nodes do."""

    pushes = True

    def __init__(self, lines: int = 300) -> None:
        super().__init__()
        self.lines, self.starts = lines, []

    def _one(self, method: str, start: WorkerStart) -> WorkerProcess:
        self.starts.append(start)
        proc = PushedProcess(start, self.lines)
        self.started.append(proc)
        return proc

    def go(self) -> None:
        for proc in self.started:
            proc.thread.start()


def test_a_pushing_backend_reports_every_line_in_order_per_rank_without_a_descriptor_per_rank():
    backend = PushingBackend(lines=300)
    sink = Collect()
    handle = LaunchHandle(_plan(4), print, sinks=[sink], backend=backend)
    before = _fd_count()
    handle.start(threaded=False)
    assert _fd_count() - before == 1  # the inbox's wake descriptor, for all four ranks
    inbox = backend.starts[0].inbox
    assert isinstance(inbox, RankInbox) and all(s.inbox is inbox for s in backend.starts)
    assert all(s.stdout is None and s.result is None for s in backend.starts)
    inbox.data(backend.started[0], "stderr", b"early\n")
    assert not handle.output_drained(0) and handle.output_drained(1)  # waiting in the inbox: not handled yet
    backend.go()
    handle.run_here()
    assert handle.result() == [0, 10, 20, 30] and handle.output_drained(0)
    for rank in range(4):
        got = [line.text for line in sink.lines if line.rank == rank and line.stream == "stdout"]
        assert got == [f"r{rank} {i}" for i in range(300)]
    assert [line.text for line in sink.lines if line.stream == "stderr"] == ["early"]
    assert [s.state for s in handle.status()] == [State.SUCCEEDED] * 4
    assert [s.exitcode for s in handle.status()] == [0] * 4
    assert _fd_count() == before  # the inbox was closed with the launch


def test_the_supervisor_of_pushed_ranks_waits_on_their_inbox_and_never_polls():
    from notebook_accel.launch.ranks import _Rank
    from notebook_accel.launch.supervisor import RankSupervisor

    inbox = RankInbox()
    seen = []
    ranks = RankSupervisor(
        lambda r, s, d: seen.append((r.rank, s, d)),
        lambda r, s: seen.append((r.rank, s, "end")),
        lambda r: seen.append((r.rank, "exit")),
        inbox=inbox,
    )
    rank = _Rank(0, 0)
    rank.proc = PushedProcess(WorkerStart(types.SimpleNamespace(rank=0), None, None, None, inbox), 0)
    ranks.add([rank])
    assert not ranks.polling and not rank.fds
    inbox.data(rank.proc, "stdout", b"a")
    inbox.end(rank.proc, "stdout")
    inbox.data(rank.proc, "stdout", b"after its end")  # never reported: the stream ended
    rank.proc.exitcode = 3
    inbox.exited(rank.proc)
    assert not ranks.over(0.0)
    ranks.wait(1.0)
    assert seen == [(0, "stdout", b"a"), (0, "stdout", "end"), (0, "exit")] and rank.exited
    assert not ranks.over(0.0)  # stderr and result not ended yet: their bytes may still come
    inbox.end(rank.proc, "stderr")
    inbox.end(rank.proc, "result")
    ranks.wait(1.0)
    assert ranks.over(0.0)
    ranks.close()
    inbox.data(rank.proc, "stdout", b"late")  # dropped once the launch closed it: never waits
    assert not inbox.pending(rank.proc)


def test_an_inbox_holds_a_bounded_number_of_bytes_and_its_pushers_wait_for_room():
    inbox = RankInbox(max_bytes=100)
    inbox.attach()  # a reader takes the events: the pushers wait for it
    source = object()
    pushed = []

    def push() -> None:
        for i in range(10):
            inbox.data(source, "stdout", bytes([i]) * 40)
            pushed.append(i)

    pusher = threading.Thread(target=push, daemon=True)
    pusher.start()
    deadline = time.monotonic() + 10
    while len(pushed) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert pushed == [0, 1] and inbox.pending(source)  # a third 40 bytes would pass 100: it waits
    got = b""
    while len(got) < 400:
        got += b"".join(data for kind, _, _, data in inbox.take() if kind == "data")
        time.sleep(0.01)
    pusher.join(5)
    assert got == b"".join(bytes([i]) * 40 for i in range(10))  # in order, nothing lost
    inbox.close()
    with pytest.raises(ValueError, match="max_bytes=0: an inbox holds at least one byte"):
        RankInbox(max_bytes=0)


def test_closing_an_inbox_releases_a_pusher_waiting_for_room():
    inbox = RankInbox(max_bytes=10)
    inbox.attach()
    inbox.data("rank", "stdout", b"x" * 10)
    pusher = threading.Thread(target=inbox.data, args=("rank", "stdout", b"y"), daemon=True)
    pusher.start()
    time.sleep(0.1)
    assert pusher.is_alive()
    inbox.close()
    pusher.join(2)
    assert not pusher.is_alive()


def test_no_pusher_waits_for_room_before_a_reader_is_attached():
    # A start under way, or one that failed and waits for its ranks' exits behind their output: nobody
    # drains the inbox yet, so waiting for room would wait for ever (and hold the rank's lost() back).
    inbox = RankInbox(max_bytes=10)
    pusher = threading.Thread(
        target=lambda: [inbox.data("rank", "stdout", b"x" * 10) for _ in range(5)] and inbox.exited("rank"),
        daemon=True,
    )
    pusher.start()
    pusher.join(5)
    assert not pusher.is_alive()
    events = inbox.take()
    assert [kind for kind, *_ in events] == ["data"] * 5 + ["exit"]
    inbox.close()


def test_a_lost_remote_rank_completes_its_cut_frame_and_ends_through_the_inbox():
    from notebook_accel.launch.events import FrameDecoder
    from notebook_accel.nodes.workers import NODE_LOST

    inbox = RankInbox()
    node = types.SimpleNamespace(procs={}, host="n7", send_quietly=lambda message: None)
    proc = RemoteWorkerProcess(node, 3, inbox, wid=1)
    body = pickle.dumps(("ok", 42))
    frame = FRAME_HEADER.pack(len(body)) + body
    proc.feed("stdout", b"hi\n")
    proc.feed("result", frame[:5])  # the node is lost in the middle of the frame
    proc.lost("node n7 was lost: gone")
    events = inbox.take()
    assert [(kind, stream) for kind, _, stream, _ in events] == [
        ("data", "stdout"), ("data", "result"), ("data", "result"),
        ("end", "stdout"), ("end", "stderr"), ("end", "result"), ("exit", None),
    ]  # fmt: skip
    assert proc.sentinel is None and proc.exitcode == -signal.SIGKILL
    decoder = FrameDecoder()
    result = b"".join(data for kind, _, stream, data in events if stream == "result" and kind == "data")
    with pytest.raises(pickle.UnpicklingError):
        decoder.feed(result)  # the cut frame, padded with zeros: it fails to unpickle, as it should
    note = result[FRAME_HEADER.size + len(body) :]
    assert FrameDecoder().feed(note) == [("err", NODE_LOST, "node n7 was lost: gone", "")]
    proc.feed("stdout", b"late")  # after its end: dropped
    assert not inbox.pending(proc)
    inbox.close()


def test_a_node_group_needs_the_inbox_of_its_starts():
    assert NodeGroup.pushes and not LocalProcesses.pushes
    spec = types.SimpleNamespace(rank=5, env={"NODE_RANK": "0"})
    group = object.__new__(NodeGroup)  # nothing of the group is touched before the starts are checked
    with pytest.raises(ValueError, match="the start of rank 5 has no inbox: NodeGroup pushes"):
        group.start("spawn", [WorkerStart(spec, 10, 11, 12)])


def test_remote_usage_copies_a_rank_s_figures_only_when_its_agent_sent_new_ones():
    from notebook_accel.launch.ranks import RankStatus

    figures = {3: {"cpu_percent": 50.0, "rss": 100, "peak_rss": 150}}
    usage = RemoteUsage(figures)
    status = RankStatus(3, 1, State.RUNNING, 0.0)
    usage.sample(status)
    assert (status.cpu_percent, status.rss, status.peak_rss) == (50.0, 100, 150)
    status.rss = 7  # e.g. the rank's own usage event: the agent's unchanged figures do not overwrite it
    usage.sample(status)
    assert status.rss == 7
    figures[3] = {"cpu_percent": 20.0, "rss": 90, "peak_rss": 150}  # the next Usage message of its agent
    usage.sample(status)
    assert (status.cpu_percent, status.rss, status.peak_rss) == (20.0, 90, 150)


@pytest.mark.parametrize("backend", [FakeBackend, PushingBackend])
def test_output_pending_names_the_ranks_whose_output_is_not_handled_yet(backend):
    backend = backend()
    handle = LaunchHandle(_plan(3), print, sinks=[Collect()], backend=backend)
    handle.start(threaded=False)
    if isinstance(backend, PushingBackend):
        backend.started[1].thread.start()  # rank 1 pushes its lines; ranks 0 and 2 have said nothing yet
        backend.started[1].thread.join(10)
        assert handle.output_pending([0, 1, 2]) == [1]
    else:  # every fake rank wrote its line and value into its pipes at once
        assert handle.output_pending([2, 0]) == [2, 0]
    assert not handle.output_drained(1)
    if isinstance(backend, PushingBackend):
        for proc in (backend.started[0], backend.started[2]):
            proc.thread.start()
    handle.run_here()
    assert handle.output_pending([0, 1, 2]) == [] and handle.output_drained(1)
