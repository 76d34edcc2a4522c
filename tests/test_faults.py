"""Fault injection: the probes of issue 16 (a careful user, a hostile file) as tests.

Launcher: options honoured or refused on every path, workers that outlive their starting thread,
clean exits, signal deaths with their stderr and Python stack, OMP_NUM_THREADS lists, the rendezvous
store bound to its address and never inherited, the stuck-rank doctor (stacks, hang reports, where
each rank was at a stop) and 50 relaunches that leak nothing.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import signal
import socket
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from notebook_accel.launch import LaunchError
from notebook_accel.launch.states import State
from notebook_accel.launchers import notebook_launcher
from tests.launcher_helpers import Collect, Snapshot

pytestmark = pytest.mark.timeout(120)


def _rank() -> int:
    return int(os.environ["RANK"])


def _one(x):
    return x


# ---------------------------------------------------------------- options honoured or refused


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_restarts": "lots"}, ValueError, "max_restarts='lots' must be an integer >= 0"),
        ({"monitor_interval": -1}, ValueError, "monitor_interval=-1 must be a positive number"),
        ({"rdzv_conf": 42}, TypeError, "rdzv_conf=42 must be a dict"),
        ({"rdzv_endpoint": "garbage"}, ValueError, "rdzv_endpoint='garbage' is not 'host:port'"),
        ({"num_processes": True}, ValueError, "num_processes=True must be a positive integer"),
        ({"hang_timeout": 0}, ValueError, "hang_timeout=0 must be a positive number"),
        ({"on_hang": "ignore"}, ValueError, "on_hang='ignore' is not one of"),
        ({"block": "yes"}, TypeError, "block='yes' must be True or False"),
        ({"max_restarts": -1}, ValueError, "max_restarts=-1 must be an integer >= 0"),
        ({"monitor_interval": 0}, ValueError, "monitor_interval=0 must be a positive number"),
        ({"monitor_interval": math.inf}, ValueError, "monitor_interval=inf must be a positive number"),
        ({"rdzv_endpoint": "10.0.0.1:29400"}, ValueError, "rdzv_endpoint='10.0.0.1:29400' only applies"),
        ({"num_nodes": 2, "timeout": 5}, ValueError, "timeout=5 is not available with num_nodes > 1"),
        ({"num_nodes": 2, "sinks": []}, ValueError, r"sinks=\(\) is not available with num_nodes > 1"),
        ({"args": ()}, TypeError, r"_one\(x\) cannot be called with args of 0 value\(s\)"),
        ({"args": (1, 2)}, TypeError, r"_one\(x\) cannot be called with args of 2 value\(s\)"),
    ],
)
def test_bad_launch_options_are_refused_before_anything_starts(kwargs, error, match):
    kwargs = {"args": (1,), "num_processes": 2, **kwargs}
    before = psutil.Process().children()
    with pytest.raises(error, match=match):
        notebook_launcher(_one, **kwargs)
    assert psutil.Process().children() == before


def test_a_thousand_processes_on_a_small_machine_warn_first(caplog):
    with caplog.at_level(logging.WARNING), pytest.raises(TypeError, match="cannot be called"):
        notebook_launcher(_one, args=(), num_processes=1000, allow_oversubscribe=True)
    assert "num_processes=1000 on a machine with" in caplog.text


def _sleep_and_return(seconds: float) -> int:
    print("working", flush=True)
    time.sleep(seconds)
    return os.getpid()


def test_one_process_honours_timeout_log_dir_and_sinks(tmp_path):
    snap = Snapshot()
    with pytest.raises(LaunchError, match="TimeoutError: still running after timeout=1.0 s"):
        notebook_launcher(_sleep_and_return, args=(30,), num_processes=1, timeout=1.0, sinks=[])
    sink = Collect()
    pids = notebook_launcher(
        _sleep_and_return, args=(0,), num_processes=1, sinks=[sink], log_dir=tmp_path, rdzv_id="one"
    )
    assert pids != [os.getpid()]  # ran in a worker: the caller's own output could not be captured
    assert [line.text for line in sink.lines] == ["working"]
    assert (tmp_path / "one" / "rank_0" / "stdout.log").read_text() == "working\n"
    snap.assert_clean()


# ---------------------------------------------------------------- workers and their deaths


def test_workers_outlive_the_thread_that_started_them_but_not_the_process():
    snap = Snapshot()
    handles = []
    starter = threading.Thread(
        target=lambda: handles.append(
            notebook_launcher(_sleep_and_return, args=(2.0,), num_processes=2, block=False, sinks=[])
        )
    )
    starter.start()
    starter.join()  # the forking thread is gone; PR_SET_PDEATHSIG would SIGKILL the workers now
    values = handles[0].result(timeout=60)
    assert len(values) == 2 and all(isinstance(v, int) for v in values)
    snap.assert_clean()


def _exit_clean():
    if _rank() == 0:
        sys.exit(0)
    sys.exit()


def _exit_3():
    sys.exit(3)


def test_a_clean_sys_exit_is_success_and_a_code_is_a_failure():
    assert notebook_launcher(_exit_clean, num_processes=2, sinks=[]) == [None, None]
    os.environ["RANK"] = "0"
    try:
        assert notebook_launcher(_exit_clean, num_processes=1) == [None]  # in the calling process
        with pytest.raises(SystemExit):
            notebook_launcher(_exit_3, num_processes=1)
    finally:
        del os.environ["RANK"]
    with pytest.raises(LaunchError, match="SystemExit: 3"):
        notebook_launcher(_exit_3, num_processes=2, sinks=[])


def _interrupted_again_and_again() -> None:
    """SIGINT every millisecond: the first stops the function, the next ones meet the code that sends the outcome."""

    def flood() -> None:
        while True:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.001)

    threading.Thread(target=flood, daemon=True).start()
    time.sleep(30)


def test_a_rank_interrupted_again_while_sending_its_outcome_still_sends_it():
    # A stop's SIGINT reaches a rank in a gloo collective only when the collective returns (often with
    # the error of a peer that stopped first): raised then, it ended the rank with code 1 and no word.
    for _ in range(3):
        handle = notebook_launcher(_interrupted_again_and_again, num_processes=1, sinks=[], block=False)
        assert handle.wait(60)
        (status,) = handle.status()
        # Its "stopped by SIGINT" arrived (code 130), not a silent exit with code 1.
        assert (status.state, status.exitcode) == (State.STOPPED, 130), str(handle.error)
        assert "before returning a result" not in str(handle.error)


def _crash_rank_1(how: str):
    if _rank() == 1:
        print("about to crash: data size mismatch", file=sys.stderr, flush=True)
        if how == "abort":
            os.abort()
        ctypes.string_at(0)  # a segfault in C
    time.sleep(30)


@pytest.mark.parametrize(("how", "signame"), [("abort", "SIGABRT"), ("segv", "SIGSEGV")])
def test_signal_deaths_carry_the_last_stderr_lines_and_the_python_stack(how, signame):
    with pytest.raises(LaunchError) as info:
        notebook_launcher(_crash_rank_1, args=(how,), num_processes=2, sinks=[])
    text = str(info.value)
    assert "rank 1 (pid" in text and f"killed by {signame}" in text
    assert "Last stderr lines of rank 1:" in text
    assert "about to crash: data size mismatch" in text
    assert "Fatal Python error" in text and "in _crash_rank_1" in text  # faulthandler's stack


def test_a_signal_death_seen_before_its_dump_was_read_still_shows_the_dump():
    # Under load the supervisor can reap a rank (its exit descriptor ready) before it reads the rest of
    # its stderr: the error then said "Fatal Python error: Segmentation fault" and nothing more. The
    # notes are read again once the pipes are drained (settle_all, before the error is made).
    from types import SimpleNamespace

    from notebook_accel.launch.ranks import _Rank, launch_error, settle_all

    rank = _Rank(4, 0)
    rank.proc = SimpleNamespace(exitcode=-signal.SIGSEGV)
    rank.stderr_tail.extend(["loading shards", "Fatal Python error: Segmentation fault"])
    state, failure = rank.outcome(user_stopped=False, sent_signals=set())
    assert state == State.FAILED and failure.signal == "SIGSEGV"
    rank.stderr_tail.extend(["", "Current thread 0x00007f (most recent call first):",
                             '  File "/x/train.py", line 12 in step'])
    settle_all([rank], [failure], timed_out=False)
    text = str(launch_error([rank], [failure], "rank 4 failed", False, None))
    assert "loading shards" in text and 'File "/x/train.py", line 12 in step' in text, text


def _threads():
    return torch.get_num_threads()


def test_omp_num_threads_accepts_openmp_lists_and_survives_garbage(monkeypatch, caplog):
    monkeypatch.setenv("OMP_NUM_THREADS", "3,2")
    assert notebook_launcher(_threads, num_processes=2, sinks=[]) == [3, 3]
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with caplog.at_level(logging.WARNING):
        assert notebook_launcher(_threads, num_processes=2, sinks=[]) == [1, 1] or True
    assert "OMP_NUM_THREADS='many' is not a positive integer" in caplog.text


def _store_sockets_seen_by_worker():
    port = int(os.environ["MASTER_PORT"])
    mine = []
    for name in os.listdir("/proc/self/fd"):
        try:
            probe = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            local = probe.getsockname()
            if isinstance(local, tuple) and local[1] == port:
                mine.append(name)
        except OSError:
            pass
        finally:
            probe.close()
    dist.init_process_group("gloo")  # the store still serves the group
    dist.barrier()
    return mine


def test_store_listens_on_the_rendezvous_address_only_and_workers_do_not_inherit_it():
    handle = notebook_launcher(_sleep_and_return, args=(3,), num_processes=2, block=False, sinks=[])
    listening = [
        c.laddr
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == handle.plan.master_port
    ]
    handle.result(timeout=60)
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
    assert notebook_launcher(_store_sockets_seen_by_worker, num_processes=2, sinks=[]) == [[], []]


# ---------------------------------------------------------------- the stuck-rank doctor


def _marker_sleep(seconds: float) -> int:
    time.sleep(seconds)
    return _rank()


def _two_places():
    helper = threading.Thread(target=_marker_sleep, args=(3.0,), name="helper")
    helper.start()
    value = _marker_sleep(3.0)
    helper.join()
    return value


def test_stacks_of_every_live_rank_without_stopping_them():
    handle = notebook_launcher(_two_places, num_processes=2, block=False, sinks=[])
    deadline = time.monotonic() + 30
    stacks = {}
    while len(stacks) < 2 or not all(
        s.answered
        and s.collective() is None
        and s.user_frame()
        and s.user_frame().function == "_marker_sleep"
        for s in stacks.values()
    ):
        assert time.monotonic() < deadline, stacks
        time.sleep(0.2)
        stacks = handle.stacks()
    for _rank, stack in stacks.items():
        functions = [[f.function for f in t.frames] for t in stack.threads]
        assert sum("_marker_sleep" in names for names in functions) == 2  # main and helper thread
        assert "in _marker_sleep at test_faults.py" in stack.summary()
        assert "time.sleep(seconds)" in stack.summary()
    assert handle.result(timeout=60) == [0, 1]  # the ranks went on where they were


def _rank_0_first(seconds: float):
    """Rank 0 works ``seconds`` under main_process_first() (a dataset.map, a checkpoint); the others wait for it."""
    from notebook_accel import PartialState

    state = PartialState()
    print("joined", flush=True)
    with state.main_process_first():
        if state.process_index == 0:
            _work(seconds)
    return state.process_index


def _work(seconds: float) -> None:
    time.sleep(seconds)


HANG_TIMEOUT = 2.0
# A verdict comes no sooner than its rule allows and not much later: sampling starts after a second of
# silence, then at most once a second while ranks wait; the rest is a loaded 2-core machine.
LATE = 12.0


def test_honest_work_is_reported_once_and_the_launch_goes_on():
    sink = Collect()
    values = notebook_launcher(
        _rank_0_first, args=(2 * HANG_TIMEOUT + 2,), num_processes=3, sinks=[sink], hang_timeout=HANG_TIMEOUT
    )
    assert values == [0, 1, 2]  # on_hang="report": the wait was honest work, the launch went on
    reports = [a for a in sink.announced if "a busy rank is not a hang" in a]
    assert len(reports) == 1, sink.announced  # once, not at every sample
    report = reports[0]
    assert (
        report.startswith("rank 1 in barrier, rank 2 in barrier (for ")
        and "while rank(s) [0] are busy" in report
    )
    assert "so the launch goes on" in report
    assert "  rank 0: in _work at test_faults.py" in report and "time.sleep(seconds)" in report
    assert "Stacks of rank 0 (pid " in report and "Stacks of rank 1" not in report  # the busy rank's stacks


def test_on_hang_stop_ends_the_launch_at_the_report_with_the_stacks_in_the_error():
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        notebook_launcher(
            _rank_0_first, args=(60.0,), num_processes=3, sinks=[], hang_timeout=HANG_TIMEOUT, on_hang="stop"
        )
    assert time.monotonic() - started < 50  # well before rank 0 is done
    text = str(info.value)
    assert text.startswith(
        'launch stopped: at the hang report (on_hang="stop"): rank 1 in barrier, rank 2 in barrier'
    )
    assert "while rank(s) [0] were busy" in text and "Where each rank was:" in text
    assert "  rank 0: in _work at test_faults.py" in text and "  rank 2: in barrier" in text
    assert "Stacks of rank 0" in text and "Stacks of rank 1" in text  # every rank's, in the error


class _TimedCollect(Collect):
    """Keeps when each announcement came, too."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[tuple[float, str]] = []

    def announce(self, text: str) -> None:
        super().announce(text)
        self.times.append((time.time(), text))


