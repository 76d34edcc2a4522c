"""save_state / load_state / save_model: files, resume bit-for-bit, automatic naming, atomic writes."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests._dist import run_distributed


class Counter:
    """A custom object registered for checkpointing."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 5, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def _build(init_seed: int):
    from notebook_accel import Accelerator
    from notebook_accel.utils import DataLoaderConfiguration, set_seed

    acc = Accelerator(
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=11),
        gradient_accumulation_steps=2,
    )
    set_seed(init_seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    # The loader's own generator draws each epoch's worker base seed (as in a plain DataLoader);
    # without one that draw comes from the global stream, which a mid-epoch resume then replays.
    loader = DataLoader(
        _data(), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(init_seed)
    )
    counter = Counter()
    acc.register_for_checkpointing(counter)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    return acc, model, opt, loader, sched, counter


def _run(acc, model, opt, loader, sched, counter, stop_after: int | None = None) -> None:
    for i, (x, y) in enumerate(loader):
        if stop_after is not None and i == stop_after:
            return
        with acc.accumulate(model):
            # python / numpy / torch randomness all feed the loss: each stream must be restored
            noise = 1e-3 * (random.random() + float(np.random.rand()) + torch.rand(()).item())
            loss = torch.nn.functional.mse_loss(model(x), y) + noise
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            counter.count += 1


def _snapshot(acc, model, sched, counter) -> dict:
    return {
        "weights": {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()},
        "lr": sched.get_last_lr(),
        "count": counter.count,
        "rng": torch.rand(3),
    }


def _resume_worker(ckpt: str) -> dict:
    # A: two epochs uninterrupted.
    a = _build(0)
    _run(*a)
    _run(*a)
    uninterrupted = _snapshot(a[0], a[1], a[4], a[5])
    # B: one epoch and 4 batches (an accumulation boundary), then save.
    b = _build(0)
    _run(*b)
    _run(*b, stop_after=4)
    saved_to = b[0].save_state(ckpt)
    files = sorted(p.name for p in __import__("pathlib").Path(ckpt).iterdir())
    # C: a fresh run with other weights and RNG streams, restored from the checkpoint.
    c = _build(123)
    random.seed(5)
    np.random.seed(5)
    c[0].load_state(ckpt)
    acc, model, opt, loader, sched, counter = c
    _run(acc, model, opt, acc.skip_first_batches(loader, 4), sched, counter)
    resumed = _snapshot(acc, model, sched, counter)
    # the next epoch starts from the original loader, in step with A's third epoch (both
    # continue from the same RNG streams: this process shares them, so restore them in between)
    streams = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    # As in Accelerate, the skipped loader counted that epoch on its own sampler: select the next one.
    loader.set_epoch(2)
    _run(acc, model, opt, loader, sched, counter)
    random.setstate(streams[0])
    np.random.set_state(streams[1])
    torch.set_rng_state(streams[2])
    _run(*a)
    return {
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "third_epoch_equal": all(
            torch.equal(x, y)
            for x, y in zip(
                acc.unwrap_model(model).state_dict().values(), a[0].unwrap_model(a[1]).state_dict().values()
            )
        ),
        "files": files,
        "saved_to": saved_to,
    }


def test_resume_equals_uninterrupted_run_on_two_processes(tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    results = run_distributed(_resume_worker, nprocs=2, args=(ckpt,), timeout=120)
    for r in results:
        for k, v in r["uninterrupted"]["weights"].items():
            assert torch.equal(r["resumed"]["weights"][k], v), k
        assert r["resumed"]["lr"] == r["uninterrupted"]["lr"]
        assert r["resumed"]["count"] == r["uninterrupted"]["count"]
        assert torch.equal(r["resumed"]["rng"], r["uninterrupted"]["rng"])
        assert r["third_epoch_equal"]
        assert r["saved_to"] == ckpt
    assert results[0]["files"] == [
        "custom_checkpoint_0.pkl",
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "sampler.bin",
        "scheduler.bin",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary folder left behind


def _small_setup(tmp_path, **config):
    from notebook_accel import Accelerator
    from notebook_accel.utils import ProjectConfiguration

    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path), **config))
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def test_automatic_naming_total_limit_and_latest_load(tmp_path) -> None:
    acc, model, _ = _small_setup(tmp_path, automatic_checkpoint_naming=True, total_limit=2)
    saved = []
    for i in range(3):
        with torch.no_grad():
            model.weight.fill_(float(i))
        saved.append(acc.save_state())
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_1", "checkpoint_2"]
    assert saved[-1] == str(root / "checkpoint_2") and acc.save_iteration == 3
    with torch.no_grad():
        model.weight.fill_(-1.0)
    acc.load_state()  # the latest one
    assert torch.all(model.weight == 2.0) and acc.save_iteration == 3
    acc.project_configuration.iteration = 2
    with pytest.raises(ValueError, match="checkpoint_2.*already exists"):
        acc.save_state()


