"""One process of the save-kill scenario (``tests.support.save_kill``): rollout steps on
``AprilDataSource`` and saves, SIGKILLed at a named point of one save, or a restart from that
checkpoint. Run as ``python -m tests.support.save_kill_worker CONFIG_JSON``; each line of stdout is
one JSON event."""

import json
import os
import sys
from types import SimpleNamespace

from tests.support import slime_standin


class _Patch:  # the monkeypatch slime_standin expects, in a process that never undoes it
    def setitem(self, mapping, key, value):
        mapping[key] = value

    def setattr(self, target, name, value, raising=True):
        setattr(target, name, value)


cfg = json.loads(sys.argv[1])
if slime_standin.install(_Patch(), force=cfg["slime"] == "standin") == "real":
    slime_standin.patch_real_tokenizer(_Patch())
# the plugin imports after slime (real or stand-in) is in place
from april_slime import rollout  # noqa: E402
from april_slime.core import checkpoint  # noqa: E402
from april_slime.core.jsonfile import StateFileError  # noqa: E402
from april_slime.core.replay import SegmentReplay, int32_bytes  # noqa: E402
from april_slime.core.types import TrajectoryStatus  # noqa: E402

# with "replay": a MoE job with routing and top-p replay (rows of 2 layers x top-2, two kept ids a token)
REPLAY = dict(use_rollout_routing_replay=True, num_layers=2, moe_router_topk=2, rollout_top_p=0.9)

args = SimpleNamespace(
    prompt_data=cfg["prompts"], input_key="prompt", label_key=None, rollout_global_dataset=True,
    metadata_key="metadata", tool_key=None, multimodal_keys=None, apply_chat_template=False,
    apply_chat_template_kwargs={}, rollout_max_prompt_len=None, dump_details=None, buffer_filter_path=None,
    hf_checkpoint="toy", rollout_seed=1, rollout_shuffle=cfg["shuffle"], n_samples_per_prompt=2,
    rollout_batch_size=3, over_sampling_batch_size=3, rollout_max_response_len=16, rollout_top_p=1.0,
    save=cfg["ckpt"], load=cfg["ckpt"] if cfg["restart"] else None, april_policy="april")
for key, value in (REPLAY if cfg.get("replay") else {}).items():
    setattr(args, key, value)
source = rollout.AprilDataSource(args)


def emit(kind, **values):
    print(json.dumps({"kind": kind, **values}, default=lambda b: bytes(b).hex()), flush=True)


def replay_of(t, tokens, k):
    """What an engine would send with ``tokens`` more tokens of ``t``: rows of the positions after
    the ones ``t`` holds, two kept ids per token."""
    if not cfg.get("replay"):
        return None
    start, end = t.replay_rows, len(t.input_ids()) + len(tokens) - 1
    rows = int32_bytes([(k + p + j) % 8 for p in range(start, end) for j in range(4)])
    return SegmentReplay(routed_start=start, routed=rows, routed_width=4,
                         top_p_ids=int32_bytes([x for tok in tokens for x in (tok, k)]),
                         top_p_counts=int32_bytes([2] * len(tokens)))


def step(k):
    # a rollout step: buffered groups first, then fresh prompts; three train, one goes back partial
    version = k + 1
    groups = source.buffer.take(2, version)
    groups += source.next_groups(4 - len(groups), version)
    emit("step", step=k, trained=[g.uid for g in groups[:3]], handed_out=[g.uid for g in groups])
    partial = groups[3]
    t = partial.trajectories[0]
    t.append([5 + k, 6 + k], [-0.5, -0.25], version, None, replay_of(t, [5 + k, 6 + k], k))
    t.status, t.finish_reason = TrajectoryStatus.ABORTED, "abort"
    source.buffer.put(partial)
    source.policy_version = version
    source.snapshot(k)
    emit("state", step=k, buffer=source.buffer.state_dict())


def save(k):
    if k == cfg["kill_save"] and not cfg["restart"]:
        os.environ[checkpoint.KILL_AT_ENV] = cfg["point"]
    source.save(k)
    os.environ.pop(checkpoint.KILL_AT_ENV, None)


if not cfg["restart"]:
    if cfg["loop"] == "train":
        for k in range(cfg["kill_save"] + 1):
            step(k)
            save(k)
    else:  # train_async: generate k+1 is queued on the rollout actor before save k
        step(0)
        for k in range(cfg["kill_save"] + 1):
            step(k + 1)
            save(k)
    emit("finished")
else:
    restored = cfg["kill_save"]
    try:
        source.load(restored)
    except StateFileError as e:
        emit("refused", message=str(e))
        restored -= 1
        source.load(restored)
    folder = os.path.join(cfg["ckpt"], "rollout")
    emit("restored", step=restored, buffer=source.buffer.state_dict(), files=sorted(os.listdir(folder)))
    for k in range(restored + 1, restored + 4):
        step(k)
        save(k)
    emit("end", buffered=[g.uid for g in source.buffer.groups()],
         pointer=source._prompts.sample_group_index)