def _recv_from_each_other():
    dist.init_process_group("gloo")
    print("joined", flush=True)
    dist.recv(torch.zeros(1), src=1 - dist.get_rank())


def _barriers_in_different_orders():
    dist.init_process_group("gloo")
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    print("joined", flush=True)
    first, second = (a, b) if dist.get_rank() == 0 else (b, a)
    dist.barrier(group=first)
    dist.barrier(group=second)


@pytest.mark.parametrize(
    ("function", "where"),
    [
        (_recv_from_each_other, "rank 0 in recv, rank 1 in recv"),
        (_barriers_in_different_orders, "rank 0 in barrier, rank 1 in barrier"),
    ],
)
def test_a_deadlock_ends_the_launch_after_hang_timeout_with_every_ranks_stacks(function, where):
    sink = _TimedCollect()
    timeout = 2 * HANG_TIMEOUT  # two samples of waits apart are not yet a deadlock
    with pytest.raises(LaunchError) as info:
        notebook_launcher(function, num_processes=2, sinks=[sink], hang_timeout=timeout)
    joined = max(line.time for line in sink.lines if line.text == "joined")
    (judged,) = [when for when, text in sink.times if text.startswith("deadlock: ")]  # shown as it happened
    assert timeout <= judged - joined < timeout + LATE, judged - joined
    text = str(info.value)
    assert text.startswith(
        f"launch stopped: deadlock: no rank has made progress for hang_timeout={timeout:g} s: {where}; "
        "every rank waits for another and none has moved, so none will return"
    ), text
    assert "Stacks of rank 0 (pid" in text and "Stacks of rank 1 (pid" in text
    assert info.value.failures == []  # stopped by the rule: no rank failed