def test_hooks_custom_objects_and_bin_format(tmp_path) -> None:
    acc, model, opt = _small_setup(tmp_path)
    seen = []

    def save_hook(models, weights, output_dir):
        seen.append(("save", len(models), len(weights)))
        (__import__("pathlib").Path(output_dir) / "extra.json").write_text("{}")

    def load_hook(models, input_dir):
        seen.append(("load", len(models), input_dir))

    handle = acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)
    counter = Counter()
    counter.count = 7
    acc.register_for_checkpointing(counter)
    out = tmp_path / "state"
    acc.save_state(out, safe_serialization=False)
    assert (out / "extra.json").exists() and (out / "pytorch_model.bin").exists()
    counter.count = 0
    acc.load_state(out)
    assert counter.count == 7
    assert seen == [("save", 1, 1), ("load", 1, str(out))]
    handle.remove()
    acc.save_state(out)
    assert seen[-1][0] == "load"
    # Accelerate 1.15's message, character for character (its index counts the invalid items only)
    with pytest.raises(ValueError) as info:
        acc.register_for_checkpointing(torch.nn.Linear(1, 1), object(), 3)
    assert str(info.value) == (
        "All `objects` must include a `state_dict` and `load_state_dict` function to be stored. "
        "The following inputs are invalid:\n\t- Item at index 0, `object`\n\t- Item at index 1, `int`"
    )
    assert len(acc._custom_objects) == 1  # nothing of a refused call was registered


def test_failed_save_keeps_previous_checkpoint(tmp_path) -> None:
    acc, model, _ = _small_setup(tmp_path)
    out = tmp_path / "state"
    acc.save_state(out)
    before = (out / "model.safetensors").read_bytes()

    def broken(models, weights, output_dir):
        raise OSError("disk full")

    acc.register_save_state_pre_hook(broken)
    with torch.no_grad():
        model.weight.fill_(3.0)
    with pytest.raises(OSError, match="disk full"):
        acc.save_state(out)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == [
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
    ]


def _save_fails_on_one_rank(out: str, failing: int) -> dict:
    from notebook_accel import Accelerator

    acc = Accelerator(cpu=True)
    acc.prepare(torch.nn.Linear(2, 2))
    acc.save_state(out)  # a good checkpoint first
    before = {name: (Path(out) / name).read_bytes() for name in sorted(os.listdir(out))}

    def broken(models, weights, output_dir):
        if acc.process_index == failing:
            raise OSError(f"disk full on rank {failing}")

    acc.register_save_state_pre_hook(broken)
    try:
        acc.save_state(out)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    acc.wait_for_everyone()  # the group still works after the failed save
    after = {name: (Path(out) / name).read_bytes() for name in sorted(os.listdir(out))}
    return {"error": error, "unchanged": after == before, "beside": sorted(os.listdir(Path(out).parent))}


@pytest.mark.parametrize("failing", [0, 1])
def test_a_save_failing_on_one_process_raises_on_every_process(tmp_path, failing: int) -> None:
    # Before, the other process waited forever at the barrier after the write.
    out = tmp_path / "state"
    results = run_distributed(_save_fails_on_one_rank, nprocs=2, args=(str(out), failing), timeout=40)
    assert results[failing]["error"] == f"OSError: disk full on rank {failing}"
    other = results[1 - failing]["error"]
    assert other.startswith(
        f"RuntimeError: save_state failed on process(es) [{failing}] while writing its part"
    )
    assert all(r["unchanged"] and r["beside"] == ["state"] for r in results), results  # no partial folder


