"""``notebook_launcher`` and ``debug_launcher``: run a function on several processes from a notebook.

The workers are forked from the calling process (a Jupyter kernel), so a function defined in a cell,
closures included, runs as is. Each worker gets the torchrun environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so ``PartialState()`` / ``Accelerator()``
or a plain ``torch.distributed.init_process_group()`` inside the function form the process group.

Both entry points build one ``LaunchRequest`` (every option checked, frozen) and hand it to
``_launch``, which picks the path: in the caller, forked workers, torch elastic or torch_xla.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ._lazy import LazyModule
from .launch.cell_bars import CellBars, kernel_display
from .launch.collapse import CollapsingPrinter
from .launch.elastic import launch_elastic
from .launch.handle import LaunchHandle
from .launch.output import LogDirSink, OutputLine, PrintSink, announce
from .launch.plan import LaunchPlan, check_cuda_not_initialised, resolve_plan
from .launch.ports import DEFAULT_PORT, host_store
from .launch.request import LaunchRequest
from .launch.restarts import RestartingHandle
from .launch.xla import launch_xla
from .nodes.plan import join_nodes, node_plan
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

logger = logging.getLogger(__name__)
# The launch panel (panel=True): the widgets, and ipywidgets with them, load only when one is shown.
_widgets = LazyModule("notebook_accel.widgets")

_run_counter = itertools.count()
# Options that need the launch in a worker process: the calling process cannot be timed out, its
# output cannot be sent to sinks or log files, and a panel watches a handle.
_WORKER_OPTIONS = ("timeout", "log_dir", "sinks", "panel")


def _resolve_bars(progress_bars: str, panel: bool) -> tuple[bool, set[int] | None]:
    """Return (whether workers send bar events, the ranks shown live: None for all) for ``progress_bars``."""
    mode = progress_bars
    if mode == "auto":
        # A plain script keeps tqdm's own text; a notebook (or a panel) gets live bars.
        mode = "main" if panel or kernel_display() is not None else "text"
    if mode == "text":
        return False, None
    return True, ({0} if mode == "main" else None)


def _run_id(rdzv_id: str) -> str:
    if rdzv_id and rdzv_id != "none":
        return str(rdzv_id)
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_run_counter)}"


def _build_sinks(plan: LaunchPlan, request: LaunchRequest) -> list[Callable[[OutputLine], None]]:
    if request.sinks is not None:
        return list(request.sinks)
    if request.panel:
        # The panel shows every line; printing them too would fill whichever cell runs meanwhile.
        return []
    printer = PrintSink(prefix_template=request.log_line_prefix_template, num_processes=plan.num_processes,
                        node_rank=plan.node_rank, hosts=plan.hosts)  # fmt: skip
    window = request.collapse_seconds
    return [printer if window is None else CollapsingPrinter(printer, plan.supervised_ranks, window)]


def _show_panel(handle: LaunchHandle | RestartingHandle) -> None:
    try:
        panel_class = _widgets.LaunchPanel
    except ImportError as exc:
        raise ImportError(
            "panel=True needs the launch panel (notebook_accel.widgets.LaunchPanel) and ipywidgets: "
            f"pip install 'notebook-accel[panels]' ({exc})"
        ) from exc
    panel_class(handle).display()


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
    if request.nodes is not None:
        group, plan = _join(request)
        if request.max_restarts == 0:
            return _launch_workers(request, plan, group)
        return _launch_with_restarts(request, plan, group)
    plan = resolve_plan(request)
    if plan.backend == "xla":
        request.refuse_on("a TPU launch (torch_xla runs to the end)",
                          ("block", "sinks", "timeout", "panel", "log_dir", "collapse_output"))  # fmt: skip
        announce(_build_sinks(plan, request), plan.describe())
        return launch_xla(request.function, request.args, plan)
    if plan.num_nodes > 1 or request.rdzv_backend != "static":
        request.refuse_on(
            "num_nodes > 1 or rdzv_backend='c10d' (torch elastic runs to the end)",
            ("block", "sinks", "timeout", "panel", "hang_timeout", "on_hang", "progress_bars", "collapse_output"),
        )  # fmt: skip
        announce(_build_sinks(plan, request), plan.describe())
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
        announce(_build_sinks(plan, request), plan.describe())
        return [_run_in_caller(request)]
    if plan.in_process:
        plan = _with_workers(plan)
    if request.max_restarts == 0:
        return _launch_workers(request, plan)
    return _launch_with_restarts(request, plan)


def start_persistent_group(
    request: LaunchRequest, *, on_join: Callable[[Any], LaunchRequest] | None = None
) -> LaunchHandle:
    """Return the started handle of a group whose workers run ``request.function`` until it returns.

    The interactive ranks' launch (``notebook_accel.interactive``): the same plan, environment,
    sinks, log files, hang rule and panel as ``notebook_launcher(..., block=False)``, supervised by
    the handle's own thread; no bars are drawn in the calling cell (each command shows its own).
    With ``request.nodes``, ``on_join(group)`` (a ``nodes.remote.NodeGroup``, joined, no rank started
    yet: e.g. to open its stream relays) returns the request actually started.
    """
    if request.nodes is not None:
        group, plan = _join(request)
        if on_join is not None:
            try:
                request = on_join(group)
            except BaseException:
                group.close()
                raise
        return _start_persistent(request, plan, group)
    plan = resolve_plan(request)
    if plan.backend == "xla" or plan.num_nodes > 1:
        raise ValueError(
            f"a persistent group runs on one machine with gloo or nccl; this launch would use {plan.backend} "
            f"on {plan.num_nodes} node(s): use notebook_launcher for it"
        )
    if plan.in_process:
        plan = _with_workers(plan)
    return _start_persistent(request, plan)


def _join(request: LaunchRequest) -> tuple[Any, LaunchPlan]:
    """Return the joined agents of ``request.nodes`` and the plan across them (the agents end if the plan fails)."""
    group = join_nodes(request.nodes)
    try:
        return group, node_plan(request, group)
    except BaseException:
        group.close()
        raise


def _start_persistent(request: LaunchRequest, plan: LaunchPlan, group: Any = None) -> LaunchHandle:
    output = _open_output(request, plan, group)
    try:
        handle, release = _new_handle(request, plan, output, on_finish=output.close)
    except BaseException:
        output.close()
        raise
    try:
        handle._start(threaded=True)
    except BaseException:
        release()
        raise
    if request.panel:
        try:
            _show_panel(handle)
        except BaseException:
            handle.kill()
            handle.wait()
            raise
    return handle


def _run_in_caller(request: LaunchRequest) -> Any:
    """Return ``function(*args)`` run here; a clean ``sys.exit(0)`` / ``sys.exit()`` returns None, as in a worker."""
    try:
        return request.function(*request.args)
    except SystemExit as exc:
        if exc.code in (0, None):
            return None
        raise


@dataclass
class _RunOutput:
    """Where a launch's lines go, for all of its groups (one more after each restart)."""

    run_id: str
    sinks: list[Callable[[OutputLine], None]]
    log_sink: LogDirSink | None = None
    log_files: dict[int, dict[str, str]] = field(default_factory=dict)
    group: Any = None
    """The agents of a launch across nodes (``nodes.remote.NodeGroup``): they end with the launch."""

    def close(self) -> None:
        for sink in self.sinks:
            if isinstance(sink, CollapsingPrinter):
                sink.close()  # the lines it still holds, before the launch's outcome
        if self.log_sink is not None:
            self.log_sink.close()
        if self.group is not None:
            self.group.close()