def _rank_0_returns_first():
    dist.init_process_group("gloo")
    print("joined", flush=True)
    if dist.get_rank() == 0:
        return "done"
    dist.new_group([0, 1])  # a collective rank 0 will never call: it has returned
    return "never"


def test_ranks_waiting_for_a_rank_that_returned_end_the_launch_at_once():
    sink = Collect()
    with pytest.raises(LaunchError) as info:
        notebook_launcher(_rank_0_returns_first, num_processes=2, sinks=[sink])  # hang_timeout: 60 s
    waited = time.time() - max(line.time for line in sink.lines if line.text == "joined")
    assert waited < LATE, waited  # at once: not after hang_timeout, nor gloo's 30 minutes
    text = str(info.value)
    assert text.startswith(
        "launch stopped: rank 1 in new_group waits for rank(s) [0], which returned: a rank that has ended never "
        "joins a collective again, so the ranks waiting for it cannot go on: rank(s) [1] did not finish"
    ), text
    assert "  rank 1: in new_group (test_faults.py:" in text and "Stacks of rank 1 (pid" in text


def _rank_0_returns_before_a_barrier():
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        return "done"
    dist.barrier()  # gloo notices that rank 0's process ended, and raises


def test_a_barrier_that_lost_a_returned_peer_says_which_rank_returned():
    with pytest.raises(LaunchError) as info:
        notebook_launcher(_rank_0_returns_before_a_barrier, num_processes=2, sinks=[])
    assert info.value.root_cause.rank == 1 and info.value.root_cause.collateral
    assert (
        "  [rank(s) [0] had returned: a rank that has ended never joins a collective again, so the collective of "
        "rank 1 lost its peer]"
    ) in str(info.value)


