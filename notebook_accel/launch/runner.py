"""The one path that assembles a launch of ranks in worker processes: local, persistent (interactive), across nodes.

``run_launch`` (``notebook_launcher``'s worker launches) and ``start_persistent_group`` (the interactive
ranks) take a checked ``LaunchRequest``, its ``LaunchPlan`` and the ``WorkerBackend`` the ranks run on
(``procs.LocalProcesses``, or the joined agents of ``nodes.remote.NodeGroup``). From there it is the
same for all: open the output sinks and log files, host the TCPStores, build the handle (one per try
with restarts), start it, show the panel and the cell's bars; and on a failure anywhere, release what
was opened, the backend included, in reverse.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .._lazy import LazyModule
from .cell_bars import CellBars, kernel_display
from .collapse import CollapsingPrinter
from .handle import LaunchHandle
from .interfaces import WorkerBackend
from .output import LogDirSink, OutputLine, PrintSink, announce
from .plan import LaunchPlan, check_cuda_not_initialised
from .ports import DEFAULT_PORT, host_store
from .request import LaunchRequest
from .restarts import RestartingHandle

__all__ = ["build_sinks", "resolve_bars", "run_launch", "start_persistent_group", "with_workers"]

# The launch panel (panel=True): the widgets, and ipywidgets with them, load only when one is shown.
_widgets = LazyModule("notebook_accel.widgets")
_run_counter = itertools.count()


def run_launch(
    request: LaunchRequest, plan: LaunchPlan, backend: WorkerBackend
) -> list[Any] | LaunchHandle | RestartingHandle:
    """Return the values (``block=True``) or the handle of ``request``'s ranks, run on ``backend``.

    ``backend`` belongs to the launch from here: it is closed when the launch ends, or when it fails to start.
    """
    output = _open_output(request, with_workers(plan), backend)
    if request.max_restarts == 0:
        handle = _started_handle(request, output, threaded=not request.block, cell_bars=True)
    else:
        handle = _started_restarts(request, output)
    return _serve(request, handle)


def start_persistent_group(
    request: LaunchRequest,
    plan: LaunchPlan,
    backend: WorkerBackend,
    *,
    on_join: Callable[[WorkerBackend], LaunchRequest] | None = None,
) -> LaunchHandle:
    """Return the started handle of a group whose workers run ``request.function`` until it returns.

    The interactive ranks' launch (``notebook_accel.interactive``): the same plan, environment,
    sinks, log files, hang rule and panel as ``notebook_launcher(..., block=False)``, supervised by
    the handle's own thread; no bars are drawn in the calling cell (each command shows its own).
    ``on_join(backend)`` (e.g. to open the stream relays of joined agents; no rank started yet)
    returns the request actually started. ``backend`` belongs to the group from here.
    """
    try:
        if not plan.hosts and (plan.backend == "xla" or plan.num_nodes > 1):
            raise ValueError(
                f"a persistent group runs on one machine with gloo or nccl; this launch would use "
                f"{plan.backend} on {plan.num_nodes} node(s): use notebook_launcher for it"
            )
        if on_join is not None:
            request = on_join(backend)
    except BaseException:
        backend.close()
        raise
    output = _open_output(request, with_workers(plan), backend)
    handle = _started_handle(request, output, threaded=True, cell_bars=False)
    if request.panel:
        try:
            _show_panel(handle)
        except BaseException:
            handle.kill()
            handle.wait()
            raise
    return handle


def with_workers(plan: LaunchPlan) -> LaunchPlan:
    """Return ``plan`` run by worker processes (a one-process plan meant for the caller is switched over)."""
    if not plan.in_process:
        return plan
    check_cuda_not_initialised(plan.start_method, plan.device_type)
    dist_type = "MULTI_GPU" if plan.device_type == "cuda" else "MULTI_CPU"
    return replace(plan, in_process=False, distributed_type=dist_type)


def resolve_bars(progress_bars: str, panel: bool) -> tuple[bool, set[int] | None]:
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


def build_sinks(plan: LaunchPlan, request: LaunchRequest) -> list[Callable[[OutputLine], None]]:
    """Return where ``request``'s lines go: the sinks given, none under a panel, else the (collapsing) printer."""
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


