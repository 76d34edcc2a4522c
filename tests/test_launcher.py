"""notebook_launcher / debug_launcher from a plain process: groups, output, results, failures, stops."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from notebook_accel.launch import LaunchError, LaunchHandle, OutputLine
from notebook_accel.launch.request import LaunchRequest
from notebook_accel.launchers import debug_launcher, notebook_launcher
from tests.launcher_helpers import Collect

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_launch_leaks")]


def _allreduce_rank() -> dict:
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item()}")
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": t,
        "cuda": torch.cuda.is_initialized(),
    }


def test_two_processes_form_a_gloo_group_and_return_values(capsys):
    results = notebook_launcher(_allreduce_rank, num_processes=2)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["sum"].item() == 3.0 for r in results)
    assert not any(r["cuda"] for r in results) and not torch.cuda.is_initialized()
    out = capsys.readouterr().out
    assert "[rank 0] rank 0 of 2 sum 3.0" in out and "[rank 1] rank 1 of 2 sum 3.0" in out
    plan_line = out.splitlines()[0]
    assert "2 process(es)" in plan_line and "gloo" in plan_line and "cpu" in plan_line and "fork" in plan_line
    assert "127.0.0.1:" in plan_line


def test_partial_state_in_workers_sees_the_group():
    from notebook_accel import state as state_mod

    # Singletons built in the kernel before the launch: the forked workers must not inherit them.
    assert state_mod.AcceleratorState().num_processes == 1
    state_mod.GradientState()

    def fn():
        state = state_mod.PartialState()
        t = torch.ones(1)
        dist.all_reduce(t)
        inherited = state_mod.AcceleratorState._shared_state or state_mod.GradientState._shared_state
        return (
            state.num_processes,
            state.process_index,
            state.distributed_type.value,
            t.item(),
            bool(inherited),
        )

    results = notebook_launcher(fn, num_processes=2, sinks=[])
    assert [r[:2] for r in results] == [(2, 0), (2, 1)]
    assert all("MULTI_CPU" in r[2] and r[3] == 2.0 and not r[4] for r in results)
    assert state_mod.PartialState().num_processes == 1  # the kernel's own state is untouched


def test_closure_args_env_contract_and_fd_level_output():
    secret = object.__new__(
        type("Local", (), {})
    )  # unpicklable-by-reference local object: fork needs no pickling

    def fn(scale):
        assert secret is not None
        os.write(1, b"c-level stdout\n")
        subprocess.run(["sh", "-c", "echo from a subprocess; echo to stderr >&2"], check=True)
        print("py stderr", file=sys.stderr)
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        env = {k: os.environ[k] for k in keys}
        env.update(
            {
                k: os.environ.get(k)
                for k in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_CPU", "ACCELERATE_FORK_LAUNCHED")
            }
        )
        return env, torch.full((2,), scale), torch.get_num_threads(), None

    sink = Collect()
    results = notebook_launcher(fn, args=(3.0,), num_processes=2, mixed_precision="bf16", sinks=[sink])
    for rank, (env, tensor, threads, none) in enumerate(results):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "127.0.0.1"
        assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and env["ACCELERATE_USE_CPU"] == "1"
        assert env["ACCELERATE_FORK_LAUNCHED"] == "1"
        assert tensor.tolist() == [3.0, 3.0] and threads >= 1 and none is None
        assert {"c-level stdout", "from a subprocess"} <= set(sink.texts(rank, "stdout"))
        assert {"to stderr", "py stderr"} <= set(sink.texts(rank, "stderr"))
    assert "RANK" not in os.environ and sink.announced and "mixed precision bf16" in sink.announced[0]


def _fail_on_rank_1():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    time.sleep(60)  # rank 0 must be stopped, not left waiting


def test_failing_rank_raises_with_rank_pid_and_traceback():
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 \(pid \d+\) ValueError: rank one is unhappy") as info:
        notebook_launcher(_fail_on_rank_1, num_processes=2, sinks=[])
    assert time.monotonic() - start < 20
    root = info.value.failures[0]
    assert root.rank == 1 and root.exc_type == "ValueError" and root.pid
    assert "_fail_on_rank_1" in root.traceback and "rank one is unhappy" in str(info.value)
    # what Accelerate's launchers raise, so `except ChildFailedError` written for it catches ours
    assert isinstance(info.value, ChildFailedError) and isinstance(info.value, RuntimeError)
    assert info.value.get_first_failure() == (1, root)
    assert info.value.format_msg() == str(info.value)


def _rank_1_fails_rank_0_ignores_sigterm():
    if int(os.environ["RANK"]) == 1:
        time.sleep(0.5)  # let rank 0 install its handlers first
        raise ValueError("rank one is unhappy")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    time.sleep(30)  # ends normally unless killed


def test_a_rank_ignoring_sigterm_is_killed():
    handle = notebook_launcher(_rank_1_fails_rank_0_ignores_sigterm, num_processes=2, sinks=[], block=False)
    with pytest.raises(LaunchError, match=r"rank 1 \(pid \d+\) ValueError: rank one is unhappy"):
        handle.result()
    rank0 = handle.status()[0]
    # SIGTERM was ignored, so the stop escalated; without SIGKILL rank 0 would end its sleep normally
    assert rank0.state == "stopped" and rank0.exitcode == -signal.SIGKILL


def _killed_rank_1():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 is blocked here until stopped
    time.sleep(60)


def test_rank_killed_by_a_signal():
    with pytest.raises(LaunchError, match=r"rank 1 .*killed by SIGKILL") as info:
        notebook_launcher(_killed_rank_1, num_processes=2, sinks=[])
    root = info.value.failures[0]
    assert root.signal == "SIGKILL" and root.exitcode == -signal.SIGKILL


def test_rank_exiting_without_a_result():
    def fn():
        if int(os.environ["RANK"]) == 0:
            os._exit(3)
        return 1

    with pytest.raises(LaunchError, match=r"rank 0 .*ExitCode: exited with code 3"):
        notebook_launcher(fn, num_processes=2, sinks=[])


def test_non_blocking_handle_status_subscribe_and_stop():
    def fn():
        print("started", flush=True)
        time.sleep(60)

    handle = notebook_launcher(fn, num_processes=2, block=False, sinks=[])
    assert isinstance(handle, LaunchHandle) and handle.num_processes == 2 and all(handle.pids)
    seen: list[OutputLine] = []
    ready = threading.Event()

    def on_line(line):
        seen.append(line)
        if len({ln.rank for ln in seen if ln.text == "started"}) == 2:
            ready.set()

    unsubscribe = handle.subscribe(on_line)
    assert ready.wait(20) and not handle.done and not handle.wait(0.01)
    assert {s.state for s in handle.status()} == {"running"}
    assert handle.status()[0].last_line == "started" and handle.lines(1)[0].text == "started"
    unsubscribe()
    finished: list[LaunchHandle] = []
    handle.add_done_callback(finished.append)
    handle.stop()
    handle.stop()  # idempotent
    assert handle.wait(20) and handle.done and finished == [handle]
    assert {s.state for s in handle.status()} == {"stopped"}
    assert all(s.ended_at is not None for s in handle.status())
    with pytest.raises(LaunchError, match="stopped by the user"):
        handle.result()
    late: list[OutputLine] = []
    handle.subscribe(late.append)  # replays the history after the end
    assert len(late) == 2 and isinstance(handle.error, LaunchError)
    handle.add_done_callback(finished.append)
    assert finished == [handle, handle]


def test_keyboard_interrupt_stops_every_worker():
    def fn():
        time.sleep(60)

    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(fn, num_processes=2, sinks=[])
    timer.join()
    assert time.monotonic() - start < 15


def _matmul_on_two_threads() -> int:
    torch.set_num_threads(2)
    a = torch.randn(400, 400)
    for _ in range(3):
        a = (a @ a).tanh()
    return torch.get_num_threads()


def test_forked_ranks_run_threaded_ops_after_the_caller_did():
    # The caller has run a parallel op (GNU OpenMP started its pool in this thread); a rank forked
    # from this thread inherited a pool without threads and hung in its first op on two threads.
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _matmul_on_two_threads()
        got = notebook_launcher(_matmul_on_two_threads, num_processes=2, sinks=[], timeout=40)
    finally:
        torch.set_num_threads(before)
    assert got == [2, 2]


def test_text_the_caller_had_buffered_is_written_once_by_the_caller(tmp_path):
    # A script whose stdout goes to a file is block-buffered: each forked rank used to flush the
    # caller's pending text into the caller's stdout before taking its own pipe (3 copies, 2 ranks).
    script = tmp_path / "buffered.py"
    script.write_text(
        textwrap.dedent(
            """
            import io, sys
            sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False), 1 << 16))
            from notebook_accel import notebook_launcher
            print("pending in the caller")
            got = []
            notebook_launcher(lambda: print("from a rank"), num_processes=2, sinks=[lambda ln: got.append(ln.text)])
            print("ranks said", got)
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("pending in the caller") == 1, out.stdout
    assert "ranks said ['from a rank', 'from a rank']" in out.stdout


