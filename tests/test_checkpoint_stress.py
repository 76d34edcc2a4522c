"""Checkpoints under stress: a failed or full-disk save leaves nothing behind, a broken file is named before
anything is restored, an index must match its shards and stay inside its folder (issue 23)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from notebook_accel.utils import load_checkpoint_in_model


def _setup(tmp_path, width: int = 3, custom: object | None = None):
    from notebook_accel import Accelerator
    from notebook_accel.utils import ProjectConfiguration

    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path)))
    model = torch.nn.Linear(width, width)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    if custom is not None:
        acc.register_for_checkpointing(custom)
    model, opt, sched = acc.prepare(model, opt, sched)
    model(torch.ones(1, width)).sum().backward()
    opt.step()
    return acc, model, opt


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------------------------- failed saves


def test_a_failed_save_removes_what_it_wrote_and_keeps_the_earlier_checkpoint(tmp_path) -> None:
    acc, model, _ = _setup(tmp_path)
    out = tmp_path / "state"
    acc.save_state(out)
    weights = model.weight.detach().clone()

    def fail_after_writing(models, weights, output_dir):
        (Path(output_dir) / "big.bin").write_bytes(b"x" * 100_000)
        raise OSError("the hook failed")

    handle = acc.register_save_state_pre_hook(fail_after_writing)
    with pytest.raises(OSError, match="the hook failed"):
        acc.save_state(out)
    with pytest.raises(OSError, match="the hook failed"):
        acc.save_state(tmp_path / "other")  # a new folder: nothing of it may stay either
    assert _hidden(tmp_path) == []
    assert not (tmp_path / "other").exists()
    handle.remove()
    with torch.no_grad():
        model.weight.zero_()
    acc.load_state(out)
    assert torch.equal(model.weight, weights)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MB tmpfs (root only); skipped with the reason where it cannot be mounted."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the file-size-limit test covers a short write")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)


def test_a_full_disk_names_the_file_and_the_room_needed_and_leaves_nothing(tmp_path, small_tmpfs) -> None:
    from notebook_accel.utils.atomic_files import NoSpaceError

    # 300 x 300 float32 weights are 0.36 MB; AdamW's two moments make optimizer.bin 0.72 MB: one
    # checkpoint (1.1 MB) fits in 2 MB, a second one does not.
    acc, model, _ = _setup(tmp_path, width=300)
    first = small_tmpfs / "first"
    acc.save_state(first)
    with pytest.raises(
        NoSpaceError, match=r"could not write '.*\.bin': the disk is full \(.* free on "
    ) as info:
        acc.save_state(small_tmpfs / "second")
    assert "The whole checkpoint needs about 1.1 MB" in str(info.value)
    assert "about 0.7 MB for this file" in str(info.value) or "about 0.4 MB for this file" in str(info.value)
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["first"]  # no .second.partial, no temporary
    # The space the failed save took is free again: the same save fits once the first one is gone.
    acc.load_state(first)
    import shutil

    shutil.rmtree(first)
    acc.save_state(small_tmpfs / "second")
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["second"]


def test_a_file_size_limit_names_the_file(tmp_path) -> None:
    # A short write without a full disk (RLIMIT_FSIZE in a child; SIGXFSZ ignored so write() fails instead).
    script = textwrap.dedent(
        f"""
        import resource, signal, torch
        from notebook_accel.checkpointing import save_accelerator_state
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
        model = torch.nn.Linear(300, 300)
        try:
            save_accelerator_state({str(tmp_path / "s")!r}, [model.state_dict()], [], [], [], 0, 0)
        except OSError as exc:
            print(type(exc).__name__, exc)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "NoSpaceError [Errno 27] could not write" in done.stdout, done.stdout + done.stderr
    assert "model.safetensors': it exceeds this process's file-size limit (ulimit -f: 0.2 MB" in done.stdout
    assert "The whole checkpoint needs about 0.4 MB" in done.stdout
    assert not [p for p in (tmp_path / "s").iterdir() if p.name.endswith(".tmp")]


# ------------------------------------------------------------------------------------- broken state files


