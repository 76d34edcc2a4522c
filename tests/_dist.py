"""Run a test function in N real worker processes (gloo on 127.0.0.1, a free port per call).

    from tests._dist import run_distributed
    results = run_distributed(worker_fn, nprocs=2, args=(1, 2))  # list indexed by rank

Workers are forked, so ``worker_fn`` may be any module-level function or closure. Each worker gets
the torchrun environment contract (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) plus ``env``; the notebook_accel state singletons are reset in the child before the
call. A worker's exception is re-raised in the test with its rank and traceback; a worker that hangs
past ``timeout`` is killed and the test fails with what each rank was doing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reset_state_singletons() -> None:
    """Forget every notebook_accel state singleton (no-op where the state module is absent)."""
    try:
        from notebook_accel import state
    except ImportError:
        return
    for cls_name, kwargs in (
        ("AcceleratorState", {"reset_partial_state": True}),
        ("GradientState", {}),
        ("PartialState", {}),
    ):
        cls = getattr(state, cls_name, None)
        reset = getattr(cls, "_reset_state", None)
        if reset is not None:
            reset(**kwargs)


def _child(
    fn: Callable, rank: int, nprocs: int, port: int, args: Sequence, env: Mapping[str, str], conn
) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            **{k: str(v) for k, v in env.items()},
        }
    )
    try:
        import torch

        torch.set_num_threads(1)
        reset_state_singletons()
        result = fn(*args)
        try:
            payload = pickle.dumps(("ok", result))
        except Exception as exc:  # an unpicklable result is a test bug worth naming
            payload = pickle.dumps(("err", f"result of rank {rank} is not picklable: {exc!r}"))
        conn.send_bytes(payload)
    except BaseException:
        conn.send_bytes(pickle.dumps(("err", traceback.format_exc())))
    finally:
        conn.close()
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        os._exit(0)


def run_distributed(
    fn: Callable,
    nprocs: int = 2,
    args: Sequence = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> list[Any]:
    """Return ``[fn(*args) on rank 0, ..., on rank nprocs-1]`` computed in forked workers."""
    ctx = mp.get_context("fork")
    port = free_port()
    procs, conns = [], []
    for rank in range(nprocs):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_child, args=(fn, rank, nprocs, port, args, env or {}, child_conn), daemon=True
        )
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)
    results: list[Any] = [None] * nprocs
    errors: dict[int, str] = {}
    import time

    deadline = time.monotonic() + timeout
    pending = set(range(nprocs))
    while pending and time.monotonic() < deadline:
        ready = mp.connection.wait([conns[r] for r in pending], timeout=max(0.0, deadline - time.monotonic()))
        for conn in ready:
            rank = conns.index(conn)
            try:
                status, value = pickle.loads(conn.recv_bytes())
            except EOFError:
                status, value = "err", "worker exited without a result"
            pending.discard(rank)
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = value
        if errors:
            break  # one failed rank: the others may be blocked in a collective
    for p in procs:
        p.join(timeout=5 if not (errors or pending) else 0.5)
        if p.is_alive():
            p.kill()
            p.join()
    for c in conns:
        c.close()
    if errors:
        rank = min(errors)
        raise AssertionError(
            f"rank {rank} failed:\n{errors[rank]}"
            + "".join(f"\n(rank {r} also failed)" for r in errors if r != rank)
        )
    if pending:
        raise AssertionError(f"ranks {sorted(pending)} did not finish within {timeout} s")
    return results
