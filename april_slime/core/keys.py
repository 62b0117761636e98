"""The names the plugin writes into slime's world, in one place.

slime carries them without knowing them: the YAML keys become ``args`` attributes, the sample keys
travel in ``Sample.train_metadata`` / ``Sample.metadata`` from the rollout to the loss, and the
metric names reach slime's logger. The rollout face writes the sample keys, the loss face reads
them, the core and both faces name their metrics with the prefix.
"""

SETTING_PREFIX = "april_"  # every plugin setting: `april_policy`, `april_concurrency`, ...
METRIC_PREFIX = "april/"  # every logged metric of the rollout and the loss

# Sample.train_metadata / Sample.metadata
TOKEN_VERSIONS_KEY = "april_token_versions_rle"  # [[policy version, token count], ...] of the response
POLICY_VERSION_KEY = "april_policy_version"  # the policy version of the step the sample trained in
# index_in_group of the members masked out of the sample's prompt group (april_mask_failed_samples),
# on every sample of such a group: VCPO's group baseline leaves them out of the group's std
MASKED_MEMBERS_KEY = "april_masked_members"
OPOB_GROUP_KEY = "april_opob_group"  # written on the trainer: the sample's prompt group for VCPO's baseline
