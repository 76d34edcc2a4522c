"""DataLoaderConfiguration(use_stateful_dataloader=True): save_state mid-epoch, load_state, same samples.

Two CPU processes, a shuffled loader, with and without ``use_seedable_sampler``: the run interrupted
after 3 batches and resumed from its checkpoint (in fresh state, with a different global seed until
``load_state`` restores it) sees exactly the samples the uninterrupted run saw. Accelerate 1.15
resumes the plain shuffled loader on other samples (it does not restore the epoch's generator);
that is a deliberate difference.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests._dist import run_distributed

pytest.importorskip("torchdata")

EPOCHS, BREAK = 2, 3


def _accelerator(seedable: bool, seed: int):
    from notebook_accel import Accelerator
    from notebook_accel.state import AcceleratorState, GradientState
    from notebook_accel.utils import DataLoaderConfiguration, set_seed

    AcceleratorState._reset_state()
    GradientState._reset_state()
    set_seed(seed)
    config = DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=seedable)
    acc = Accelerator(dataloader_config=config)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(24)), batch_size=2, shuffle=True))
    return acc, loader


def _worker(seedable: bool, folder: str) -> dict:
    acc, loader = _accelerator(seedable, seed=7)
    full = [batch[0].tolist() for _ in range(EPOCHS) for batch in loader]

    acc, loader = _accelerator(seedable, seed=7)
    before = []
    for step, batch in enumerate(loader):
        before.append(batch[0].tolist())
        if step + 1 == BREAK:
            acc.save_state(folder)
            state = loader.state_dict()
            break
    acc, loader = _accelerator(seedable, seed=1234)  # a new process would start elsewhere
    acc.load_state(folder)
    after = [batch[0].tolist() for batch in loader] + [batch[0].tolist() for batch in loader]
    return {"full": full, "resumed": before + after, "state_keys": sorted(state)}


@pytest.mark.parametrize("seedable", [True, False], ids=["seedable_sampler", "plain_shuffle"])
def test_resumed_loader_sees_the_samples_of_the_uninterrupted_run(seedable: bool, tmp_path) -> None:
    results = run_distributed(_worker, nprocs=2, args=(seedable, str(tmp_path / "ckpt")), timeout=180)
    for rank, r in enumerate(results):
        assert len(r["full"]) == EPOCHS * 6
        # Exactly the remaining batches of the interrupted epoch, then the next epoch, as uninterrupted.
        assert r["resumed"] == r["full"], f"rank {rank}"
        # torchdata's own keys (as 1.15 saves them) and no other: ours are written beside them
        assert "_num_yielded" in r["state_keys"]
        assert not [key for key in r["state_keys"] if key.startswith("_notebook_accel")]
    assert results[0]["full"][:6] != results[1]["full"][:6]  # each rank reads its own shard
    assert sorted(x for r in results for b in r["full"][:6] for x in b) == list(range(24))
    assert (tmp_path / "ckpt" / "dl_state_dict.bin").is_file()
    assert (tmp_path / "ckpt" / "dl_resume_state.bin").is_file()


def test_state_dict_needs_a_stateful_loader() -> None:
    from notebook_accel.data_loader import prepare_data_loader
    from notebook_accel.state import PartialState

    PartialState(cpu=True)
    loader = prepare_data_loader(
        DataLoader(TensorDataset(torch.arange(4)), batch_size=2), num_processes=1, process_index=0
    )
    with pytest.raises(ValueError, match="use_stateful_dataloader=True"):
        loader.state_dict()
    stateful = prepare_data_loader(
        DataLoader(TensorDataset(torch.arange(4)), batch_size=2), num_processes=1, process_index=0,
        use_stateful_dataloader=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="expects what a stateful prepared dataloader's state_dict"):
        stateful.load_state_dict({"position": 3})
    # Dispatching needs the slices placed on the device, as in Accelerate 1.15 (same check there).
    with pytest.raises(ValueError, match="dispatch_batches=True requires put_on_device=True"):
        prepare_data_loader(
            DataLoader(TensorDataset(torch.arange(4)), batch_size=2), num_processes=1, process_index=0,
            dispatch_batches=True, use_stateful_dataloader=True,
        )  # fmt: skip
