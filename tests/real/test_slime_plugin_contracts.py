"""slime's own plugin contract tests against the plugin's entry points.

slime checks plugin paths against its contract with ``tests/plugin_contracts/`` (in
``../shared/third_party/slime-examples/slime-624b824a8-examples.tar.gz``, slime's pinned commit;
``APRIL_SLIME_EXAMPLES_TARBALL`` overrides the path). The folder is extracted at test time, unedited,
and pointed at our entry points the ways it offers.

``test_contract_files_with_our_paths``: each contract file that covers one of our plugin points is
run through its own command line (``python <file> --rollout-function-path ...``, which stores the
path in ``SLIME_CONTRACT_*`` and runs pytest on the file): the rollout-function file with
``april_slime.rollout.generate_rollout``, the path-loading file with
``april_slime.rollout.AprilDataSource``. Every case must pass but two, which call our entry point
with inputs no slime job can hand it and therefore cannot apply as written. They must fail exactly
where the plugin refuses those inputs, with its one-line ``AprilConfigError``; any other failure
(a signature mismatch, which the contract checks before the call, included) fails this test:

* ``test_rollout_function_path_contract_supports_user_override``: after the signature check it calls
  the function with ``args=None`` and the contract's own ``ContractDataSource``. The plugin's
  rollout function needs the job's arguments (engines, budgets, settings) and its own data source,
  ``--data-source-path april_slime.rollout.AprilDataSource``, which holds the partial buffer it
  resumes from; given any other it stops the job with ``data_source_path: ...``.
* ``test_path_loading_path_aligns_with_expected_format[data_source]``: after the signature check it
  builds the class from a stub with seven arguments. ``AprilDataSource`` validates the job's
  settings when slime builds it and stops the job without ``--rollout-max-response-len`` (slime's
  default is None), the budget partial rollouts are resumed against: ``rollout_max_response_len: ...``.

``test_contract_checks_on_a_real_job``: the behavioural half of those two cases with the inputs a
job hands our entry points, through the contract modules' own functions (unedited) in a process of
their own (``tests.support.contract_worker``) on the real engines: signature, one training rollout
(``assert_train_rollout_contract``), one evaluation through our rollout function, which is also the
job's eval function (``assert_eval_rollout_contract``), and ``check_data_source_path`` with the
contract's stub arguments completed by the job's.

Not run, because they check no entry point of ours: the custom-generate contracts (they check a
user's ``--custom-generate-function-path`` function as slime's ``generate_and_rm`` calls it; the plugin
runs such functions unchanged, ``tests/test_episodes*.py`` and ``tests/test_slime_agent_examples.py``),
the runtime-hook contracts (rollout / eval logging, reward
post-processing, sample conversion, rollout-data post-processing: none is ours), and the other
path-loading cases (eval function: in a job it is our rollout function, which the eval case would
call with ``args=None`` and hand to slime's own eval path, which needs engines, as the contract says
by skipping that call for slime's default; reward, dynamic / buffer filters, sample filter,
all-samples processing: none is ours). The tarball has no contract for the training-side plugin
points, so ``april_slime.loss.policy_loss`` (``--custom-loss-function-path``),
``april_slime.loss.tis`` (``--custom-tis-function-path``), ``april_slime.vcpo.before_train_step``
(``--custom-megatron-before-train-step-hook-path``) and ``april_slime.vcpo.opob_advantages`` are not
checked here (``tests/real/training`` runs them inside slime's loss path).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.support import ROOT, child_process_kwargs

TARBALL = Path(os.environ.get("APRIL_SLIME_EXAMPLES_TARBALL", ROOT.parent / "shared" / "third_party" / "slime-examples"
                              / "slime-624b824a8-examples.tar.gz"))
CONTRACT_ENV = "SLIME_CONTRACT_"  # slime's contract files read their paths from these variables

# contract file -> (its command-line flags pointing at our entry point, {case: how it must fail})
CONTRACT_FILES = {
    "test_plugin_rollout_contracts.py": (
        ["--rollout-function-path", "april_slime.rollout.generate_rollout"],
        {"test_rollout_function_path_contract_supports_user_override": r"AprilConfigError: data_source_path: "}),
    "test_plugin_path_loading_contracts.py": (
        ["--data-source-path", "april_slime.rollout.AprilDataSource"],
        {"test_path_loading_path_aligns_with_expected_format[data_source]":
         r"AprilConfigError: rollout_max_response_len: "}),
}


@pytest.fixture(scope="module")
def contracts(tmp_path_factory) -> Path:
    """slime's ``tests/plugin_contracts`` folder, extracted unedited from the examples tarball."""
    if not TARBALL.is_file():
        pytest.skip(f"slime's examples tarball is not at {TARBALL} (set APRIL_SLIME_EXAMPLES_TARBALL)")
    root = tmp_path_factory.mktemp("slime-examples")
    with tarfile.open(TARBALL) as tar:
        tar.extractall(root, members=[m for m in tar.getmembers() if "/tests/plugin_contracts/" in f"/{m.name}"],
                       filter="data")
    (folder,) = root.glob("*/tests/plugin_contracts")
    return folder


