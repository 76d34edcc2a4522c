"""The Megatron train steps' batch, forward and loss functions, in plain torch (no Megatron needed)."""

from __future__ import annotations

import math
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch

from notebook_accel.utils import MegatronLMPlugin
from notebook_accel.utils.megatron_lm import AbstractTrainStep, BertTrainStep, GPTTrainStep, T5TrainStep


def _accelerator(**plugin_kwargs) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(megatron_lm_plugin=MegatronLMPlugin(**plugin_kwargs)))


ACC = _accelerator()


# ----------------------------------------------------------------------------- GPT
def test_gpt_batch_shifts_tokens_and_masks_padding() -> None:
    step = GPTTrainStep(ACC, Namespace())
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attention_mask": torch.tensor([[1, 1, 1, 0]])}
    tokens, labels, loss_mask, attention_mask, position_ids = step.get_batch(iter([batch]))
    assert tokens.tolist() == [[5, 6, 7]] and labels.tolist() == [[6, 7, 8]]
    assert loss_mask.tolist() == [[1.0, 1.0, 0.0]]
    assert attention_mask.tolist() == [[[[False, True, True], [False, False, True], [False, False, False]]]]
    assert position_ids.tolist() == [[0, 1, 2]]


def test_gpt_batch_resets_at_end_of_document() -> None:
    args = Namespace(eod_token=0, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    step = GPTTrainStep(ACC, args)
    _, _, loss_mask, attention_mask, position_ids = step.get_batch(
        iter([{"input_ids": torch.tensor([[1, 0, 2, 3, 9]])}])
    )
    assert loss_mask.tolist() == [[1.0, 0.0, 1.0, 1.0]]
    assert position_ids.tolist() == [[0, 1, 0, 1]]
    hidden = attention_mask[0, 0]
    assert hidden[2].tolist() == [True, True, False, True]  # the second document cannot see the first
    assert hidden[1].tolist() == [False, False, True, True]


def test_gpt_megatron_dataset_batches_use_text() -> None:
    step = GPTTrainStep(ACC, Namespace(megatron_dataset_flag=True))
    tokens, labels, *_ = step.get_batch(iter([{"text": torch.tensor([[1, 2, 3]])}]))
    assert tokens.tolist() == [[1, 2]] and labels.tolist() == [[2, 3]]
    with pytest.raises(KeyError, match=r"GPTTrainStep's batches need 'text'; got keys \['input_ids'\]"):
        step.get_batch(iter([{"input_ids": torch.tensor([[1, 2]])}]))


def test_gpt_loss_is_the_masked_mean_and_forward_step_wires_it() -> None:
    step = GPTTrainStep(ACC, Namespace())
    loss, report = step.loss_func(torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[1.0, 2.0, 30.0]]))
    assert loss.item() == 1.5 and report["lm loss"].item() == 1.5
    seen = {}

    def model(tokens, position_ids, attention_mask, labels):
        seen.update(tokens=tokens.tolist(), positions=position_ids.tolist(), mask=tuple(attention_mask.shape))
        return labels.float()  # per-token "losses": the targets themselves

    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attention_mask": torch.tensor([[1, 1, 1, 0]])}
    output, loss_fn = step.forward_step(iter([batch]), model)
    assert seen == {"tokens": [[5, 6, 7]], "positions": [[0, 1, 2]], "mask": (1, 1, 3, 3)}
    assert loss_fn(output)[0].item() == 6.5  # (6 + 7) / 2: the padded target 8 carries no loss


def test_gpt_loss_returns_logits_when_asked() -> None:
    step = GPTTrainStep(ACC, Namespace(return_logits=True))
    logits = torch.randn(1, 2, 5)
    loss, report = step.loss_func(torch.ones(1, 2), (torch.tensor([[2.0, 4.0]]), logits))
    assert loss.item() == 3.0 and report["logits"] is logits


