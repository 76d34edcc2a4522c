"""Multi-node launches through torch elastic: two launching processes on this machine act as two nodes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._dist import free_port
from tests.launcher_helpers import Snapshot

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist
    from notebook_accel import notebook_launcher
    from notebook_accel.launch import LaunchError

    def fn(fail):
        dist.init_process_group("gloo")
        if fail and dist.get_rank() == 1:
            raise KeyError("node one broke")
        t = torch.ones(1)
        dist.all_reduce(t)  # with fail, rank 0 loses its peer here
        print("world", dist.get_world_size(), "sum", t.item())
        return dist.get_rank() * 10

    node_rank, port, backend, fail = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    kwargs = {"rdzv_endpoint": f"127.0.0.1:{port}", "rdzv_id": "t" + port} if backend == "c10d" else {}
    try:
        values = notebook_launcher(fn, (fail,), num_processes=1, num_nodes=2, node_rank=node_rank,
                                   use_port=port, rdzv_backend=backend, **kwargs)
        print("RESULT", values)
    except LaunchError as exc:
        print("LAUNCHERROR", exc.failures[0].rank, exc.failures[0].exc_type, exc.failures[0].message)
    """
)


_ENDINGS_SCRIPT = textwrap.dedent(
    """
    import ctypes, sys
    import torch, torch.distributed as dist
    from notebook_accel import notebook_launcher
    from notebook_accel.launch import LaunchError

    def fn(mode):
        dist.init_process_group("gloo")
        if dist.get_rank() == 1 and mode == "segv":
            print("rank one about to crash", file=sys.stderr, flush=True)
            ctypes.string_at(0)  # SIGSEGV; rank 0 then loses its peer in all_reduce
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.barrier()
        if dist.get_rank() == 1:
            sys.exit(0)
        return dist.get_rank() * 10

    node_rank, port, backend, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    try:
        print("RESULT", notebook_launcher(fn, (mode,), num_processes=1, num_nodes=2, node_rank=node_rank,
                                          use_port=port))
    except LaunchError as exc:
        print("LAUNCHERROR", exc.failures[0].rank, exc.failures[0].message)
        print("TRACEBACK", exc.failures[0].traceback)
    """
)


def _run_two_nodes(tmp_path: Path, backend: str, fail: bool | str, script_text: str = _SCRIPT) -> list[str]:
    script = tmp_path / "node.py"
    script.write_text(script_text)
    port = str(free_port())
    mode = fail if isinstance(fail, str) else ("1" if fail else "0")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), port, backend, mode],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        return [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_two_nodes_form_one_group(tmp_path, backend):
    snap = Snapshot()
    outs = _run_two_nodes(tmp_path, backend, fail=False)
    for out in outs:
        assert "world 2 sum 2.0" in out, out
    if backend == "static":  # node ranks given: node 0 holds rank 0
        assert "[rank 0] world 2 sum 2.0" in outs[0] and "RESULT [0]" in outs[0], outs[0]
        assert "[rank 1] world 2 sum 2.0" in outs[1] and "RESULT [10]" in outs[1], outs[1]
    else:  # c10d assigns the node ranks
        assert sorted(o.split("RESULT ")[1].split()[0] for o in outs) == ["[0]", "[10]"], outs
    snap.assert_clean()


@pytest.mark.timeout(90)
def test_failure_on_one_node_is_a_launch_error(tmp_path):
    outs = _run_two_nodes(tmp_path, "static", fail=True)
    assert "LAUNCHERROR 1 KeyError 'node one broke'" in outs[1], outs[1]
    assert "LAUNCHERROR 0" in outs[0], outs[0]  # its peer vanished from the collective


@pytest.mark.timeout(90)
def test_clean_sys_exit_is_a_success_on_the_elastic_path(tmp_path):
    outs = _run_two_nodes(tmp_path, "static", "exit0", _ENDINGS_SCRIPT)
    assert "RESULT [0]" in outs[0], outs[0]
    assert "RESULT [None]" in outs[1], outs[1]  # rank 1 called sys.exit(0)


@pytest.mark.timeout(90)
def test_a_signal_death_on_the_elastic_path_carries_its_stderr_and_python_stack(tmp_path):
    outs = _run_two_nodes(tmp_path, "static", "segv", _ENDINGS_SCRIPT)
    assert "LAUNCHERROR 1 killed by SIGSEGV" in outs[1], outs[1]
    traceback = outs[1].split("TRACEBACK", 1)[1]
    assert "Last stderr lines of rank 1:" in traceback and "rank one about to crash" in traceback, outs[1]
    # faulthandler's dump, read back from elastic's log file: the Python frame that crashed
    assert "Fatal Python error: Segmentation fault" in traceback and "in fn" in traceback, outs[1]


_ONE_NODE_C10D = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    from notebook_accel import notebook_launcher, PartialState

    def fn():
        state = PartialState()
        t = torch.ones(1)
        dist.all_reduce(t)
        # torch elastic's agent sets TORCHELASTIC_RUN_ID in the workers it starts
        print("rank", state.process_index, "world", state.num_processes, "sum", t.item(),
              "elastic", os.environ.get("TORCHELASTIC_RUN_ID"), flush=True)
        return state.process_index * 10

    print("RESULT", notebook_launcher(fn, num_processes=2, rdzv_backend="c10d", use_port=sys.argv[1],
                                      rdzv_id="onenode" + sys.argv[1]))
    """
)


def test_c10d_on_one_node_runs_through_elastics_rendezvous():
    # 1.15 accepts rdzv_backend="c10d" on one node and launches through torch elastic; so do we
    port = str(free_port())
    proc = subprocess.run([sys.executable, "-c", _ONE_NODE_C10D, port], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "RESULT [0, 10]" in proc.stdout, out[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} world 2 sum 2.0 elastic onenode{port}" in out, out[-4000:]


def test_c10d_on_one_node_refuses_what_elastic_cannot_do():
    from notebook_accel import notebook_launcher

    with pytest.raises(
        ValueError, match=r"sinks=\(\) is not available with num_nodes > 1 or rdzv_backend='c10d'"
    ):
        notebook_launcher(print, num_processes=2, rdzv_backend="c10d", sinks=[])