def _fork_from_a_worker() -> int:
    from notebook_accel.launch.procs import _FORKER

    pid = _FORKER.fork(lambda: os._exit(7))
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_forked_worker_can_fork_through_the_launcher_thread_in_turn():
    # The caller holds the fork thread's lock while a worker is forked; the worker's copy of it must
    # not stay held (a launch from inside a worker waited forever).
    assert notebook_launcher(_fork_from_a_worker, num_processes=2, sinks=[], timeout=30) == [7, 7]


_THREADED_FORK = "multi-threaded, use of fork() may lead to deadlocks"


def _fork_warnings(log: list) -> list[str]:
    return [str(w.message) for w in log if _THREADED_FORK in str(w.message)]


@pytest.mark.skipif(
    sys.version_info < (3, 12), reason="Python warns about fork in a threaded process from 3.12"
)
def test_a_fork_launch_from_a_threaded_process_gives_no_fork_warning():
    # Forking from the launcher's own thread is deliberate (launch/procs.py): Python 3.12+'s warning
    # about it must not reach the user, while the same warning from anyone else's fork still does.
    helper = threading.Thread(target=time.sleep, args=(2,))
    helper.start()  # a second thread besides the fork thread, as in a kernel
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        filters = list(warnings.filters)
        assert notebook_launcher(os.getpid, num_processes=2, sinks=[], timeout=30) != []
        assert list(warnings.filters) == filters
        assert _fork_warnings(log) == []
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        assert len(_fork_warnings(log)) == 1  # the test's own fork is warned about
    helper.join()