def test_plugin_functions_replace_the_defaults() -> None:
    def get_batch(data_iterator):
        return next(data_iterator)

    def loss(*args):
        return args

    accelerator = _accelerator(custom_get_batch_function=get_batch, custom_loss_function=loss)
    for step in (GPTTrainStep(accelerator, Namespace()), T5TrainStep(accelerator, Namespace())):
        assert step.get_batch is get_batch and step.loss_func is loss
    bert = BertTrainStep(accelerator, Namespace(pretraining_flag=True))
    assert bert.get_batch is get_batch and bert.loss_func is loss


def test_abstract_train_step_serves_plugin_functions_or_names_what_to_override() -> None:
    base = AbstractTrainStep("mine")
    assert base.name == "mine"
    with pytest.raises(
        TypeError, match=r"AbstractTrainStep \(mine\) defines no get_batch_func: .*custom_get_batch_function"
    ):
        base.get_batch_func(ACC, False)
    with pytest.raises(TypeError, match=r"defines no get_loss_func: .*custom_loss_function"):
        base.get_loss_func(ACC)
    with pytest.raises(TypeError, match=r"has no forward step: subclass AbstractTrainStep"):
        base.get_forward_step_func()
    custom = _accelerator(custom_loss_function=len)
    assert base.get_loss_func(custom) is len


def test_batch_errors_name_the_problem() -> None:
    step = GPTTrainStep(ACC, Namespace())
    with pytest.raises(ValueError, match=r"needs a data iterator yielding dicts of tensors; got None"):
        step.get_batch(None)
    with pytest.raises(TypeError, match=r"must yield dicts of tensors \(input_ids, ...\), got list"):
        step.get_batch(iter([[1, 2]]))


# ----------------------------------------------------------------------------- BERT
PRETRAIN_BATCH = {
    "input_ids": torch.tensor([[1, 2, 3]]),
    "labels": torch.tensor([[-100, 5, -100]]),
    "next_sentence_label": torch.tensor([1]),
    "attention_mask": torch.tensor([[1, 1, 0]]),
}


def test_bert_pretraining_batch_and_loss() -> None:
    step = BertTrainStep(ACC, Namespace(pretraining_flag=True))
    tokens, types, order, loss_mask, labels, padding = step.get_batch(iter([PRETRAIN_BATCH]))
    assert types.tolist() == [[0, 0, 0]] and order.tolist() == [1] and padding.tolist() == [[1, 1, 0]]
    assert loss_mask.tolist() == [[0.0, 1.0, 0.0]]
    loss, report = step.loss_func(loss_mask, order, (torch.tensor([[2.0, 4.0, 6.0]]), torch.zeros(1, 2)))
    assert report["lm loss"].item() == 4.0 and report["sop loss"].item() == pytest.approx(math.log(2))
    assert loss.item() == pytest.approx(4.0 + math.log(2))
    # Megatron marks pairs without a sentence-order target -1: they add nothing to the loss.
    two = torch.tensor([[0.0, 0.0], [5.0, 0.0]])
    _, report = step.loss_func(loss_mask, torch.tensor([1, -1]), (torch.tensor([[2.0, 4.0, 6.0]]), two))
    assert report["sop loss"].item() == pytest.approx(math.log(2))
    loss, report = step.loss_func(loss_mask, order, (torch.tensor([[2.0, 4.0, 6.0]]), None))
    assert loss.item() == 4.0 and set(report) == {"lm loss"}


def test_bert_forward_step_passes_labels_and_drops_types_without_binary_head() -> None:
    calls = []

    def model(tokens, padding_mask, tokentype_ids=None, lm_labels=None):
        calls.append((tokentype_ids, lm_labels))
        return torch.tensor([[2.0, 4.0, 6.0]]), None

    step = BertTrainStep(ACC, Namespace(pretraining_flag=True, bert_binary_head=False))
    output, loss_fn = step.forward_step(iter([PRETRAIN_BATCH]), model)
    assert calls[0][0] is None and calls[0][1].tolist() == [[-100, 5, -100]]
    assert loss_fn(output)[0].item() == 4.0


