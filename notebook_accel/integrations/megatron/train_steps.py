"""The train-step classes of Accelerate's Megatron-LM integration: batch, forward-step and loss functions.

Megatron's schedules call ``forward_step(data_iterator, model)``, which reads a batch with
``get_batch``, runs the model and returns its output with the loss function to apply to it. These
functions are plain torch (any model with Megatron's calling convention runs them); the losses are
averaged over the data-parallel ranks for logging with ``avg_losses_across_data_parallel_group``.
``MegatronLMPlugin``'s ``custom_get_batch_function`` / ``custom_loss_function`` replace the defaults.
Served at ``notebook_accel.utils.megatron_lm`` (and ``notebook_accel.utils``).
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ...utils._protocols import AcceleratorLike
from .lm import avg_losses_across_data_parallel_group

__all__ = ["AbstractTrainStep", "BertTrainStep", "GPTTrainStep", "T5TrainStep"]

_IGNORE = -100  # the label transformers uses for positions without a target


def _custom(accelerator: AcceleratorLike, name: str) -> Callable | None:
    plugin = getattr(getattr(accelerator, "state", None), "megatron_lm_plugin", None)
    return getattr(plugin, name, None)


def _next_batch(data_iterator: Any) -> dict[str, torch.Tensor]:
    if data_iterator is None:
        raise ValueError("get_batch needs a data iterator yielding dicts of tensors; got None")
    batch = next(data_iterator)
    if not isinstance(batch, dict):
        raise TypeError(
            f"the data iterator must yield dicts of tensors (input_ids, ...), got {type(batch).__name__}"
        )
    return batch


def _masked_mean(losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    mask = loss_mask.reshape(-1).float()
    return torch.sum(losses.reshape(-1).float() * mask) / mask.sum()


def _lm_loss_func(step: AbstractTrainStep, accelerator: AcceleratorLike) -> Callable:
    """Return the plugin's ``custom_loss_function``, or the masked mean of a language model's per-token losses.

    ``loss_func(loss_mask, output_tensor)`` gives back the loss and ``{"lm loss": its average over the
    data-parallel ranks}``; when ``step.return_logits`` is set (read at each call), the output is
    ``(losses, logits)`` and the logits are reported too.
    """
    custom = _custom(accelerator, "custom_loss_function")
    if custom is not None:
        return custom

    def loss_func(loss_mask, output_tensor):
        with_logits = getattr(step, "return_logits", False)
        losses, logits = output_tensor if with_logits else (output_tensor, None)
        loss = _masked_mean(losses, loss_mask)
        report = {"lm loss": avg_losses_across_data_parallel_group([loss])[0]}
        if logits is not None:
            report["logits"] = logits
        return loss, report

    return loss_func


def _forward_step(step: AbstractTrainStep, run_model: Callable[[Any, tuple], tuple[Any, tuple]]) -> Callable:
    """Return Megatron's ``forward_step(data_iterator, model)`` for ``step``.

    ``run_model(model, batch)`` feeds one batch to the model and gives back its output and the leading
    arguments of the step's loss function; Megatron's schedule later passes the output as the last one.
    The step's ``get_batch`` and ``loss_func`` are read at call time, so replacing them takes effect.
    """

    def forward_step(data_iterator, model):
        output, loss_head = run_model(model, step.get_batch(data_iterator))
        return output, partial(step.loss_func, *loss_head)

    return forward_step


class AbstractTrainStep(ABC):  # noqa: B024 - Accelerate's base is instantiable; its methods serve the plugin's functions
    """Base of the train steps: batching, forward step and loss, each given by a ``get_*_func`` method."""

    def __init__(self, name) -> None:
        self.name = name

    def get_batch_func(self, accelerator, megatron_dataset_flag) -> Callable:
        """Return the plugin's ``custom_get_batch_function``; raise TypeError when there is none."""
        return self._plugin_function(accelerator, "custom_get_batch_function", "get_batch_func")

    def get_forward_step_func(self) -> Callable:
        """Raise TypeError: a train step subclass defines its forward step."""
        raise TypeError(
            f"{type(self).__name__} ({self.name}) has no forward step: subclass AbstractTrainStep (or GPTTrainStep, "
            "BertTrainStep, T5TrainStep) and override get_forward_step_func"
        )

    def get_loss_func(self, accelerator) -> Callable:
        """Return the plugin's ``custom_loss_function``; raise TypeError when there is none."""
        return self._plugin_function(accelerator, "custom_loss_function", "get_loss_func")

    def _plugin_function(self, accelerator: AcceleratorLike, field: str, method: str) -> Callable:
        function = _custom(accelerator, field)
        if function is None:
            raise TypeError(
                f"{type(self).__name__} ({self.name}) defines no {method}: override it in a subclass, or set "
                f"MegatronLMPlugin({field}=...)"
            )
        return function