def _without_contract_paths(env: dict[str, str]) -> dict[str, str]:
    """``env`` less any ``SLIME_CONTRACT_*`` path left over from elsewhere: the children get ours only."""
    return {k: v for k, v in env.items() if not k.startswith(CONTRACT_ENV)}


def _outcomes(junit_xml: Path) -> dict[str, tuple[str, str]]:
    """Case name -> (outcome, failure text) from pytest's JUnit XML report."""
    out = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        outcome, text = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, text = child.tag, f"{child.get('message', '')}\n{child.text or ''}"
        out[case.get("name")] = (outcome, text)
    return out


@pytest.mark.parametrize("name", sorted(CONTRACT_FILES))
def test_contract_files_with_our_paths(contracts, tmp_path, name):
    flags, cannot_apply = CONTRACT_FILES[name]
    report = tmp_path / "junit.xml"
    proc = subprocess.run([sys.executable, str(contracts / name), *flags, "-q", "-pno:cacheprovider",
                           f"--junitxml={report}"], cwd=tmp_path, env=_without_contract_paths(dict(os.environ)),
                          capture_output=True, text=True, timeout=300)
    assert report.exists(), f"the contract file did not run (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    outcomes = _outcomes(report)
    assert set(cannot_apply) <= set(outcomes), f"slime's contract cases changed: {sorted(outcomes)}"
    for case, (outcome, text) in outcomes.items():
        if case in cannot_apply:
            assert outcome == "failure" and re.search(cannot_apply[case], text), (
                f"{case}: expected to stop at the plugin's {cannot_apply[case]!r}, got {outcome}:\n{text}")
        else:
            assert outcome == "passed", f"{case}: {outcome}\n{text}"
    assert len(outcomes) > len(cannot_apply)


def test_contract_checks_on_a_real_job(contracts, real_stack, tmp_path):
    cfg = {"router_url": real_stack.router_url, "engine_urls": real_stack.engine_urls,
           "model_path": str(real_stack.model_path), "job_dir": str(tmp_path / "job")}
    kwargs = child_process_kwargs()
    pythonpath = os.pathsep.join(filter(None, [str(contracts.parent), os.environ.get("PYTHONPATH")]))
    kwargs["env"] = {**_without_contract_paths(kwargs["env"]), "PYTHONPATH": pythonpath}
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.support.contract_worker", json.dumps(cfg)],
                              capture_output=True, text=True, timeout=300, **kwargs)
    finally:
        real_stack.wait_idle()
    assert proc.returncode == 0, f"a contract check failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts == {"train_groups": 2, "eval_samples": 2}, counts
