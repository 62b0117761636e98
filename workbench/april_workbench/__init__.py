"""The april_slime workbench: the SGLang-protocol emulator, the rollout benchmark, the CPU demo,
the off-policy experiments, the local real stack and the ``april-slime`` command.

It uses the plugin (``april_slime``) and nothing in the plugin imports it; it ships as a
distribution of its own (workbench/pyproject.toml).
"""
