"""State singletons in 2 real processes (gloo): the seed 000 examples, ordering, adoption, fork_launched."""

from __future__ import annotations

import contextlib
import io
import os
import time
from datetime import timedelta

import torch

from notebook_accel import AcceleratorState, PartialState
from notebook_accel.utils import InitProcessGroupKwargs
from tests._dist import run_distributed


def _log(path: str, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{text} {time.time():.6f}\n")


def _seed_examples(log_path: str) -> dict:
    import torch.distributed as dist

    kwargs = InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=120)).to_kwargs()
    state = PartialState(**kwargs)
    out: dict = {
        "type": state.distributed_type.value,
        "n": state.num_processes,
        "index": state.process_index,
        "local": state.local_process_index,
        "flags": (state.is_main_process, state.is_local_main_process, state.is_last_process),
        "device": str(state.device),
        "backend": dist.get_backend(),
        "repr": repr(state),
        "same": PartialState().process_index == state.process_index,
    }
    splits = {}
    for name, data in {
        "list": ["A", "B", "C"],
        "tuple": ("A", "B", "C"),
        "tensor": torch.arange(3),
        "dict": {"a": [1, 2, 3], "b": torch.tensor([4, 5, 6])},
    }.items():
        for pad in (False, True):
            with state.split_between_processes(data, apply_padding=pad) as part:
                splits[name, pad] = part.tolist() if isinstance(part, torch.Tensor) else part
    splits["dict", True] = {
        k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in splits["dict", True].items()
    }
    splits["dict", False] = {
        k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in splits["dict", False].items()
    }
    out["splits"] = splits

    # main_process_first: rank 0 lingers inside the block, rank 1 must still enter after it left.
    with state.main_process_first():
        _log(log_path, f"main-first enter {state.process_index}")
        if state.is_main_process:
            time.sleep(0.2)
        _log(log_path, f"main-first exit {state.process_index}")
    with state.local_main_process_first():
        _log(log_path, f"local-first enter {state.local_process_index}")
        if state.is_local_main_process:
            time.sleep(0.1)
        _log(log_path, f"local-first exit {state.local_process_index}")

    # wait_for_everyone: rank 1 cannot leave the barrier before rank 0 reaches it.
    if state.is_main_process:
        time.sleep(0.3)
    reached = time.time()
    state.wait_for_everyone()
    out["barrier"] = (reached, time.time())

    ran = []
    state.on_main_process(lambda: ran.append("main"))()
    state.on_local_main_process(lambda: ran.append("local main"))()
    state.on_last_process(lambda: ran.append("last"))()
    state.on_process(process_index=1)(lambda: ran.append("process 1"))()
    state.on_local_process(local_process_index=1)(lambda: ran.append("local process 1"))()

    @state.on_process(process_index=0)
    def decorated(x):
        ran.append(f"process 0 got {x}")
        return x * 2

    out["decorated"] = decorated(21)
    out["ran"] = ran
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        state.print("printed once")
    out["printed"] = buffer.getvalue()
    acc = AcceleratorState(mixed_precision="bf16")
    out["acc"] = (acc.num_processes, acc.process_index, acc.distributed_type.value, acc.mixed_precision)
    with acc.split_between_processes(["A", "B", "C"], apply_padding=True) as part:
        out["acc_split"] = part
    acc.wait_for_everyone()
    return out


def test_seed_examples_in_two_processes(tmp_path):
    log = str(tmp_path / "order.log")
    results = run_distributed(_seed_examples, args=(log,))
    for rank, res in enumerate(results):
        assert res["type"] == "MULTI_CPU" and res["n"] == 2 and res["index"] == rank and res["local"] == rank
        assert res["flags"] == (rank == 0, rank == 0, rank == 1)
        assert res["device"] == "cpu" and res["backend"] == "gloo" and res["same"]
        assert res["repr"].startswith(
            f"Distributed environment: DistributedType.MULTI_CPU  Backend: gloo\nNum processes: 2\nProcess index: {rank}"
        )
        assert res["acc"] == (2, rank, "MULTI_CPU", "bf16")
    r0, r1 = results[0]["splits"], results[1]["splits"]
    assert r0["list", False] == ["A", "B"] and r1["list", False] == ["C"]
    assert r0["list", True] == ["A", "B"] and r1["list", True] == ["C", "C"]
    assert r0["tuple", False] == ("A", "B") and r1["tuple", True] == ("C", "C")
    assert r0["tensor", False] == [0, 1] and r1["tensor", False] == [2] and r1["tensor", True] == [2, 2]
    assert r0["dict", False] == {"a": [1, 2], "b": [4, 5]} and r1["dict", False] == {"a": [3], "b": [6]}
    assert r1["dict", True] == {"a": [3, 3], "b": [6, 6]}
    assert results[0]["acc_split"] == ["A", "B"] and results[1]["acc_split"] == ["C", "C"]

    events = {}
    with open(log, encoding="utf-8") as f:
        for line in f:
            *words, stamp = line.split()
            events[" ".join(words)] = float(stamp)
    assert events["main-first exit 0"] <= events["main-first enter 1"]
    assert events["local-first exit 0"] <= events["local-first enter 1"]
    assert results[1]["barrier"][1] >= results[0]["barrier"][0]

    assert results[0]["ran"] == ["main", "local main", "process 0 got 21"] and results[0]["decorated"] == 42
    assert results[1]["ran"] == ["last", "process 1", "local process 1"] and results[1]["decorated"] is None
    assert results[0]["printed"] == "printed once\n" and results[1]["printed"] == ""


def _adopt_and_fork_launched() -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # someone else (user code, torchrun) owns the group
    os.environ.pop("LOCAL_RANK")
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # as if each rank were on its own node
    state = PartialState()
    out = {
        "adopted": (state.distributed_type.value, state.num_processes, state.process_index, state.backend),
        "local": (state.local_process_index, state.is_local_main_process),
        "debug": state.debug,
        "mixed": state.mixed_precision,
        "fork_launched": state.fork_launched,
    }
    acc = AcceleratorState()
    acc.destroy_process_group()  # the launcher owns the default group: left alone
    out["after_accelerator_destroy"] = dist.is_initialized()
    state.wait_for_everyone()
    state.destroy_process_group()
    out["after_partial_destroy"] = dist.is_initialized()
    return out


def test_adopts_existing_group_and_respects_fork_launch():
    env = {
        "ACCELERATE_FORK_LAUNCHED": "1",
        "ACCELERATE_DEBUG_MODE": "yes",
        "ACCELERATE_MIXED_PRECISION": "fp16",
    }
    for rank, res in enumerate(run_distributed(_adopt_and_fork_launched, env=env)):
        assert res["adopted"] == ("MULTI_CPU", 2, rank, "gloo") and res["local"] == (0, True)
        assert res["debug"] is True and res["mixed"] == "fp16" and res["fork_launched"] is True
        assert res["after_accelerator_destroy"] is True
        assert res["after_partial_destroy"] is False
