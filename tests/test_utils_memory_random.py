"""find_executable_batch_size / memory helpers, and seeding / RNG synchronisation (2 real processes)."""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest
import torch

from notebook_accel.utils import (
    find_executable_batch_size,
    release_memory,
    set_seed,
    should_reduce_batch_size,
    synchronize_rng_state,
    synchronize_rng_states,
)
from notebook_accel.utils import memory as memory_module
from notebook_accel.utils.environment import patch_environment
from tests._dist import run_distributed

# ---------------------------------------------------------------------------------------------- memory


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if ..."),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried"
        ),
        RuntimeError("XPU out of memory. Tried to allocate"),
        RuntimeError("NPU out of memory. Tried to allocate"),
        RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    ],
)
def test_should_reduce_batch_size_recognises_oom(error) -> None:
    assert should_reduce_batch_size(error)


def test_should_reduce_batch_size_ignores_other_errors() -> None:
    assert not should_reduce_batch_size(RuntimeError("shape mismatch"))
    assert not should_reduce_batch_size(ValueError("CUDA out of memory."))
    assert not should_reduce_batch_size(RuntimeError("CUDA out of memory.", "two args"))
    # as in Accelerate 1.15: the message decides, and a Python MemoryError is not an allocator OOM
    assert not should_reduce_batch_size(torch.OutOfMemoryError("anything"))
    assert not should_reduce_batch_size(MemoryError())


# A Python MemoryError (the host, not an allocator) and any other error are not out-of-memory: no retry.
@pytest.mark.parametrize(("error", "start"), [(MemoryError("host ran out"), 4), (ValueError("bad data"), 8)])
def test_other_errors_propagate_without_retry(error, start) -> None:
    tried = []

    @find_executable_batch_size(starting_batch_size=start)
    def train(batch_size):
        tried.append(batch_size)
        raise error

    with pytest.raises(type(error), match=str(error)):
        train()
    assert tried == [start]


def test_starting_at_zero_raises_when_called() -> None:
    calls = []
    train = find_executable_batch_size(lambda batch_size: calls.append(batch_size), starting_batch_size=0)
    with pytest.raises(RuntimeError, match=r"No executable batch size found, reached zero\."):
        train()
    assert calls == []


def test_batch_size_shrinks_by_a_tenth_until_it_fits_and_remembers() -> None:
    tried = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size, model, scale=1):
        tried.append(batch_size)
        if batch_size > 16:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")
        return batch_size * scale, model

    # Accelerate 1.15's sequence: int(size * 0.9) after each out-of-memory error.
    expected = [128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36, 32, 28, 25, 22, 19, 17, 15]
    assert train("m", scale=2) == (30, "m")
    assert tried == expected
    assert train("m") == (15, "m") and tried[-1] == 15  # starts from the last size that worked


def test_reduce_batch_size_fn_picks_the_next_size() -> None:
    tried, offers = [], iter([50, 7])

    @find_executable_batch_size(starting_batch_size=128, reduce_batch_size_fn=lambda: next(offers))
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > 20:
            raise RuntimeError("CUDA out of memory.")
        return batch_size

    assert train() == 7 and tried == [128, 50, 7]


def test_reduce_batch_size_fn_bad_values_raise() -> None:
    with pytest.raises(TypeError, match=r"reduce_batch_size_fn must be a callable.*got 3"):
        find_executable_batch_size(lambda batch_size: 1, reduce_batch_size_fn=3)

    @find_executable_batch_size(starting_batch_size=8, reduce_batch_size_fn=lambda: "half")
    def train(batch_size):
        raise RuntimeError("CUDA out of memory.")

    with pytest.raises(TypeError, match=r"must return a batch size \(an int >= 0\), got 'half'"):
        train()


def test_decorator_without_arguments_and_cpu_oom() -> None:
    tried = []

    @find_executable_batch_size
    def run(batch_size):
        tried.append(batch_size)
        if batch_size > 100:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        return batch_size

    assert run() == 92 and tried == [128, 115, 103, 92]


def test_reaching_zero_raises() -> None:
    @find_executable_batch_size(starting_batch_size=4)
    def never_fits(batch_size):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    with pytest.raises(RuntimeError, match=r"No executable batch size found, reached zero\."):
        never_fits()


def test_failed_attempt_is_freed_before_the_caches_are_cleared(monkeypatch) -> None:
    import weakref

    attempts: list[weakref.ref] = []
    alive_at_clear: list[list[bool]] = []
    clear = memory_module.clear_device_cache

    def spy(garbage_collection: bool = False) -> None:
        clear(garbage_collection)
        alive_at_clear.append([ref() is not None for ref in attempts])

    monkeypatch.setattr(memory_module, "clear_device_cache", spy)

    @find_executable_batch_size(starting_batch_size=3)  # 3 -> 2 -> 1
    def train(batch_size):
        activations = torch.empty(16)
        attempts.append(weakref.ref(activations))
        if batch_size > 1:
            raise RuntimeError("CUDA out of memory.")
        return batch_size

    assert train() == 1
    # One clear before the first attempt, then one per retry, each after the failed attempt let go.
    assert alive_at_clear == [[], [False], [False, False]]


