"""notebook_launcher from a real ipykernel: cell functions, per-rank output, failures, interrupts, leaks."""

from __future__ import annotations

import re
import textwrap
import time
from collections.abc import Callable, Iterator

import pytest

from tests.launcher_helpers import StartedKernel, printed_by, shows

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

pytestmark = pytest.mark.timeout(120)


class Kernel(StartedKernel):
    """A started ipykernel and a client; ``run(code)`` returns (status, stdout, stderr, error name)."""

    def run(self, code: str, timeout: float = 60, interrupt_after: str | Callable[[str], bool] | None = None):
        out: list[str] = []
        err: list[str] = []
        ename: list[str] = []
        interrupted = False
        for msg in self.cell(textwrap.dedent(code), timeout):
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                (out if content["name"] == "stdout" else err).append(content["text"])
                if interrupt_after and not interrupted and shows(interrupt_after, "".join(out)):
                    self.km.interrupt_kernel()
                    interrupted = True
            elif kind == "error":
                ename.append(content["ename"])
                err.append("\n".join(content["traceback"]))
        return self.reply["content"]["status"], "".join(out), "".join(err), ename[0] if ename else None

    def interrupted(
        self, code: str, after: str | Callable[[str], bool], timeout: float = 60
    ) -> tuple[float, str, str]:
        """Return (seconds, stdout, stderr) of ``code`` stopped with the Stop button once ``after`` was printed."""
        started = time.monotonic()
        status, out, err, ename = self.run(code, timeout=timeout, interrupt_after=after)
        assert status == "error" and ename == "KeyboardInterrupt", (status, out, err)
        return time.monotonic() - started, out, err

    def ok(self, code: str, timeout: float = 120) -> str:
        """Return the stdout of ``code`` run as one cell, asserting it raised nothing."""
        status, out, err, _ = self.run(code, timeout=timeout)
        assert status == "ok", (out, err)
        return out


def interactive_kernel(setup: str, timeout: float = 120) -> Iterator[Kernel]:
    """Yield a :class:`Kernel` that ran ``setup``, then stop its interactive ranks and close it (a fixture's body)."""
    k = Kernel()
    k.ok(setup, timeout)
    yield k
    k.run("interactive.current() and interactive.current().stop()")
    k.close()


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    status, _, err, _ = k.run(
        """
        import os, signal, time, psutil, torch, torch.distributed as dist
        from notebook_accel import notebook_launcher
        from notebook_accel.launch import LaunchError
        from datetime import timedelta
        # The first TCPStore server opens a process-wide pipe pair for good: not a per-launch leak.
        _warm = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)
        del _warm
        # ipykernel < 7.4 (Python 3.10's) opens two eventfds for good the first time a thread other than
        # the main one prints, as the launcher's output pump does: not a per-launch leak either.
        import threading
        _printer = threading.Thread(target=print, args=("warm-up print from a thread",))
        _printer.start()
        _printer.join()
        def _leaks():
            kids = psutil.Process().children(recursive=True)
            return [c.pid for c in kids], len(os.listdir("/proc/self/fd"))
        """
    )
    assert status == "ok", err
    yield k
    k.close()


def _assert_no_leaks(kernel: Kernel, fds_before: int) -> None:
    status, out, err, _ = kernel.run("print(_leaks())")
    assert status == "ok", err
    kids, fds = eval(out.strip())
    assert kids == [], f"processes left in the kernel: {kids}"
    assert fds <= fds_before, f"kernel fds grew from {fds_before} to {fds}"


def _fds(kernel: Kernel) -> int:
    return eval(kernel.run("print(_leaks())")[1].strip())[1]


@pytest.fixture(autouse=True)
def _no_leaks(kernel: Kernel) -> Iterator[None]:
    """Check after each test that the kernel has no process left and no more file descriptors than before."""
    before = _fds(kernel)
    yield
    _assert_no_leaks(kernel, before)