def _ltor_masks_and_position_ids(
    tokens: torch.Tensor, eod_token: int | None, reset_position_ids: bool, reset_attention_mask: bool,
    eod_mask_loss: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Return the causal attention mask (True = hidden, [b, 1, s, s]), the loss mask and the position ids.

    With an end-of-document token, ``eod_mask_loss`` drops the loss there, and the reset flags restart
    positions / hide earlier documents after each one.
    """
    batch, length = tokens.shape
    causal = torch.tril(torch.ones(length, length, device=tokens.device, dtype=torch.bool))
    allowed = causal.expand(batch, 1, length, length).clone()
    loss_mask = torch.ones(batch, length, dtype=torch.float, device=tokens.device)
    position_ids = torch.arange(length, dtype=torch.long, device=tokens.device).expand(batch, length).clone()
    if eod_token is not None:
        if eod_mask_loss:
            loss_mask[tokens == eod_token] = 0.0
        if reset_position_ids or reset_attention_mask:
            for row in range(batch):
                start = 0
                for end in (tokens[row] == eod_token).nonzero().flatten().tolist():
                    if reset_attention_mask:
                        allowed[row, 0, end + 1 :, : end + 1] = False
                    if reset_position_ids:
                        position_ids[row, end + 1 :] -= end + 1 - start
                    start = end + 1
    return ~allowed, loss_mask, position_ids


class GPTTrainStep(AbstractTrainStep):
    """GPT train step: next-token batches, the masked mean of per-token losses.

    Args:
        args (`argparse.Namespace`): Megatron-LM arguments (``megatron_dataset_flag``, ``eod_mask_loss``,
            ``reset_position_ids``, ``reset_attention_mask``, ``return_logits``; ``eod_token`` if any).
    """

    def __init__(self, accelerator, args) -> None:
        super().__init__("GPTTrainStep")
        self.eod_token = getattr(args, "eod_token", None)
        self.reset_position_ids = bool(getattr(args, "reset_position_ids", False))
        self.reset_attention_mask = bool(getattr(args, "reset_attention_mask", False))
        self.eod_mask_loss = bool(getattr(args, "eod_mask_loss", False))
        self.return_logits = bool(getattr(args, "return_logits", False))
        self.get_batch = self.get_batch_func(accelerator, bool(getattr(args, "megatron_dataset_flag", False)))
        self.loss_func = self.get_loss_func(accelerator)
        self.forward_step = self.get_forward_step_func()

    def get_batch_func(self, accelerator, megatron_dataset_flag) -> Callable:
        """Return ``get_batch(data_iterator)`` -> tokens, labels, loss_mask, attention_mask, position_ids."""
        custom = _custom(accelerator, "custom_get_batch_function")
        if custom is not None:
            return custom
        key = "text" if megatron_dataset_flag else "input_ids"  # Megatron's GPT datasets yield "text"

        def get_batch(data_iterator):
            batch = _next_batch(data_iterator)
            if key not in batch:
                raise KeyError(f"GPTTrainStep's batches need {key!r}; got keys {sorted(batch)}")
            sequence = batch[key].long()
            tokens, labels = sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()
            attention_mask, loss_mask, position_ids = _ltor_masks_and_position_ids(
                tokens, self.eod_token, self.reset_position_ids, self.reset_attention_mask, self.eod_mask_loss
            )
            if "attention_mask" in batch:  # padding carries no loss
                loss_mask = loss_mask * batch["attention_mask"][:, 1:].to(loss_mask.dtype)
            return tokens, labels, loss_mask, attention_mask, position_ids

        return get_batch

    def get_loss_func(self, accelerator) -> Callable:
        """Return ``loss_func(loss_mask, output_tensor)`` -> (loss, {"lm loss": average over data-parallel ranks})."""
        return _lm_loss_func(self, accelerator)

    def get_forward_step_func(self) -> Callable:
        """Return ``forward_step(data_iterator, model)`` -> (model output, loss function to apply to it)."""

        def run_gpt(model, batch):
            tokens, labels, loss_mask, attention_mask, position_ids = batch
            return model(tokens, position_ids, attention_mask, labels=labels), (loss_mask,)

        return _forward_step(self, run_gpt)


class BertTrainStep(AbstractTrainStep):
    """BERT train step: masked-LM (+ sentence order) pretraining, or sequence classification / regression.

    Args:
        args (`argparse.Namespace`): Megatron-LM arguments (``megatron_dataset_flag``, ``pretraining_flag``,
            ``num_labels``, ``bert_binary_head``).
    """

    def __init__(self, accelerator, args) -> None:
        super().__init__("BertTrainStep")
        pretraining = bool(getattr(args, "pretraining_flag", False))
        self.get_batch = self.get_batch_func(accelerator, bool(getattr(args, "megatron_dataset_flag", False)))
        self.loss_func = self.get_loss_func(accelerator, pretraining, getattr(args, "num_labels", 2))
        self.forward_step = self.get_forward_step_func(
            pretraining, bool(getattr(args, "bert_binary_head", True))
        )

    def get_batch_func(self, accelerator, megatron_dataset_flag) -> Callable:
        """Return ``get_batch(data_iterator)`` -> tokens, types, sentence_order, loss_mask, lm_labels, padding_mask."""
        custom = _custom(accelerator, "custom_get_batch_function")
        if custom is not None:
            return custom
        # Megatron's BERT datasets name the fields differently from transformers' tokenizers.
        names = (
            ("text", "types", "is_random", "loss_mask", "labels", "padding_mask") if megatron_dataset_flag
            else ("input_ids", "token_type_ids", "next_sentence_label", None, "labels", "attention_mask")
        )  # fmt: skip

        def get_batch(data_iterator):
            batch = _next_batch(data_iterator)
            if names[0] not in batch:
                raise KeyError(f"BertTrainStep's batches need {names[0]!r}; got keys {sorted(batch)}")
            tokens = batch[names[0]].long()
            types = batch.get(names[1], torch.zeros_like(tokens)).long()
            sentence_order = batch.get(names[2])
            labels = batch.get(names[4])
            padding_mask = batch.get(names[5], torch.ones_like(tokens)).long()
            if names[3] is not None:
                loss_mask = batch[names[3]].float()
            elif labels is not None and labels.dim() == 2:  # token labels: loss where a target is given
                loss_mask = (labels != _IGNORE).float()
            else:
                loss_mask = torch.ones_like(tokens, dtype=torch.float)
            return tokens, types, sentence_order, loss_mask, labels, padding_mask

        return get_batch

    def get_loss_func(self, accelerator, pretraining_flag, num_labels) -> Callable:
        """Return the loss function: masked-LM (+ sentence order) when pretraining, else classification/regression."""
        custom = _custom(accelerator, "custom_loss_function")
        if custom is not None:
            return custom
        if not pretraining_flag and (
            isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1
        ):
            raise ValueError(
                f"BertTrainStep: num_labels must be an int >= 1 (1 = regression), got {num_labels!r}"
            )

        def pretraining_loss(loss_mask, sentence_order, output_tensor):
            lm_losses, sop_logits = output_tensor
            parts = {"lm loss": _masked_mean(lm_losses, loss_mask)}
            if sop_logits is not None:  # the sentence-order head; -1 marks pairs without a target
                targets = sentence_order.reshape(-1)
                parts["sop loss"] = F.cross_entropy(
                    sop_logits.reshape(-1, 2).float(), targets, ignore_index=-1
                )
            reported = dict(zip(parts, avg_losses_across_data_parallel_group(list(parts.values()))))
            return sum(parts.values()), reported

        def classification_loss(labels, logits):
            if num_labels == 1:
                loss = F.mse_loss(logits.view(-1).float(), labels.view(-1).float())
            else:
                loss = F.cross_entropy(logits.view(-1, num_labels).float(), labels.view(-1))
            return loss, {"loss": avg_losses_across_data_parallel_group([loss])[0]}

        return pretraining_loss if pretraining_flag else classification_loss

    def get_forward_step_func(self, pretraining_flag, bert_binary_head) -> Callable:
        """Return ``forward_step(data_iterator, model)`` -> (model output, loss function to apply to it)."""

        def run_bert(model, batch):
            tokens, types, sentence_order, loss_mask, labels, padding_mask = batch
            # Without the binary (sentence-order) head the model takes no token types.
            type_ids = types if bert_binary_head else None
            if not pretraining_flag:
                return model(tokens, padding_mask, tokentype_ids=type_ids), (labels,)
            output = model(tokens, padding_mask, tokentype_ids=type_ids, lm_labels=labels)
            return output, (loss_mask, sentence_order)

        return _forward_step(self, run_bert)


class T5TrainStep(AbstractTrainStep):
    """T5 train step: encoder/decoder batches with their masks, the masked mean of per-token losses.

    Args:
        args (`argparse.Namespace`): Megatron-LM arguments (``megatron_dataset_flag``).
    """

    def __init__(self, accelerator, args) -> None:
        super().__init__("T5TrainStep")
        self.get_batch = self.get_batch_func(accelerator, bool(getattr(args, "megatron_dataset_flag", False)))
        self.loss_func = self.get_loss_func(accelerator)
        self.forward_step = self.get_forward_step_func()

    @staticmethod
    def attn_mask_postprocess(attention_mask):
        """Return the encoder self-attention mask [b, s, s] from a padding mask [b, s] (True = hidden)."""
        return (attention_mask.unsqueeze(1) * attention_mask.unsqueeze(2)) < 0.5

    @staticmethod
    def get_decoder_mask(seq_length, device):
        """Return the causal decoder mask [1, s, s] (True = hidden: the future)."""
        return torch.tril(torch.ones((1, seq_length, seq_length), device=device)) < 0.5

    @staticmethod
    def get_enc_dec_mask(attention_mask, dec_seq_length, device):
        """Return the decoder-to-encoder mask [b, dec, enc] from the encoder padding mask (True = hidden)."""
        batch = attention_mask.shape[0]
        decoder_rows = torch.ones((batch, dec_seq_length, 1), device=device)
        return (decoder_rows * attention_mask.unsqueeze(1).to(device)) < 0.5

    def get_batch_func(self, accelerator, megatron_dataset_flag) -> Callable:
        """Return ``get_batch(data_iterator)`` -> tokens_enc, tokens_dec, loss_mask, labels, enc, dec, enc-dec masks."""
        custom = _custom(accelerator, "custom_get_batch_function")
        if custom is not None:
            return custom
        names = (
            ("text_enc", "text_dec", "labels", "enc_mask") if megatron_dataset_flag
            else ("input_ids", "decoder_input_ids", "labels", "attention_mask")
        )  # fmt: skip

        def get_batch(data_iterator):
            batch = _next_batch(data_iterator)
            missing = [n for n in (names[0], names[2]) if n not in batch]
            if missing:
                raise KeyError(f"T5TrainStep's batches need {missing}; got keys {sorted(batch)}")
            tokens_enc, labels = batch[names[0]].long(), batch[names[2]].long()
            if names[1] in batch:
                tokens_dec = batch[names[1]].long()
            else:  # teacher forcing: the labels shifted right behind the start token (0), ignored ones as pad 0
                tokens_dec = torch.zeros_like(labels)
                tokens_dec[:, 1:] = labels[:, :-1].clamp(min=0)
            padding = batch.get(names[3], torch.ones_like(tokens_enc))
            device = tokens_enc.device
            return (
                tokens_enc, tokens_dec, (labels != _IGNORE).float(), labels, self.attn_mask_postprocess(padding),
                self.get_decoder_mask(tokens_dec.shape[1], device),
                self.get_enc_dec_mask(padding, tokens_dec.shape[1], device),
            )  # fmt: skip

        return get_batch

    def get_loss_func(self, accelerator) -> Callable:
        """Return ``loss_func(loss_mask, output_tensor)`` -> (loss, {"lm loss": average over data-parallel ranks})."""
        return _lm_loss_func(self, accelerator)

    def get_forward_step_func(self) -> Callable:
        """Return ``forward_step(data_iterator, model)`` -> (model output, loss function to apply to it)."""

        def run_t5(model, batch):
            tokens_enc, tokens_dec, loss_mask, labels, *masks = batch  # masks: encoder, decoder, cross
            return model(tokens_enc, tokens_dec, *masks, tokentype_ids=None, lm_labels=labels), (loss_mask,)

        return _forward_step(self, run_t5)
