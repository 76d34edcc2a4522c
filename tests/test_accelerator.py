"""Accelerator training loop: 2-process equivalence with 1-process full-batch training, metrics, errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests._dist import run_distributed

N_SAMPLES, BATCH, EPOCHS, LR = 64, 4, 3, 0.05


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, 5, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0], [0.0]]) + 0.1 * torch.randn(N_SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _reference(batch_size: int, autocast: bool = False) -> dict[str, torch.Tensor]:
    """Plain torch, one process, full global batch."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(_data(), batch_size=batch_size)
    for _ in range(EPOCHS):
        for x, y in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(accum: int, mixed_precision: str) -> dict:
    from notebook_accel import Accelerator, AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    acc = Accelerator(gradient_accumulation_steps=accum, mixed_precision=mixed_precision)
    model, opt, loader = acc.prepare(
        _model(), torch.optim.SGD(_model().parameters(), lr=LR), DataLoader(_data(), batch_size=BATCH)
    )
    # The optimizer above was built on a throw-away copy: rebuild it on the prepared model's parameters.
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=LR))
    steps = 0
    for _ in range(EPOCHS):
        for x, y in loader:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
                steps += acc.sync_gradients
    weights = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    return {"weights": weights, "steps": steps, "type": type(model).__name__, "len": len(loader)}


def _equivalence_worker() -> dict:
    torch.set_num_threads(1)
    return {
        "plain": _train(1, "no"),
        "accum": _train(2, "no"),
        "bf16": _train(1, "bf16"),
    }


def _close(a: dict, b: dict, atol: float) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a if a[k].dtype.is_floating_point) if atol else 0.0


def test_two_processes_match_one_process_full_batch() -> None:
    results = run_distributed(_equivalence_worker, nprocs=2, timeout=120)
    ref = _reference(2 * BATCH)
    ref_accum = _reference(2 * BATCH * 2)
    ref_bf16 = _reference(2 * BATCH, autocast=True)
    for rank_result in results:
        assert rank_result["plain"]["type"] == "DistributedDataParallel"
        assert rank_result["plain"]["len"] == N_SAMPLES // (2 * BATCH)
        assert rank_result["plain"]["steps"] == EPOCHS * N_SAMPLES // (2 * BATCH)
        assert rank_result["accum"]["steps"] == EPOCHS * N_SAMPLES // (4 * BATCH)
        for k, v in ref.items():
            torch.testing.assert_close(rank_result["plain"]["weights"][k], v, rtol=1e-5, atol=1e-6)
        for k, v in ref_accum.items():
            torch.testing.assert_close(rank_result["accum"]["weights"][k], v, rtol=1e-5, atol=1e-6)
        for k, v in ref_bf16.items():
            torch.testing.assert_close(rank_result["bf16"]["weights"][k], v, rtol=0, atol=3e-2)
    # both ranks hold the same weights
    for k in ref:
        assert torch.equal(results[0]["plain"]["weights"][k], results[1]["plain"]["weights"][k])
    # the bf16 run really ran in bf16 (differs from fp32 training)
    assert any(not torch.equal(results[0]["bf16"]["weights"][k], ref[k]) for k in ref)


def _metrics_worker() -> dict:
    from notebook_accel import Accelerator

    acc = Accelerator()
    n = 21  # not divisible by 2 processes nor by the global batch of 8
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(n, dtype=torch.float32)), batch_size=4))
    gathered, objects, remainders = [], [], []
    for (x,) in loader:
        gathered.append(acc.gather_for_metrics(x * 10))
        objects.extend(acc.gather_for_metrics([f"s{int(v)}" for v in x.tolist()]))
        remainders.append(acc.gradient_state.remainder)
    # reduce / pad / split helpers
    total = acc.reduce(torch.tensor(float(acc.process_index + 1)), reduction="sum")
    padded = acc.pad_across_processes(torch.ones(acc.process_index + 1), dim=0)
    with acc.split_between_processes(list(range(5))) as part:
        share = part
    return {
        "gathered": torch.cat(gathered),
        "objects": objects,
        "remainders": remainders,
        "total": total.item(),
        "padded": padded.shape[0],
        "share": share,
        "in_loop_after": acc.gradient_state.in_dataloader,
        "main": acc.is_main_process,
        "last": acc.is_last_process,
    }


