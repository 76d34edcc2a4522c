"""``accelerate estimate-memory``: the memory a model needs to load and to train, per dtype, as a table.

The model is built on the meta device from its config (no weights are downloaded): a local folder
holding a ``config.json`` works offline; a Hub name needs the Hub for the config only.
"""

from __future__ import annotations

import argparse

from ..utils.device_planning.sizes import calculate_maximum_sizes
from ..utils.other import convert_bytes

__all__ = [
    "add_timm_hub_prefix",
    "create_ascii_table",
    "create_empty_model",
    "estimate_command",
    "estimate_command_parser",
    "estimate_training_usage",
    "gather_data",
    "verify_on_hub",
]

DTYPES = ("float32", "float16", "int8", "int4")
# Bytes per parameter relative to float32.
_DTYPE_DIVISOR = {"float32": 1, "float16": 2, "int8": 4, "int4": 8}


def estimate_command_parser(subparsers=None):
    """Return the ``estimate-memory`` parser (a subparser of ``subparsers`` when given)."""
    description = "Estimate the memory a model needs to load and to train with Adam, without downloading it."
    if subparsers is not None:
        parser = subparsers.add_parser("estimate-memory", description=description)
    else:
        parser = argparse.ArgumentParser("Accelerate estimate-memory command", description=description)
    parser.add_argument("model_name", type=str, help="A local folder with config.json, or a Hub model name.")
    parser.add_argument("--library_name", "--library-name", choices=["timm", "transformers"], default=None,
                        help="The library that builds the model (default: transformers).")  # fmt: skip
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES),
                        help="The dtypes to report (float32, float16, int8, int4).")  # fmt: skip
    parser.add_argument("--trust_remote_code", "--trust-remote-code", action="store_true",
                        help="Allow a model whose code lives with its config (run only code you trust).")  # fmt: skip
    parser.set_defaults(func=estimate_command)
    return parser


def verify_on_hub(repo: str, token: str | None = None):
    """Return the Hub's model info for ``repo``; ``"gated"`` when it needs a login, ``"repo"`` when there is none.

    Other failures (no network) are raised as they are.
    """
    from huggingface_hub import model_info
    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError

    try:
        return model_info(repo, token=token)
    except GatedRepoError:
        return "gated"
    except RepositoryNotFoundError:
        return "repo"


def _check_on_hub(model_name: str, access_token) -> None:
    """Raise OSError when the Hub answers that ``model_name`` is gated or absent (a local folder is not asked)."""
    import os

    from huggingface_hub import constants

    if os.path.isdir(model_name) or constants.HF_HUB_OFFLINE:
        return
    answer = verify_on_hub(model_name, access_token)
    if answer == "gated":
        raise OSError(
            f"Repo for model `{model_name}` is gated. You must be authenticated to access it: run "
            "`hf auth login` (or pass a token), or point to a local folder holding its config.json."
        )
    if answer == "repo":
        raise OSError(
            f"Repo for model `{model_name}` does not exist on the Hub: check the name, log in for a private "
            "repo (`hf auth login`), or point to a local folder holding its config.json."
        )


def add_timm_hub_prefix(model_name: str) -> str:
    """Return ``model_name`` as timm's ``create_model`` reads a Hub repo: ``"org/name"`` gets ``"hf-hub:"``.

    timm >= 1.0.29 wants the source prefix on repo ids; a bare architecture name (``"resnet50"``) comes
    from timm's registry and a name that already names its source (``"local-dir:/path"``) stays as is.
    """
    if ":" in model_name or "/" not in model_name:
        return model_name
    return f"hf-hub:{model_name}"


