"""Which models sequence parallelism must refuse: layers that carry a state along the whole sequence."""

from __future__ import annotations

from typing import Any

__all__ = ["_refuse_recurrent_layers_under_sequence_parallelism"]  # private; 1.15 serves it at big_modeling, as we do


# Layer types whose output at a position depends on a state carried along the whole sequence: sharding the
# sequence over ranks restarts that state on each rank (the gradients are wrong, and nothing fails).
_RECURRENT_LAYER_TYPES = ("linear_attention",)


def _refuse_recurrent_layers_under_sequence_parallelism(model: Any) -> None:
    """Return None, or raise ValueError when ``model``'s (text) config lists recurrent layer types.

    Called before sequence parallelism (``sp_size > 1``) wraps a model; Accelerate 1.15 serves it at
    ``accelerate.big_modeling``. A model without ``config.layer_types`` passes.
    """
    config = getattr(model, "config", None)
    if callable(getattr(config, "get_text_config", None)):
        config = config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or ()
    recurrent = [kind for kind in _RECURRENT_LAYER_TYPES if kind in layer_types]
    if recurrent:
        raise ValueError(
            f"Sequence parallelism (sp_size > 1) cannot shard the sequence of {type(model).__name__}: its "
            f"config's layer_types include {recurrent}, layers that carry a state along the whole sequence, "
            "so each rank would restart it on its shard and train on wrong gradients. Use sp_size=1 for this "
            "model, or a model with full attention only."
        )
