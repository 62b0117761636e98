"""``april-slime bench real``: the rollout policies on real SGLang engines, side by side with the
emulator's prediction for the same comparison (``cli.py`` has the command and the method).

* ``workload``: what a comparison runs: every sample's length fixed up front (a law, or a job's
  lengths), single turn or agent episodes;
* ``stacks``: the engines: the local CPU stack, a user's (``--url``), or the emulated twin;
* ``rounds``: the arms (a policy at a bound, with its settings), taking turns round by round;
* ``trace``: every call of a step as the client saw it, and where the step's time went;
* ``stats``: warm-up, speed-ups and their bands;
* ``tools``: the multi-turn workload's tool worker processes;
* ``slime_dump``: a slime rollout dump of the engines, for a job's own lengths;
* ``report``: the tables the documents render from the JSON (``april-slime bench report``).
"""