def test_checkpoint_errors(tmp_path) -> None:
    acc, model, opt = _small_setup(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        acc.load_state(tmp_path / "missing")
    with pytest.raises(ValueError, match="save_state needs output_dir"):
        acc.save_state()
    with pytest.raises(ValueError, match="load_state needs input_dir"):
        acc.load_state()
    acc.save_state(tmp_path / "s")
    (tmp_path / "s" / "optimizer.bin").unlink()
    with pytest.raises(FileNotFoundError, match="optimizer.bin for optimizer 0"):
        acc.load_state(tmp_path / "s")
    acc2, _, _ = _small_setup(tmp_path / "p", automatic_checkpoint_naming=True)
    with pytest.raises(FileNotFoundError, match="no checkpoints/checkpoint_"):
        acc2.load_state()
    acc.save_state(tmp_path / "s")
    bigger = torch.nn.Linear(3, 3)
    acc._models[0] = bigger
    with pytest.raises(RuntimeError, match="size mismatch"):
        acc.load_state(tmp_path / "s")


def test_save_model_single_and_sharded(tmp_path) -> None:
    from safetensors.torch import load_file

    from notebook_accel import Accelerator
    from notebook_accel.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_NAME

    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
    model[2].weight = model[0].weight  # tied: saved once
    acc.save_model(model, tmp_path / "one")
    single = load_file(str(tmp_path / "one" / SAFE_WEIGHTS_NAME))
    assert "2.weight" not in single and torch.equal(single["0.weight"], model[0].weight)

    acc.save_model(model, tmp_path / "one", max_shard_size="5KB")
    index = json.loads((tmp_path / "one" / SAFE_WEIGHTS_INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert (
        len(files) > 1 and not (tmp_path / "one" / SAFE_WEIGHTS_NAME).exists()
    )  # the old single file was replaced
    merged = {}
    for name in files:
        merged.update(load_file(str(tmp_path / "one" / name)))
    assert set(merged) == set(index["weight_map"]) and torch.equal(merged["1.bias"], model[1].bias)

    acc.save_model(model, tmp_path / "bin", safe_serialization=False)
    assert (tmp_path / "bin" / WEIGHTS_NAME).exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        acc.save_model(model, tmp_path / "file")
    acc.save({"a": torch.ones(2)}, tmp_path / "obj.pt")
    assert torch.equal(torch.load(tmp_path / "obj.pt")["a"], torch.ones(2))


def test_missing_and_mismatched_checkpoint_files(tmp_path) -> None:
    from notebook_accel.checkpointing import load_custom_state

    acc, model, _ = _small_setup(tmp_path)
    out = tmp_path / "s"
    acc.save_state(out)
    with pytest.raises(
        FileNotFoundError, match="custom_checkpoint_0.pkl for registered object 0 \\(Counter\\)"
    ):
        load_custom_state(Counter(), out, 0)

    class Wider(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(2, 3))
            self.bias = torch.nn.Parameter(torch.zeros(2))
            self.extra = torch.nn.Parameter(torch.zeros(1))

    acc._models[0] = Wider()
    with pytest.raises(RuntimeError, match="missing keys \\['extra'\\]"):
        acc.load_state(out)
    acc.load_state(out, strict=False)  # load_model_func_kwargs reach load_state_dict
    (out / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights for model 0"):
        acc.load_state(out)


def test_failed_file_write_leaves_neither_file_nor_temporary(tmp_path) -> None:
    from notebook_accel.checkpointing import save_model_weights

    target = tmp_path / "pytorch_model.bin"
    target.write_bytes(b"previous")
    with pytest.raises(Exception, match="pickle|lambda"):
        save_model_weights({"w": torch.ones(2), "bad": lambda: 0}, target, safe_serialization=False)
    assert [p.name for p in tmp_path.iterdir()] == ["pytorch_model.bin"]
    assert target.read_bytes() == b"previous"