def test_only_the_threaded_fork_warning_of_the_fork_thread_is_silenced(monkeypatch):
    # Runs on every Python: a stand-in os.fork emits 3.12's warning text, attributed (stacklevel=2)
    # to the caller of os.fork, as CPython does; the real filter logic decides.
    from notebook_accel.launch import procs

    said: list[str] = []

    def fake_fork() -> int:
        for text in said:
            warnings.warn(text, DeprecationWarning, stacklevel=2)
        return 4242

    monkeypatch.setattr(os, "fork", fake_fork)
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("error")  # as `-W error::DeprecationWarning` would
        filters = list(warnings.filters)
        said[:] = [f"This process (pid={os.getpid()}) is {_THREADED_FORK} in the child."]
        assert procs._fork_without_thread_warning() == 4242
        assert list(warnings.filters) == filters  # nothing left behind
        warnings.simplefilter("always")
        said.append("some other deprecation")
        assert procs._fork_without_thread_warning() == 4242
        assert [str(w.message) for w in log] == ["some other deprecation"]
        warnings.warn(said[0], DeprecationWarning, stacklevel=1)  # the same text from elsewhere shows
        assert len(_fork_warnings(log)) == 1


def test_default_port_taken_falls_back_explicit_port_taken_is_an_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"use_port='{port}' is already in use"):
            notebook_launcher(_allreduce_rank, num_processes=2, use_port=str(port), sinks=[])
    try:
        with socket.socket() as default:
            default.bind(("127.0.0.1", 29500))
            default.listen()
            sink = Collect()
            assert notebook_launcher(_allreduce_rank, num_processes=2, sinks=[sink])[0]["sum"].item() == 3.0
            assert "127.0.0.1:29500" not in sink.announced[0]
    except OSError:  # 29500 is busy anyway (another process): the fallback was exercised all the same
        assert notebook_launcher(_allreduce_rank, num_processes=2, sinks=[])[0]["world"] == 2


def test_timeout_stops_the_launch():
    def fn():
        time.sleep(60)

    with pytest.raises(LaunchError, match=r"TimeoutError: still running after timeout=1.0 s"):
        notebook_launcher(fn, num_processes=2, sinks=[], timeout=1.0)