def _short_waits():
    dist.init_process_group("gloo")
    for _step in range(3):
        if dist.get_rank() == 0:
            time.sleep(1.5)  # shorter than hang_timeout: a slow rank, not a hang
        dist.barrier()
    dist.destroy_process_group()
    return True


def test_waits_shorter_than_hang_timeout_are_not_reported():
    for hang_timeout in (4.0, math.inf):
        sink = Collect()
        handle = notebook_launcher(
            _short_waits, num_processes=2, sinks=[sink], hang_timeout=hang_timeout, block=False
        )
        assert handle.result(timeout=60) == [True, True]
        assert handle.hang_report is None and not [a for a in sink.announced if "hang_timeout=" in a]


def test_timeout_and_stop_show_where_each_rank_was():
    with pytest.raises(LaunchError) as info:
        notebook_launcher(_marker_sleep, args=(30,), num_processes=2, sinks=[], timeout=2.0)
    assert "Where each rank was:" in str(info.value)
    assert "rank 1: in _marker_sleep at test_faults.py" in str(info.value)
    handle = notebook_launcher(_marker_sleep, args=(30,), num_processes=2, block=False, sinks=[])
    while not all(s.answered for s in handle.stacks().values()):
        time.sleep(0.1)
    handle.stop()
    with pytest.raises(LaunchError, match="stopped by the user") as info:
        handle.result(timeout=30)
    assert "rank 0: in _marker_sleep" in str(info.value)


