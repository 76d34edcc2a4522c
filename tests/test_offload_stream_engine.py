"""The CUDA copy engine's own code, run on the CPU against a stand-in for ``torch.cuda``.

The stand-in records what the engine asks of streams and events (which stream a buffer is allocated
and recorded on, where each copy is issued, what each stream waits for) and runs the copies at
once on CPU tensors. It checks the engine's logic and bookkeeping (the side stream, the worker
thread and staging ring for staged units, the GPU-timed telemetry) without a GPU; what CUDA does
with it is checked by ``tests/test_cuda_streaming.py`` on a GPU.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from notebook_accel import cpu_offload, disk_offload, telemetry
from notebook_accel.hooks import streaming
from notebook_accel.hooks.offloaded import find_align_hook
from notebook_accel.hooks.prefetch import Prefetcher

CPU = torch.device("cpu")


class _Log(list):
    def add(self, *entry: object) -> None:
        self.append(entry)


class _Stream:
    def __init__(self, log: _Log, name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: _Event) -> None:
        self.log.add("wait_event", self.name, event.name)

    def synchronize(self) -> None:
        self.log.add("synchronize", self.name)


class _Event:
    count = 0

    def __init__(self, log: _Log, enable_timing: bool = False) -> None:
        _Event.count += 1
        self.log, self.name, self.timing, self.on = log, f"e{_Event.count}", enable_timing, None

    def record(self, stream: _Stream) -> None:
        self.on = stream.name
        self.log.add("record", self.name, stream.name, self.timing)

    def synchronize(self) -> None:
        self.log.add("event_synchronize", self.name)

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _Event) -> float:
        return 2.0  # ms


class _FakeCuda:
    """What streaming.py uses of ``torch.cuda``; the current stream is per thread, as in CUDA."""

    def __init__(self, log: _Log) -> None:
        self.log = log
        self.compute = _Stream(log, "compute")
        self.local = threading.local()

    def Stream(self, device: torch.device) -> _Stream:  # noqa: N802 - torch's name
        return _Stream(self.log, "side")

    def Event(self, enable_timing: bool = False) -> _Event:  # noqa: N802 - torch's name
        return _Event(self.log, enable_timing)

    def current_stream(self, device: torch.device | None = None) -> _Stream:
        return getattr(self.local, "stream", self.compute)

    def stream(self, stream: _Stream):  # noqa: ANN201 - a context manager
        fake = self

        class _Context:
            def __enter__(self) -> None:
                self.before = fake.current_stream()
                fake.local.stream = stream

            def __exit__(self, *exc: object) -> None:
                fake.local.stream = self.before

        return _Context()

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        return 10_000, 20_000


class _Buffer(torch.Tensor):
    """A CPU tensor standing for a device buffer: it logs record_stream."""

    log: _Log | None = None

    def record_stream(self, stream: _Stream) -> None:
        _Buffer.log.add("record_stream", stream.name)


class _TorchProxy:
    """``torch`` with a fake ``cuda``; ``empty`` logs on which stream a buffer is allocated."""

    def __init__(self, cuda: _FakeCuda) -> None:
        self.cuda = cuda

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    def empty(self, *args: object, **kwargs: object) -> torch.Tensor:
        self.cuda.log.add("empty", self.cuda.current_stream().name)
        return torch.empty(*args, **kwargs).as_subclass(_Buffer)


class _Engine(streaming.CudaCopyEngine):
    pinned_ok = True

    @staticmethod
    def register_host(pointer: int, nbytes: int) -> str | None:
        return None if _Engine.pinned_ok else "refused (test)"

    @staticmethod
    def unregister_host(pointer: int) -> None:
        return None


@pytest.fixture
def fake_cuda(monkeypatch) -> _Log:
    log = _Log()
    cuda = _FakeCuda(log)
    monkeypatch.setattr(streaming, "torch", _TorchProxy(cuda))
    monkeypatch.setattr(_Buffer, "log", log)
    monkeypatch.setattr(_Engine, "pinned_ok", True)
    return log


def _stack(n: int = 3, width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n)]).eval()


def _stream(model: nn.Module, **options) -> Prefetcher:
    prefetcher = Prefetcher(depth=None)
    for module in model.modules():
        hook = find_align_hook(module)
        if hook is not None and hook.offload:
            prefetcher.register(hook)
    prefetcher.stream(CPU, engine=_Engine(CPU, prefetcher._submit_call), **options)
    return prefetcher


def test_pinned_units_are_copied_on_the_side_stream_and_waited_for_on_the_compute_stream(fake_cuda) -> None:
    reference = _stack()
    x = torch.randn(2, 16)
    expected = reference(x)
    model = cpu_offload(copy.deepcopy(reference), CPU, prefetch=False)
    prefetcher = _stream(model, lookahead=2 * 1280, owned=True)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(x), expected)
    log = fake_cuda
    allocations = [i for i, e in enumerate(log) if e[0] == "empty"]
    assert [log[i] for i in allocations] == [
        ("empty", "side")
    ] * 2  # the pool: two buffers, on the side stream
    assert all(log[i + 1] == ("record_stream", "compute") for i in allocations)
    copies = [e for e in log if e[0] == "record" and e[2] == "side"]
    waits = [e for e in log if e[0] == "wait_event" and e[1] == "compute"]
    assert len(waits) == 6 and len(copies) == 6 + 2  # the next forward's first two units are on their way
    assert {e[2] for e in waits} <= {e[1] for e in copies}  # the compute stream waits for copy events only
    reuses = [e for e in log if e[0] == "wait_event" and e[1] == "side"]
    assert reuses and all(
        e[2] in {r[1] for r in log if r[0] == "record" and r[2] == "compute"} for e in reuses
    )
    prefetcher.close()
    assert log[-1] == ("synchronize", "side") and prefetcher.streamer is None


def test_staged_units_go_through_the_worker_and_the_staging_ring(fake_cuda, tmp_path) -> None:
    reference = _stack(4)
    x = torch.randn(2, 16)
    expected = reference(x)
    model = disk_offload(copy.deepcopy(reference), tmp_path, CPU, prefetch=False)
    prefetcher = _stream(model, lookahead=10_000)
    engine = prefetcher.streamer.engine
    assert len(engine._stager.blocks) == 2 and all(b.pinned for b in engine._stager.blocks)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(x), expected)
    assert prefetcher.alive_threads  # the staged copies ran on the worker
    # a staging buffer is written again only once its previous copy to the device is done
    assert any(e[0] == "event_synchronize" for e in fake_cuda)
    prefetcher.close()
    assert not prefetcher.alive_threads


def test_refused_pinning_is_staged_and_the_telemetry_reports_device_times(fake_cuda) -> None:
    reference = _stack()
    x = torch.randn(2, 16)
    expected = reference(x)
    model = cpu_offload(copy.deepcopy(reference), CPU, prefetch=False)
    _Engine.pinned_ok = False
    with pytest.warns(ResourceWarning, match=r"refused \(test\)"):
        prefetcher = _stream(model, lookahead=10_000, owned=True)
    assert all(u.staged and not u.direct for u in prefetcher.streamer.units)
    seen: list = []
    with telemetry.subscribe(seen.append), torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(x), expected)
    transfers = [e for e in seen if e.kind == "transfer"]
    waits = [e for e in seen if e.kind == "wait"]
    assert transfers and all(e.seconds == pytest.approx(0.002) and e.nbytes == 1280 for e in transfers)
    assert waits and all(e.device == "cuda:0" for e in transfers + waits)
    assert {e.source for e in transfers} == {"cpu"}
    prefetcher.close()


def test_the_default_lookahead_comes_from_the_devices_free_memory(fake_cuda) -> None:
    model = cpu_offload(_stack(), CPU, prefetch=False)
    prefetcher = _stream(model)
    assert prefetcher.streamer.schedule.budget == 5_000  # half of mem_get_info's 10,000 free bytes
    prefetcher.close()
