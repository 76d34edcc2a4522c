"""The Accelerator's parts on their own: resolved flags, precision, the accumulation window, the scheduler wrapper."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from notebook_accel.accelerator.flags import SPLIT_BATCHES_UNSET, resolve_flags
from notebook_accel.accelerator.precision import Precision
from notebook_accel.scheduler import AcceleratedScheduler
from notebook_accel.state import AcceleratorState, GradientState
from notebook_accel.utils import AutocastKwargs, GradientAccumulationPlugin, GradScalerKwargs
from notebook_accel.utils.enums import DistributedType, PrecisionType
from tests.test_checkpointing import Counter


def _flags(**overrides):
    arguments = dict(
        device_placement=True,
        split_batches=SPLIT_BATCHES_UNSET,
        mixed_precision=None,
        gradient_accumulation_steps=1,
        cpu=True,
        dataloader_config=None,
        deepspeed_plugin=None,
        fsdp_plugin=None,
        torch_tp_plugin=None,
        megatron_lm_plugin=None,
        rng_types=None,
        log_with=None,
        project_dir=None,
        project_config=None,
        gradient_accumulation_plugin=None,
        step_scheduler_with_optimizer=True,
        kwargs_handlers=None,
        dynamo_backend=None,
        dynamo_plugin=None,
        deepspeed_plugins=None,
        parallelism_config=None,
    )
    arguments.update(overrides)
    return resolve_flags(**arguments)


# --- flags ---------------------------------------------------------------------------------------


def test_flags_are_resolved_once_and_frozen(monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "3")
    flags = _flags(
        mixed_precision="BF16", split_batches=True, rng_types=["torch"], kwargs_handlers=[GradScalerKwargs()]
    )
    assert flags.mixed_precision is PrecisionType.BF16  # typed once here; the state takes it unchecked
    assert flags.dataloader_config.split_batches is True
    assert flags.rng_types == ("torch",)
    assert flags.accumulation_plugin.num_steps == 3  # the environment is read here, once
    assert isinstance(flags.handler("scaler"), GradScalerKwargs) and flags.handler("ddp") is None
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "5")
    assert flags.accumulation_plugin.num_steps == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        flags.mixed_precision = "fp16"
    # Not given, split_batches leaves the dataloader configuration alone.
    assert _flags().dataloader_config.split_batches is False and _flags().mixed_precision is None


def test_the_state_takes_the_typed_precision_as_a_plain_mode() -> None:
    from notebook_accel import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="BF16")
    assert type(accelerator.state.mixed_precision) is str and accelerator.mixed_precision == "bf16"
    assert accelerator.precision.mode == "bf16" and type(accelerator.precision.mode) is str


def test_flags_reject_bad_values() -> None:
    with pytest.raises(
        ValueError, match=r"Unknown mixed_precision 'fp32': choose one of 'no', 'fp16', 'bf16', 'fp8'"
    ):
        _flags(mixed_precision="fp32")
    with pytest.raises(TypeError, match="split_batches must be a bool, got 'yes'"):
        _flags(split_batches="yes")
    with pytest.raises(ValueError, match="holds two GradScalerKwargs"):
        _flags(kwargs_handlers=[GradScalerKwargs(), GradScalerKwargs()])
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be an int >= 1, got 0"):
        _flags(gradient_accumulation_steps=0)


# --- precision -----------------------------------------------------------------------------------


def test_precision_modes() -> None:
    assert Precision("bf16", "cpu").native_amp and Precision("bf16", "cpu").dtype == torch.bfloat16
    assert Precision("fp16", "cpu").dtype == torch.float16
    for mode in ("no", "fp8"):
        assert not Precision(mode, "cpu").native_amp and Precision(mode, "cpu").dtype is None


def test_precision_autocast_and_override() -> None:
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with Precision("bf16", "cpu").autocast():
        assert (a @ b).dtype == torch.bfloat16
    with Precision("no", "cpu").autocast():
        assert (a @ b).dtype == torch.float32
    # The handler given at the call wins over the Accelerator's (here: autocast switched off).
    precision = Precision("bf16", "cpu", AutocastKwargs(enabled=True))
    with precision.autocast(AutocastKwargs(enabled=False)):
        assert (a @ b).dtype == torch.float32


def test_precision_wraps_forward_once_with_fp32_outputs() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    inside = []  # what the layer computes in, under the wrapper's autocast
    model[0].register_forward_hook(lambda module, args, out: inside.append(out.dtype))
    precision = Precision("bf16", "cpu")
    precision.wrap_forward(model)
    wrapped = model.forward
    precision.wrap_forward(model)  # prepared twice: the first wrapper stays
    assert model.forward is wrapped
    assert model(torch.randn(2, 4)).dtype == torch.float32 and inside == [torch.bfloat16]
    clone = copy.deepcopy(model)  # the wrapper is a bound method: the copy runs the copy
    with torch.no_grad():
        clone[0].weight.zero_()
        clone[0].bias.zero_()
    assert torch.count_nonzero(clone(torch.randn(2, 4))) == 0
    assert model._original_forward.__self__ is model
    plain = torch.nn.Linear(4, 4)
    Precision("no", "cpu").wrap_forward(plain)
    assert "_original_forward" not in plain.__dict__
    # A forward set on the instance (a hook did it, say) is wrapped as a plain function.
    layer = torch.nn.Linear(4, 4)
    computed = []

    def instance_forward(x):
        out = torch.nn.functional.linear(x, layer.weight, layer.bias)
        computed.append(out.dtype)
        return out

    layer.forward = instance_forward
    precision.wrap_forward(layer)
    assert layer._original_forward is instance_forward
    assert layer(torch.randn(2, 4)).dtype == torch.float32 and computed == [torch.bfloat16]


def test_precision_grad_scaler() -> None:
    scaler = Precision("fp16", "cpu").grad_scaler(DistributedType.NO, GradScalerKwargs(init_scale=64.0))
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() == 64.0
    assert Precision("fp16", "cpu").grad_scaler(DistributedType.DEEPSPEED) is None
    assert Precision("bf16", "cpu").grad_scaler(DistributedType.NO) is None


# --- the accumulation window ---------------------------------------------------------------------


class _Loader:
    """Stands for a prepared dataloader: GradientState reads its end_of_dataloader flag."""

    end_of_dataloader = False
    remainder = -1


@pytest.mark.parametrize("sync_with_dataloader", [True, False])
def test_accumulation_window_and_epoch_end(sync_with_dataloader: bool) -> None:
    from notebook_accel import Accelerator

    plugin = GradientAccumulationPlugin(num_steps=3, sync_with_dataloader=sync_with_dataloader)
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    loader = _Loader()
    acc.gradient_state._add_dataloader(loader)
    synced = []
    for batch in range(5):  # an epoch of 5 batches, window of 3
        loader.end_of_dataloader = batch == 4
        acc._do_sync()
        synced.append(acc.sync_gradients)
    if sync_with_dataloader:
        assert (
            synced == [False, False, True, False, True] and acc.step == 0
        )  # the last batch closes the window
    else:
        assert synced == [False, False, True, False, False] and acc.step == 5
    acc.gradient_state._remove_dataloader(loader)


# --- the scheduler wrapper -----------------------------------------------------------------------


class _Schedule:
    """Counts its steps like a torch scheduler; ``total_steps`` as OneCycleLR has it."""

    def __init__(self, total_steps: int | None = None) -> None:
        self._step_count = 1
        self.steps = 0
        if total_steps is not None:
            self.total_steps = total_steps

    def step(self) -> None:
        if getattr(self, "total_steps", None) is not None and self._step_count > self.total_steps:
            raise ValueError("stepped past the end of the schedule")
        self._step_count += 1
        self.steps += 1


class _Optimizer:
    step_was_skipped = False


def _processes(monkeypatch, count: int) -> None:
    AcceleratorState(cpu=True)
    monkeypatch.setitem(AcceleratorState._shared_state, "num_processes", count)


def test_scheduler_steps_once_per_process_on_synchronised_steps(monkeypatch) -> None:
    _processes(monkeypatch, 3)
    state = GradientState()
    schedule, optimizer = _Schedule(), _Optimizer()
    wrapper = AcceleratedScheduler(schedule, optimizer)
    wrapper.step()
    assert schedule.steps == 3  # one optimizer step consumed one batch on each of 3 processes
    split = _Schedule()
    AcceleratedScheduler(split, [optimizer], split_batches=True).step()
    assert split.steps == 1
    state._set_sync_gradients(False)
    wrapper.step()
    assert schedule.steps == 3 and schedule._step_count == 4  # accumulating: nothing moves
    state._set_sync_gradients(True)
    optimizer.step_was_skipped = True
    wrapper.step()
    assert schedule.steps == 3  # the scaler skipped the optimizer step, the schedule waits


def test_scheduler_counts_accumulating_steps_with_adjust_scheduler(monkeypatch) -> None:
    _processes(monkeypatch, 1)
    state = GradientState(GradientAccumulationPlugin(num_steps=2, adjust_scheduler=True))
    schedule = _Schedule()
    state._set_sync_gradients(False)
    AcceleratedScheduler(schedule, _Optimizer()).step()
    assert (schedule.steps, schedule._step_count) == (0, 2)


def test_scheduler_without_step_with_optimizer_always_steps(monkeypatch) -> None:
    _processes(monkeypatch, 4)
    GradientState()._set_sync_gradients(False)
    schedule = _Schedule(total_steps=1)
    wrapper = AcceleratedScheduler(schedule, _Optimizer(), step_with_optimizer=False)
    wrapper.step()
    assert schedule.steps == 1
    with pytest.raises(ValueError, match="past the end"):  # the user's own step is not bounded
        wrapper.step()


def test_scheduler_stops_a_fixed_length_schedule_at_its_end(monkeypatch) -> None:
    _processes(monkeypatch, 4)
    schedule = _Schedule(total_steps=2)
    AcceleratedScheduler(schedule, _Optimizer()).step()
    assert schedule.steps == 2  # 4 per-process steps asked, the schedule had 2 left


def test_scheduler_needs_a_step_method() -> None:
    with pytest.raises(TypeError, match="wraps an object with a step\\(\\) method, got str"):
        AcceleratedScheduler("cosine", [])


# --- checkpoints ---------------------------------------------------------------------------------


def test_checkpointer_saves_and_restores_registered_objects_without_an_accelerator(tmp_path) -> None:
    from notebook_accel.accelerator.checkpoint import Checkpointer, PreparedObjects
    from notebook_accel.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=1)
    prepared = PreparedObjects()
    checkpointer = Checkpointer(config, AcceleratorState(cpu=True), prepared)
    counter = Counter()
    checkpointer.register(counter)
    seen = []
    handle = checkpointer.add_save_hook(lambda models, weights, folder: seen.append(folder))
    counter.count = 3
    first = checkpointer.save(None, [], step=7, scaler=None, safe_serialization=True)
    counter.count = 5
    second = checkpointer.save(None, [], step=8, scaler=None, safe_serialization=True)
    handle.remove()
    assert first.endswith("checkpoint_0") and second.endswith("checkpoint_1") and len(seen) == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1"]  # total_limit=1
    counter.count = 0
    config.iteration = 0  # a fresh run: loading the latest checkpoint continues its numbering
    saved = checkpointer.load(None, unwrap=lambda m: m, scaler=None)
    assert counter.count == 5 and saved["step"] == 8 and config.iteration == 2
    with pytest.raises(ValueError, match=r"The following inputs are invalid:\n\t- Item at index 0, `int`"):
        checkpointer.register(3)


def test_free_memory_empties_the_registries_in_place() -> None:
    from notebook_accel import Accelerator

    acc = Accelerator(cpu=True)
    models = acc._models
    acc.prepare(torch.nn.Linear(2, 2))
    assert acc._checkpointer.prepared.models is models and len(models) == 1
    acc.free_memory()
    assert acc._models is models and models == []