def create_empty_model(
    model_name: str, library_name: str, trust_remote_code: bool = False, access_token=None
):
    """Return the model ``model_name`` built on the meta device (no weights), by ``library_name``.

    A Hub name is first checked with :func:`verify_on_hub` (OSError for a gated or absent repo).
    """
    import torch

    _check_on_hub(model_name, access_token)

    library_name = library_name or "transformers"
    if library_name == "transformers":
        import transformers

        config = transformers.AutoConfig.from_pretrained(
            model_name, trust_remote_code=trust_remote_code, token=access_token
        )
        with torch.device("meta"):
            return transformers.AutoModel.from_config(config, trust_remote_code=trust_remote_code)
    if library_name == "timm":
        try:
            import timm
        except ImportError as exc:
            raise ImportError(
                f"--library_name timm builds {model_name!r} with timm: `pip install timm`."
            ) from exc
        with torch.device("meta"):
            return timm.create_model(add_timm_hub_prefix(model_name), pretrained=False)
    raise ValueError(f"--library_name {library_name!r} is not supported: use transformers or timm.")


def estimate_training_usage(bytes: int, mixed_precision: str, msamp_config=None) -> dict[str, int]:
    """Return the bytes to train with Adam: ``model``, ``optimizer``, ``gradients`` and the ``step`` peak.

    ``bytes`` is the model's size in ``mixed_precision`` (``float32``/``no``, ``float16``/``bf16``);
    other precisions give ``-1`` everywhere (not trainable with Adam as is).
    """
    if mixed_precision in ("float32", "no", "fp32"):
        sizes = {"model": bytes, "optimizer": 2 * bytes, "gradients": bytes}
        return {**sizes, "step": sum(sizes.values())}
    if mixed_precision in ("float16", "bf16", "fp16", "bfloat16"):
        # float32 master weights and Adam moments, gradients in both precisions.
        sizes = {"model": 2 * bytes, "optimizer": 4 * bytes, "gradients": 3 * bytes}
        return {**sizes, "step": max(sizes.values())}
    return {"model": -1, "optimizer": -1, "gradients": -1, "step": -1}


def gather_data(args) -> list[list]:
    """Return one row per dtype: ``[dtype, largest layer bytes, total bytes, training usage dict]``."""
    model = create_empty_model(args.model_name, getattr(args, "library_name", None),
                               getattr(args, "trust_remote_code", False))  # fmt: skip
    total, (largest, _) = calculate_maximum_sizes(model)
    rows = []
    for dtype in args.dtypes or DTYPES:
        if dtype not in _DTYPE_DIVISOR:
            raise ValueError(f"dtype {dtype!r} is not one of {list(DTYPES)}.")
        divisor = _DTYPE_DIVISOR[dtype]
        size = total if divisor == 1 else total / divisor
        rows.append([dtype, largest if divisor == 1 else largest / divisor, size,
                     estimate_training_usage(int(size), dtype)])  # fmt: skip
    return rows


def create_ascii_table(headers: list, rows: list, title: str) -> str:
    """Return ``rows`` under ``headers`` in a box-drawn table with ``title`` centered on top."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    inner = sum(widths) + len(widths) - 1
    if len(title) > inner:  # the last column widens to fit the title
        widths[-1] += len(title) - inner
        inner = len(title)

    def line(left: str, mid: str, right: str) -> str:
        return left + mid.join("─" * w for w in widths) + right

    def row(values) -> str:
        return "│" + "│".join(str(v).center(w) for v, w in zip(values, widths)) + "│"

    out = ["┌" + "─" * inner + "┐", "│" + title.center(inner) + "│", line("├", "┬", "┤"), row(headers),
           line("├", "┼", "┤"), *(row(r) for r in cells), line("└", "┴", "┘")]  # fmt: skip
    return "\n".join(out)


def estimate_command(args):
    """Return the rows of :func:`gather_data` after printing them as 1.15's table."""
    rows = gather_data(args)
    shown = [[dtype, convert_bytes(largest), convert_bytes(total),
              "N/A" if usage["step"] == -1 else convert_bytes(usage["step"])]
             for dtype, largest, total, usage in rows]  # fmt: skip
    title = f"Memory Usage for loading `{args.model_name}`"
    print(create_ascii_table(["dtype", "Largest Layer", "Total Size", "Training using Adam"], shown, title))
    return rows


def main():
    """Return the rows of ``estimate-memory`` for the command line in ``sys.argv``."""
    return estimate_command(estimate_command_parser().parse_args())