def _open_output(request: LaunchRequest, plan: LaunchPlan, group: Any = None) -> _RunOutput:
    """Return the launch's sinks (and its log files when ``log_dir`` is given); it owns ``group`` from here."""
    try:
        output = _RunOutput(_run_id(request.rdzv_id), _build_sinks(plan, request), group=group)
    except BaseException:
        if group is not None:
            group.close()
        raise
    if request.log_dir is not None:
        ranks = plan.supervised_ranks
        output.log_sink = LogDirSink(request.log_dir, output.run_id, ranks)
        output.sinks.append(output.log_sink)
        output.log_files = {
            r: {s: str(output.log_sink.path(r, s)) for s in ("stdout", "stderr")} for r in ranks
        }
    return output


def _new_handle(
    request: LaunchRequest,
    plan: LaunchPlan,
    output: _RunOutput,
    *,
    attempt: int = 1,
    started: float | None = None,
    on_finish: Callable[[], None] | None = None,
) -> tuple[LaunchHandle, Callable[[], None]]:
    """Return a group's handle (not started) over freshly hosted stores, and the function releasing them.

    The plan, with the port found, is announced to the sinks first.
    """
    plan, stores = _host_stores(plan, explicit_port=str(request.use_port) != DEFAULT_PORT)
    announce(output.sinks, plan.describe())  # with the port the stores got (each group gets its own)

    def release() -> None:
        # Last references to the stores: their servers stop and the ports are free again.
        stores.clear()
        if on_finish is not None:
            on_finish()

    bar_events, live_bar_ranks = _resolve_bars(request.progress_bars, request.panel)
    handle = LaunchHandle(
        plan, request.function, request.args, sinks=output.sinks, timeout=request.timeout,
        run_id=output.run_id, log_files=output.log_files, on_finish=release, bar_events=bar_events,
        live_bar_ranks=live_bar_ranks, hang_timeout=request.effective_hang_timeout,
        on_hang=request.on_hang, attempt=attempt, started=started, backend=output.group,
    )  # fmt: skip
    return handle, release


