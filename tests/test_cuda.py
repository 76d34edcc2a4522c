"""What a user with one GPU (Colab, Kaggle, a workstation) meets: training, memory, dispatch, launching.

Every test here needs a CUDA device and is skipped without one. The launcher and interactive-rank
tests run in a fresh interpreter, since a process whose CUDA is initialised cannot fork workers
that use it (and pytest's process has initialised it by then).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import torch
from torch import nn

from tests._cuda import CUDA_ONLY

pytestmark = CUDA_ONLY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fresh_python(code: str, timeout: float = 180, stderr: bool = False) -> str:
    """Run ``code`` in a new interpreter and return its stdout (then its stderr, with ``stderr``); fail with its output."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout + proc.stderr if stderr else proc.stdout


def _blocks(n: int = 6, width: int = 256) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n)])


def test_bf16_training_on_cuda_moves_batches_and_learns() -> None:
    from notebook_accel import Accelerator

    acc = Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    y = x @ torch.randn(16, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(model, opt, loader)
    assert acc.device == torch.device("cuda", 0)
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in model.parameters())
    losses = []
    for _ in range(15):
        for xb, yb in loader:
            assert xb.device.type == "cuda"
            with acc.autocast():
                assert model[0](xb).dtype == torch.bfloat16
            loss = nn.functional.mse_loss(model(xb).float(), yb)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert losses[-1] < losses[0] / 4, losses[:: len(losses) // 5]


def test_find_executable_batch_size_recovers_from_a_real_cuda_oom() -> None:
    from notebook_accel.utils import find_executable_batch_size

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(0.02, 0)  # 2% of the card: 1.6 GiB of 80, 2.8 of 140
    unit = int(total * 0.02) // 8  # bytes per batch element: 8 elements fill the cap
    tried: list[int] = []
    try:

        @find_executable_batch_size(starting_batch_size=64)
        def step(batch_size: int) -> int:
            tried.append(batch_size)
            block = torch.empty(batch_size * unit, dtype=torch.uint8, device="cuda")
            del block
            return batch_size

        found = step()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    # 1.15's sequence: 90% of the last size, rounded down, until one fits
    assert tried == [64] + [int(t * 0.9) for t in tried[:-1]] and found == tried[-1], tried
    # it stopped at the first size that fits under the cap; the size before it was near the cap or over
    assert found * unit <= total * 0.02 < tried[-2] * unit / 0.9, (tried, unit)
    gc.collect()
    assert torch.cuda.memory_allocated(0) < unit  # what the failed tries took was given back


def test_release_memory_and_free_memory_give_cuda_memory_back() -> None:
    from notebook_accel import Accelerator
    from notebook_accel.utils import release_memory

    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(0)
    acc = Accelerator()
    model = acc.prepare(nn.Linear(4096, 4096))  # 64 MiB of float32 weights
    other = torch.zeros(1024, 1024, 16, device="cuda")  # 64 MiB
    assert torch.cuda.memory_allocated(0) - before >= 128 * 2**20
    model, other = release_memory(model, other)
    assert model is None and other is None
    acc.free_memory()
    gc.collect()
    assert torch.cuda.memory_allocated(0) - before < 2**20
    assert acc._models == []


def test_load_checkpoint_and_dispatch_auto_splits_gpu_and_cpu(tmp_path) -> None:
    from safetensors.torch import save_file

    from notebook_accel import init_empty_weights, load_checkpoint_and_dispatch

    reference = _blocks(8)
    x = torch.randn(4, 256)
    expected = reference(x)
    save_file(reference.state_dict(), str(tmp_path / "model.safetensors"))
    with init_empty_weights():
        model = _blocks(8)
    block_bytes = 256 * 257 * 4
    model = load_checkpoint_and_dispatch(
        model,
        str(tmp_path),
        device_map="auto",
        max_memory={0: int(block_bytes * 3.5), "cpu": 10 * 2**30},
        no_split_module_classes=["Sequential"],
    )
    placed = set(model.hf_device_map.values())
    assert placed == {0, "cpu"}, model.hf_device_map
    assert model[0][0].weight.device.type == "cuda"
    out = model(x.cuda())
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_layerwise_casting_on_cuda_stores_low_and_computes_high() -> None:
    from notebook_accel.hooks import attach_layerwise_casting_hooks

    model = _blocks(2, 64).cuda()
    x = torch.randn(3, 64, device="cuda")
    expected = model(x)
    attach_layerwise_casting_hooks(model, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    out = model(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert model[0][0].weight.dtype == torch.float8_e4m3fn  # back to storage between calls
    torch.testing.assert_close(out.float(), expected, atol=0.3, rtol=0.2)


def test_notebook_launcher_on_the_gpus_this_machine_has() -> None:
    out = _fresh_python(
        """
        import torch
        from notebook_accel import Accelerator, notebook_launcher

        def train():
            acc = Accelerator()
            t = torch.ones(3, device=acc.device) * (acc.process_index + 1)
            return acc.device.type, acc.num_processes, acc.gather(t).sum().item()

        gpus = torch.cuda.device_count()
        print("one", notebook_launcher(train, num_processes=1))
        try:
            notebook_launcher(train, num_processes=gpus + 1)
        except ValueError as exc:
            print("too-many", exc)
        if gpus >= 2:
            print("all", notebook_launcher(train, num_processes=gpus))
        """
    )
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert lines["one"] == "[('cuda', 1, 3.0)]", out  # one value per rank, as for 2 ranks
    assert "visible CUDA device(s)" in lines["too-many"], out
    if torch.cuda.device_count() >= 2:
        n = torch.cuda.device_count()
        assert lines["all"].startswith("[('cuda', " + str(n)), out


def test_ranks_started_after_cuda_was_initialised_are_spawned_with_a_warning() -> None:
    # start_method=None (the default): fork while CUDA is untouched here, spawn (and say so) once it is
    out = _fresh_python(
        """
        import torch
        from notebook_accel import start_ranks
        torch.zeros(1, device="cuda")
        ranks = start_ranks(1)
        try:
            print("device", ranks.run("import torch; torch.ones(1, device='cuda').device.type"))
        finally:
            ranks.stop()
        """,
        stderr=True,
    )
    assert "the ranks are started with spawn instead of fork" in out, out  # interactive.gpus.SPAWN_NOTE
    assert "device ['cuda']" in out, out


def test_fork_asked_for_after_cuda_was_initialised_is_refused_with_the_way_out() -> None:
    out = _fresh_python(
        """
        import torch
        from notebook_accel import start_ranks
        torch.zeros(1, device="cuda")
        try:
            start_ranks(1, start_method="fork")
        except RuntimeError as exc:
            print("refused", exc)
        """
    )
    assert "refused CUDA is already initialised" in out and 'start_method="spawn"' in out, out


def test_interactive_rank_on_a_gpu_keeps_cuda_state_between_cells() -> None:
    out = _fresh_python(
        """
        from notebook_accel import start_ranks
        ranks = start_ranks(1)
        try:
            ranks.run("import torch; from notebook_accel import Accelerator; acc = Accelerator()")
            ranks.run("w = torch.ones(1000, 1000, device=acc.device)")
            print("dev", ranks.run("str(w.device), acc.distributed_type.value"))
            print("sum", ranks.run("(w @ w).sum().item()"))
            print("mem", ranks.run("torch.cuda.memory_allocated() >= 4 * 1000 * 1000"))
        finally:
            ranks.stop()
        """
    )
    assert "dev [('cuda:0', " in out and "sum [1000000000.0]" in out and "mem [True]" in out, out


def test_seeding_and_cache_clearing_leave_cuda_uninitialised() -> None:
    # A notebook that seeds or clears the cache before notebook_launcher must still be able to fork.
    out = _fresh_python(
        """
        import torch
        from notebook_accel.utils import clear_device_cache, set_seed
        set_seed(3)
        clear_device_cache(garbage_collection=True)
        print("initialised", torch.cuda.is_initialized())
        """
    )
    assert "initialised False" in out, out


def test_cpu_ranks_after_gpu_work_run_and_a_backward_there_names_the_cause() -> None:
    out = _fresh_python(
        """
        import torch
        from notebook_accel import debug_launcher
        from notebook_accel.launch import LaunchError

        def forward():
            return float(torch.nn.Linear(4, 1)(torch.ones(2, 4)).shape[0])

        def backward():
            x = torch.ones(3, requires_grad=True)
            x.sum().backward()
            return float(x.grad.sum())

        x = torch.ones(3, device="cuda", requires_grad=True)  # a notebook that trained on the GPU first
        (x * 2).sum().backward()
        print("forward", debug_launcher(forward, num_processes=2))
        try:
            print("backward", debug_launcher(backward, num_processes=2))
        except LaunchError as exc:
            print("cause", str(exc).split("Cause: ")[1].splitlines()[0])
        """
    )
    assert "forward [2.0, 2.0]" in out, out
    # torch refuses a backward in a rank forked after one ran here; the error says so and what to do
    assert "backward [3.0, 3.0]" in out or "cause this process ran a backward pass" in out, out