def test_gather_for_metrics_drops_padding_and_collectives_through_notebook_launcher() -> None:
    from notebook_accel import notebook_launcher

    results = notebook_launcher(_metrics_worker, num_processes=2, sinks=[], timeout=120)
    for rank, r in enumerate(results):
        assert torch.equal(r["gathered"], torch.arange(21, dtype=torch.float32) * 10)
        assert r["objects"] == [f"s{i}" for i in range(21)]
        assert r["remainders"][-1] == 21 % 8
        assert r["total"] == 3.0
        assert r["padded"] == 2
        assert r["in_loop_after"] is False
        assert r["main"] is (rank == 0) and r["last"] is (rank == 1)
    assert results[0]["share"] == [0, 1, 2] and results[1]["share"] == [3, 4]


def test_single_process_state_and_helpers(capsys) -> None:
    from notebook_accel import Accelerator
    from notebook_accel.utils import DistributedType

    acc = Accelerator(cpu=True)
    assert acc.distributed_type == DistributedType.NO
    assert (acc.num_processes, acc.process_index, acc.local_process_index) == (1, 0, 0)
    assert acc.is_main_process and acc.is_local_main_process and acc.is_last_process
    assert acc.device == torch.device("cpu") and not acc.use_distributed
    assert acc.mixed_precision == "no" and acc.sync_gradients and acc.gradient_accumulation_steps == 1
    acc.gradient_accumulation_steps = 3
    assert acc.gradient_accumulation_steps == 3
    assert acc.project_dir is None and acc.save_iteration == 0
    acc.print("hello from main")
    assert "hello from main" in capsys.readouterr().out
    calls = []
    acc.on_main_process(lambda: calls.append("main"))()
    acc.on_process(process_index=0)(lambda: calls.append("p0"))()
    acc.on_local_process(local_process_index=1)(lambda: calls.append("l1"))()
    assert calls == ["main", "p0"]
    with acc.main_process_first():
        pass
    acc.wait_for_everyone()
    model = torch.nn.Linear(2, 2)
    assert acc.prepare(model) is model  # a single object comes back as itself
    thing = object()
    assert acc.prepare(thing) is thing
    assert "Accelerator(" in repr(acc)


def test_scheduler_follows_accumulation_and_fp16_skip() -> None:
    from notebook_accel import Accelerator, GradScalerKwargs

    acc = Accelerator(
        cpu=True,
        mixed_precision="fp16",
        gradient_accumulation_steps=2,
        kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)],
    )
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    assert acc.scaler is not None and acc.scaler.get_scale() == 1024.0
    x = torch.randn(4, 3)
    # step 1: accumulating -> no optimizer step, no scheduler step
    with acc.accumulate(model):
        acc.backward(model(x).sum())
        before = model.weight.detach().clone()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert not acc.sync_gradients and torch.equal(model.weight, before)
    assert model.weight.grad is not None  # zero_grad kept the accumulated gradient
    assert sched.get_last_lr() == [1.0]
    # step 2: synchronising, but gradients overflow -> the scaler skips, so does the scheduler
    with acc.accumulate(model):
        acc.backward(model(x).sum())
        model.weight.grad.fill_(float("inf"))
        opt.step()
        sched.step()
        opt.zero_grad()
    assert acc.sync_gradients and acc.optimizer_step_was_skipped and acc.scaler.get_scale() == 512.0
    assert torch.equal(model.weight, before) and sched.get_last_lr() == [1.0]
    # steps 3-4: a clean window -> one real step and one scheduler step
    for _ in range(2):
        with acc.accumulate(model):
            acc.backward(model(x).sum())
            acc.clip_grad_norm_(model.parameters(), 1e6)
            opt.step()
            sched.step()
            opt.zero_grad()
    assert not acc.optimizer_step_was_skipped and not torch.equal(model.weight, before)
    assert sched.get_last_lr() == [0.5]


