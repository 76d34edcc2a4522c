"""What every prepared dataloader shares: the adapter over a (stateful) DataLoader and the step book-keeping.

``DataLoaderAdapter`` is a ``torch.utils.data.DataLoader`` that, with ``use_stateful_dataloader=True``,
iterates through torchdata's ``StatefulDataLoader`` built with the same arguments (so ``state_dict()``
/ ``load_state_dict()`` resume mid-epoch). ``DataLoaderStateMixin`` tells ``GradientState`` which loader
is being iterated, whether its last batch is being served and how many samples of it are real. The
prepared loaders (``DataLoaderShard``, ``DataLoaderDispatcher``, ``SkipDataLoader``) are built on both,
as in Accelerate 1.15. The helpers at the end read a loader's settings (to rebuild it) and a device
mesh's data-parallel share.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler, SequentialSampler

from ..state import GradientState
from .stateful import OWN_KEYS, LoaderPosition, make_stateful_loader

__all__ = ["DataLoaderAdapter", "DataLoaderStateMixin", "find_sampler", "get_sampler"]

logger = logging.getLogger(__name__)

# DataLoader constructor arguments carried over when a loader is rebuilt around a new sampler.
_LOADER_DEFAULTS: dict[str, Any] = {
    "num_workers": 0,
    "collate_fn": None,
    "pin_memory": False,
    "timeout": 0,
    "worker_init_fn": None,
    "multiprocessing_context": None,
    "generator": None,
    "prefetch_factor": None,
    "persistent_workers": False,
    "pin_memory_device": "",
    "in_order": True,
}


class DataLoaderStateMixin:
    """Book-keeping shared by the prepared loaders: epoch, end-of-data flag, remainder, GradientState.

    ``end_of_dataloader`` is True while the last batch is served; ``remainder`` is the number of real
    samples in the last global batch (``-1`` while unknown). A custom loader subclassing this creates
    ``self.gradient_state = GradientState()`` and calls :meth:`begin` / :meth:`end` around an iteration.
    """

    end_of_dataloader: bool = False
    remainder: int = -1
    _drop_last: bool = False

    # Whether ``set_epoch`` also reaches the batch samplers behind this loader (a user's own with
    # ``set_epoch``): a loader that batches on every process does, as in 1.15; the dispatcher does not.
    _epoch_reaches_batch_sampler: bool = False

    def set_epoch(self, epoch: int) -> None:
        """Return nothing; select ``epoch``'s shuffling in the sampler (or iterable dataset) behind this loader.

        A batch sampler behind it that has ``set_epoch`` of its own (a user's) is told the epoch too.
        """
        self.iteration = epoch
        if self._epoch_reaches_batch_sampler:
            for batch_sampler in _batch_samplers(self):
                if hasattr(batch_sampler, "set_epoch"):
                    batch_sampler.set_epoch(epoch)
        sampler = find_sampler(self)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        elif hasattr(getattr(self, "dataset", None), "set_epoch"):
            self.dataset.set_epoch(epoch)

    def reset(self) -> None:
        """Return nothing; forget the end-of-data flag and the remainder (a new iteration starts)."""
        self.end_of_dataloader = False
        self.remainder = -1

    def begin(self) -> None:
        """Return nothing; start an iteration: reset, and register this loader as GradientState's active one."""
        self.reset()
        self.remainder = self._compute_remainder()
        # A fresh handle each time: the singleton may have been reset since the last iteration.
        self.gradient_state = GradientState()
        self.gradient_state._add_dataloader(self)
        self._publish()

    def end(self) -> None:
        """Return nothing; finish an iteration: this loader stops being GradientState's active one."""
        self.gradient_state._remove_dataloader(self)

    def _mark_last_batch(self) -> None:
        self.end_of_dataloader = True
        self._publish()

    def _publish(self) -> None:
        # GradientState answers end_of_dataloader/remainder for the active loader; keep it current.
        gs = self.gradient_state
        if gs.active_dataloader is self:
            gs._set_end_of_dataloader(self.end_of_dataloader)
            gs._set_remainder(self.remainder)

    def _compute_remainder(self) -> int:
        # Known up front from the length of what is iterated; loaders that learn it from their last
        # batch (the dispatcher) or never report it (SkipDataLoader) override this.
        if self._drop_last:
            return -1
        length = self._remainder_length()
        total = getattr(self, "total_batch_size", None)
        return length % total if length is not None and total else -1

    def _remainder_length(self) -> int | None:
        """Return how many samples the epoch's batches hold together (None when unknown)."""
        try:
            return len(self.dataset)
        except TypeError:
            return None


class _WrappedLoader:
    """``base_dataloader``: the loader iterated, the ``StatefulDataLoader`` with ``use_stateful_dataloader``,
    else the loader itself. An attribute of instances only: read on the class it raises AttributeError,
    as 1.15's (set in ``__init__``) does.

    "The loader itself" is kept as None, not as a reference to itself: a loader referring to itself is
    a cycle, and a cycle waits for the garbage collector (the loader, its iterator and the Accelerator
    holding them are freed when their owner goes, as in 1.15).
    """

    def __get__(self, loader: Any, owner: type | None = None) -> Any:
        if loader is None:
            raise AttributeError(
                f"type object {getattr(owner, '__name__', owner)!r} has no attribute 'base_dataloader': "
                "it is the wrapped loader of each instance (read it on a prepared loader)"
            )
        inner = loader.__dict__.get("_stateful_inner")
        return loader if inner is None else inner

    def __set__(self, loader: Any, value: Any) -> None:
        loader.__dict__["_stateful_inner"] = None if value is loader else value


class DataLoaderAdapter(DataLoader):
    """A ``DataLoader`` (or, with ``use_stateful_dataloader``, torchdata's ``StatefulDataLoader``) to prepare.

    With the stateful loader, iteration, ``state_dict`` and ``load_state_dict`` go to a
    ``StatefulDataLoader`` built with the same arguments (``base_dataloader``), which resumes
    mid-epoch; without it ``base_dataloader`` is this loader and ``state_dict`` raises, naming the flag.
    """

    def __init__(
        self,
        dataset: Any,
        use_stateful_dataloader: bool = False,
        batch_sampler: Any = None,
        *,
        _prepared_in_order: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self.use_stateful_dataloader = use_stateful_dataloader
        self.base_dataloader = self
        if use_stateful_dataloader:
            # Built directly, the stateful loader gets the arguments as given (its state_dict() is then
            # that of a StatefulDataLoader built with them, as in 1.15); ``prepare`` asks for in-order
            # batches of torch's BatchSampler where 1.15's prepared loader has them.
            loader_args = _plain_batches(dataset, batch_sampler, kwargs) if _prepared_in_order else kwargs
            self.base_dataloader = make_stateful_loader(
                dataset, **({"batch_sampler": batch_sampler, **loader_args})
            )

    base_dataloader = _WrappedLoader()

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        # isinstance(loader, StatefulDataLoader) is how users and libraries (as with Accelerate 1.15)
        # tell a resumable loader: with the stateful loader this object answers as one too, while
        # type(self) and isinstance(self, DataLoaderShard) stay what they are.
        inner = self.__dict__.get("_stateful_inner")
        return type(self) if inner is None else type(inner)

    def __iter__(self):
        if self.base_dataloader is self:
            return super().__iter__()
        return iter(self.base_dataloader)

    def __len__(self) -> int:
        return super().__len__() if self.base_dataloader is self else len(self.base_dataloader)

    def state_dict(self) -> dict[str, Any]:
        """Return the stateful loader's position (needs ``use_stateful_dataloader=True``)."""
        if self.base_dataloader is self:
            raise ValueError(
                "state_dict() needs a stateful loader: build it with use_stateful_dataloader=True "
                "(DataLoaderConfiguration(use_stateful_dataloader=True) in an Accelerator)"
            )
        self.dl_state_dict = self.base_dataloader.state_dict()
        self.adjust_state_dict_for_prefetch()
        return self.dl_state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Return nothing; resume the stateful loader at the position ``state_dict`` describes."""
        if self.base_dataloader is self:
            raise ValueError(
                "load_state_dict() needs a stateful loader: build it with use_stateful_dataloader=True"
            )
        self.base_dataloader.load_state_dict(state_dict)

    def adjust_state_dict_for_prefetch(self) -> None:
        """Return nothing; make ``dl_state_dict`` (the position last read) count only batches handed out.

        This loader yields each batch as it fetches it, so no batch is held ahead and the recorded
        position already is the one to resume from; a subclass that reads ahead moves it back here.
        """


def _plain_batches(dataset: Any, batch_sampler: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Return the stateful loader's arguments: in-order batches of a map-style dataset come from torch's
    ``BatchSampler`` (as in 1.15), not from one torchdata builds, whose iterator saves a state of its own.

    So ``state_dict()`` has ``_sampler_iter_state: None`` as 1.15's has, and a state 1.15 saved (which
    torchdata resumes by counting batches) resumes here: torchdata's own sampler would start over.
    """
    ordered = kwargs.get("sampler") is None and not kwargs.get("shuffle")
    if batch_sampler is not None or not ordered or kwargs.get("batch_size", 1) is None:
        return {"batch_sampler": batch_sampler, **kwargs}
    if isinstance(dataset, IterableDataset):
        return {"batch_sampler": batch_sampler, **kwargs}
    batches = BatchSampler(
        SequentialSampler(dataset), kwargs.get("batch_size", 1), kwargs.get("drop_last", False)
    )
    rest = {k: v for k, v in kwargs.items() if k not in ("batch_size", "drop_last", "shuffle", "sampler")}
    return {"batch_sampler": batches, **rest}


def find_sampler(dataloader: Any) -> Sampler | None:
    """Return the innermost index sampler behind ``dataloader`` (through shard/skip wrappers)."""
    obj = getattr(dataloader, "batch_sampler", None)
    seen = 0
    while obj is not None and seen < 8:
        inner = getattr(obj, "batch_sampler", None)
        if inner is None:
            return getattr(obj, "sampler", None)
        obj, seen = inner, seen + 1
    return getattr(dataloader, "sampler", None)


def _batch_samplers(dataloader: Any) -> list[Any]:
    """Return the chain of batch samplers behind ``dataloader``, outermost first (through shard wrappers)."""
    out, obj = [], getattr(dataloader, "batch_sampler", None)
    while obj is not None and len(out) < 8:
        out.append(obj)
        obj = getattr(obj, "batch_sampler", None)
    return out


def _sampler_holder(dataloader: Any) -> Any:
    """Return the innermost batch sampler holding ``.sampler`` behind ``dataloader`` (``dataloader`` if none)."""
    obj = getattr(dataloader, "batch_sampler", None)
    for _ in range(8):
        inner = getattr(obj, "batch_sampler", None)
        if inner is None:
            break
        obj = inner
    return obj if obj is not None and hasattr(obj, "sampler") else dataloader


def get_sampler(dataloader: Any) -> Sampler | None:
    """Return the sampler that orders ``dataloader``'s samples (looking through batch samplers and shard wrappers)."""
    return find_sampler(dataloader)


def _loader_kwargs(dataloader: DataLoader) -> dict[str, Any]:
    """Return the constructor arguments of ``dataloader`` that differ from DataLoader's defaults."""
    out = {}
    for name, default in _LOADER_DEFAULTS.items():
        if hasattr(dataloader, name):
            value = getattr(dataloader, name)
            if value != default:
                out[name] = value
    if out.get("num_workers", 0) == 0:
        out.pop("prefetch_factor", None)
        out.pop("persistent_workers", None)
    return out


def _data_parallel_share(mesh: Any) -> tuple[int, int]:
    """Return ``(data-parallel ranks, this rank's index)`` of a device mesh (its "dp" dims, else all of it).

    Ranks that differ only along the other dims (tensor or context parallel) read the same data.
    """
    names = tuple(mesh.mesh_dim_names or ())
    dp = [name for name in ("dp_replicate", "dp_shard") if name in names]
    if not dp:
        return (1, 0) if {"tp", "cp"} & set(names) else (mesh.size(), mesh.get_rank())
    coordinate, total, index = mesh.get_coordinate(), 1, 0
    for name in dp:  # replicate-major, as the mesh lays the ranks out
        dim = names.index(name)
        index = index * mesh.shape[dim] + coordinate[dim]
        total *= mesh.shape[dim]
    return total, index


class _PositionedLoader(DataLoaderAdapter):
    """A prepared loader whose epoch position survives a checkpoint (``use_stateful_dataloader=True``).

    The position is that of the batch last handed out, not of the look-ahead the loader reads to flag
    its last batch (see :class:`~notebook_accel.data_loader.stateful.LoaderPosition`).
    """

    _position: LoaderPosition | None = None

    def get_sampler(self) -> Sampler | None:
        """Return the sampler that orders this loader's samples (through its batch samplers)."""
        return find_sampler(self)

    def set_sampler(self, sampler: Sampler) -> None:
        """Return nothing; make ``sampler`` order this loader's samples from the next epoch on."""
        if not isinstance(sampler, Sampler):
            raise TypeError(f"set_sampler needs a torch.utils.data.Sampler, got {type(sampler).__name__}")
        holder = _sampler_holder(self)
        if holder is self:
            raise ValueError(
                "set_sampler: this loader batches with no sampler to replace (an iterable dataset or a "
                "batch sampler without .sampler); build the DataLoader with the sampler instead"
            )
        holder.sampler = sampler

    def _keep_position(self) -> None:
        self._position = LoaderPosition(self.base_dataloader) if self.use_stateful_dataloader else None

    def state_dict(self) -> dict[str, Any]:
        """Return this loader's position in its epoch: torchdata's ``StatefulDataLoader.state_dict()``,
        equal to it as 1.15's is (needs ``use_stateful_dataloader=True``)."""
        return self._require_position().state_dict()

    def resume_state(self) -> dict[str, Any]:
        """Return what resuming exactly needs beside ``state_dict()`` (the epoch, and the generators the
        epoch began with, so a plain shuffled loader resumes on the interrupted epoch's order);
        ``save_state`` writes it beside the loader's state and ``load_state`` gives it back."""
        return self._require_position().resume_state(self.iteration)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Return nothing; the next iteration resumes at the position ``state_dict`` recorded (a plain
        shuffled loader exactly too when ``resume_from`` is also given its ``resume_state()``)."""
        self.resume_from(state_dict, None)

    def resume_from(self, state_dict: dict[str, Any], resume_state: dict[str, Any] | None) -> None:
        """Return nothing; resume at ``state_dict``'s position, exactly, with what ``resume_state()``
        returned beside it (``load_state`` calls this; ``load_state_dict`` keeps 1.15's signature)."""
        self._require_position().load_state_dict(state_dict, resume_state)
        recorded = (resume_state or {}).get("iteration")
        if recorded is None:  # a state of an earlier version of ours had the epoch inside
            recorded = state_dict.get(OWN_KEYS["iteration"], state_dict.get("iteration", self.iteration))
        self.iteration = int(recorded)

    def _require_position(self) -> LoaderPosition:
        if self._position is None:
            raise ValueError(
                "this prepared dataloader keeps no position: create the Accelerator with "
                "dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)"
            )
        return self._position