def test_single_process_runs_in_the_caller(capsys):
    assert notebook_launcher(os.getpid, num_processes=1) == [os.getpid()]
    assert "in the calling process" in capsys.readouterr().out
    assert notebook_launcher(os.getpid) == [os.getpid()]  # None on a CPU machine


def test_single_process_with_sinks_runs_in_one_worker_so_they_get_its_lines():
    sink = Collect()

    def fn():
        print("hello from the one rank")
        return os.getpid()

    assert notebook_launcher(fn, num_processes=1, sinks=[sink]) != [os.getpid()]
    assert "start method fork" in sink.announced[0]
    assert sink.texts(0, "stdout") == ["hello from the one rank"]


def test_log_dir_and_prefix_template(tmp_path, capsys):
    results = notebook_launcher(
        _allreduce_rank,
        num_processes=2,
        log_dir=tmp_path,
        rdzv_id="run1",
        log_line_prefix_template="<{role_name}:{rank}/${local_rank}> ",
    )
    assert len(results) == 2
    for rank in range(2):
        text = (tmp_path / "run1" / f"rank_{rank}" / "stdout.log").read_text()
        assert f"rank {rank} of 2" in text
        assert (tmp_path / "run1" / f"rank_{rank}" / "stderr.log").exists()
    assert "<default:1/1> rank 1 of 2" in capsys.readouterr().out


def test_debug_launcher_and_debug_mode_dry_run(monkeypatch):
    assert [r["world"] for r in debug_launcher(_allreduce_rank)] == [2, 2]
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "1")
    sink = Collect()
    assert [r["sum"].item() for r in notebook_launcher(_allreduce_rank, num_processes=2, sinks=[sink])] == [
        3.0,
        3.0,
    ]
    assert "debug dry run" in sink.announced[0]


def _main_function():
    """Return a function that lives in __main__ (like a notebook cell's) with a closure."""
    namespace = {"__name__": "__main__"}
    source = (
        "import torch, torch.distributed as dist\n"
        "def make(offset):\n"
        "    def cell_fn(x):\n"
        "        dist.init_process_group('gloo')\n"
        "        t = torch.tensor([x + offset + dist.get_rank()])\n"
        "        dist.all_reduce(t)\n"
        "        print('spawned', dist.get_rank())\n"
        "        return t.item(), torch.cuda.is_initialized()\n"
        "    return cell_fn\n"
    )
    exec(compile(source, "<cell>", "exec"), namespace)
    return namespace["make"](10.0)


# spawn ships a cell function the same way: in a real kernel, test_launcher_kernel.py's
# test_spawn_from_a_kernel_ships_the_cell_function (and debug_launcher's spawn in
# test_a_failure_caused_by_the_launching_process_says_what_to_do).
@pytest.mark.parametrize("method", ["forkserver"])
def test_spawn_and_forkserver_ship_notebook_functions_by_value(method):
    sink = Collect()
    results = notebook_launcher(
        _main_function(), args=(1.0,), num_processes=2, start_method=method, sinks=[sink]
    )
    assert results == [(23.0, False), (23.0, False)]
    assert sink.texts(0) == ["spawned 0"] and method in sink.announced[0]


