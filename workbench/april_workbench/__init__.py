"""The april_slime workbench: the SGLang-protocol emulator, the rollout benchmark, the CPU demo,
the off-policy experiments, the local real stack and the ``april-slime`` command.

It uses the plugin (``april_slime``) and nothing in the plugin imports it; it ships as a
distribution of its own (workbench/pyproject.toml).

What it uses of the plugin is declared here: the public surface (``april_slime.__all__``) and the
plugin modules below, each with why the workbench needs it. The workbench imports nothing else of
the plugin, and no private name (``tests/test_structure.py`` reads every import and fails
otherwise), so a change to anything else of the plugin cannot break it unseen.
"""

# plugin module -> why the workbench needs it
PLUGIN_MODULES = {
    # the slime face, as a slime job loads it
    "april_slime.rollout": "the demo and the slime-dump bench run the plugin's rollout function and close it",
    "april_slime.loss": "the demo trains with the plugin's custom loss and reads its settings",
    "april_slime.vcpo": "the demo calls VCPO's before-train-step hook as slime's trainer does",
    "april_slime.settings": "`april-slime settings` prints the settings table generated from the fields",
    # the rollout core: the bench drives the production scheduler, engine client and buffer
    "april_slime.core.scheduler": "the bench runs every policy through the production scheduler",
    "april_slime.core.engine": "the bench's scheduler calls engines through the production client",
    "april_slime.core.buffer": "the bench holds partial groups in the production buffer",
    "april_slime.core.config": "the bench builds the rollout settings it runs under",
    "april_slime.core.types": "workloads make the groups and trajectories the scheduler runs",
    "april_slime.core.versions": "multi-turn episodes rebuild a member's per-token versions",
    "april_slime.core.episodes": "multi-turn workloads run agent episodes through the production runner",
    "april_slime.core.dispatch": "the real-engine bench sets the dispatch (direct or through the router) it measures",
    "april_slime.core.transport": "the emulator and the bench speak HTTP through the production transport",
    "april_slime.core.sglang_protocol": "the emulator answers in the SGLang reply shape the client parses; "
                                        "the decode bench times the client's reply checks",
    "april_slime.core.replay": "the emulator encodes routed experts as the client decodes them",
    "april_slime.core.step_metrics": "the real-engine trace reads the scheduler's timeline points",
    "april_slime.core.jsonfile": "the demo writes its results with the plugin's atomic JSON write",
    "april_slime.core.columns": "workloads hand a group's one prompt column to all its trajectories",
    "april_slime.core.checkpoint": "`bench scale` saves and loads the production checkpoint at size",
    # the training wing: the demo and the experiments run its math on CPU
    "april_slime.training.offpolicy": "the experiments and the VCPO timing pack samples and weight them",
    "april_slime.training.ess": "the experiments measure ESS and scale learning rates as VCPO does",
    "april_slime.training.baseline": "the experiments and the VCPO timing run the optimal baseline",
    "april_slime.training.grad_norms": "the experiments and the VCPO timing take exact per-sample gradient norms",
    "april_slime.training.packed": "the demo's trainer takes each response's log-probs from the logits",
}