@dataclass
class _RunOutput:
    """What a launch opened for all of its groups (one more after each restart): sinks, log files, its backend."""

    request: LaunchRequest
    plan: LaunchPlan
    backend: WorkerBackend
    run_id: str
    sinks: list[Callable[[OutputLine], None]]
    log_sink: LogDirSink | None = None
    log_files: dict[int, dict[str, str]] = field(default_factory=dict)

    def close(self) -> None:
        for sink in self.sinks:
            if isinstance(sink, CollapsingPrinter):
                sink.close()  # the lines it still holds, before the launch's outcome
        if self.log_sink is not None:
            self.log_sink.close()
        self.backend.close()


def _open_output(request: LaunchRequest, plan: LaunchPlan, backend: WorkerBackend) -> _RunOutput:
    """Return the launch's sinks (and its log files when ``log_dir`` is given); it owns ``backend`` from here."""
    try:
        output = _RunOutput(request, plan, backend, _run_id(request.rdzv_id), build_sinks(plan, request))
    except BaseException:
        backend.close()
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
    output: _RunOutput,
    *,
    attempt: int = 1,
    started: float | None = None,
    on_finish: Callable[[], None] | None = None,
) -> tuple[LaunchHandle, Callable[[], None]]:
    """Return a group's handle (not started) over freshly hosted stores, and the function releasing them.

    The plan, with the port found, is announced to the sinks first.
    """
    request = output.request
    plan, stores = _host_stores(output.plan, explicit_port=str(request.use_port) != DEFAULT_PORT)
    announce(output.sinks, plan.describe())  # with the port the stores got (each group gets its own)

    def release() -> None:
        # Last references to the stores: their servers stop and the ports are free again.
        stores.clear()
        if on_finish is not None:
            on_finish()

    bar_events, live_bar_ranks = resolve_bars(request.progress_bars, request.panel)
    handle = LaunchHandle(
        plan, request.function, request.args, sinks=output.sinks, timeout=request.timeout,
        run_id=output.run_id, log_files=output.log_files, on_finish=release, bar_events=bar_events,
        live_bar_ranks=live_bar_ranks, hang_timeout=request.effective_hang_timeout,
        on_hang=request.on_hang, attempt=attempt, started=started, backend=output.backend,
    )  # fmt: skip
    return handle, release


def _started_handle(
    request: LaunchRequest, output: _RunOutput, *, threaded: bool, cell_bars: bool
) -> LaunchHandle:
    """Return the started handle of a launch without restarts (everything opened is released if it cannot start)."""
    try:
        handle, release = _new_handle(output, on_finish=output.close)
    except BaseException:
        output.close()
        raise
    if cell_bars:
        _show_cell_bars(request, handle)
    try:
        handle.start(threaded=threaded)
    except BaseException:
        release()
        raise
    return handle


def _started_restarts(request: LaunchRequest, output: _RunOutput) -> RestartingHandle:
    """Return the started handle of a launch whose group restarts after a failure."""

    def start_attempt(attempt: int, started: float) -> LaunchHandle:
        handle, release = _new_handle(output, attempt=attempt, started=started)
        try:
            handle.start(threaded=False)  # supervised by the RestartingHandle's thread (or the caller)
        except BaseException:
            release()
            raise
        return handle

    handle = RestartingHandle(
        start_attempt, request.max_restarts, request.monitor_interval, timeout=request.timeout,
        sinks=output.sinks, on_finish=output.close,
    )  # fmt: skip
    handle.start(threaded=not request.block)  # a first group that cannot start raises here
    _show_cell_bars(request, handle)
    return handle


def _show_cell_bars(request: LaunchRequest, handle: LaunchHandle | RestartingHandle) -> None:
    """Draw the live bars in the calling cell (in a kernel, bars on, no panel): above the lines that follow."""
    display = kernel_display()
    if display is not None and not request.panel and resolve_bars(request.progress_bars, request.panel)[0]:
        CellBars(handle, display)


def _serve(request: LaunchRequest, handle: LaunchHandle | RestartingHandle) -> list[Any] | Any:
    """Return the handle (``block=False``) or, once the launch ended, its values; show the panel first."""
    if request.panel:
        try:
            _show_panel(handle)
        except BaseException:
            handle.kill()
            handle.supervise() if request.block else handle.wait()
            raise
    if not request.block:
        return handle
    handle.run_here()
    return handle.result()


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