def _show_cell_bars(request: LaunchRequest, handle: LaunchHandle | RestartingHandle) -> None:
    """Draw the live bars in the calling cell (in a kernel, bars on, no panel): above the lines that follow."""
    display = kernel_display()
    if display is not None and not request.panel and _resolve_bars(request.progress_bars, request.panel)[0]:
        CellBars(handle, display)


def _launch_workers(request: LaunchRequest, plan: LaunchPlan, group: Any = None) -> list[Any] | LaunchHandle:
    output = _open_output(request, plan, group)
    try:
        handle, release = _new_handle(request, plan, output, on_finish=output.close)
    except BaseException:
        output.close()
        raise
    _show_cell_bars(request, handle)
    try:
        handle._start(threaded=not request.block)
    except BaseException:
        release()
        raise
    return _serve(request, handle)


def _launch_with_restarts(
    request: LaunchRequest, plan: LaunchPlan, group: Any = None
) -> list[Any] | RestartingHandle:
    """Return the values (or the handle) of a launch whose group restarts after a failure."""
    output = _open_output(request, plan, group)

    def start_attempt(attempt: int, started: float) -> LaunchHandle:
        handle, release = _new_handle(request, plan, output, attempt=attempt, started=started)
        try:
            handle._start(threaded=False)  # supervised by the RestartingHandle's thread (or the caller)
        except BaseException:
            release()
            raise
        return handle

    handle = RestartingHandle(
        start_attempt, request.max_restarts, request.monitor_interval, timeout=request.timeout,
        sinks=output.sinks, on_finish=output.close,
    )  # fmt: skip
    handle._start(threaded=not request.block)  # a first group that cannot start raises here
    _show_cell_bars(request, handle)
    return _serve(request, handle)


def _serve(request: LaunchRequest, handle: LaunchHandle | RestartingHandle) -> list[Any] | Any:
    """Return the handle (``block=False``) or, once the launch ended, its values; show the panel first."""
    if request.panel:
        try:
            _show_panel(handle)
        except BaseException:
            handle.kill()
            handle._supervise() if request.block else handle.wait()
            raise
    if not request.block:
        return handle
    handle._run_here()
    return handle.result()


def _with_workers(plan: LaunchPlan) -> LaunchPlan:
    check_cuda_not_initialised(plan.start_method, plan.device_type)
    dist_type = "MULTI_GPU" if plan.device_type == "cuda" else "MULTI_CPU"
    return replace(plan, in_process=False, distributed_type=dist_type)


def _loopback(addr: str) -> bool:
    return addr in ("localhost", "::1") or addr.startswith("127.")


def _host_stores(plan: LaunchPlan, explicit_port: bool) -> tuple[LaunchPlan, list]:
    """Return the plan with the ports of the TCPStore(s) this process now hosts, and the stores.

    The workers connect to them as clients (TORCHELASTIC_USE_AGENT_STORE, as under torchrun), so the
    port is held from before the first fork to the end of the launch: nothing can take it meanwhile.
    The stores listen on ``master_addr`` only (127.0.0.1 by default), never on every interface.
    """
    store = host_store(plan.master_port, fallback=not explicit_port, host=plan.master_addr)
    stores = [store]
    dry_run_port = None
    if plan.debug:  # a separate store, so the dry run's keys never meet the real group's
        try:
            stores.append(host_store(0, fallback=True, host=plan.master_addr))
        except BaseException:
            stores.clear()
            raise
        dry_run_port = stores[1].port
    env = {**plan.env, "TORCHELASTIC_USE_AGENT_STORE": "True"}
    if (
        _loopback(plan.master_addr)
        and sys.platform.startswith("linux")
        and "GLOO_SOCKET_IFNAME" not in os.environ
    ):
        # Every peer is on this machine: gloo needs no host-name lookup (which in containers often
        # resolves to an address the peers cannot reach) and connects over loopback.
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return replace(plan, master_port=store.port, dry_run_port=dry_run_port, env=env), stores


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
