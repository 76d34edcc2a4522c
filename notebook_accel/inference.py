"""Pipeline-parallel inference: ``prepare_pippy`` splits a model into one stage per process.

Built on PyTorch's own ``torch.distributed.pipelining``: the model is traced once with an example
micro-batch, cut at the split points (``SplitPoint.BEGINNING`` of each named submodule), and each
process keeps only its stage. Calling the prepared model runs a GPipe schedule: the first process
feeds the batch in ``num_chunks`` micro-batches, every process runs its stage as soon as the one
before hands it a micro-batch, and the last process holds the output (every process does with
``gather_output=True``).

``split_points="auto"`` balances the stages by parameter size over the model's blocks, taken in the
order the model registers them (which is the order they run in for the usual stacks of layers).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import nn

from .state import PartialState
from .utils import (
    broadcast_object_list,
    calculate_maximum_sizes,
    compute_module_sizes,
    convert_bytes,
    copy_tensor_to_devices,
    ignorant_find_batch_size,
    infer_auto_device_map,
    is_pippy_available,
    pad_input_tensors,
    send_to_device,
)

__all__ = [
    "PartialState",
    "build_pipeline",
    "calculate_maximum_sizes",
    "convert_bytes",
    "copy_tensor_to_devices",
    "find_pippy_batch_size",
    "generate_device_map",
    "ignorant_find_batch_size",
    "infer_auto_device_map",
    "is_pippy_available",
    "pad_input_tensors",
    "pippy_forward",
    "prepare_pippy",
    "send_to_device",
]

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

logger = logging.getLogger(__name__)


def _pipelining() -> Any:
    """Return ``torch.distributed.pipelining``, or raise naming the torch it needs (notebook_accel itself allows torch 2.1)."""
    if not is_pippy_available():
        raise ImportError(
            f"prepare_pippy runs on torch.distributed.pipelining, which torch {torch.__version__} lacks. "
            "Install torch 2.4 or newer: pip install 'torch>=2.4'."
        )
    # The submodule is loaded too: build_pipeline reads microbatch.split_args_kwargs_into_chunks.
    importlib.import_module("torch.distributed.pipelining.microbatch")
    return importlib.import_module("torch.distributed.pipelining")


# ---------------------------------------------------------------------------------------------
# where to split


def _split_units(model: nn.Module, per_stage: float, no_split: set[str]) -> list[tuple[str, int]]:
    """Return ``(module name, bytes)`` for the blocks a stage boundary may fall before, in registration order.

    A block larger than one stage's share is opened into its children (unless its class is listed in
    ``no_split_module_classes``), so one big container does not end up as a stage of its own.
    """
    sizes = compute_module_sizes(model)

    def units(module: nn.Module, prefix: str) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            size = sizes.get(full, 0)
            opens = size > per_stage and type(child).__name__ not in no_split and any(child.children())
            out.extend(units(child, f"{full}.") if opens else [(full, size)])
        return out

    return units(model, "")


def _balanced_boundaries(sizes: Sequence[int], num_stages: int) -> list[int]:
    """Return the indices where stages 1..n-1 start, each cut nearest its share of the total size."""
    total = sum(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    cuts: list[int] = []
    for stage in range(1, num_stages):
        # Leave at least one block before this cut (after the previous one) and one per later stage.
        low = (cuts[-1] if cuts else 0) + 1
        high = len(sizes) - (num_stages - stage)
        target = total * stage / num_stages
        cuts.append(min(range(low, high + 1), key=lambda i: (abs(prefix[i] - target), i)))
    return cuts


def generate_device_map(
    model: nn.Module,
    num_processes: int = 1,
    no_split_module_classes: Optional[list[str]] = None,
    max_memory: Optional[dict] = None,
) -> dict[str, int]:
    """Return a device map giving each block of ``model`` to one of ``num_processes`` pipeline stages.

    Without ``max_memory`` the stages are balanced by parameter size (each near ``1/num_processes`` of
    the model); with it, the map is ``infer_auto_device_map`` under those budgets (keys are process
    indices). Blocks whose class is in ``no_split_module_classes`` stay whole.
    """
    if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
        raise ValueError(f"generate_device_map: num_processes must be a positive int, got {num_processes!r}")
    if max_memory is not None:
        return infer_auto_device_map(
            model, max_memory=max_memory, no_split_module_classes=no_split_module_classes, clean_result=False
        )
    total = compute_module_sizes(model).get("", 0)
    units = _split_units(model, total / num_processes, set(no_split_module_classes or ()))
    if len(units) < num_processes:
        raise ValueError(
            f"Cannot split the model into {num_processes} pipeline stages: it has only {len(units)} "
            f"block(s) a stage can start at ({[name for name, _ in units]}). Use fewer processes, or remove "
            "classes from no_split_module_classes so their blocks can be opened."
        )
    cuts = _balanced_boundaries([size for _, size in units], num_processes)
    stage_of = [sum(i >= cut for cut in cuts) for i in range(len(units))]
    return {name: stage for (name, _), stage in zip(units, stage_of)}


def _split_points_from_map(device_map: dict[str, int]) -> list[str]:
    """Return the first module name of every stage after the first, in map order."""
    names = list(device_map)
    return [name for before, name in zip(names, names[1:]) if device_map[name] != device_map[before]]


def _check_split_points(model: nn.Module, split_points: Any) -> list[str]:
    """Return ``split_points`` as a list of existing module names, or raise naming the bad one."""
    if isinstance(split_points, str) or not isinstance(split_points, (list, tuple)):
        raise ValueError(
            f"split_points must be 'auto' or a list of module names to start a stage at, got {split_points!r}"
        )
    modules = {name for name, _ in model.named_modules() if name}
    for point in split_points:
        if point not in modules:
            close = difflib.get_close_matches(str(point), sorted(modules), n=3, cutoff=0.5)
            hint = f"Closest module names: {close}." if close else f"Module names: {sorted(modules)[:12]}."
            raise ValueError(f"Split point {point!r} names no submodule of {type(model).__name__}. {hint}")
    return list(split_points)


# ---------------------------------------------------------------------------------------------
# inputs


def find_pippy_batch_size(args: tuple, kwargs: dict) -> Optional[int]:
    """Return the batch size (first dimension) of the first tensor in ``args``, then ``kwargs``; None without one."""
    for value in (*(args or ()), *((kwargs or {}).values())):
        found = ignorant_find_batch_size(value)
        if found is not None:
            return found
    return None


def _check_chunks(num_chunks: Any, batch_size: Optional[int], where: str) -> None:
    if not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
    if batch_size is None:
        raise ValueError(
            f"{where}: no tensor with a batch dimension found in the inputs. Pass the model's inputs as "
            "example_args (positional) or example_kwargs (by name), each a tensor batch."
        )
    if batch_size % num_chunks:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise ValueError(
            f"{where}: a batch of {batch_size} cannot be cut into num_chunks={num_chunks} equal micro-batches. "
            f"Use a batch size that is a multiple of {num_chunks}, or num_chunks in {divisors}."
        )


# ---------------------------------------------------------------------------------------------
# the pipeline


def build_pipeline(
    model: nn.Module, split_points: list[str], args: tuple, kwargs: dict, num_chunks: int
) -> PipelineStage:
    """Return this process's ``PipelineStage`` of ``model`` cut before each of ``split_points``.

    ``args``/``kwargs`` are an example batch (on the CPU) that ``num_chunks`` divides; the model is
    traced with one micro-batch of it, and the stage for ``PartialState().process_index`` is built on
    this process's device.
    """
    state = PartialState()
    split = _pipelining().microbatch.split_args_kwargs_into_chunks
    mb_args, mb_kwargs = split(tuple(args or ()), dict(kwargs or {}), num_chunks)
    pipe = _trace(model, split_points, mb_args[0], mb_kwargs[0])
    if pipe.num_stages != state.num_processes:
        raise ValueError(
            f"Split points {split_points} cut the model into {pipe.num_stages} stage(s), but "
            f"{state.num_processes} processes run the pipeline: a split point at the model's first call, "
            "a repeated one, or one that forward never calls makes no new stage. Give "
            f"{state.num_processes - 1} distinct split points in the order forward calls them."
        )
    _check_inputs_enter_first_stage(pipe, split_points)
    return pipe.build_stage(state.process_index, device=state.device)


def _trace(model: nn.Module, split_points: list[str], mb_args: tuple, mb_kwargs: dict) -> Any:
    """Return torch's ``Pipe`` of ``model`` traced with one micro-batch, the model left as it was.

    ``pipeline()`` marks each split point by replacing that submodule's ``forward`` on the instance and
    leaves it there; a second trace of the same model then recurses. The instance attributes are put
    back, so a model can be prepared again (after an error, or with other split points).
    """
    modules = dict(model.named_modules())
    saved = {point: modules[point].__dict__.get("forward") for point in split_points}
    try:
        pipelining = _pipelining()
        return pipelining.pipeline(
            model,
            mb_args=mb_args,
            mb_kwargs=mb_kwargs,
            split_spec={point: pipelining.SplitPoint.BEGINNING for point in split_points},
        )
    finally:
        for point, forward in saved.items():
            if forward is None:
                modules[point].__dict__.pop("forward", None)
            else:
                modules[point].forward = forward


def _check_inputs_enter_first_stage(pipe: Any, split_points: list[str]) -> None:
    """Raise when a later stage reads a model input directly: only the first process is given the inputs.

    torch.distributed.pipelining hands every input to stage 0 and does not forward one that stage 0
    never reads: at the first call stage 0 fails with a bare ``forward() takes N positional
    arguments`` TypeError while the later stages wait for a micro-batch that never comes.
    """
    graph = pipe.split_gm.graph
    inputs = {node for node in graph.nodes if node.op == "placeholder"}
    stages = [node for node in graph.nodes if node.op == "call_module"]
    for index, node in enumerate(stages[1:], start=1):
        late = [str(arg.target) for arg in (*node.args, *node.kwargs.values()) if arg in inputs]
        if late:
            raise ValueError(
                f"Model input(s) {late} are first read in stage {index} (after split point "
                f"{split_points[index - 1]!r}), but only the first stage receives the inputs. Move the split "
                "points after the first use of those inputs, or compute them inside the model's first layers."
            )


def pippy_forward(forward: Callable, num_chunks: int, gather_output: bool, *args: Any, **kwargs: Any) -> Any:
    """Return the pipeline's output on the last process (every process with ``gather_output``), else None.

    ``forward`` is a schedule's ``step``: the first process feeds it the inputs (moved to its device),
    the others call it empty and exchange micro-batches with their neighbours.
    """
    state = PartialState()
    _check_chunks(num_chunks, find_pippy_batch_size(args, kwargs), "pippy_forward")
    output = None
    if state.is_main_process:
        output = forward(*send_to_device(args, state.device), **send_to_device(kwargs, state.device))
    elif state.is_last_process:
        output = forward()
    else:
        forward()
    if gather_output and state.num_processes > 1:
        # Outputs may be any structure (a transformers ModelOutput, tuples): sent as one object.
        output = broadcast_object_list([output], from_process=state.num_processes - 1)[0]
        output = send_to_device(output, state.device)
    return output


def _check_call(expected: Optional[int], args: tuple, kwargs: dict) -> None:
    """Raise before any communication when a call's batch differs from the traced one (all ranks agree)."""
    found = find_pippy_batch_size(args, kwargs)
    if found != expected:
        raise ValueError(
            f"The pipeline was traced with a batch of {expected} (example_args/example_kwargs) and is called "
            f"with a batch of {found}. Pad the batch to {expected} (notebook_accel.utils.pad_input_tensors), or "
            f"call prepare_pippy again with an example batch of {found}."
        )