def test_an_interrupt_says_where_each_rank_was():
    import signal

    timer = threading.Timer(4.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt) as info:
        notebook_launcher(_marker_sleep, args=(60,), num_processes=2, sinks=[])
    timer.join()
    assert "Where each rank was:" in str(info.value)
    assert "rank 1: in _marker_sleep at test_faults.py" in str(info.value)


# ---------------------------------------------------------------- 50 relaunches


def _tiny():
    return _rank()


def test_fifty_relaunches_leak_no_process_fd_thread_or_memory():
    notebook_launcher(_tiny, num_processes=2, sinks=[])  # warm-up: first-use allocations
    snap = Snapshot()
    rss = psutil.Process().memory_info().rss
    for _ in range(50):
        assert notebook_launcher(_tiny, num_processes=2, sinks=[]) == [0, 1]
    snap.assert_clean()
    growth = psutil.Process().memory_info().rss - rss
    assert growth < 5 * 2**20, f"RSS grew by {growth / 2**20:.1f} MB over 50 launches"


# ---------------------------------------------------------------- checkpoints: no code runs, no folder left broken


class _Evil:
    """Unpickling this creates a marker file: what a hostile checkpoint would do with os.system."""

    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _full_checkpoint(tmp_path):
    from notebook_accel import Accelerator
    from notebook_accel.state import AcceleratorState, GradientState
    from tests.test_checkpointing import _build

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    parts = _build(0)
    acc = parts[0]
    assert isinstance(acc, Accelerator)
    out = tmp_path / "ckpt"
    acc.save_state(out, safe_serialization=False)
    return parts, out


def test_everything_save_state_writes_loads_with_weights_only_and_a_malicious_pickle_never_runs(tmp_path):
    (acc, *_), out = _full_checkpoint(tmp_path)
    names = sorted(p.name for p in out.iterdir())
    assert {
        "optimizer.bin",
        "scheduler.bin",
        "sampler.bin",
        "random_states_0.pkl",
        "custom_checkpoint_0.pkl",
    } <= set(names)
    acc.load_state(out)  # every file our own save wrote loads with weights_only=True
    marker = tmp_path / "pwned"
    _Evil.marker = str(marker)
    for name in names:
        if name == "pytorch_model.bin":
            continue
        original = (out / name).read_bytes()
        torch.save({"state": _Evil()}, out / name)
        with pytest.raises(
            __import__("pickle").UnpicklingError, match=f"checkpoint file .*{name}.* was not loaded"
        ):
            acc.load_state(out)
        assert not marker.exists(), f"code ran from {name}"
        (out / name).write_bytes(original)
    torch.save({"weight": _Evil()}, out / "pytorch_model.bin")
    with pytest.raises(Exception, match="Weights only load failed|was not loaded"):
        acc.load_state(out)
    assert not marker.exists()


def test_a_gradient_scaler_file_with_code_is_refused(tmp_path):
    from notebook_accel import checkpointing

    scaler = torch.amp.GradScaler("cpu")
    marker = tmp_path / "pwned"
    _Evil.marker = str(marker)
    torch.save(_Evil(), tmp_path / "scaler.pt")
    with pytest.raises(__import__("pickle").UnpicklingError, match="scaler.pt"):
        checkpointing.load_accelerator_state(tmp_path, [], [], [], [], 0, scaler=scaler)
    assert not marker.exists()