@pytest.mark.parametrize(
    ("name", "damage", "match"),
    [
        ("model.safetensors", b"", r"model\.safetensors' is empty, truncated or not a safetensors file .*"
         r"the file is empty"),
        ("model.safetensors", "cut", r"model\.safetensors' is empty, truncated .*the file is cut short"),
        ("optimizer.bin", b"", r"optimizer\.bin' is empty \(0 bytes\)"),
        ("optimizer.bin", "cut", r"optimizer\.bin' looks truncated"),
        ("scheduler.bin", "cut", r"scheduler\.bin' looks truncated"),
        ("random_states_0.pkl", b"", r"random_states_0\.pkl' is empty"),
        ("custom_checkpoint_0.pkl", "cut", r"custom_checkpoint_0\.pkl' looks truncated"),
    ],
)  # fmt: skip
def test_a_broken_file_is_named_and_nothing_is_restored(tmp_path, name, damage, match) -> None:
    class Counter:
        count = 7

        def state_dict(self):
            return {"count": self.count}

        def load_state_dict(self, state):
            self.count = state["count"]

    counter = Counter()
    acc, model, opt = _setup(tmp_path, custom=counter)
    acc.save_state(tmp_path / "s")
    path = tmp_path / "s" / name
    path.write_bytes(damage if isinstance(damage, bytes) else path.read_bytes()[: path.stat().st_size // 2])
    with torch.no_grad():
        model.weight.fill_(5.0)
    opt.param_groups[0]["lr"] = 0.5
    counter.count = 99
    with pytest.raises(ValueError, match=match):
        acc.load_state(tmp_path / "s")
    # Nothing was restored: not the model (read first), not the optimizer, not the registered object.
    assert bool((model.weight == 5.0).all()) and opt.param_groups[0]["lr"] == 0.5 and counter.count == 99


def test_a_checkpoint_for_another_model_restores_nothing(tmp_path) -> None:
    acc, model, opt = _setup(tmp_path)
    acc.save_state(tmp_path / "s")
    (tmp_path / "s" / "optimizer.bin").unlink()
    with torch.no_grad():
        model.weight.fill_(5.0)
    with pytest.raises(FileNotFoundError, match="optimizer.bin for optimizer 0"):
        acc.load_state(tmp_path / "s")
    assert bool((model.weight == 5.0).all())  # the model file was fine, yet the model is untouched
    save_file(
        {"weight": torch.zeros(4, 4), "bias": torch.zeros(3)}, str(tmp_path / "s" / "model.safetensors")
    )
    with pytest.raises(RuntimeError, match=r"size mismatch for weight: .* Nothing was restored"):
        acc.load_state(tmp_path / "s")


# ------------------------------------------------------------------------------------ load_checkpoint_*


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def _meta_net() -> torch.nn.Module:
    with torch.device("meta"):
        return _net()


def _sharded(folder: Path, fmt: str = "safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.clone() for k, v in _net().state_dict().items()}
    first = {k: v for k, v in state.items() if k.startswith("0.")}
    second = {k: v for k, v in state.items() if k.startswith("1.")}
    names = [f"model-0000{i}-of-00002.{fmt}" for i in (1, 2)]
    for name, shard in zip(names, (first, second)):
        if fmt == "safetensors":
            save_file(shard, str(folder / name), metadata={"format": "pt"})
        else:
            torch.save(shard, folder / name)
    weight_map = {k: names[0] for k in first} | {k: names[1] for k in second}
    index = folder / f"model.{fmt}.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def _rewrite_index(index: Path, change) -> None:
    data = json.loads(index.read_text())
    change(data["weight_map"])
    index.write_text(json.dumps(data))


@pytest.mark.parametrize("how", ["in_model", "and_dispatch"])
@pytest.mark.parametrize(("damage", "match"), [(b"", "the file is empty"), ("cut", "the file is cut short")])
def test_an_empty_or_truncated_shard_is_named(tmp_path, how, damage, match) -> None:
    from notebook_accel import load_checkpoint_and_dispatch

    index = _sharded(tmp_path / "ck")
    shard = tmp_path / "ck" / "model-00002-of-00002.safetensors"
    shard.write_bytes(damage if isinstance(damage, bytes) else shard.read_bytes()[:-7])
    pattern = r"model-00002-of-00002\.safetensors' is empty, truncated or not a safetensors file .*" + match
    with pytest.raises(ValueError, match=pattern):
        if how == "in_model":
            load_checkpoint_in_model(_meta_net(), index, device_map={"": "cpu"})
        else:
            load_checkpoint_and_dispatch(_meta_net(), str(tmp_path / "ck"), device_map={"": "cpu"})


@pytest.mark.parametrize(("damage", "match"), [(b"", r"is empty \(0 bytes\)"), ("cut", "looks truncated")])
def test_an_empty_or_truncated_bin_file_is_named(tmp_path, damage, match) -> None:
    index = _sharded(tmp_path / "ck", "bin")
    shard = tmp_path / "ck" / "model-00001-of-00002.bin"
    shard.write_bytes(damage if isinstance(damage, bytes) else shard.read_bytes()[:-30])
    with pytest.raises(ValueError, match=r"model-00001-of-00002\.bin' " + match):
        load_checkpoint_in_model(_meta_net(), index, device_map={"": "cpu"})


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_an_index_mapping_a_tensor_to_the_wrong_shard_names_both(tmp_path, fmt) -> None:
    index = _sharded(tmp_path / "ck", fmt)
    _rewrite_index(index, lambda m: m.update({"1.weight": f"model-00001-of-00002.{fmt}"}))
    match = rf"maps '1\.weight' to the shard '.*model-00001-of-00002\.{fmt}', which does not hold it"
    with pytest.raises(ValueError, match=match):
        load_checkpoint_in_model(_meta_net(), index, device_map={"": "cpu"})


@pytest.mark.parametrize("outside", ["../elsewhere.safetensors", "ABSOLUTE"])
def test_an_index_naming_a_shard_outside_its_folder_is_refused(tmp_path, outside) -> None:
    index = _sharded(tmp_path / "ck")
    save_file(_net()[1].state_dict() | {}, str(tmp_path / "elsewhere.safetensors"))
    name = str(tmp_path / "elsewhere.safetensors") if outside == "ABSOLUTE" else outside
    _rewrite_index(index, lambda m: m.update({"1.weight": name, "1.bias": name}))
    with pytest.raises(ValueError, match=rf"shard of the index .* {name!r} leaves the checkpoint folder"):
        load_checkpoint_in_model(_meta_net(), index, device_map={"": "cpu"})


def test_a_shard_linked_from_a_cache_still_loads(tmp_path) -> None:
    # The Hugging Face hub's snapshot folders link each file to ../../blobs: the name stays inside.
    index = _sharded(tmp_path / "blobs")
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    for entry in (tmp_path / "blobs").iterdir():
        (snapshot / entry.name).symlink_to(Path("../../blobs") / entry.name)
    model = _meta_net()
    load_checkpoint_in_model(model, snapshot / index.name, device_map={"": "cpu"})
    assert torch.equal(model[1].weight, _net()[1].weight)


@pytest.mark.parametrize("where", ["cpu", "disk", "existing"])
def test_an_int64_checkpoint_tensor_takes_the_parameters_dtype(tmp_path, where) -> None:
    from notebook_accel.hooks import remove_hook_from_module  # noqa: F401 - hooks importable
    from notebook_accel.utils.offload import OffloadedWeightsLoader

    state = {k: torch.arange(v.numel()).reshape(v.shape) for k, v in _net().state_dict().items()}  # int64
    save_file(state, str(tmp_path / "w.safetensors"), metadata={"format": "pt"})
    model = _net() if where == "existing" else _meta_net()
    device_map = {"": "cpu"} if where == "cpu" else {"0": "cpu", "1": "disk"} if where == "disk" else None
    load_checkpoint_in_model(
        model, tmp_path / "w.safetensors", device_map=device_map, offload_folder=tmp_path / "off"
    )
    if where == "disk":
        loaded = OffloadedWeightsLoader(save_folder=tmp_path / "off")["1.weight"]
        assert loaded.dtype == torch.float32 and torch.equal(loaded, state["1.weight"].float())
    else:
        assert model[1].weight.dtype == torch.float32
        assert torch.equal(model[1].weight, state["1.weight"].float())
    assert model[0].weight.dtype == torch.float32
