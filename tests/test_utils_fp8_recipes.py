"""FP8 recipes of Accelerate 1.15: TERecipeKwargs, MSAMPRecipeKwargs, AORecipeKwargs and the deprecated FP8RecipeKwargs."""

from __future__ import annotations

import pytest

from notebook_accel.utils import AORecipeKwargs, FP8RecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs


def test_te_recipe_defaults_and_environment(monkeypatch) -> None:
    recipe = TERecipeKwargs()
    assert (recipe.fp8_format, recipe.amax_history_len, recipe.amax_compute_algo) == (
        "HYBRID",
        1024,
        "most_recent",
    )
    assert (recipe.margin, recipe.interval, recipe.use_autocast_during_eval) == (0, 1, False)
    assert (
        recipe.override_linear_precision == (False, False, False) and recipe.use_mxfp8_block_scaling is False
    )
    monkeypatch.setenv("ACCELERATE_FP8_FORMAT", "e4m3")
    monkeypatch.setenv("ACCELERATE_FP8_AMAX_HISTORY_LEN", "16")
    monkeypatch.setenv("ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL", "true")
    recipe = TERecipeKwargs(margin=2)
    assert (recipe.fp8_format, recipe.amax_history_len, recipe.use_autocast_during_eval, recipe.margin) == (
        "E4M3",
        16,
        True,
        2,
    )
    assert TERecipeKwargs(fp8_format="e5m2").fp8_format == "E5M2"


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: TERecipeKwargs(fp8_format="E6M1"), r"fp8_format='E6M1'.*HYBRID"),
        (lambda: TERecipeKwargs(amax_compute_algo="mean"), r"amax_compute_algo='mean'"),
        (lambda: TERecipeKwargs(interval=0), "interval must be an int >= 1, got 0"),
        (lambda: TERecipeKwargs(override_linear_precision=(True,)), "three bools"),
        (lambda: MSAMPRecipeKwargs(opt_level="O3"), r"opt_level='O3'.*'O1'"),
    ],
)
def test_bad_recipes_raise(build, match) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def test_msamp_and_ao_recipes() -> None:
    assert MSAMPRecipeKwargs().opt_level == "O2" and MSAMPRecipeKwargs(opt_level="01").opt_level == "O1"
    with pytest.raises(ImportError, match="MS-AMP"):
        MSAMPRecipeKwargs().check_engine()
    ao = AORecipeKwargs()
    assert ao.pad_inner_dim is True and ao.enable_fsdp_float8_all_gather is True
    sentinel = object()
    assert AORecipeKwargs(config=sentinel).build_config() is sentinel
    with pytest.raises(ImportError, match="pip install torchao"):
        ao.build_config()
    with pytest.raises(TypeError, match="module_filter_func must be callable"):
        AORecipeKwargs(module_filter_func=3)


def test_te_engine_is_needed_only_when_used() -> None:
    recipe = TERecipeKwargs()
    with pytest.raises(ImportError, match=r"pip install 'transformer_engine\[pytorch\]'"):
        recipe.to_te_recipe()


def test_fp8_recipe_kwargs_is_deprecated_and_picks_a_backend(monkeypatch) -> None:
    with pytest.warns(FutureWarning, match="FP8RecipeKwargs is deprecated"):
        default = FP8RecipeKwargs()
    assert (
        default.backend == "TE"
        and isinstance(default, TERecipeKwargs)
        and isinstance(default, MSAMPRecipeKwargs)
    )
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "msamp")
    with pytest.warns(FutureWarning):
        msamp = FP8RecipeKwargs(opt_level="O1")
    assert (msamp.backend, msamp.opt_level) == ("MSAMP", "O1")
    with pytest.raises(ValueError, match="needs backend='TE'"):
        msamp.to_te_recipe()
    with pytest.raises(ImportError, match="MS-AMP"):
        msamp.check_engine()
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match=r"backend='X'"):
        FP8RecipeKwargs(backend="x")


def test_accelerator_takes_the_new_recipes_as_handlers() -> None:
    from notebook_accel.accelerator.flags import sort_kwargs_handlers

    for handler in (TERecipeKwargs(), MSAMPRecipeKwargs(), AORecipeKwargs()):
        assert sort_kwargs_handlers([handler]) == {"fp8": handler}
    with pytest.raises(ValueError, match="two"):
        sort_kwargs_handlers([TERecipeKwargs(), MSAMPRecipeKwargs()])


def test_deepspeed_plugin_msamp_fields(monkeypatch) -> None:
    from notebook_accel.utils import DeepSpeedPlugin

    assert DeepSpeedPlugin().enable_msamp is False and DeepSpeedPlugin().msamp_opt_level == "O1"
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "msamp")
    monkeypatch.setenv("ACCELERATE_FP8_OPT_LEVEL", "02")
    plugin = DeepSpeedPlugin()
    assert plugin.enable_msamp is True and plugin.msamp_opt_level == "O2"
    with pytest.raises(ValueError, match=r"msamp_opt_level='O3' is not valid"):
        DeepSpeedPlugin(msamp_opt_level="O3")
