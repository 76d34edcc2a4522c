"""``notebook_launcher`` and ``debug_launcher``: run a function on several processes from a notebook.

The workers are forked from the calling process (a Jupyter kernel), so a function defined in a cell,
closures included, runs as is. Each worker gets the torchrun environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so ``PartialState()`` / ``Accelerator()``
or a plain ``torch.distributed.init_process_group()`` inside the function form the process group.

Both entry points build one ``LaunchRequest`` (every option checked, frozen) and hand it to
``_launch``, which picks the path: in the caller, torch elastic or torch_xla, else worker processes
on this machine or across nodes, assembled by ``launch.runner.run_launch``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from .launch.elastic import launch_elastic
from .launch.handle import LaunchHandle
from .launch.output import OutputLine, announce
from .launch.plan import LaunchPlan, resolve_plan
from .launch.request import LaunchRequest
from .launch.restarts import RestartingHandle
from .launch.runner import build_sinks, run_launch
from .launch.xla import launch_xla
from .nodes.plan import place_ranks
from .nodes.spec import Nodes
from .state import AcceleratorState, PartialState
from .utils.constants import ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION
from .utils.device_info import check_cuda_p2p_ib_support, get_current_device_type, get_gpu_info
from .utils.enums import PrecisionType
from .utils.environment import are_libraries_initialized, patch_environment
from .utils.imports import is_mps_available, is_rocm_available
from .utils.launch import PrepareForLaunch
from .utils.versions import is_torch_version

__all__ = ["PrepareForLaunch", "debug_launcher", "notebook_launcher", "test_launch"]
__all__ += ["Nodes"]  # notebook_launcher(nodes=Nodes(...)): served beside the function that takes it
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += [
    "AcceleratorState",
    "ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION",
    "PartialState",
    "PrecisionType",
    "are_libraries_initialized",
    "check_cuda_p2p_ib_support",
    "get_current_device_type",
    "get_gpu_info",
    "is_mps_available",
    "is_rocm_available",
    "is_torch_version",
    "patch_environment",
]

# Options that need the launch in a worker process: the calling process cannot be timed out, its
# output cannot be sent to sinks or log files, and a panel watches a handle.
_WORKER_OPTIONS = ("timeout", "log_dir", "sinks", "panel")


def notebook_launcher(
    function: Callable,
    args: tuple = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    *,
    block: bool = True,
    panel: bool = False,
    start_method: str = "fork",
    log_dir: str | os.PathLike | None = None,
    sinks: Sequence[Callable[[OutputLine], None]] | None = None,
    timeout: float | None = None,
    progress_bars: str = "auto",
    hang_timeout: float | None = None,
    on_hang: str = "report",
    allow_oversubscribe: bool = False,
    nodes: Any = None,
    collapse_output: bool | float = True,
) -> list[Any] | LaunchHandle | RestartingHandle:
    """Return each rank's return value (a list indexed by rank) after running ``function(*args)`` on every process.

    Args:
        function: what every process runs; defined anywhere, a notebook cell included.
        args: positional arguments of ``function`` in every process (checked against its signature first).
        num_processes: processes on this machine (None: one per CUDA device, or 1 on a CPU). 1 runs
            in the calling process unless an option needs a worker (``timeout``, ``log_dir``,
            ``sinks``, ``panel``, ``max_restarts``, ``block=False``): then in one worker.
        mixed_precision: "no", "fp16", "bf16" or "fp8"; exported as ACCELERATE_MIXED_PRECISION.
        use_port: rendezvous port (the default one, when taken, is replaced by a free one).
        master_addr: address of the rank-0 node.
        node_rank, num_nodes: this machine's rank and the number of machines; ``num_nodes > 1``
            runs through torch.distributed.elastic (see ``notebook_accel.launch.elastic``).
        rdzv_backend, rdzv_endpoint, rdzv_conf, rdzv_id: elastic rendezvous settings (as in torchrun);
            ``"c10d"`` runs through torch elastic on one node too (``rdzv_id`` names the log folder).
        max_restarts, monitor_interval: after a rank fails, restart the group up to ``max_restarts`` times,
            ``monitor_interval`` s later (never after a stop, ^C or the timeout); a ``RestartingHandle``.
        log_line_prefix_template: prefix of each output line, e.g. "[{rank}]: " (``${rank}``,
            ``{local_rank}``, ``{role_name}`` work too); default "[rank N] ".
        block: False returns a ``LaunchHandle`` at once (status, live output, stacks, wait/result/stop).
        panel: show the live launch panel (``notebook_accel.widgets.LaunchPanel``). With the
            default ``sinks=None`` the lines then show in the panel only, not printed in the cell.
        start_method: "fork" (default; CUDA not initialised in the caller), "spawn" or "forkserver".
        log_dir: also write ``<log_dir>/<run_id>/rank_<N>/stdout.log`` and ``stderr.log``.
        sinks: callables receiving every ``OutputLine``; None prints in the cell with a rank prefix
            (nothing with ``panel=True``), [] prints nothing; a list is used as given, panel or not.
        timeout: seconds after which the workers are stopped and LaunchError (with where each rank
            was) is raised (with ``max_restarts``: counted over the whole run).
        progress_bars: "main": live bars of the main process's tqdm bars (panel or cell), "all": of
            every rank, "text": tqdm's own text; "auto": "main" in a kernel or panel, else "text".
        hang_timeout: seconds without progress after which the hang rule acts (None: 60 s; math.inf: never;
            guide: "A stuck rank"): a rank waiting that long for a busy one is reported once; every rank
            waiting that long, none moving, is a deadlock that stops the launch with every rank's stack.
        on_hang: what that report does: "report" (show it once, keep running) or "stop" (stop, raise with the stacks).
        allow_oversubscribe: accept ``num_processes`` above 64 per CPU core (else refused as a likely typo).
        nodes: run ``num_processes`` ranks on each of several machines from this kernel: ``"slurm"`` (the
            allocation's nodes), ``"slurm:<jobid>"``, SSH host names or a ``Nodes`` (guide: "Several machines").
        collapse_output: a line ranks print alike shows once in the cell, ``[ranks 0-3] text``, held up to
            0.25 s for the others (a number: that many s); False: each rank's (lines()/log_dir keep all).

    Raises:
        LaunchError: a rank raised or died; the root cause's rank, pid, type and traceback first.
        KeyboardInterrupt: re-raised after every worker was stopped.
        ValueError / TypeError / RuntimeError: bad arguments, a taken explicit port, CUDA
            initialised before a fork.
    """
    # Every parameter is the LaunchRequest field of the same name (a new one that is not fails here at once).
    request = LaunchRequest(**locals())
    return _launch(request)


def _launch(request: LaunchRequest) -> list[Any] | LaunchHandle | RestartingHandle:
    """Return the values (or the handle) of the launch ``request`` describes, on the path it needs."""
    plan = None
    if request.nodes is None:  # on this machine: torch_xla, torch elastic or the caller itself may run it
        plan = resolve_plan(request)
        ran = _launch_without_workers(request, plan)
        if ran is not None:
            return ran
    return run_launch(request, *place_ranks(request, plan))


def _launch_without_workers(request: LaunchRequest, plan: LaunchPlan) -> list[Any] | None:
    """Return the values of a launch that runs without our workers (torch_xla, torch elastic, the caller), else None."""
    if plan.backend == "xla":
        request.refuse_on("a TPU launch (torch_xla runs to the end)",
                          ("block", "sinks", "timeout", "panel", "log_dir", "collapse_output"))  # fmt: skip
        announce(build_sinks(plan, request), plan.describe())
        return launch_xla(request.function, request.args, plan)
    if plan.num_nodes > 1 or request.rdzv_backend != "static":
        request.refuse_on(
            "num_nodes > 1 or rdzv_backend='c10d' (torch elastic runs to the end)",
            ("block", "sinks", "timeout", "panel", "hang_timeout", "on_hang", "progress_bars", "collapse_output"),
        )  # fmt: skip
        announce(build_sinks(plan, request), plan.describe())
        return launch_elastic(
            request.function, request.args, plan, rdzv_backend=request.rdzv_backend,
            rdzv_endpoint=request.rdzv_endpoint, rdzv_conf=request.rdzv_conf, rdzv_id=request.rdzv_id,
            max_restarts=request.max_restarts, monitor_interval=request.monitor_interval,
            log_line_prefix_template=request.log_line_prefix_template, log_dir=request.log_dir,
        )  # fmt: skip
    needs_worker = not request.block or any(
        getattr(request, name) not in (None, False) for name in _WORKER_OPTIONS
    )
    needs_worker = needs_worker or request.max_restarts > 0  # a failed process is restarted from here
    if plan.in_process and not needs_worker:
        announce(build_sinks(plan, request), plan.describe())
        return [_run_in_caller(request)]
    return None


def _run_in_caller(request: LaunchRequest) -> Any:
    """Return ``function(*args)`` run here; a clean ``sys.exit(0)`` / ``sys.exit()`` returns None, as in a worker."""
    try:
        return request.function(*request.args)
    except SystemExit as exc:
        if exc.code in (0, None):
            return None
        raise


def debug_launcher(
    function: Callable, args: tuple = (), num_processes: int = 2, *, start_method: str = "fork"
) -> list[Any]:
    """Return each rank's return value after running ``function(*args)`` on ``num_processes`` CPU processes.

    Meant for tests of distributed code on a machine without accelerators: the workers use gloo on
    the CPU (ACCELERATE_USE_CPU=1) even where CUDA devices exist.

    Args:
        function: The function each process runs.
        args: The positional arguments it receives.
        num_processes: How many CPU processes to start (default 2).
        start_method: "fork" (default), or "spawn"/"forkserver" for fresh interpreters: on a machine
            with a GPU, ranks forked after a backward ran in this process cannot run one themselves.
    """
    request = LaunchRequest(
        function=function, args=args, num_processes=num_processes, force_cpu=True, start_method=start_method
    )
    return _launch(request)


def test_launch() -> None:
    """Build a ``PartialState`` (raises if this process cannot join its launch); Accelerate's launch self-check."""
    PartialState()
