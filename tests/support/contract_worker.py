"""slime's plugin-contract checks on the plugin's rollout entry points, with the inputs a slime job
hands them: the job's arguments (slime's parser), the job's data source, the real tier's engines.

Run by ``tests/real/test_slime_plugin_contracts.py`` as ``python -m tests.support.contract_worker
CONFIG_JSON`` from the repository root, with the extracted ``tests/`` folder of slime's examples
tarball on ``PYTHONPATH`` (so ``plugin_contracts`` imports). A process of its own: importing a
contract module installs stand-ins for ``ray`` / ``sglang_router`` / ``transformers`` where they are
not imported yet and puts the tarball's folders first on ``sys.path``. The real modules are imported
first here, so the stand-ins only replace what is not installed, as the contract intends.

The checks are the contract modules' own functions, unedited; what each case is given instead of
the contract's stub inputs is said where it is called. Prints one JSON line of counts on success;
a broken contract raises (exit status 1, the assertion in stderr).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import sys
from pathlib import Path

for _name in ("transformers", "sglang_router", "ray"):
    if importlib.util.find_spec(_name) is not None:
        importlib.import_module(_name)

from april_slime import rollout  # noqa: E402
from tests.support import real_tier  # noqa: E402


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rollout_contracts = importlib.import_module("plugin_contracts.test_plugin_rollout_contracts")
    path_contracts = importlib.import_module("plugin_contracts.test_plugin_path_loading_contracts")
    from slime.rollout.base_types import call_rollout_fn

    job = Path(cfg["job_dir"])
    job.mkdir(parents=True, exist_ok=True)
    stack = real_tier.RealStack(real_tier.LocalStack(cfg["router_url"], cfg["engine_urls"], [], None),
                                Path(cfg["model_path"]), Path(cfg["model_path"]))
    eval_data = real_tier.write_prompts(job / "eval.jsonl", 2, seed=7)
    args = real_tier.plugin_args(stack, job, settings={"april_policy": "april"}, batch=2, n=2, max_len=16,
                                 extra_argv=["--eval-prompt-data", "arith", str(eval_data),
                                             "--n-samples-per-eval-prompt", "1", "--eval-max-response-len", "8"])
    # slime's RolloutManager set-up (HTTP client, --data-source-path, --rollout-function-path and
    # --eval-function-path loaded by path), as a job's rollout process makes it
    manager = real_tier.SlimeRolloutManager(args)
    rollout_fn, eval_fn = manager.manager.generate_rollout, manager.manager.eval_generate_rollout
    try:
        # test_plugin_rollout_contracts.assert_rollout_function_matches_default_contract, step by
        # step: the same signature check and output checks; the function is called as slime's
        # RolloutManager calls it, with the job's args and data source where the contract passes
        # args=None and its ContractDataSource (see the test module's docstring)
        rollout_contracts.assert_rollout_function_signature_matches_default(rollout_fn)
        train = call_rollout_fn(rollout_fn, args, 0, manager.data_source, evaluation=False)
        rollout_contracts.assert_train_rollout_contract(train, n_samples_per_prompt=args.n_samples_per_prompt)
        # slime's default --eval-function-path is the rollout function: ours, for evaluation too
        assert eval_fn is rollout_fn, (args.eval_function_path, args.rollout_function_path)
        evaluation = call_rollout_fn(eval_fn, args, 0, manager.data_source, evaluation=True)
        rollout_contracts.assert_eval_rollout_contract(evaluation)

        # test_plugin_path_loading_contracts.check_data_source_path, unedited, given the contract's
        # stub arguments completed with the job's arguments the stub lacks (the stub's own values win)
        stub = path_contracts.make_args
        missing = {k: v for k, v in vars(args).items() if not hasattr(stub(), k)}
        path_contracts.make_args = functools.partial(stub, **missing)
        path_contracts.check_data_source_path(args.data_source_path)
    finally:
        rollout.shutdown()
    print(json.dumps({"train_groups": len(train.samples),
                      "eval_samples": sum(len(d["samples"]) for d in evaluation.data.values())}), flush=True)


if __name__ == "__main__":
    main()