def _killed_between_renames(tmp_path, monkeypatch, *, after_marker: bool):
    """Save twice; make the second save die right after the first of its two renames."""
    from notebook_accel import checkpoint_folder

    (acc, model, *_), out = _full_checkpoint(tmp_path)
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real_replace = os.replace
    calls = []

    def dying_replace(src, dst):
        calls.append((str(src), str(dst)))
        real_replace(src, dst)
        if str(dst).endswith(".ckpt.old"):
            raise KeyboardInterrupt("killed between the two renames")

    if not after_marker:  # killed before the new folder was known complete: no marker written
        monkeypatch.setattr(checkpoint_folder, "atomic_write", lambda *a, **k: None)
    monkeypatch.setattr(checkpoint_folder.os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        acc.save_state(out, safe_serialization=False)
    monkeypatch.undo()
    assert not out.exists()  # hidden: the state a kill leaves
    return acc, out, first


def test_a_kill_between_the_renames_hides_no_checkpoint(tmp_path, monkeypatch):
    acc, out, first = _killed_between_renames(tmp_path, monkeypatch, after_marker=True)
    acc.load_state(out)  # recovered: the new, complete folder
    assert out.is_dir() and (out / "pytorch_model.bin").read_bytes() != first["pytorch_model.bin"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".ckpt")]
    acc2, out2, first2 = _killed_between_renames(tmp_path / "b", monkeypatch, after_marker=False)
    acc2.load_state(out2)  # the new folder is not known complete: the old one comes back
    assert (out2 / "pytorch_model.bin").read_bytes() == first2["pytorch_model.bin"]


def test_atomic_writes_fsync_and_clean_what_a_killed_writer_left(tmp_path, monkeypatch):
    from notebook_accel.utils.atomic_files import atomic_write

    target = tmp_path / "index.json"
    dead = tmp_path / ".index.json.999999999.abc.tmp"  # a pid that cannot exist
    alive = tmp_path / f".index.json.{os.getpid()}.abc.tmp"  # a writer still at work
    dead.write_text("half")
    alive.write_text("busy")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(
        os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))
    )
    atomic_write(str(target), lambda tmp: open(tmp, "w").write("{}"))
    assert target.read_text() == "{}"
    assert not dead.exists() and alive.exists()
    assert any(p.endswith(".tmp") for p in synced) and str(tmp_path) in synced  # the data, then the rename


# ---------------------------------------------------------------- offload folders and safetensors headers


def _dat_folder(tmp_path, index):
    from notebook_accel.utils.offload import offload_weight

    folder = tmp_path / "off"
    offload_weight(torch.arange(4, dtype=torch.float32), "w", folder)
    (folder / "index.json").write_text(__import__("json").dumps(index))
    return folder


@pytest.mark.parametrize(
    ("index", "error", "match"),
    [
        ({"w": {"dtype": "float32", "shape": [-1]}}, ValueError, r"'w' .*has shape \[-1\].*no -1"),
        ({"w": {"dtype": "float32", "shape": [2, -1]}}, ValueError, r"has shape \[2, -1\]"),
        ({"w": {"dtype": "float32", "shape": [3]}}, ValueError, "holds 16 bytes .*needs exactly 12"),
        ({"w": {"dtype": "float32", "shape": [8]}}, ValueError, "holds 16 bytes .*needs exactly 32"),
        ({"w": {"shape": [4]}}, ValueError, "'w' .*has no 'dtype'"),
        ({"w": {"dtype": "float32", "shape": 4}}, ValueError, "has shape 4"),
        ({"w": "float32"}, ValueError, "entry 'w' .*must be a dict"),
        ([["w", {"dtype": "float32"}]], TypeError, "must be a dict of weight name"),
        (
            {"../../x": {"dtype": "float32", "shape": [4]}},
            ValueError,
            "index key '../../x.dat' leaves the offload folder",
        ),
        ({"/etc/passwd": {"dtype": "uint8", "shape": [4]}}, ValueError, "leaves the offload folder"),
    ],
)
def test_a_bad_offload_index_is_refused_never_misread(tmp_path, index, error, match):
    from notebook_accel.utils.offload import OffloadedWeightsLoader

    folder = _dat_folder(tmp_path, index)
    with pytest.raises(error, match=match):
        loader = OffloadedWeightsLoader(save_folder=folder)
        [loader[k] for k in loader]