def prepare_pippy(
    model: nn.Module,
    split_points: Optional[Union[str, list[str]]] = "auto",
    no_split_module_classes: Optional[list[str]] = None,
    example_args: Optional[tuple[Any]] = (),
    example_kwargs: Optional[dict[str, Any]] = None,
    num_chunks: Optional[int] = None,
    gather_output: Optional[bool] = False,
) -> nn.Module:
    """Return ``model`` with its forward replaced by a pipeline over all processes (one stage each).

    ``split_points`` is ``"auto"`` or None (stages balanced by size) or the names of the submodules that start
    stages 2..n. ``example_args``/``example_kwargs`` are one batch of the inputs every later call
    passes (same batch size, same keyword names); ``num_chunks`` (default: the number of processes)
    micro-batches are cut from it. Call the prepared model with the same inputs on every process;
    the output lives on the last process (None elsewhere) unless ``gather_output=True``.

    Args:
        model: The model to cut into one pipeline stage per process.
        split_points: "auto" or None (stages balanced by size), or the names of the submodules that start
            stages 2..n.
        no_split_module_classes: Module classes an automatic split never cuts through.
        example_args: Positional inputs of one batch, shaped like every later call's.
        example_kwargs: Keyword inputs of that batch.
        num_chunks: Micro-batches cut from each batch (default: the number of processes).
        gather_output: Send the output to every process (default: only the last holds it).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare_pippy needs a torch.nn.Module, got {type(model).__name__}")
    state = PartialState()
    num_chunks = state.num_processes if num_chunks is None else num_chunks
    example_args = tuple(example_args or ())
    example_kwargs = dict(example_kwargs or {})
    batch_size = find_pippy_batch_size(example_args, example_kwargs)
    _check_chunks(num_chunks, batch_size, "prepare_pippy")
    if split_points is None or split_points == "auto":
        device_map = generate_device_map(model, state.num_processes, no_split_module_classes)
        split_points = _split_points_from_map(device_map)
    split_points = _check_split_points(model, split_points)
    if state.num_processes < 2:
        raise ValueError(
            "prepare_pippy splits the model across processes, but this is a single process. Launch the "
            "function with notebook_launcher(fn, num_processes=N) (N >= 2), or call the model directly."
        )
    if len(split_points) != state.num_processes - 1:
        raise ValueError(
            f"{len(split_points)} split point(s) {split_points} make {len(split_points) + 1} stages, but "
            f"{state.num_processes} processes run the pipeline (one stage each). Give "
            f"{state.num_processes - 1} split point(s), or launch {len(split_points) + 1} processes."
        )
    stage = build_pipeline(model, split_points, example_args, example_kwargs, num_chunks)
    schedule = _pipelining().ScheduleGPipe(stage, num_chunks)
    original_forward = model.forward

    @functools.wraps(original_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        _check_call(batch_size, args, kwargs)
        return pippy_forward(schedule.step, num_chunks, gather_output, *args, **kwargs)

    model.forward = forward
    model.hf_split_points = split_points
    logger.debug(
        "pipeline stage %d of %d starts at %s", state.process_index, state.num_processes, split_points
    )
    return model