def test_refuses_to_fork_gpu_workers_after_cuda_was_initialised(monkeypatch):
    monkeypatch.setattr("notebook_accel.launch.plan._cuda_device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setitem(sys.modules, "bitsandbytes", type(sys)("bitsandbytes"))
    with pytest.raises(
        RuntimeError, match=r"CUDA is already initialised.*bitsandbytes.*start_method=\"spawn\""
    ):
        notebook_launcher(_allreduce_rank, num_processes=2, sinks=[])


def test_cpu_workers_may_be_forked_after_cuda_was_initialised(monkeypatch):
    # As DataLoader workers are: they never touch the parent's CUDA context (seen on a GPU machine:
    # debug_launcher was refused once any earlier cell had used CUDA).
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert [r["sum"].item() for r in debug_launcher(_allreduce_rank, num_processes=2)] == [3.0, 3.0]
    assert [r["sum"].item() for r in notebook_launcher(_allreduce_rank, num_processes=2, sinks=[])] == [
        3.0,
        3.0,
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mixed_precision": "fp17"}, ValueError, "mixed_precision='fp17' .*no, fp16, bf16, fp8"),
        ({"num_processes": 0}, ValueError, "num_processes=0 must be a positive integer"),
        ({"start_method": "thread"}, ValueError, "start_method='thread' .*fork, spawn, forkserver"),
        ({"rdzv_backend": "etcd"}, ValueError, "rdzv_backend='etcd' .*static, c10d"),
        (
            {"num_nodes": 2, "node_rank": 2},
            ValueError,
            r"node_rank=2 must be an integer in \[0, num_nodes=2\)",
        ),
        ({"num_nodes": 0}, ValueError, "num_nodes=0 must be a positive integer"),
        ({"use_port": "http"}, ValueError, "use_port='http' is not a port number"),
        ({"use_port": "70000"}, ValueError, "use_port='70000' is out of range"),
        (
            {"log_line_prefix_template": "{nope}"},
            ValueError,
            "log_line_prefix_template='{nope}' cannot be formatted",
        ),
        ({"timeout": 0}, ValueError, "timeout=0 must be a positive number"),
        ({"args": 5}, TypeError, "args must be a tuple"),
        ({"sinks": [42]}, TypeError, "sinks must be callables"),
        (
            {"master_addr": "no-such-host.invalid"},
            ValueError,
            "master_addr='no-such-host.invalid' does not resolve",
        ),
        ({"num_nodes": 2, "block": False}, ValueError, "block=False is not available with num_nodes > 1"),
        ({"num_nodes": 2, "rdzv_backend": "c10d"}, ValueError, "rdzv_backend='c10d' needs rdzv_endpoint"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    kwargs = {"num_processes": 2, "sinks": [], **kwargs}
    with pytest.raises(error, match=match):
        notebook_launcher(_allreduce_rank, **kwargs)


def test_bad_function():
    with pytest.raises(TypeError, match="function must be callable"):
        notebook_launcher(42)
    with pytest.raises(TypeError, match="function must be callable"):
        debug_launcher("nope")


def test_unpicklable_result_is_reported():
    def fn():
        return lambda: None

    with pytest.raises(LaunchError, match=r"TypeError: rank \d returned a function that cannot be pickled"):
        notebook_launcher(fn, num_processes=2, sinks=[])


def test_panel_option(monkeypatch):
    shown = []

    class FakePanel:
        def __init__(self, handle):
            self.handle = handle

        def display(self):
            shown.append(self.handle)

    fake = type(sys)("notebook_accel.widgets")
    fake.LaunchPanel = FakePanel
    monkeypatch.setitem(sys.modules, "notebook_accel.widgets", fake)
    assert len(notebook_launcher(_allreduce_rank, num_processes=2, sinks=[], panel=True)) == 2
    assert len(shown) == 1 and isinstance(shown[0], LaunchHandle) and shown[0].done
    monkeypatch.setitem(sys.modules, "notebook_accel.widgets", None)
    with pytest.raises(ImportError, match="panel=True needs the launch panel"):
        notebook_launcher(_allreduce_rank, num_processes=2, sinks=[], panel=True)


def test_panel_true_prints_no_worker_lines_unless_sinks_say_so(capsys):
    # The real panel: outside a kernel its display() prints a text summary, never the lines.
    pytest.importorskip("ipywidgets")
    from notebook_accel.launch import PrintSink

    results = notebook_launcher(_allreduce_rank, num_processes=2, panel=True)
    assert [r["rank"] for r in results] == [0, 1]
    out = capsys.readouterr().out
    assert "LaunchPanel(" in out
    assert not [line for line in out.splitlines() if line.startswith("[rank ")], out
    # An explicit sinks list is honoured with a panel too.
    collect = Collect()
    notebook_launcher(_allreduce_rank, num_processes=2, panel=True, sinks=[PrintSink(), collect])
    out = capsys.readouterr().out
    assert "[rank 0] rank 0 of 2 sum 3.0" in out and "[rank 1] rank 1 of 2 sum 3.0" in out
    assert sorted(collect.texts()) == ["rank 0 of 2 sum 3.0", "rank 1 of 2 sum 3.0"]
    for thread in threading.enumerate():  # the panels' tickers end with their launch
        if thread.name == "notebook_accel-launch-panel":
            thread.join(5)


def test_colab_tpu_goes_through_torch_xla(monkeypatch):
    monkeypatch.setenv("COLAB_TPU_ADDR", "10.0.0.2:8470")
    monkeypatch.setitem(sys.modules, "torch_xla", None)
    with pytest.raises(ImportError, match="TPU runtime was detected \\(colab\\).*pip install torch_xla"):
        notebook_launcher(_allreduce_rank)
    calls = []

    def spawn(fn, args, nprocs, start_method):
        calls.append((nprocs, start_method))
        for i in range(nprocs):
            fn(i, *args)

    xmp = type(sys)("torch_xla.distributed.xla_multiprocessing")
    xmp.spawn = spawn
    for name, mod in (
        ("torch_xla", type(sys)("torch_xla")),
        ("torch_xla.distributed", type(sys)("torch_xla.distributed")),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setitem(sys.modules, "torch_xla.distributed.xla_multiprocessing", xmp)
    sys.modules["torch_xla"].distributed = sys.modules["torch_xla.distributed"]
    sys.modules["torch_xla.distributed"].xla_multiprocessing = xmp
    assert notebook_launcher(lambda x: x * 2, args=(21,), num_processes=2) == [42, 42]
    assert calls == [(2, "fork")]


@pytest.mark.parametrize(
    ("gpus", "platform_env", "num_processes", "expected"),
    [
        (4, {}, None, (4, "nccl", "cuda", "MULTI_GPU", False)),
        (4, {}, 2, (2, "nccl", "cuda", "MULTI_GPU", False)),
        (1, {"COLAB_GPU": "1"}, None, (1, "nccl", "cuda", "NO", True)),  # a single Colab GPU: in process
        (0, {"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, 2, (2, "gloo", "cpu", "MULTI_CPU", False)),
        (0, {}, None, (1, "gloo", "cpu", "NO", True)),
    ],
)
def test_plan_from_the_machine(monkeypatch, gpus, platform_env, num_processes, expected):
    from notebook_accel.launch import plan as plan_mod

    monkeypatch.setattr(plan_mod, "_cuda_device_count", lambda: gpus)
    for key, value in platform_env.items():
        monkeypatch.setenv(key, value)
    plan = plan_mod.resolve_plan(LaunchRequest(function=print, num_processes=num_processes))
    assert (
        plan.num_processes,
        plan.backend,
        plan.device_type,
        plan.distributed_type,
        plan.in_process,
    ) == expected
    assert plan.platform == {"COLAB_GPU": "colab", "KAGGLE_KERNEL_RUN_TYPE": "kaggle"}.get(
        next(iter(platform_env), ""), "local"
    )
    assert ("ACCELERATE_USE_CPU" in plan.env) == (gpus == 0)
    with pytest.raises(ValueError, match=r"num_processes=8 is more than the 4 visible CUDA device"):
        monkeypatch.setattr(plan_mod, "_cuda_device_count", lambda: 4)
        plan_mod.resolve_plan(LaunchRequest(function=print, num_processes=8))


def test_plan_reads_debug_mode_as_a_flag(monkeypatch):
    from notebook_accel.launch import plan as plan_mod

    on_cpu = LaunchRequest(function=print, num_processes=2, force_cpu=True)
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "yes")
    assert plan_mod.resolve_plan(on_cpu).debug is True
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "off")
    assert plan_mod.resolve_plan(on_cpu).debug is False
    # The workers would reject it too (PartialState reads the same flag): fail before forking.
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "maybe")
    with pytest.raises(ValueError, match=r"ACCELERATE_DEBUG_MODE='maybe' is not a flag"):
        plan_mod.resolve_plan(on_cpu)


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_workers_do_not_outlive_a_dead_launching_process(how):
    import psutil

    code = textwrap.dedent(
        """
        import sys, time
        from notebook_accel import notebook_launcher
        def f():
            time.sleep(60)
        handle = notebook_launcher(f, num_processes=2, block=False, sinks=[])
        print(handle.pids, flush=True)
        time.sleep(0 if sys.argv[1] == "exit" else 60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code, how], stdout=subprocess.PIPE, text=True)
    pids = eval(proc.stdout.readline())
    if how == "sigkill":
        proc.kill()
    proc.wait(timeout=30)
    proc.stdout.close()
    deadline = time.monotonic() + 10

    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in pids), f"workers {pids} outlived their launcher ({how})"


def test_launch_error_root_cause_first_and_traceback_cap():
    from notebook_accel.launch.errors import RankFailure, order_failures

    lost_peer = RankFailure(
        0, 10, "RuntimeError", "Connection closed by peer [127.0.0.1]:1", "tb0", 1, None, 1.00
    )
    killed = RankFailure(3, 13, "Signal", "killed by SIGKILL", "", -9, "SIGKILL", 1.05)
    others = [
        RankFailure(r, 20 + r, "ValueError", f"v{r}", f"Traceback\nValueError: v{r}", 1, None, 2.0 + r)
        for r in (4, 5, 6)
    ]
    ordered = order_failures([others[0], lost_peer, killed, *others[1:]])
    assert [f.rank for f in ordered] == [3, 0, 4, 5, 6]  # the death, not the peer that lost it, comes first
    text = str(LaunchError(ordered))
    assert text.startswith("rank 3 (pid 13) Signal: killed by SIGKILL")
    assert "4 other rank(s) also failed" in text and "(2 more traceback(s) hidden" in text
    assert LaunchError(ordered).root_cause is killed and str(LaunchError([], "stopped")) == "stopped"


def _backward_on_each_rank() -> float:
    x = torch.ones(3, requires_grad=True)
    (x * 2).sum().backward()
    return float(x.grad.sum())


def _raise_torchs_fork_error() -> None:
    # What torch raises in a forked rank when the launching process started autograd's device threads
    # (any backward on a machine with a GPU; seen there, see tests/test_cuda.py for the real one).
    raise RuntimeError(
        "Unable to handle autograd's threading in combination with fork-based multiprocessing. "
        "See https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork"
    )


def test_a_failure_caused_by_the_launching_process_says_what_to_do():
    with pytest.raises(
        LaunchError,
        match=r"(?s)Unable to handle autograd.*Cause: this process ran a backward pass.*"
        r"start_method=\"spawn\"",
    ):
        debug_launcher(_raise_torchs_fork_error, num_processes=2)
    with pytest.raises(LaunchError) as info:
        notebook_launcher(_fail_on_rank_1, num_processes=2, sinks=[])
    assert "Cause:" not in str(info.value)  # the rank's own bug gets no such line
    assert debug_launcher(_backward_on_each_rank, num_processes=2) == [6.0, 6.0]
    # the way out the cause names, for debug_launcher too
    assert debug_launcher(_backward_on_each_rank, num_processes=2, start_method="spawn") == [6.0, 6.0]
    with pytest.raises(ValueError, match="start_method='thread' .*fork, spawn, forkserver"):
        debug_launcher(_backward_on_each_rank, start_method="thread")


def test_line_splitter_cuts_lines_across_chunks():
    from notebook_accel.launch.output import LineSplitter

    lines: list[str] = []
    splitter = LineSplitter(3, "stderr", lambda line: lines.append((line.rank, line.stream, line.text)))
    # A \r\n cut between two reads is one line end; a lone \r (progress bar redraw) ends a line too,
    # repeated \r make no empty lines, empty \n lines are kept, and a UTF-8 character cut in two is whole.
    for chunk in (b"one\r", b"\ntwo\n\n 10%\r 20%\r\r", b"caf\xc3", b"\xa9\nlast"):
        splitter.feed(chunk)
    assert [text for *_, text in lines] == ["one", "two", "", " 10%", " 20%", "café"]
    splitter.close()
    assert lines[-1] == (3, "stderr", "last")


def test_results_are_detached_cpu_copies_in_the_same_containers():
    import collections

    from notebook_accel.launch.worker import to_cpu

    Pair = collections.namedtuple("Pair", "tensor label")
    weight = torch.ones(2, requires_grad=True)
    value = {"out": [Pair(weight * 2, "x")], "n": 3, "meta": collections.OrderedDict(t=torch.zeros(1))}
    moved = to_cpu(value)
    pair = moved["out"][0]
    assert isinstance(pair, Pair) and pair.label == "x" and moved["n"] == 3
    assert (
        not pair.tensor.requires_grad and pair.tensor.grad_fn is None and pair.tensor.tolist() == [2.0, 2.0]
    )
    assert type(moved["meta"]) is collections.OrderedDict and moved["meta"]["t"].device.type == "cpu"
