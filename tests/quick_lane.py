"""The quick lane: ``python -m pytest -m quick`` (under 5 minutes on CI's 2 cores, the whole suite ~20).

The rule, applied by ``tests/conftest.py``: a test is marked ``quick`` when

- its module is listed below (every test of that module, except those marked ``slow``), or
- its ``module::function`` is listed below (every parametrization of that function), or
- it is in ``test_quick_lane`` (the lane's own check).

``QUICK`` is keyed by the package of ``notebook_accel`` the entries cover (a subpackage, a top-level
module, or ``widgets``); ``tests/test_quick_lane.py`` checks that every package of the source tree has an
entry, that each entry exists and imports its package, and that ``QUICK_LAUNCH``, the lane's one real
multi-process launch (two gloo ranks), is in the lane. A new package adds its unit-test module here.
"""

from __future__ import annotations

# The real launch: two forked ranks form a gloo group on 127.0.0.1, all-reduce, and return values.
QUICK_LAUNCH = "test_launcher::test_two_processes_form_a_gloo_group_and_return_values"

QUICK: dict[str, tuple[str, ...]] = {
    "accelerator": ("test_accelerator_parts",),
    "big_modeling": ("test_big_modeling",),
    "checkpoint_folder": ("test_faults::test_a_kill_between_the_renames_hides_no_checkpoint",),
    "checkpointing": ("test_checkpointing",),
    "commands": ("test_commands_config", "test_launch_validation"),
    "data_loader": ("test_data_loader",),
    "hooks": ("test_hooks",),
    "inference": (
        "test_inference::test_generate_device_map_balances_stages_by_size_and_keeps_no_split_blocks",
        "test_inference::test_split_point_naming_a_missing_module_names_close_ones",
    ),
    "integrations": ("test_engine_shared_pieces", "test_utils_fp8_layers"),
    "interactive": ("test_states", "test_interactive_protocol", "test_interactive_links"),
    "launch": ("test_collapse", "test_states"),
    "launchers": (QUICK_LAUNCH,),
    "local_sgd": ("test_local_sgd_launch::test_local_sgd_validates_its_arguments",),
    "logging": ("test_logging",),
    "nodes": ("test_nodes_spec", "test_nodes_plan"),
    "optimizer": ("test_surface_training_names",),
    "parallelism_config": ("test_engine_configs",),
    "prefetch": ("test_big_modeling",),
    "scheduler": ("test_accelerator_parts",),
    "state": ("test_state",),
    "telemetry": ("test_telemetry",),
    "tracking": ("test_register_tracker",),
    "utils": ("test_operations", "test_utils_constants_enums", "test_utils_kwargs_plugins"),
    "widgets": ("test_widgets_launch_model", "test_widgets_device_map_model"),
}

_MODULES = frozenset(e for entries in QUICK.values() for e in entries if "::" not in e) | {"test_quick_lane"}
_FUNCTIONS = frozenset(e for entries in QUICK.values() for e in entries if "::" in e)


def is_quick(module: str, function: str, slow: bool = False) -> bool:
    """The rule above, for a test function ``function`` (parameters stripped) of ``tests/<module>.py``."""
    if f"{module}::{function}" in _FUNCTIONS:
        return True
    return module in _MODULES and not slow