def test_passing_batch_size_is_refused() -> None:
    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size, model):
        return batch_size

    with pytest.raises(TypeError, match=r"Batch size was passed into `train`.*`train\(model='m'\)`"):
        train(8, "m")
    with pytest.raises(TypeError, match="Batch size was passed into `train`"):
        train("m", batch_size=8)


def test_function_must_take_batch_size_first() -> None:
    with pytest.raises(TypeError, match=r"`train` must take `batch_size` as its first parameter"):

        @find_executable_batch_size
        def train(model, batch_size):
            return batch_size

    with pytest.raises(ValueError, match="starting_batch_size must be an int >= 0, got -1"):
        find_executable_batch_size(lambda batch_size: 1, starting_batch_size=-1)
    with pytest.raises(TypeError, match="decorates a function"):
        find_executable_batch_size(42)


def test_memory_is_released_between_tries(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(
        memory_module, "clear_device_cache", lambda garbage_collection=False: calls.append(garbage_collection)
    )

    @find_executable_batch_size(starting_batch_size=3)  # 3 -> 2 -> 1
    def train(batch_size):
        if batch_size > 1:
            raise RuntimeError("CUDA out of memory.")
        return batch_size

    assert train() == 1
    assert calls == [True, True, True]  # once before the first try, once after each of the 2 failures


def test_release_memory_drops_references(monkeypatch) -> None:
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(True) or 0)
    a, b = torch.ones(3), torch.ones(4)
    a, b = release_memory(a, b)
    assert (a, b) == (None, None) and collected


def test_clear_device_cache_leaves_cuda_alone() -> None:
    memory_module.clear_device_cache(garbage_collection=True)
    assert not torch.cuda.is_initialized()


# ---------------------------------------------------------------------------------------------- seeding


def _draw():
    return random.random(), float(np.random.rand()), torch.rand(2).tolist()


def test_set_seed_is_reproducible() -> None:
    set_seed(1234)
    first = _draw()
    set_seed(1234)
    assert _draw() == first
    set_seed(4321)
    assert _draw() != first
    assert not torch.cuda.is_initialized()


def test_set_seed_device_specific_uses_rank() -> None:
    with patch_environment(RANK="3"):
        set_seed(10, device_specific=True)
        shifted = _draw()
    set_seed(13)
    assert _draw() == shifted


def test_set_seed_deterministic() -> None:
    try:
        set_seed(0, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_set_seed_validation() -> None:
    with pytest.raises(TypeError, match="seed must be an int"):
        set_seed("42")
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*32\)"):
        set_seed(-1)
    with patch_environment(RANK="zero"), pytest.raises(ValueError, match="RANK='zero' is not an integer"):
        set_seed(1, device_specific=True)


def test_synchronize_is_a_no_op_without_process_group() -> None:
    torch.manual_seed(5)
    state = torch.get_rng_state()
    synchronize_rng_state()
    synchronize_rng_states(["torch"])
    assert torch.equal(torch.get_rng_state(), state)


def test_synchronize_validation() -> None:
    with pytest.raises(ValueError, match=r"rng_type='dice' is not valid.*'generator'"):
        synchronize_rng_state("dice")
    with pytest.raises(ValueError, match="needs the torch.Generator"):
        synchronize_rng_state("generator")
    with pytest.raises(TypeError, match="rng_types must be a list"):
        synchronize_rng_states("torch")


def _sync_worker():
    import torch.distributed as dist

    from notebook_accel.state import PartialState

    state = PartialState()
    set_seed(100, device_specific=True)  # different on each rank
    generator = torch.Generator().manual_seed(7 + state.process_index)
    before = (torch.rand(1).item(), torch.rand(1, generator=generator).item())
    set_seed(100, device_specific=True)
    generator.manual_seed(7 + state.process_index)
    synchronize_rng_states(["torch", "generator"], generator=generator)
    after = (torch.rand(1).item(), torch.rand(1, generator=generator).item())
    return dist.get_backend(), before, after


def test_rng_states_synchronised_across_two_processes() -> None:
    (backend, before0, after0), (_, before1, after1) = run_distributed(_sync_worker, nprocs=2)
    assert backend == "gloo"
    assert before0 != before1  # device_specific seeding differs per rank
    assert after0 == after1 == before0  # everyone now follows rank 0