def test_cell_function_on_two_processes(kernel):
    status, out, err, _ = kernel.run(
        """
        def train(scale):
            dist.init_process_group("gloo")
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            print(f"world {dist.get_world_size()} sum {t.item()}")
            return (t * scale).item(), torch.cuda.is_initialized()

        results = notebook_launcher(train, args=(2,), num_processes=2)
        print("RESULTS", results, torch.cuda.is_initialized())
        """
    )
    assert status == "ok", err
    assert sorted(printed_by(out, "world 2 sum 3.0")) == [0, 1]  # once as [ranks 0,1], or apart
    assert "RESULTS [(6.0, False), (6.0, False)] False" in out
    assert out.startswith("Launching 2 process(es) | backend gloo")


def test_failing_and_killed_ranks_in_a_kernel(kernel):
    status, out, err, ename = kernel.run(
        """
        def bad():
            dist.init_process_group("gloo")
            if dist.get_rank() == 1:
                raise ZeroDivisionError("cell rank failed")
            dist.barrier()
        notebook_launcher(bad, num_processes=2)
        """
    )
    assert status == "error" and ename == "LaunchError", (status, out, err)
    assert "rank 1" in err and "ZeroDivisionError: cell rank failed" in err and "in bad" in err
    status, out, err, ename = kernel.run(
        """
        def killed():
            dist.init_process_group("gloo")
            if dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.barrier()
        notebook_launcher(killed, num_processes=2)
        """
    )
    assert status == "error" and ename == "LaunchError" and "killed by SIGKILL" in err


def test_kernel_interrupt_stops_the_workers(kernel):
    kernel.interrupted(
        """
        def forever():
            print("working", flush=True)
            time.sleep(120)
        notebook_launcher(forever, num_processes=2)
        """,
        after=lambda out: 1 in printed_by(out, "working"),  # alone or as [ranks 0,1]
    )


def test_twenty_relaunches_and_busy_port_in_a_kernel(kernel):
    status, out, err, _ = kernel.run(
        """
        import socket
        def one():
            dist.init_process_group("gloo")
            t = torch.ones(1); dist.all_reduce(t)
            return t.item()
        ok = sum(notebook_launcher(one, num_processes=2, sinks=[]) == [2.0, 2.0] for _ in range(20))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); s.listen()
            port = s.getsockname()[1]
            try:
                notebook_launcher(one, num_processes=2, use_port=str(port), sinks=[])
            except RuntimeError as exc:
                print("EXPLICIT", "already in use" in str(exc))
        print("OK", ok)
        """
    )
    assert status == "ok", err
    assert "OK 20" in out and "EXPLICIT True" in out


def test_spawn_from_a_kernel_ships_the_cell_function(kernel):
    status, out, err, _ = kernel.run(
        """
        offset = 5
        def cell_fn():
            dist.init_process_group("gloo")
            return dist.get_rank() + offset
        print("SPAWN", notebook_launcher(cell_fn, num_processes=2, start_method="spawn", sinks=[]))
        """
    )
    assert status == "ok", err
    assert "SPAWN [5, 6]" in out


def test_restarts_in_a_kernel_print_each_attempt_and_stop_on_interrupt(kernel):
    define = """
        import tempfile
        _tries_dir = tempfile.mkdtemp()
        def flaky(failures):
            path = os.path.join(_tries_dir, os.environ["RANK"])
            tries = os.path.getsize(path) if os.path.exists(path) else 0
            with open(path, "a") as f:
                f.write("x")
            print(f"try {tries}", flush=True)
            dist.init_process_group("gloo")
            if dist.get_rank() == 1 and tries < failures:
                raise ValueError(f"try {tries} fails")
            dist.barrier()
            return tries
        """
    status, out, err, _ = kernel.run(
        define
        + 'print("RESULTS", notebook_launcher(flaky, (1,), num_processes=2, max_restarts=1, monitor_interval=0.05))'
    )
    assert status == "ok", err
    # both ranks print "try N": once as [ranks 0,1] when close together, else apart
    assert 1 in printed_by(out, "try 0") and re.search(r"\[(rank 1|ranks 0,1), attempt 2\] try 1\n", out), out
    assert (
        "restarting the group in 0.05 s (restart 1 of 1) after rank 1" in out and "RESULTS [1, 1]" in out
    ), out
    # ^C during the wait before a restart: the run ends there, nothing restarts, nothing is left.
    _, out, _ = kernel.interrupted(
        define + "notebook_launcher(flaky, (9,), num_processes=2, max_restarts=3, monitor_interval=60)",
        after="restarting the group",
    )
    assert "attempt 2" not in out, out
