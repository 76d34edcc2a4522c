"""Planning where a model's weights go, bottom up: how a device is spelled (``devices``), byte accounting
(``sizes``), shared weights (``tied_params``), moving one tensor (``tensors``), the model snapshot the planner
walks (``_module_tree``), the budgets (``device_memory``), the planner and its fallbacks (``planner``,
``allocation``), the strategies (``device_map``) and checking a map against its model (``placement``).

Accelerate serves these names from ``utils.modeling``; so does ``notebook_accel.utils.modeling``.
"""
