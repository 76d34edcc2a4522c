"""utils.megatron_lm without Megatron: placeholders, prepare() arguments, loss averaging (2 gloo ranks), engine pieces."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from notebook_accel import Accelerator
from notebook_accel.integrations.megatron import lm as mlm
from notebook_accel.state import PartialState
from notebook_accel.utils import MegatronLMPlugin
from notebook_accel.utils.megatron_lm import (
    MegatronEngine,
    MegatronLMDummyDataLoader,
    MegatronLMDummyScheduler,
    avg_losses_across_data_parallel_group,
    gather_across_data_parallel_groups,
    megatron_training_args,
)
from tests._dist import run_distributed


def _accelerator(**plugin_kwargs) -> SimpleNamespace:
    """An object shaped like an Accelerator under Megatron (the real one needs megatron-core to start)."""
    plugin = MegatronLMPlugin(**plugin_kwargs)
    return SimpleNamespace(state=SimpleNamespace(megatron_lm_plugin=plugin), num_processes=1, process_index=0)


def _optimizer(kind=torch.optim.AdamW, **kwargs) -> torch.optim.Optimizer:
    return kind([torch.nn.Parameter(torch.ones(2))], **kwargs)


# ----------------------------------------------------------------------------- placeholders
def test_dummy_scheduler_carries_steps_and_extra_arguments() -> None:
    optimizer = _optimizer()
    scheduler = MegatronLMDummyScheduler(optimizer, total_num_steps=100, warmup_num_steps=10, decay="cosine")
    assert scheduler.optimizer is optimizer
    assert (scheduler.total_num_steps, scheduler.warmup_num_steps, scheduler.kwargs) == (
        100,
        10,
        {"decay": "cosine"},
    )
    assert MegatronLMDummyScheduler(optimizer).total_num_steps is None


def test_dummy_scheduler_rejects_bad_step_counts() -> None:
    with pytest.raises(ValueError, match=r"total_num_steps must be an int >= 0 or None, got -1"):
        MegatronLMDummyScheduler(_optimizer(), total_num_steps=-1)
    with pytest.raises(ValueError, match=r"warmup_num_steps must be an int >= 0 or None, got True"):
        MegatronLMDummyScheduler(_optimizer(), warmup_num_steps=True)
    with pytest.raises(ValueError, match=r"warmup_num_steps=20 exceeds total_num_steps=10"):
        MegatronLMDummyScheduler(_optimizer(), total_num_steps=10, warmup_num_steps=20)


def test_dummy_data_loader_carries_megatron_data_arguments() -> None:
    loader = MegatronLMDummyDataLoader(
        data_path=["corpus"], splits_string="949,50,1", seq_length=128, micro_batch_size=4
    )
    assert loader.dataset_args == {
        "data_path": ["corpus"], "splits_string": "949,50,1", "seq_length": 128, "micro_batch_size": 4,
    }  # fmt: skip


def test_dummy_data_loader_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"train,valid,test weights such as '949,50,1'; got '90,10'"):
        MegatronLMDummyDataLoader(splits_string="90,10")
    with pytest.raises(ValueError, match=r"seq_length must be an int >= 0, got -5"):
        MegatronLMDummyDataLoader(seq_length=-5)
    with pytest.raises(TypeError, match=r"data_path must be a path or a list, got 3"):
        MegatronLMDummyDataLoader(data_path=3)


def test_accelerator_without_megatron_passes_the_placeholders_through() -> None:
    # As in Accelerate: only a Megatron accelerator consumes them; any other leaves them as they are.
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = MegatronLMDummyScheduler(optimizer, total_num_steps=5)
    loader = MegatronLMDummyDataLoader(micro_batch_size=2)
    _, prepared_optimizer, same_scheduler, same_loader = accelerator.prepare(
        model, optimizer, scheduler, loader
    )
    assert same_scheduler is scheduler and same_loader is loader
    assert prepared_optimizer.optimizer is optimizer


# ----------------------------------------------------------------------------- prepare() -> Megatron arguments
def test_training_args_from_a_prepare_call() -> None:
    plugin = MegatronLMPlugin(tp_degree=2, num_micro_batches=2)
    optimizer = _optimizer(lr=1e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    scheduler = MegatronLMDummyScheduler(optimizer, total_num_steps=100, warmup_num_steps=10)
    loader = DataLoader(list(range(16)), batch_size=4)
    args = megatron_training_args(
        plugin, (torch.nn.Linear(1, 1), optimizer, scheduler, loader), num_processes=8
    )
    assert args["tensor_model_parallel_size"] == 2
    assert (args["micro_batch_size"], args["data_parallel_size"], args["global_batch_size"]) == (4, 4, 32)
    assert (args["train_iters"], args["lr_warmup_iters"]) == (100, 10)
    assert args["optimizer"] == "adam" and args["lr"] == 1e-3 and args["weight_decay"] == 0.1
    assert (args["adam_beta1"], args["adam_beta2"], args["adam_eps"]) == (0.8, 0.95, 1e-6)
    assert args["lr_decay_style"] == "linear"


def test_training_args_plugin_steps_win_and_dummy_loader_gives_batch_and_data() -> None:
    plugin = MegatronLMPlugin(train_iters=7, lr_warmup_iters=3)
    sgd = _optimizer(torch.optim.SGD, lr=0.5, momentum=0.9)
    scheduler = MegatronLMDummyScheduler(sgd, total_num_steps=100, warmup_num_steps=10)
    loader = MegatronLMDummyDataLoader(micro_batch_size=3, seq_length=64)
    args = megatron_training_args(plugin, (sgd, scheduler, loader), num_processes=2)
    assert (args["train_iters"], args["lr_warmup_iters"]) == (7, 3)
    assert (args["micro_batch_size"], args["global_batch_size"], args["seq_length"]) == (3, 6, 64)
    assert args["megatron_dataset_flag"] is True
    assert (args["optimizer"], args["sgd_momentum"]) == ("sgd", 0.9)


def test_training_args_read_the_guide_spelling_of_the_dummy_scheduler() -> None:
    # Accelerate's Megatron-LM guide writes MegatronLMDummyScheduler(optimizer=..., num_warmup_steps=..., num_training_steps=...).
    optimizer = _optimizer()
    scheduler = MegatronLMDummyScheduler(optimizer=optimizer, num_warmup_steps=5, num_training_steps=50)
    args = megatron_training_args(
        MegatronLMPlugin(), (optimizer, scheduler, DataLoader([1], batch_size=1)), 1
    )
    assert (args["train_iters"], args["lr_warmup_iters"]) == (50, 5)


def test_training_args_errors_name_the_problem() -> None:
    loader = DataLoader(list(range(4)), batch_size=2)
    with pytest.raises(ValueError, match=r"3 processes cannot hold tp_degree=2 x pp_degree=1"):
        megatron_training_args(MegatronLMPlugin(tp_degree=2), (loader,), num_processes=3)
    with pytest.raises(
        ValueError, match=r"needs a DataLoader or MegatronLMDummyDataLoader\(micro_batch_size=...\)"
    ):
        megatron_training_args(MegatronLMPlugin(), (_optimizer(),), num_processes=1)
    with pytest.raises(ValueError, match=r"builds Adam or SGD optimizers; got RMSprop"):
        megatron_training_args(MegatronLMPlugin(), (loader, _optimizer(torch.optim.RMSprop)), num_processes=1)


# ----------------------------------------------------------------------------- loss averaging / gathering
def test_one_process_losses_come_back_stacked_and_detached() -> None:
    loss = torch.tensor(2.0, requires_grad=True) * 1.5
    averaged = avg_losses_across_data_parallel_group([loss, torch.tensor([4.0])])
    assert averaged.tolist() == [3.0, 4.0] and not averaged.requires_grad
    value = {"a": torch.ones(2)}
    assert gather_across_data_parallel_groups(value) is value


def test_avg_losses_rejects_what_is_not_a_list_of_scalars() -> None:
    with pytest.raises(TypeError, match=r"losses must be a non-empty list of scalar tensors, got \[\]"):
        avg_losses_across_data_parallel_group([])
    with pytest.raises(ValueError, match=r"each loss must be a one-element tensor, got tensor\(\[1., 1.\]\)"):
        avg_losses_across_data_parallel_group([torch.ones(2)])


def _average_and_gather() -> dict:
    rank = PartialState().process_index
    averaged = avg_losses_across_data_parallel_group(
        [torch.tensor(rank + 1.0), torch.tensor(10.0 * (rank + 1))]
    )
    gathered = gather_across_data_parallel_groups(
        {"rows": torch.full((1, 2), float(rank)), "n": [torch.tensor(rank)]}
    )
    return {"avg": averaged.tolist(), "rows": gathered["rows"].tolist(), "n": gathered["n"][0].tolist()}


def test_two_ranks_average_losses_and_gather_over_the_data_parallel_group() -> None:
    results = run_distributed(_average_and_gather, nprocs=2)
    for result in results:
        assert result["avg"] == [1.5, 15.0]
        assert result["rows"] == [[0.0, 0.0], [1.0, 1.0]]
        assert result["n"] == [0, 1]


# ----------------------------------------------------------------------------- engine and wrappers
def _engine(**plugin_kwargs) -> MegatronEngine:
    accelerator = _accelerator(**plugin_kwargs)
    accelerator.state.megatron_lm_plugin.megatron_lm_default_args["model_type_name"] = "gpt"
    return MegatronEngine(accelerator, torch.nn.Linear(2, 2), optimizer=None, scheduler=None)


def test_engine_picks_the_train_step_and_splits_micro_batches() -> None:
    engine = _engine(num_micro_batches=2)
    assert type(engine.train_step_handler).__name__ == "GPTTrainStep"
    batches = list(
        engine.get_batch_data_iterator({"input_ids": torch.arange(8).view(4, 2), "y": torch.arange(4)})
    )
    assert [b["input_ids"].tolist() for b in batches] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert [b["y"].tolist() for b in batches] == [[0, 1], [2, 3]]
    assert engine.get_batch_data_iterator({}) is None


def test_engine_errors() -> None:
    with pytest.raises(
        ValueError, match=r"same batch size, divisible by num_micro_batches=2; got sizes \[3\]"
    ):
        _engine(num_micro_batches=2).get_batch_data_iterator({"x": torch.ones(3)})
    accelerator = _accelerator()
    with pytest.raises(
        ValueError, match=r"model_type_name=None has no train step; use one of \['bert', 'gpt', 't5'\]"
    ):
        MegatronEngine(accelerator, torch.nn.Linear(1, 1), None, None)
    with pytest.raises(ValueError, match=r"needs an Accelerator\(megatron_lm_plugin=MegatronLMPlugin"):
        MegatronEngine(SimpleNamespace(state=SimpleNamespace()), torch.nn.Linear(1, 1), None, None)
    with pytest.raises(
        ImportError, match=r"MegatronEngine.train_step needs Megatron-LM .*pip install megatron-core"
    ):
        _engine()(input_ids=torch.ones(2, 2))


def test_engine_uses_a_custom_train_step_class() -> None:
    class Step:
        def __init__(self, accelerator, args, scale):
            self.scale, self.tp = scale, args.tensor_model_parallel_size

    plugin_kwargs = {"custom_train_step_class": Step, "custom_train_step_kwargs": {"scale": 3}}
    engine = MegatronEngine(_accelerator(**plugin_kwargs), torch.nn.Linear(1, 1), None, None)
    assert (engine.train_step_handler.scale, engine.train_step_handler.tp) == (3, 1)


def test_engine_reports_averaged_eval_losses_and_perplexity() -> None:
    engine = _engine()
    engine.eval_total_loss_dict = {"lm loss": torch.tensor(4.0)}
    engine.eval_iterations = 2
    assert engine.log_eval_results() == "lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00"
    assert engine.log_eval_results() == ""  # reset after reporting


def test_prepare_data_loader_shards_a_torch_loader_over_data_parallel_ranks() -> None:
    loader = DataLoader(list(range(6)), batch_size=2)
    prepared = mlm.prepare_data_loader(_accelerator(), loader)
    assert [batch.tolist() for batch in prepared] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(TypeError, match=r"takes a torch DataLoader or MegatronLMDummyDataLoader, got list"):
        mlm.prepare_data_loader(_accelerator(), [1, 2])


def _shard_two_ranks() -> list:
    PartialState()
    loader = DataLoader(list(range(8)), batch_size=2)
    return [batch.tolist() for batch in mlm.prepare_data_loader(_accelerator(), loader)]


def test_prepare_data_loader_on_two_ranks() -> None:
    assert run_distributed(_shard_two_ranks, nprocs=2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]


# ----------------------------------------------------------------------------- what needs Megatron itself
MEGATRON_ONLY = [
    ("initialize", lambda: mlm.initialize(_accelerator())),
    ("finish_mpu_init", mlm.finish_mpu_init),
    ("model_provider_func", lambda: mlm.model_provider_func()),
    ("prepare_optimizer", lambda: mlm.prepare_optimizer(_accelerator(), None)),
    ("prepare_scheduler", lambda: mlm.prepare_scheduler(_accelerator(), None, None)),
    ("prepare_model_optimizer_scheduler", lambda: mlm.prepare_model_optimizer_scheduler(_accelerator())),
    ("set_megatron_data_args", lambda: MegatronLMDummyDataLoader().set_megatron_data_args()),
    ("datasets provider", lambda: mlm.prepare_data_loader(_accelerator(), MegatronLMDummyDataLoader())),
    ("save_checkpoint", lambda: _engine().save_checkpoint("out")),
    ("load_checkpoint", lambda: _engine().load_checkpoint("out")),
    ("get_module_config", lambda: _engine().get_module_config()),
    ("eval_step", lambda: _engine().eval().forward(input_ids=torch.ones(1, 1))),
]


@pytest.mark.parametrize(("what", "call"), MEGATRON_ONLY, ids=[w for w, _ in MEGATRON_ONLY])
def test_megatron_steps_name_megatron_core(what, call, monkeypatch) -> None:
    with pytest.raises(ImportError, match=rf"{what}.* needs Megatron-LM .*pip install megatron-core"):
        call()
    monkeypatch.setattr(mlm, "is_megatron_lm_available", lambda: True)
    with pytest.raises(
        RuntimeError, match=rf"{what}.*run this script under Accelerate's Megatron-LM integration"
    ):
        call()


def test_custom_datasets_provider_is_served_and_arguments_are_checked() -> None:
    provider = object()
    accelerator = _accelerator(custom_megatron_datasets_provider_function=provider)
    assert MegatronLMDummyDataLoader().get_train_valid_test_datasets_provider(accelerator) is provider
    with pytest.raises(TypeError, match=r"extra_args_provider must be callable .*got 3"):
        mlm.initialize(_accelerator(), extra_args_provider=3)
    with pytest.raises(TypeError, match=r"args_defaults must be a dict of Megatron arguments, got \[1\]"):
        mlm.initialize(_accelerator(), args_defaults=[1])
    with pytest.raises(TypeError, match=r"model_provider_func: add_decoder must be a bool, got 'yes'"):
        mlm.model_provider_func(add_decoder="yes")
    with pytest.raises(ValueError, match=r"needs an Accelerator\(megatron_lm_plugin="):
        mlm.initialize(SimpleNamespace(state=None))


def test_megatron_data_parallel_group_is_used_once_its_state_is_initialized(monkeypatch) -> None:
    group = object()
    state = SimpleNamespace(initialized=False)
    parallel_state = types.ModuleType("megatron.core.parallel_state")
    parallel_state.model_parallel_is_initialized = lambda: state.initialized
    parallel_state.get_data_parallel_group = lambda: group
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", parallel_state)
    assert mlm._megatron_data_parallel_group() is None  # megatron-core missing: the default group
    monkeypatch.setattr(mlm, "is_megatron_lm_available", lambda: True)
    assert mlm._megatron_data_parallel_group() is None  # installed, not initialized: the default group
    state.initialized = True
    assert mlm._megatron_data_parallel_group() is group


def test_engine_train_and_eval_switch_every_chunk_and_the_forward_step() -> None:
    engine = _engine()
    assert engine.eval() is engine
    assert engine.training is False and not engine.module[0].training
    with pytest.raises(ImportError, match=r"MegatronEngine.eval_step needs Megatron-LM"):
        engine(x=torch.zeros(2, 1))
    assert engine.train() is engine
    assert engine.training is True and engine.module[0].training
    with pytest.raises(ImportError, match=r"MegatronEngine.train_step needs Megatron-LM"):
        engine(x=torch.zeros(2, 1))
    with pytest.raises(TypeError):
        engine.train(False)  # Accelerate 1.15's MegatronEngine.train takes no mode