def test_bert_classification_and_regression_losses() -> None:
    classify = BertTrainStep(ACC, Namespace(num_labels=3))
    batch = {"input_ids": torch.tensor([[1, 2]]), "labels": torch.tensor([2])}
    output, loss_fn = classify.forward_step(
        iter([batch]), lambda tokens, mask, tokentype_ids=None: torch.zeros(1, 3)
    )
    loss, report = loss_fn(output)
    assert loss.item() == pytest.approx(math.log(3)) and report["loss"].item() == pytest.approx(math.log(3))
    regress = BertTrainStep(ACC, Namespace(num_labels=1))
    assert regress.loss_func(torch.tensor([1.0]), torch.tensor([[3.0]]))[0].item() == 4.0
    with pytest.raises(ValueError, match=r"num_labels must be an int >= 1 \(1 = regression\), got 0"):
        BertTrainStep(ACC, Namespace(num_labels=0))


def test_bert_megatron_dataset_fields() -> None:
    step = BertTrainStep(ACC, Namespace(megatron_dataset_flag=True, pretraining_flag=True))
    batch = {
        "text": torch.tensor([[7, 8]]), "types": torch.tensor([[0, 1]]), "is_random": torch.tensor([0]),
        "loss_mask": torch.tensor([[1, 0]]), "labels": torch.tensor([[7, -1]]), "padding_mask": torch.tensor([[1, 1]]),
    }  # fmt: skip
    tokens, types, order, loss_mask, labels, padding = step.get_batch(iter([batch]))
    assert types.tolist() == [[0, 1]] and loss_mask.tolist() == [[1.0, 0.0]] and order.tolist() == [0]


# ----------------------------------------------------------------------------- T5
def test_t5_masks_match_accelerate() -> None:
    # Recorded from accelerate 1.15.0's T5TrainStep static methods on the same inputs.
    padding = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert T5TrainStep.attn_mask_postprocess(padding).tolist() == [
        [[False, False, True], [False, False, True], [True, True, True]],
        [[False, True, True], [True, True, True], [True, True, True]],
    ]
    assert T5TrainStep.get_decoder_mask(3, "cpu").tolist() == [
        [[False, True, True], [False, False, True], [False, False, False]]
    ]
    assert T5TrainStep.get_enc_dec_mask(padding, 2, "cpu").tolist() == [
        [[False, False, True], [False, False, True]],
        [[False, True, True], [False, True, True]],
    ]


def test_t5_batch_shifts_labels_into_decoder_inputs_and_loss_is_masked() -> None:
    step = T5TrainStep(ACC, Namespace())
    batch = {"input_ids": torch.tensor([[9, 8, 7]]), "labels": torch.tensor([[4, 5, -100]])}
    enc, dec, loss_mask, labels, enc_mask, dec_mask, enc_dec_mask = step.get_batch(iter([batch]))
    assert dec.tolist() == [[0, 4, 5]] and loss_mask.tolist() == [[1.0, 1.0, 0.0]]
    assert enc_mask.shape == (1, 3, 3) and dec_mask.shape == (1, 3, 3) and enc_dec_mask.shape == (1, 3, 3)
    seen = []

    def model(enc, dec, enc_mask, dec_mask, enc_dec_mask, tokentype_ids=None, lm_labels=None):
        seen.append(lm_labels.tolist())
        return torch.tensor([[1.0, 3.0, 50.0]])

    output, loss_fn = step.forward_step(iter([batch]), model)
    loss, report = loss_fn(output)
    assert seen == [[[4, 5, -100]]] and loss.item() == 2.0 and report["lm loss"].item() == 2.0
    given = {**batch, "decoder_input_ids": torch.tensor([[1, 2, 3]])}
    assert step.get_batch(iter([given]))[1].tolist() == [[1, 2, 3]]
    with pytest.raises(KeyError, match=r"T5TrainStep's batches need \['labels'\]"):
        step.get_batch(iter([{"input_ids": torch.tensor([[1]])}]))