def test_autocast_and_unwrap_fp32_wrapper() -> None:
    from notebook_accel import Accelerator
    from notebook_accel.utils import AutocastKwargs

    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = acc.prepare(torch.nn.Linear(4, 4))
    out = model(torch.randn(2, 4))
    assert out.dtype == torch.float32  # outputs converted back to fp32
    with acc.autocast():
        assert torch.nn.functional.linear(torch.randn(2, 4), torch.randn(4, 4)).dtype == torch.bfloat16
    with acc.autocast(autocast_handler=AutocastKwargs(enabled=False)):
        assert torch.nn.functional.linear(torch.randn(2, 4), torch.randn(4, 4)).dtype == torch.float32
    twin = copy.deepcopy(model)  # the copy's forward runs the copy's weights, still under autocast
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
    assert (
        torch.equal(twin(torch.randn(2, 4)), torch.zeros(2, 4))
        and twin(torch.randn(2, 4)).dtype == torch.float32
    )
    assert not torch.equal(model.weight, twin.weight)
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert "_original_forward" not in plain.__dict__ and "forward" not in plain.__dict__


def test_dynamo_backend_compiles_in_prepare() -> None:
    from notebook_accel import Accelerator

    acc = Accelerator(cpu=True, dynamo_backend="eager")
    base = torch.nn.Linear(3, 2)
    model = acc.prepare(base)
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    x = torch.randn(5, 3)
    torch.testing.assert_close(model(x), base(x))
    assert acc.unwrap_model(model, keep_torch_compile=False) is base


def test_find_executable_batch_size_around_accelerator() -> None:
    from notebook_accel import Accelerator, find_executable_batch_size

    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size: int) -> int:
        acc = Accelerator(cpu=True)
        acc.free_memory()
        tried.append(batch_size)
        if batch_size > 50:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes")
        loader = acc.prepare(DataLoader(_data(), batch_size=batch_size))
        return next(iter(loader))[0].shape[0]

    assert train() == min(45, N_SAMPLES)
    assert tried == [64, 57, 51, 45]  # Accelerate 1.15: int(size * 0.9) after each out-of-memory error


def _hide_package(name: str, monkeypatch, request) -> None:
    """Make ``name`` not importable for this test, with the trackers extra installed or not."""
    import sys

    from notebook_accel.utils.package_checks import is_package_available

    monkeypatch.setitem(sys.modules, name, None)
    is_package_available.cache_clear()  # the probe caches its answers: forget them now and after the test
    request.addfinalizer(is_package_available.cache_clear)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"mixed_precision": "fp32"}, ValueError, "fp32"),
        ({"mixed_precision": "fp8"}, ImportError, "msamp|transformer_engine"),
        ({"gradient_accumulation_steps": 0}, ValueError, "gradient_accumulation_steps"),
        ({"log_with": "nope"}, ValueError, "not a known tracker"),
        ({"log_with": "wandb"}, ImportError, "pip install wandb"),
        ({"log_with": "jsonl"}, ValueError, "project_dir"),
        ({"dynamo_backend": "eager", "dynamo_plugin": "x"}, ValueError, "not both"),
        ({"kwargs_handlers": [object()]}, TypeError, "kwargs_handlers accepts"),
        ({"split_batches": "yes"}, TypeError, "split_batches"),
        ({"project_config": "dir"}, TypeError, "ProjectConfiguration"),
    ],
)
def test_bad_constructor_arguments(kwargs: dict, exc: type, match: str, monkeypatch, request) -> None:
    from notebook_accel import Accelerator

    _hide_package("wandb", monkeypatch, request)
    with pytest.raises(exc, match=match):
        Accelerator(cpu=True, **kwargs)


def test_bad_plugin_and_handler_combinations() -> None:
    from notebook_accel import Accelerator, DeepSpeedPlugin, GradScalerKwargs
    from notebook_accel.utils import DataLoaderConfiguration, GradientAccumulationPlugin, MegatronLMPlugin

    with pytest.raises(ValueError, match="two GradScalerKwargs"):
        Accelerator(cpu=True, kwargs_handlers=[GradScalerKwargs(), GradScalerKwargs()])
    with pytest.raises(ValueError, match="both given"):
        Accelerator(
            cpu=True,
            gradient_accumulation_steps=2,
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2),
        )
    with pytest.raises(ValueError, match="dataloader_config were both given"):
        Accelerator(cpu=True, split_batches=True, dataloader_config=DataLoaderConfiguration())
    with pytest.raises(ImportError, match="pip install deepspeed"):
        Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    with pytest.raises(ImportError, match="megatron-core"):
        Accelerator(cpu=True, megatron_lm_plugin=MegatronLMPlugin())