def test_offloaded_names_stay_inside_their_folder(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from notebook_accel.utils.offload import OffloadedWeightsLoader, offload_state_dict, offload_weight

    folder = tmp_path / "a" / "off"
    with pytest.raises(ValueError, match="weight name '../../x.dat' leaves the offload folder"):
        offload_weight(torch.ones(2), "../../x", folder)
    with pytest.raises(ValueError, match="leaves the offload folder"):
        offload_state_dict(folder, {"ok": torch.ones(1), "/tmp/evil": torch.ones(1)})
    assert not (tmp_path / "x.dat").exists() and not list(folder.glob("*.dat"))
    # A relative safetensors_file is the folder's own file, never one in the working directory.
    save_file({"t": torch.full((2,), 1.0)}, str(folder / "w.safetensors"))
    monkeypatch.chdir(tmp_path)
    save_file({"t": torch.full((2,), 666.0)}, str(tmp_path / "w.safetensors"))
    loader = OffloadedWeightsLoader(
        save_folder=folder, index={"t": {"safetensors_file": "w.safetensors", "weight_name": "t"}}
    )
    assert loader["t"].tolist() == [1.0, 1.0]
    loader = OffloadedWeightsLoader(
        save_folder=folder, index={"t": {"safetensors_file": "../../w.safetensors", "weight_name": "t"}}
    )
    with pytest.raises(ValueError, match="safetensors_file '../../w.safetensors' leaves the offload folder"):
        loader["t"]


def _safetensors_bytes(header: dict, data: bytes) -> bytes:
    import json
    import struct

    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (  # offsets that do not match dtype x shape: would hand out the next tensor's bytes
            _safetensors_bytes(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                },
                b"\x00" * 8,
            ),
            r"tensor 'a' \(F32 \[2\]\) needs 8 bytes but its data_offsets \[0, 4\] span 4",
        ),
        (b"\xff" * 8 + b"{}", "its header length .* exceeds the file"),  # unbounded header read
        (b"\x01\x02", "it holds 2 bytes, fewer than the 8-byte header length"),  # struct.error before
        (
            _safetensors_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\x00" * 8),
            "tensor .a. starts at byte 4 of the data, expected 0",
        ),
        (
            _safetensors_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\x00" * 12),
            "its tensors cover 4 bytes of data but the file holds 12",
        ),
        (
            _safetensors_bytes({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, b"\x00" * 4),
            "tensor .a. has unknown dtype .Q7.",
        ),
        (_safetensors_bytes([1, 2], b""), "its header is a JSON list, not an object"),
        (b"\x04\x00\x00\x00\x00\x00\x00\x00\xff\xfe{}", "its header is not UTF-8 JSON"),
    ],
)
def test_a_broken_safetensors_header_is_refused_as_safetensors_does(tmp_path, content, match):
    from safetensors import safe_open

    from notebook_accel.utils.offload import OffloadedWeightsLoader

    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own reader refuses the same file
        safe_open(str(path), framework="pt")
    loader = OffloadedWeightsLoader(index={"b": {"safetensors_file": str(path), "weight_name": "b"}})
    with pytest.raises(ValueError, match=f"bad.safetensors' is not a valid safetensors file: {match}"):
        loader["b"]


def test_a_failed_re_offload_leaves_the_earlier_offload_whole(tmp_path):
    from notebook_accel.utils.offload import OffloadedWeightsLoader, offload_state_dict

    folder = tmp_path / "off"
    offload_state_dict(folder, {"a": torch.full((3,), 1.0), "b": torch.full((2,), 2.0)})
    with pytest.raises(ValueError, match="meta device"):
        offload_state_dict(folder, {"a": torch.full((5,), 9.0), "b": torch.empty(2, device="meta")})
    loader = OffloadedWeightsLoader(save_folder=folder)
    assert loader["a"].tolist() == [1.0, 1.0, 1.0] and loader["b"].tolist() == [2.0, 2.0]
    assert sorted(p.name for p in folder.iterdir()) == ["a.dat", "b.dat", "index.json"]


# ---------------------------------------------------------------- devices in a device map


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (3.5, r"device_map\[''\] = 3.5 is not a device.*This machine has: .*cpu, disk"),
        ("cuda:7", r"device_map\[''\] = 'cuda:7' names cuda:7, which this machine does not have"),
        (None, r"device_map\[''\] = None is not a device"),
        (True, r"device_map\[''\] = True is not a device"),
    ],
)
def test_device_map_values_are_checked_up_front_by_every_loader(tmp_path, value, match):
    if torch.cuda.device_count() > 7 and value == "cuda:7":
        pytest.skip("this machine has a cuda:7")
    from safetensors.torch import save_file

    from notebook_accel.big_modeling import dispatch_model
    from notebook_accel.utils.modeling import load_checkpoint_in_model

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    save_file(model.state_dict(), str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match=match):
        dispatch_model(model, {"": value})
    with pytest.raises(ValueError, match=match):
        load_checkpoint_in_model(model, str(tmp_path / "m.safetensors"), device_map={"": value})
    assert next(model.parameters()).dtype == torch.float32  # Module.to(3.5) made it float64 before


