"""``accelerate.commands``: the configuration-file side of Accelerate's command line, as libraries import it.

``commands.config`` reads and writes the ``default_config.yaml`` that ``accelerate config`` creates
(transformers' ``env`` command reads it through ``load_config_from_file``).
"""

__all__: list[str] = []
