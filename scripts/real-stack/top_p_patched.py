"""top-p replay (``--rollout-top-p`` < 1) end to end against the SGLang that slime's images run: SGLang
0.5.15.post1 with slime's ``sglang.patch`` and ``sglang-top_p.patch`` applied, served on CPU.

    python scripts/real-stack/top_p_patched.py --slime-dir SLIME_CHECKOUT [--top-p 0.9] [--out FILE]

Not a test: slime's patches are slime's code, which this repository does not carry, so the script
needs a checkout of slime at the pinned commit (its ``docker/patch/latest/``) and the SGLang
0.5.15.post1 layer ``scripts/real-stack/setup.sh`` builds. The patches are applied to a copy of that
layer's ``sglang`` package in a temporary folder, put first on the engine's ``PYTHONPATH``.

What it runs: a tiny Qwen3 on one engine behind sglang-router, the plugin inside slime's rollout
manager under copris, other weights pushed before every step (so partials resume under new
weights), three steps and more (at most ``--most-steps``) until a trained sample spans two versions.
What it checks, token by token over every trained sample, against transformers under the weights
of the token's recorded version: the kept ids slime's trainer will replay are the nucleus
(``top_p`` of the temperature-scaled distribution, as the patch computes it), and the rollout
log-prob is the patch's renormalised one (over the nucleus and the sampled token).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import yaml

from april_slime import rollout
from april_slime.core.keys import TOKEN_VERSIONS_KEY
from april_workbench.localstack import local_stack
from april_workbench.rollout_manager import SlimeRolloutManager, slime_args
from april_workbench.tiny_qwen3 import build_tiny_qwen3

REPO = Path(__file__).resolve().parents[2]
PATCHES = ("sglang.patch", "sglang-top_p.patch")  # slime's docker/Dockerfile applies them in this order
POINTER = REPO / ".venv" / "sglang-0.5.15.post1-python"


def patched_sglang(python: str, slime_dir: Path, into: Path) -> Path:
    """A copy of ``python``'s ``sglang`` package with slime's patches applied; the folder to put on
    ``PYTHONPATH``."""
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    shutil.copytree(Path(site) / "sglang", into / "sglang")
    for name in PATCHES:
        patch = slime_dir / "docker" / "patch" / "latest" / name
        if not patch.is_file():
            raise SystemExit(f"{patch} is missing: --slime-dir must be a checkout of slime (THUDM/slime@624b824a8)")
        done = subprocess.run(["patch", "-p2", "--forward", "--silent", "-d", str(into), "-i", str(patch)],
                              capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{name} does not apply to {site}/sglang: {done.stdout or done.stderr}")
    return into


def push(url: str, model: Path, version: int) -> None:
    body = json.dumps({"model_path": str(model), "weight_version": str(version)}).encode()
    request = urllib.request.Request(f"{url}/update_weights_from_disk", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        assert json.loads(reply.read())["success"]


async def zero_reward(args, sample, **kwargs) -> float:
    return 0.0


def job(router_url: str, model: Path, folder: Path, top_p: float) -> SlimeRolloutManager:
    (folder / "april.yaml").write_text(yaml.safe_dump({"april_policy": "copris", "april_concurrency": 16}))
    with open(folder / "prompts.jsonl", "w", encoding="utf-8") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"Question: what is {i} + {2 * i}? Answer:", "label": str(3 * i)}) + "\n")
    host, port = router_url.removeprefix("http://").rsplit(":", 1)
    return SlimeRolloutManager(slime_args([
        "--rollout-function-path", "april_slime.rollout.generate_rollout",
        "--data-source-path", "april_slime.rollout.AprilDataSource",
        "--custom-config-path", str(folder / "april.yaml"), "--hf-checkpoint", str(model),
        "--prompt-data", str(folder / "prompts.jsonl"), "--input-key", "prompt", "--label-key", "label",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "160",
        "--rollout-temperature", "1.0", "--rollout-top-p", str(top_p), "--num-rollout", "1000",
        "--custom-rm-path", f"{__name__}.zero_reward", "--sglang-router-ip", host, "--sglang-router-port", port,
        "--save", str(folder / "ckpt"), "--rollout-num-gpus", "1", "--rollout-num-gpus-per-engine", "1"]))


def check_sample(sample, model_of_version, top_p: float) -> tuple[int, float]:
    """(tokens whose kept ids are not transformers' nucleus, largest |rollout log-prob - renormalised
    log-prob|) of one sample, each token under the weights of its recorded version."""
    import torch

    tokens, n = list(sample.tokens), sample.response_length
    start = len(tokens) - n
    versions = [int(v) for v, c in sample.train_metadata[TOKEN_VERSIONS_KEY] for _ in range(c)]
    probs = {}
    with torch.no_grad():
        for v in set(versions):
            logits = model_of_version(v)(input_ids=torch.tensor([tokens[:-1]])).logits[0, start - 1:]
            probs[v] = torch.softmax(logits.float(), dim=-1)
    offsets = sample.rollout_top_p_token_offsets.tolist()
    ids = sample.rollout_top_p_token_ids.tolist()
    differ, worst = 0, 0.0
    for j in range(n):
        p = probs[versions[j]][j]
        order = p.argsort(descending=True)
        sorted_p = p[order]
        keep = set(order[(sorted_p.cumsum(0) - sorted_p) <= top_p].tolist())
        differ += set(ids[offsets[j]:offsets[j + 1]]) != keep
        kept = sorted(keep | {tokens[start + j]})
        renorm = float(torch.log(p[tokens[start + j]] / p[kept].sum()))
        worst = max(worst, abs(renorm - sample.rollout_log_probs[j]))
    return differ, worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slime-dir", type=Path, required=True, help="a checkout of slime at the pinned commit")
    parser.add_argument("--python", default=None, help="the SGLang 0.5.15.post1 interpreter (default: the one "
                                                       "setup.sh names in .venv/sglang-0.5.15.post1-python)")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--most-steps", type=int, default=10,
                        help="steps at most while no trained sample spans two versions (at least 3)")
    parser.add_argument("--out", type=Path, default=None)
    ns = parser.parse_args()
    python = ns.python or (POINTER.read_text().strip() if POINTER.exists() else None)
    if not python:
        print(f"no SGLang 0.5.15.post1 interpreter ({POINTER} is missing): run scripts/real-stack/setup.sh",
              file=sys.stderr)
        return 2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        site = patched_sglang(python, ns.slime_dir, root / "sglang-patched")
        a = build_tiny_qwen3(root / "a", eos_rate=1 / 24, seed=0)
        b = build_tiny_qwen3(root / "b", tokenizer=AutoTokenizer.from_pretrained(a), eos_rate=1 / 24, seed=1)
        hf = {m: AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32).eval() for m in (a, b)}
        weights = {v: (a, b)[v % 2] for v in range(ns.most_steps)}  # version v's weights, pushed before step v
        result = {"top_p": ns.top_p, "samples": 0, "tokens": 0, "set_differs": 0, "max_logprob_diff": 0.0,
                  "samples_spanning_versions": 0, "steps": 0}
        with local_stack(a, n_engines=1, python=python, env={"PYTHONPATH": str(site)},
                         log_dir=root / "logs") as stack:
            (root / "job").mkdir()
            m = job(stack.router_url, a, root / "job", ns.top_p)
            try:
                for step, version in enumerate(weights):
                    if step >= 3 and result["samples_spanning_versions"]:
                        break  # at least three steps, and one trained sample resumed under other weights
                    if version:
                        push(stack.engine_urls[0], weights[version], version)
                    result["steps"] += 1
                    samples, _, train = m.generate(step)
                    assert len(train["rollout_top_p_token_ids"]) == len(samples)  # slime's conversion took them
                    for s in samples:
                        versions = {int(v) for v, _ in s.train_metadata[TOKEN_VERSIONS_KEY]}
                        differ, worst = check_sample(s, lambda v: hf[weights[v]], ns.top_p)
                        result["samples"] += 1
                        result["tokens"] += s.response_length
                        result["samples_spanning_versions"] += len(versions) > 1
                        result["set_differs"] += differ
                        result["max_logprob_diff"] = max(result["max_logprob_diff"], worst)
            finally:
                rollout.shutdown()
    print(json.dumps(result, indent=1))
    if ns.out:
        ns.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