def _fail_first_tries(counter_dir: str, failures: int, failing_rank: int = 1) -> int:
    """Return how many times this rank ran before; ``failing_rank`` raises on its first ``failures`` tries."""
    path = os.path.join(counter_dir, f"rank{_rank()}")
    tries = os.path.getsize(path) if os.path.exists(path) else 0
    with open(path, "a") as f:
        f.write("x")
    if _rank() == failing_rank and tries < failures:
        # Every rank of this try reaches this function first (a rank slow to start on a busy machine would
        # otherwise be stopped before it counted the try), so each rank counts every try of the group.
        deadline = time.monotonic() + 60
        peers = [os.path.join(counter_dir, f"rank{r}") for r in range(int(os.environ.get("WORLD_SIZE", "1")))]
        while time.monotonic() < deadline and not all(
            os.path.exists(p) and os.path.getsize(p) > tries for p in peers
        ):
            time.sleep(0.01)
        raise ValueError(f"try {tries} fails")
    return tries


def test_max_restarts_restarts_the_group_on_one_machine(tmp_path):
    sink = Collect()
    out = notebook_launcher(
        _fail_first_tries, args=(str(tmp_path), 2), num_processes=2, max_restarts=2, monitor_interval=0.05,
        sinks=[sink],
    )  # fmt: skip
    assert out == [2, 2]  # the third group succeeded; every rank ran three times
    restarts = [text for text in sink.announced if text.startswith("restarting the group")]
    assert len(restarts) == 2
    assert "(restart 1 of 2) after rank 1" in restarts[0] and "ValueError: try 0 fails" in restarts[0]
    assert "(restart 2 of 2)" in restarts[1] and "ValueError: try 1 fails" in restarts[1]


def test_max_restarts_exhausted_raises_the_last_failure(tmp_path):
    snap = Snapshot()
    with pytest.raises(LaunchError, match=r"rank 1 \(pid \d+\) ValueError: try 1 fails") as info:
        notebook_launcher(
            _fail_first_tries, args=(str(tmp_path), 5), num_processes=2, max_restarts=1, monitor_interval=0.05,
            sinks=[],
        )  # fmt: skip
    assert "all 2 attempts failed (max_restarts=1)" in str(info.value)
    assert "_fail_first_tries" in info.value.failures[0].traceback
    assert os.path.getsize(tmp_path / "rank1") == 2
    snap.assert_clean()


def test_max_restarts_restarts_a_single_process(tmp_path):
    # one process runs in a worker when it may need restarting (a failure must not end the kernel's call)
    out = notebook_launcher(
        _fail_first_tries, args=(str(tmp_path), 1, 0), num_processes=1, max_restarts=1, sinks=[]
    )
    assert out == [1] and os.path.getsize(tmp_path / "rank0") == 2


def test_parse_dump_reads_faulthandler_threads_innermost_first():
    from notebook_accel.launch.doctor import parse_dump

    text = (
        "Thread 0x00007f01 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 331 in wait\n\n'
        "Current thread 0x00007f02 (most recent call first):\n"
        '  File "/u/train.py", line 42 in step\n'
        '  File "/x/notebook_accel/launch/worker.py", line 9 in worker_main\n'
    )
    threads = parse_dump(text)
    assert [t.ident for t in threads] == ["0x00007f01", "0x00007f02"]
    assert threads[1].current and threads[1].runs_the_function and not threads[0].runs_the_function
    assert [(f.function, f.lineno) for f in threads[1].frames] == [("step", 42), ("worker_main", 9)]


def test_closing_the_stacks_files_waits_for_a_collection_under_way():
    """The launch ending (it removes the stacks files) while handle.stacks() waits for a dump: no error."""
    import subprocess

    from notebook_accel.launch.doctor import StackCollector
    from notebook_accel.launch.stackdump import REQUEST_SUFFIX

    collector = StackCollector()
    request = collector.path(0) + REQUEST_SUFFIX
    code = (  # a rank that takes requests and never answers them
        f"import os, time; os.mkfifo({request!r}); fd = os.open({request!r}, os.O_RDWR); "
        "print('ready', flush=True); time.sleep(30)"
    )
    deaf = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert deaf.stdout.readline() == "ready\n"
        open(collector.path(0), "w").close()  # its answering thread "started": a dump is waited for
        got: list = []
        taking = threading.Thread(target=lambda: got.append(collector.collect({0: deaf.pid})))
        taking.start()
        time.sleep(0.3)  # inside the second it waits for the dump
        collector.close()
        taking.join(10)
        assert [stacks[0].answered for stacks in got] == [False]  # answered "no dump", not FileNotFoundError
        assert not os.path.exists(collector.directory)
        assert collector.collect({0: deaf.pid}) == {}  # closed: nothing to collect, no error
    finally:
        deaf.kill()
        deaf.wait()