def test_bad_prepare_and_step_arguments() -> None:
    from notebook_accel import Accelerator

    acc = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="device_placement has 1 entries for 2 objects"):
        acc.prepare(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), device_placement=[True])
    with pytest.raises(TypeError, match="torch.nn.Module"):
        acc.prepare_model("model")
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be"):
        acc.gradient_accumulation_steps = 0
    with pytest.raises(ValueError, match="no tracker named 'wandb'"):
        acc.get_tracker("wandb")


def test_json_lines_tracker(tmp_path) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    from notebook_accel import Accelerator
    from notebook_accel.tracking import GeneralTracker, get_available_trackers

    # "all" starts every installed tracker library (the trackers extra), whose patches of logging,
    # stdout and imports outlive their runs: it runs in a child, offline (tests.tracker_programs).
    root = str(Path(__file__).resolve().parents[1])
    code = (
        f"import json, sys; sys.path.insert(0, {root!r}); from tests.tracker_programs import jsonl_beside_all; "
        f"print(json.dumps(jsonl_beside_all({str(tmp_path)!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    assert child == {
        "trackers": ["jsonl", *(t.value for t in get_available_trackers())],
        "unwrapped_is_run": True,
        "refused": [],
    }
    lines = (tmp_path / "run1" / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    assert record["loss"] == 0.5 and record["step"] == 3
    assert json.loads((tmp_path / "run1" / "config.json").read_text()) == {"lr": 0.1}

    class Custom(GeneralTracker):
        name = "custom"
        requires_logging_directory = False

        def __init__(self) -> None:
            super().__init__()
            self.seen = []

        def log(self, values, step=None, **kwargs) -> None:
            self.seen.append((values, step))

    custom = Custom()
    acc2 = Accelerator(cpu=True, log_with=custom)
    acc2.init_trackers("p")
    acc2.log({"x": 1}, step=1)
    assert custom.seen == [({"x": 1}, 1)]
    with pytest.raises(ValueError, match="init_kwargs names trackers"):
        acc2.init_trackers("p", init_kwargs={"wandb": {}})

    class Broken(GeneralTracker):
        pass

    with pytest.raises(TypeError, match="must define the class attributes"):
        Broken()


def _sync_worker() -> dict:
    from notebook_accel import Accelerator, DistributedDataParallelKwargs
    from notebook_accel.utils import GradientAccumulationPlugin

    torch.set_num_threads(1)
    acc = Accelerator(
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2),
    )
    model = acc.prepare(torch.nn.Linear(2, 1, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt, sched = acc.prepare(opt, sched)
    x = torch.full((1, 2), float(acc.process_index + 1))
    out = {"find_unused": model.find_unused_parameters}
    with acc.no_sync(model):
        model(x).sum().backward()
    out["local_grad"] = model.module.weight.grad.clone()  # not averaged: differs by rank
    model.zero_grad()
    with acc.no_sync(model), acc.trigger_sync_in_backward(model):
        model(x).sum().backward()
    out["forced_grad"] = model.module.weight.grad.clone()  # averaged despite no_sync
    model.zero_grad()
    with acc.accumulate(model):  # step 1 of 2: accumulating, not synchronised
        model(x).sum().backward()
        out["clip_on_accumulating_step"] = acc.clip_grad_norm_(model.parameters(), 1.0)
    out["accumulated_grad"] = model.module.weight.grad.clone()
    with acc.accumulate(model):  # step 2 of 2: synchronised
        model(x).sum().backward()
        out["clip_norm"] = acc.clip_grad_norm_(model.parameters(), 100.0)
        out["synced_grad"] = model.module.weight.grad.clone()
        opt.step()
        sched.step()  # one optimizer step = one global batch = num_processes scheduler steps
    out["lr"] = sched.get_last_lr()
    loader = acc.prepare(DataLoader(list(range(3)), batch_size=1))  # 3 batches: 2 for rank 0, 1 for rank 1
    steps = 0
    with acc.join_uneven_inputs([model], even_batches=False):
        for batch in loader:
            model(batch.float().view(1, 1).repeat(1, 2)).sum().backward()
            steps += 1
    out["uneven_steps"] = steps
    out["even_batches_restored"] = loader.batch_sampler.even_batches
    acc.set_trigger() if acc.process_index == 1 else None
    out["trigger"] = acc.check_trigger()
    out["trigger_reset"] = acc.check_trigger()
    return out


def test_no_sync_trigger_sync_and_accumulate_through_debug_launcher() -> None:
    from notebook_accel import debug_launcher

    r0, r1 = debug_launcher(_sync_worker, num_processes=2)
    assert r0["find_unused"] is True
    assert torch.equal(r0["local_grad"], torch.ones(1, 2)) and torch.equal(
        r1["local_grad"], 2 * torch.ones(1, 2)
    )
    assert torch.equal(r0["forced_grad"], 1.5 * torch.ones(1, 2)) and torch.equal(
        r1["forced_grad"], r0["forced_grad"]
    )
    assert r0["clip_on_accumulating_step"] is None
    assert torch.equal(r0["accumulated_grad"], torch.ones(1, 2))
    # synchronised mean of (local accumulated + new) over ranks: ((1+1) + (2+2)) / 2
    assert torch.equal(r0["synced_grad"], 3 * torch.ones(1, 2)) and torch.equal(
        r1["synced_grad"], r0["synced_grad"]
    )
    assert r0["clip_norm"] is not None
    assert r0["lr"] == [0.25]
    assert (r0["uneven_steps"], r1["uneven_steps"]) == (2, 1) and r0["even_batches_restored"] is True
    assert r0["trigger"] and r1["trigger"] and not r0["trigger_reset"]


def _fsdp_worker(ckpt: str) -> dict:
    from notebook_accel import Accelerator, FullyShardedDataParallelPlugin

    torch.set_num_threads(1)
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, opt, loader = acc.prepare(model, opt, DataLoader(_data(), batch_size=BATCH))

    def epoch() -> None:
        for x, y in loader:
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()

    epoch()
    trained = acc.get_state_dict(model)
    acc.save_state(ckpt)
    epoch()  # moves weights and momentum on
    acc.load_state(ckpt)
    restored = acc.get_state_dict(model)
    epoch()  # continues from the restored momentum
    return {
        "type": type(model).__name__,
        "weights": trained,
        "restored": restored,
        "continued": acc.get_state_dict(model),
    }


def test_fsdp_on_cpu_processes_matches_full_batch_training_and_checkpoints(tmp_path) -> None:
    results = run_distributed(_fsdp_worker, nprocs=2, args=(str(tmp_path / "fsdp"),), timeout=120)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    snapshots = []
    for _ in range(2):
        for x, y in DataLoader(_data(), batch_size=2 * BATCH):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        snapshots.append({k: v.clone() for k, v in model.state_dict().items()})
    for r in results:
        assert r["type"] == "FullyShardedDataParallel"
        for k, v in snapshots[0].items():
            torch.testing.assert_close(r["weights"][k], v, rtol=1e-5, atol=1e-6)
            assert torch.equal(r["restored"][k], r["weights"][k])
            torch.testing.assert_close(r["continued"][k], snapshots[1][k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive"])
def test_tracker_without_its_package_names_it(name: str, tmp_path, monkeypatch, request) -> None:
    from notebook_accel import Accelerator
    from notebook_accel.tracking import LOGGER_TYPE_TO_CLASS

    _hide_package(name, monkeypatch, request)
    with pytest.raises(ImportError, match=f"pip install {name}"):
        Accelerator(cpu=True, project_dir=tmp_path, log_with=name)
    with pytest.raises(ImportError, match=f"requires `{name}`"):
        LOGGER_TYPE_TO_CLASS[name]("run", logging_dir=tmp_path) if LOGGER_TYPE_TO_CLASS[
            name
        ].requires_logging_directory else LOGGER_TYPE_TO_CLASS[name]("run")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_on_cuda_scales_and_returns_fp32() -> None:
    from notebook_accel import Accelerator

    acc = Accelerator(mixed_precision="fp16")
    model, opt = acc.prepare(
        torch.nn.Linear(8, 8), torch.optim.SGD(torch.nn.Linear(8, 8).parameters(), lr=0.1)
    )
    assert acc.device.type == "cuda" and next(model.parameters()).device.type == "cuda"
    out = model(torch.randn(4, 8, device=acc.device))
    assert out.dtype == torch.float32 and acc.scaler is not None
    with acc.autocast():
        assert (
            torch.mm(torch.randn(2, 2, device="cuda"), torch.randn(2, 2, device="cuda")).dtype
            == torch.float16
        )
    acc.backward(out.sum())


def test_megatron_plugin_with_engine_present_refuses_to_fall_back(monkeypatch) -> None:
    from notebook_accel import Accelerator
    from notebook_accel.utils import MegatronLMPlugin, imports

    monkeypatch.setattr(imports, "is_megatron_lm_available", lambda: True)
    acc = Accelerator(cpu=True, megatron_lm_plugin=MegatronLMPlugin())
    with pytest.raises(RuntimeError, match="does not build Megatron-LM models"):
        acc.prepare(torch.nn.Linear(2, 2))


def test_more_bad_arguments(monkeypatch, tmp_path) -> None:
    from notebook_accel import Accelerator, DeepSpeedPlugin
    from notebook_accel.optimizer import AcceleratedOptimizer
    from notebook_accel.scheduler import AcceleratedScheduler
    from notebook_accel.tracking import JSONLinesTracker
    from notebook_accel.utils import ProjectConfiguration

    with pytest.raises(TypeError, match="dataloader_config must be a DataLoaderConfiguration"):
        Accelerator(cpu=True, dataloader_config={"split_batches": True})
    with pytest.raises(TypeError, match="fsdp_plugin must be a FullyShardedDataParallelPlugin"):
        Accelerator(cpu=True, fsdp_plugin="full_shard")
    with pytest.raises(TypeError, match="dynamo_plugin must be a TorchDynamoPlugin"):
        Accelerator(cpu=True, dynamo_plugin="eager")
    with pytest.raises(ValueError, match="deepspeed_plugin or deepspeed_plugins, not both"):
        Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(), deepspeed_plugins={"a": DeepSpeedPlugin()})
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(automatic_checkpoint_naming=True))
    with pytest.raises(ValueError, match="automatic_checkpoint_naming needs a project_dir"):
        acc.save_state()
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        AcceleratedOptimizer("sgd")
    with pytest.raises(TypeError, match="with a step\\(\\) method"):
        AcceleratedScheduler("cosine", [])
    with pytest.raises(ValueError, match="needs a logging directory"):
        JSONLinesTracker("run", logging_dir=None)


def test_plugins_given_to_a_later_accelerator_are_not_ignored() -> None:
    from notebook_accel import Accelerator, FullyShardedDataParallelPlugin

    Accelerator(cpu=True)
    later = Accelerator(cpu=True, dynamo_backend="eager")  # per-Accelerator: honoured
    assert isinstance(later.prepare(torch.nn.Linear(2, 2)), torch._dynamo.eval_frame.OptimizedModule)
    with pytest.raises(ValueError, match="fsdp_plugin was given, but this process's AcceleratorState"):
        Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())


def test_deepspeed_installed_on_cpu_without_oneccl_names_the_way_out(monkeypatch) -> None:
    from notebook_accel import Accelerator, DeepSpeedPlugin
    from notebook_accel.utils import imports

    monkeypatch.setattr(imports, "is_deepspeed_available", lambda: True)
    monkeypatch.setattr(
        imports, "is_package_available", lambda name, *a: name != "oneccl_bindings_for_pytorch"
    )
    with pytest.raises(
        RuntimeError, match=r"needs Intel's oneCCL bindings.*ParallelismConfig\(dp_shard_size=N\)"
    ):
        Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))


def test_an_fp16_step_does_not_read_the_scale_until_asked_whether_it_was_skipped(monkeypatch) -> None:
    # get_scale() reads the scale back from the device: on a GPU, once per step, it stalls the loop
    from notebook_accel import Accelerator

    acc = Accelerator(cpu=True, mixed_precision="fp16")
    model = torch.nn.Linear(4, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    reads = []
    real = acc.scaler.get_scale
    monkeypatch.setattr(acc.scaler, "get_scale", lambda: reads.append(1) or real())
    x = torch.ones(2, 4)
    for _ in range(3):
        acc.backward(model(x).sum())
        opt.step()
        opt.zero_grad()
    assert reads == []  # three steps, no read-back
    assert not opt.step_was_skipped and not acc.optimizer_step_was_skipped
    acc.backward(model(x).sum() * float("inf"))
    opt.step()
    assert opt.step_was_skipped and opt.is_overflow and acc.optimizer_step_was_skipped
