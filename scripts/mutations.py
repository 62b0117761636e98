#!/usr/bin/env python3
"""Mutation check: each change listed in MUTATIONS must make at least one test fail.

Each mutation is one or more exact text replacements (file, old text, new text). For each, the
script applies the replacements, runs that mutation's tests (the smallest set expected to catch
it, or the whole suite with --all), restores the files, and records which tests failed. A test
that failed is then run again on the unmutated code: only tests that pass there count as
catching the mutation (a test that fails anyway proves nothing). The result is a table,
mutation -> the tests that caught it, or NOT CAUGHT.

Usage (from the repository, after ``bash scripts/real-stack/setup.sh``)::

    python scripts/mutations.py                      # every mutation, each against its own tests
    python scripts/mutations.py --list               # the mutations and their tests
    python scripts/mutations.py --only codec-reverses-log-probs   # one (or: name it, no flag)
    python scripts/mutations.py codec-reverses-log-probs 'slime-patch-*'   # some (names or globs)
    python scripts/mutations.py --all                # each against the whole suite (~8 min each)
    python scripts/mutations.py --fast               # leave out tests/real (mutations only it catches: not run)
    python scripts/mutations.py NAME --test tests/test_x.py   # NAME against other tests than its own
    python scripts/mutations.py --in-place           # mutate the checkout itself (see below)
    python scripts/mutations.py --pytest-args '-x'   # extra pytest arguments for every run

Where the mutations are applied. By default into a temporary copy of the working tree (tracked
files and untracked ones git does not ignore), run with that copy first on PYTHONPATH: the
checkout is never modified, so tests running from it at the same time (other tiers, an editor)
see the real code throughout. ``--in-place`` edits the checkout's files instead, restoring each
one in a ``finally`` (also on Ctrl-C or SIGTERM); a file changed by someone else while mutated is
left alone and reported. Either way the run ends with a check that every file it touched is
byte-for-byte what it was, and that ``git diff`` of those files is unchanged.

slime's patches (patches/slime-*.patch). ``scripts/real-stack/setup.sh`` installs slime with the
patches applied into .venv, which other test runs share. A mutation of a patch file therefore
never reinstalls anything: the script unpacks the pinned slime source (``$SLIME_DIR``, or
``../shared/third_party/slime-*.tar.gz`` beside the repository or its parent folder, as setup.sh
finds it) into a temporary folder, applies the mutated patches there and puts that folder first
on PYTHONPATH, so ``import slime`` in the tests (and in the processes they start) gets the
mutated copy while .venv stays as it is. The reruns on unmutated code for those mutations use a
copy built the same way from the original patches. Nothing needs restoring afterwards.

Exit status: 0 every mutation caught; 1 some mutation not caught (or its tests timed out, or
were all skipped, e.g. a real tier without its stack); 2 the script could not run (an old text
not found exactly once, a test path that does not exist, no slime source for a patch mutation);
3 a file could not be restored (the message names it).

Not run in CI (too slow). Measured on a shared, loaded 2-core machine, copy and reruns on
unmutated code included: codec-reverses-log-probs 25 s; save-writes-live-state 35 s (its tests
include the real tier's checkpoint tests, which need slime but no engine); with --fast,
scheduler-drops-version-spans 10 s and copris-anchor-recomputed 5 s; copris-anchor-recomputed
with tests/real/training/test_slime_loss_modes.py 65 s; each slime-patch-hunk mutation 50-90 s
(tests/real/training once mutated, a few seconds to unpack and patch slime twice, and the rerun
of the failures). Without --fast, scheduler-drops-version-spans also runs the real tier's
rollout tests (SGLang engines on CPU), which take minutes. --all runs the whole suite (about 8
minutes) per mutation.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Edit:
    path: str  # relative to the repository
    old: str  # must occur exactly once
    new: str


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]  # pytest node ids or paths, relative to the repository

    @property
    def patches_slime(self) -> bool:
        return any(e.path.startswith("patches/slime-") for e in self.edits)


# ---------------------------------------------------------------------------- the mutations
_SLIME_PATCH = "patches/slime-forward-train-metadata.patch"


def _patch_file_sections(text: str) -> list[str]:
    """The per-file sections of a unified diff (each of these patches' files has one hunk)."""
    starts = [m.start() for m in re.finditer(r"^diff --git ", text, flags=re.M)]
    return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]


def _slime_patch_mutations() -> list[Mutation]:
    """One mutation per hunk of each slime patch (patches/slime-*.patch): that hunk (its whole file
    section, so the rest still applies) left out. Built from the patches as they are, so a hunk or a
    patch added is covered too; the names say which patch and which slime file the hunk patches
    (the train_metadata patch keeps its short names)."""
    out = []
    for path in sorted((REPO / "patches").glob("slime-*.patch")):
        rel = str(path.relative_to(REPO))
        sections = _patch_file_sections(path.read_text())
        prefix = "slime-patch" if rel == _SLIME_PATCH else path.stem
        for i, section in enumerate(sections, start=1):
            hunks = section.count("\n@@ ")
            if hunks != 1:
                raise SystemExit(f"mutations: {rel}: section {i} has {hunks} hunks; the hunk mutations "
                                 "assume one per file: split them in scripts/mutations.py")
            target = re.match(r"diff --git a/(\S+)", section).group(1)
            short = Path(target).parent.name + "-" + Path(target).stem
            out.append(Mutation(
                name=f"{prefix}-hunk-{i}-{short}",
                what=f"{rel} without its hunk for {target}",
                edits=(Edit(rel, section, ""),),
                tests=("tests/real/training",),
            ))
    return out


MUTATIONS: list[Mutation] = [
    Mutation(
        name="scheduler-drops-version-spans",
        what="the scheduler appends a reply without its per-token version runs (every token gets the "
             "version reported at the end of the call)",
        edits=(Edit(
            "april_slime/core/work.py",
            "result.logprobs, int(result.weight_version), result.version_runs, result.replay)",
            "result.logprobs, int(result.weight_version), None, result.replay)",
        ),),
        tests=(
            "tests/test_scheduler.py::test_weights_changed_mid_call_give_exact_per_token_versions",
            "tests/test_sample_codec.py::test_weights_pushed_mid_call_give_each_token_the_version_that_generated_it",
            "tests/real/test_rollout_weights.py",
            "tests/real/test_rollout_policies.py",
        ),
    ),
    Mutation(
        name="save-writes-live-state",
        what="AprilDataSource.save(N) writes the live state instead of rollout N's snapshot",
        edits=(Edit(
            "april_slime/core/checkpoint.py",
            "snapshot = self._snapshots.get(rollout_id)",
            "snapshot = None",
        ),),
        tests=(
            "tests/test_rollout_slime.py::test_snapshot_is_what_save_writes",
            "tests/test_rollout_slime.py::test_a_snapshot_does_not_follow_later_changes_to_the_buffer",
            "tests/test_rollout_slime.py::test_a_restart_from_n_loses_and_repeats_nothing",
            "tests/test_save_kill.py",
            "tests/real/test_checkpoint_real.py",
        ),
    ),
    Mutation(
        name="codec-reverses-log-probs",
        what="the Sample codec gives each slime sample its rollout log-probs in reverse order",
        edits=(Edit(
            "april_slime/samples.py",
            "s.rollout_log_probs = t.logprobs.tolist()",
            "s.rollout_log_probs = t.logprobs.tolist()[::-1]",
        ),),
        tests=("tests/test_sample_codec.py", "tests/test_rollout_slime.py"),
    ),
    Mutation(
        name="copris-anchor-recomputed",
        what="copris anchors the ratio on the recomputed (old) log-probs instead of the rollout ones",
        edits=(Edit(
            "april_slime/training/offpolicy.py",
            'anchor = rollout if mode == "copris" else old_log_probs',
            "anchor = old_log_probs",
        ),),
        tests=("tests/test_offpolicy.py", "tests/test_loss.py", "tests/real/training/test_slime_loss_modes.py"),
    ),
    Mutation(
        name="opob-group-without-std",
        what="a completed prompt group subtracts b_g P_g instead of (b_g / s_g) P_g (std normalisation lost "
             "on the baseline term)",
        edits=(Edit(
            "april_slime/training/baseline.py",
            "torch._foreach_add_(weighted, grads, alpha=-b / group.scale)",
            "torch._foreach_add_(weighted, grads, alpha=-b)",
        ),),
        tests=("tests/test_vcpo_opob.py",),
    ),
    Mutation(
        name="opob-single-sample-norm-misses-sp-shards",
        what="a one-sample micro-batch's norm counts sequence-parallel replicated parameters on TP rank 0 only, "
             "without summing their partial gradients over the TP group",
        edits=(Edit(
            "april_slime/training/grad_norms.py",
            'if self.tp_size > 1 and getattr(p, "sequence_parallel", False):',
            "if False:",
        ),),
        tests=("tests/real/training/test_vcpo_megatron_tp.py",),
    ),
    Mutation(
        name="opob-advantages-normalised-rewards",
        what="the baseline takes slime's group-normalised rewards instead of the raw ones",
        edits=(Edit(
            "april_slime/vcpo.py",
            "rewards = [raw_all[i] for i in partition]",
            'rewards = rollout_data["rewards"]',
        ),),
        tests=("tests/test_vcpo.py", "tests/real/training/test_slime_train_step.py"),
    ),
    Mutation(
        name="proximal-reuse-with-several-steps",
        what="the custom loss tells slime to skip its log-prob recompute whatever the number of optimizer steps "
             "per rollout",
        edits=(Edit(
            "april_slime/loss.py",
            'if len(num_microbatches) != 1 and job.loss.prox_log_probs != "loglinear":',
            "if False:",
        ),),
        tests=("tests/real/training/test_slime_train_step.py",),
    ),
    Mutation(
        name="loglinear-first-step-keeps-fresh-tokens-on-the-rollout",
        what="loglinear's first step takes the rollout log-probs for tokens of the current version instead of "
             "the trained policy's",
        edits=(Edit(
            "april_slime/training/proximal.py",
            "        return torch.ones_like(lag)",
            "        return (lag > 0).to(torch.float64)",
        ),),
        tests=("tests/real/training/test_slime_train_step.py",),
    ),
    Mutation(
        name="router-abort-not-fanned-out",
        what="through the router, an abort goes to the router (which has no /abort_request) instead of "
             "to every engine",
        edits=(Edit(
            "april_slime/core/dispatch.py",
            "return list(self.engines) if self.is_router(target) else [normalise_url(target)]",
            "return [normalise_url(target)]",
        ),),
        tests=("tests/test_dispatch.py", "tests/real/test_router_dispatch.py"),
    ),
    Mutation(
        name="auto-dispatch-ignores-pd",
        what="auto dispatch sends generates straight to PD-disaggregated workers",
        edits=(Edit("april_slime/core/dispatch.py", "    if needs_router:\n", "    if False:\n"),),
        tests=("tests/test_dispatch.py",),
    ),
    Mutation(
        name="slime-0.4-data-source-not-found",
        what="slime 0.4.0's moved data source module is not looked for",
        edits=(Edit(
            "april_slime/slime_compat.py",
            'DATA_SOURCE_MODULES = ("slime.rollout.data_source", "slime.data.data_source")',
            'DATA_SOURCE_MODULES = ("slime.rollout.data_source",)',
        ),),
        tests=("tests/test_slime_compat.py",),
    ),
    Mutation(
        name="episode-tokens-take-first-version",
        what="an episode's returned sample gives every model token the version of its first served token",
        edits=(Edit(
            "april_slime/core/served.py",
            "            last = next(by_token)\n",
            "            last = trainable_versions[0]\n",
        ),),
        tests=("tests/test_episodes.py", "tests/test_generate_functions.py", "tests/real/test_episodes_real.py",
               "tests/real/test_agent_examples_real.py"),
    ),
    Mutation(
        name="reply-text-past-the-stop",
        what="a generate function's reply keeps the text that a stop string's last token carries past it",
        edits=(Edit(
            "april_slime/core/front.py",
            "        return (text[:at + len(stop)] if keep else text[:at]), stop\n",
            "        return text, stop\n",
        ),),
        tests=("tests/test_generate_functions.py", "tests/real/test_reply_text_real.py"),
    ),
    Mutation(
        name="protected-group-not-due",
        what="a protected group gets no slack 0: it is resumed first but cut again at the target",
        edits=(Edit(
            "april_slime/core/pacing.py",
            "        if group.uid in self.protected:\n            return 0\n",
            "",
        ),),
        tests=("tests/test_pacing.py",
               "tests/test_scheduler.py::test_protection_lets_a_long_response_finish_instead_of_starving"),
    ),
    *_slime_patch_mutations(),
]


# ---------------------------------------------------------------------------- errors
class Abort(Exception):
    """The script cannot run as asked (exit status 2)."""


class RestoreError(Exception):
    """A mutated file could not be put back (exit status 3)."""


def _on_sigterm(signum, frame):
    # turns SIGTERM into an exception, so every finally (file restore, temp cleanup) runs
    raise KeyboardInterrupt(f"signal {signum}")


# ---------------------------------------------------------------------------- the tree
def tree_files(repo: Path) -> list[str]:
    """What a test run sees of the working tree: tracked files and untracked ones not ignored."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         check=True, capture_output=True).stdout
    return sorted({p for p in out.decode().split("\0") if p})


def copy_tree(repo: Path, dest: Path) -> None:
    for rel in tree_files(repo):
        src = repo / rel
        if not src.exists() and not src.is_symlink():  # deleted in the working tree, still tracked
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            target.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, target)


def git_diff(repo: Path, paths: list[str]) -> str:
    return subprocess.run(["git", "-C", str(repo), "diff", "--", *paths], check=True, capture_output=True,
                          text=True).stdout


def check_edits(root: Path, mutations: list[Mutation]) -> None:
    """Every old text occurs exactly once, before anything runs: a mutation whose code moved
    stops the script instead of silently testing nothing."""
    problems = []
    for m in mutations:
        for e in m.edits:
            path = root / e.path
            if not path.is_file():
                problems.append(f"{m.name}: {e.path} does not exist")
                continue
            count = path.read_text().count(e.old)
            if count != 1:
                first = e.old.strip().splitlines()[0] if e.old.strip() else repr(e.old)
                problems.append(f"{m.name}: {e.path}: the old text occurs {count} times, expected once: {first!r}")
            if e.old == e.new:
                problems.append(f"{m.name}: {e.path}: the new text is the old text")
        for t in m.tests:
            if not (root / t.split("::", 1)[0]).exists():
                problems.append(f"{m.name}: test path {t.split('::', 1)[0]} does not exist")
    if problems:
        raise Abort("the mutation list no longer matches the code; update scripts/mutations.py:\n  "
                    + "\n  ".join(problems))


class Mutated:
    """Applies a mutation's edits under ``root`` for the duration of a ``with`` block and puts
    every file back afterwards, whatever happened inside."""

    def __init__(self, root: Path, mutation: Mutation):
        self.root, self.mutation = root, mutation
        self.originals: dict[Path, bytes] = {}
        self.written: dict[Path, bytes] = {}

    def __enter__(self) -> Mutated:
        try:
            for e in self.mutation.edits:
                path = self.root / e.path
                if path not in self.originals:
                    self.originals[path] = path.read_bytes()
                text = path.read_text()
                if text.count(e.old) != 1:
                    raise Abort(f"{self.mutation.name}: {e.path}: the old text no longer occurs exactly once")
                data = text.replace(e.old, e.new).encode()
                path.write_bytes(data)
                self.written[path] = data
        except BaseException:
            self.restore()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        clobbered = []
        for path, original in self.originals.items():
            current = path.read_bytes()
            if current == original:
                continue
            if path in self.written and current != self.written[path]:
                # changed by someone else while mutated: their edit wins, and we say so
                clobbered.append(path)
                continue
            path.write_bytes(original)
        if clobbered:
            raise RestoreError("changed by another process while mutated, left as they are now; check them "
                               "for the mutation: " + ", ".join(map(str, clobbered)))


# ---------------------------------------------------------------------------- slime with mutated patches
def slime_source(repo: Path) -> Path:
    """The unpatched slime source, found as scripts/real-stack/setup.sh finds it."""
    env = os.environ.get("SLIME_DIR")
    if env:
        path = Path(env)
        if not (path / "slime").is_dir():
            raise Abort(f"SLIME_DIR={env} holds no slime/ package")
        return path
    for folder in (repo.parent / "shared" / "third_party", repo.parent.parent / "shared" / "third_party"):
        tarballs = sorted(folder.glob("slime-*.tar.gz"))
        if tarballs:
            return tarballs[0]
    raise Abort("the slime-patch mutations need slime's source: set SLIME_DIR to a checkout of "
                "THUDM/slime@624b824a8, or put its tarball in ../shared/third_party/")


def build_slime(source: Path, patches_root: Path, dest: Path) -> Path:
    """slime from ``source`` with ``patches_root``/patches/slime-*.patch applied, in ``dest``;
    returns the folder to put on PYTHONPATH."""
    if source.is_dir():
        shutil.copytree(source, dest / source.name, symlinks=True)
        top = dest / source.name
    else:
        with tarfile.open(source) as tar:
            # the "data" filter (no absolute paths, links out of dest...) where this Python has it
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(dest, **kw)
        dirs = [p for p in dest.iterdir() if p.is_dir()]
        if len(dirs) != 1:
            raise Abort(f"{source}: expected one top-level folder, found {[p.name for p in dirs]}")
        top = dirs[0]
    for patch in sorted((patches_root / "patches").glob("slime-*.patch")):
        with open(patch, "rb") as f:
            proc = subprocess.run(["patch", "-p1", "--forward", "--silent"], cwd=top, stdin=f,
                                  capture_output=True, text=True)
        if proc.returncode:
            raise Abort(f"{patch.name} (mutated) does not apply to {source}:\n{proc.stdout}{proc.stderr}")
    return top


# ---------------------------------------------------------------------------- running pytest
@dataclass
class Run:
    rc: int
    failed: list[str]
    summary: str
    seconds: float
    timed_out: bool = False


_FAILED = re.compile(r"^(FAILED|ERROR) (\S+?)(?: - .*)?$")
_SUMMARY = re.compile(r"^=+ (.*\b(?:passed|failed|skipped|error|errors|deselected|no tests ran)\b.*) =+$")


def run_pytest(python: str, root: Path, tests: list[str], pythonpath: list[Path], extra: list[str],
               timeout: float, log) -> Run:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PYTEST_ADDOPTS", None)  # the same options as CI, plus ours
    cmd = [python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *extra, *tests]
    log(f"  $ (cd {root} && PYTHONPATH={env['PYTHONPATH']} {shlex.join(cmd)})")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out, timed_out = "", False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        if proc.poll() is None:
            # the whole session: pytest and whatever it started (engines, workers)
            os.killpg(proc.pid, signal.SIGKILL)
            more, _ = proc.communicate()
            out += more or ""
    seconds = time.monotonic() - start
    failed, summary = [], ""
    for line in out.splitlines():
        m = _FAILED.match(line.strip())
        if m and m.group(2) not in failed:
            failed.append(m.group(2))
        s = _SUMMARY.match(line.strip())
        if s:
            summary = s.group(1)
    if not summary:
        summary = out.strip().splitlines()[-1] if out.strip() else "(no output)"
    return Run(proc.returncode, failed, summary, seconds, timed_out)


# ---------------------------------------------------------------------------- one mutation
@dataclass
class Result:
    mutation: Mutation
    caught_by: list[str] = field(default_factory=list)
    fail_anyway: list[str] = field(default_factory=list)
    note: str = ""
    seconds: float = 0.0
    skipped: bool = False  # nothing to run under the options given (--fast on a real-tier-only mutation)

    @property
    def caught(self) -> bool:
        return bool(self.caught_by)


def check_mutation(m: Mutation, root: Path, args, workdir: Path, log) -> Result:
    tests = ["tests"] if args.all else list(args.tests or m.tests)
    if args.fast:
        tests = ["tests", "--ignore=tests/real"] if args.all else [t for t in tests if not t.startswith("tests/real")]
    if not tests:
        return Result(m, note="only real-tier tests catch it; run without --fast", skipped=True)
    extra = shlex.split(args.pytest_args)
    result = Result(m)
    start = time.monotonic()
    # the copy's plugin and workbench first, so the tests import neither from the checkout
    pythonpath = [root, root / "workbench"] if root != REPO else []
    original_slime = None
    with Mutated(root, m):
        if m.patches_slime:
            folder = Path(tempfile.mkdtemp(prefix=f"{m.name}-", dir=workdir))
            slime_dir = build_slime(args.slime_source, root, folder)
            check_import(args.python, "slime", slime_dir / "slime", [slime_dir, *pythonpath], root)
            run = run_pytest(args.python, root, tests, [slime_dir, *pythonpath], extra, args.timeout, log)
        else:
            run = run_pytest(args.python, root, tests, pythonpath, extra, args.timeout, log)
    log(f"  mutated: rc {run.rc}, {run.summary} ({run.seconds:.0f} s)")
    if run.timed_out:
        result.note = f"timed out after {args.timeout:.0f} s"
    elif run.rc not in (0, 1, 2, 5) or (run.rc == 2 and not run.failed):
        result.note = f"pytest exited {run.rc}: {run.summary}"
    elif run.failed and args.confirm:
        # the same tests on the unmutated code: only those that pass there caught the mutation
        if m.patches_slime:
            folder = Path(tempfile.mkdtemp(prefix=f"{m.name}-original-", dir=workdir))
            original_slime = build_slime(args.slime_source, root, folder)
        path = [original_slime, *pythonpath] if original_slime else pythonpath
        again = run_pytest(args.python, root, run.failed, path, extra, args.timeout, log)
        log(f"  unmutated: rc {again.rc}, {again.summary} ({again.seconds:.0f} s)")
        if again.timed_out or again.rc not in (0, 1):
            result.note = f"the rerun on unmutated code did not finish cleanly: {again.summary}"
        result.fail_anyway = [t for t in run.failed if _fails(t, again.failed)]
        result.caught_by = [t for t in run.failed if t not in result.fail_anyway]
        if result.fail_anyway:
            result.note = (result.note + "; " if result.note else "") + "fail on unmutated code too: " + \
                ", ".join(result.fail_anyway)
    else:
        result.caught_by = list(run.failed)
    if not result.caught and not result.note:
        result.note = run.summary
    result.seconds = time.monotonic() - start
    return result


def _fails(test: str, failed: list[str]) -> bool:
    # a failing file or parametrized test reported as a whole counts for everything under it
    return any(test == f or test.startswith(f + "::") or test.startswith(f + "[") for f in failed)


def check_import(python: str, module: str, expected: Path, pythonpath: list[Path], cwd: Path) -> None:
    """The tests will import ``module`` from ``expected``, or the run would test the wrong code
    (e.g. --in-place in a checkout whose .venv has the project installed from another one)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([python, "-c", f"import {module}, os; print(os.path.dirname({module}.__file__))"],
                          env=env, capture_output=True, text=True, cwd=cwd)
    got = proc.stdout.strip()
    if proc.returncode or Path(got).resolve() != expected.resolve():
        raise Abort(f"with PYTHONPATH={env['PYTHONPATH']}, {python} imports {module} from "
                    f"{got or proc.stderr.strip()}, not from {expected}")


# ---------------------------------------------------------------------------- main
def select(names: list[str]) -> list[Mutation]:
    if not names:
        return list(MUTATIONS)
    chosen = [m for m in MUTATIONS if any(fnmatch.fnmatchcase(m.name, n) for n in names)]
    unknown = [n for n in names if not any(fnmatch.fnmatchcase(m.name, n) for m in MUTATIONS)]
    if unknown:
        raise Abort(f"no mutation named {', '.join(unknown)}; known: {', '.join(m.name for m in MUTATIONS)}")
    return chosen


def collapse(tests: list[str]) -> list[str]:
    """Test ids with the parametrizations of one test folded into one entry, ``name[N cases]``,
    so that a table row stays readable and still names every test that caught the mutation."""
    cases: dict[str, list[str]] = {}
    for t in tests:
        cases.setdefault(t.split("[", 1)[0] if "::" in t else t, []).append(t)
    return [f"{base}[{len(ids)} cases]" if len(ids) > 1 else ids[0] for base, ids in cases.items()]


def table(results: list[Result]) -> str:
    """One row per mutation; a mutation caught by several tests continues on the lines below."""
    width = max(len(r.mutation.name) for r in results)
    lines = [f"{'mutation'.ljust(width)}  {'time':>6}  caught by", f"{'-' * width}  {'-' * 6}  {'-' * 9}"]
    for r in results:
        if r.skipped:
            caught = [f"not run ({r.note})"]
        else:
            caught = collapse(r.caught_by) if r.caught else ["NOT CAUGHT" + (f" ({r.note})" if r.note else "")]
        lines.append(f"{r.mutation.name.ljust(width)}  {r.seconds:5.0f}s  {caught[0]}")
        lines.extend(f"{'':{width}}  {'':6}  {c}" for c in caught[1:])
    return "\n".join(lines)


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description="Check that each listed code change makes a test fail.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("names", nargs="*", help="mutations to run, by name or glob (default: all)")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="run this mutation (name or glob; repeatable); the same as naming it")
    p.add_argument("--list", action="store_true", help="list the mutations and their tests, run nothing")
    p.add_argument("--all", action="store_true", help="run the whole suite (tests/) for each mutation")
    p.add_argument("--test", dest="tests", action="append", metavar="TEST",
                   help="run this test (node id or path; repeatable) for each chosen mutation instead of "
                        "its own list, to find out what else catches it")
    p.add_argument("--fast", action="store_true",
                   help="only the fast tier: leave out the tests under tests/real (seconds, not minutes)")
    p.add_argument("--in-place", action="store_true", help="mutate the checkout instead of a temporary copy")
    p.add_argument("--no-confirm", dest="confirm", action="store_false",
                   help="do not rerun failing tests on unmutated code (faster; a test that fails anyway "
                        "then counts as catching)")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments for every run (one string)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per pytest run (default 3600)")
    default_python = REPO / ".venv" / "bin" / "python"
    p.add_argument("--python", default=str(default_python) if default_python.exists() else sys.executable,
                   help="interpreter that runs pytest (default: the repository's .venv)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        mutations = select([*args.names, *args.only])
        if args.list:
            for m in mutations:
                print(f"{m.name}\n    {m.what}\n    tests: {' '.join(m.tests)}")
            return 0
        check_edits(REPO, mutations)
        missing = [t for t in args.tests or [] if not (REPO / t.split("::", 1)[0]).exists()]
        if missing:
            raise Abort(f"--test: no such path: {', '.join(missing)}")
        if args.tests and args.all:
            raise Abort("--test and --all: choose one")
        args.slime_source = slime_source(REPO) if any(m.patches_slime for m in mutations) else None
    except Abort as e:
        log(f"mutations: {e}")
        return 2

    touched = sorted({e.path for m in mutations for e in m.edits})
    before = {p: (REPO / p).read_bytes() for p in touched}
    diff_before = git_diff(REPO, touched)
    workdir = Path(tempfile.mkdtemp(prefix="april-mutations-"))
    results: list[Result] = []
    status = 0
    start = time.monotonic()
    try:
        if args.in_place:
            root = REPO
        else:
            root = workdir / "tree"
            log(f"copying the working tree to {root}")
            copy_tree(REPO, root)
        check_import(args.python, "april_slime", root / "april_slime", [] if args.in_place else [root], root)
        for i, m in enumerate(mutations, start=1):
            log(f"[{i}/{len(mutations)}] {m.name}: {m.what}")
            results.append(check_mutation(m, root, args, workdir, log))
            r = results[-1]
            verdict = ("not run: " + r.note if r.skipped else
                       "caught by " + ", ".join(r.caught_by) if r.caught else "NOT CAUGHT: " + r.note)
            log(f"  -> {verdict}")
    except Abort as e:
        log(f"mutations: {e}")
        status = 2
    except RestoreError as e:
        log(f"mutations: {e}")
        status = 3
    except KeyboardInterrupt:
        log("mutations: interrupted; the files are restored")
        status = 130
    finally:
        # the checkout must be exactly as it was, whatever happened above
        changed = [p for p in touched if (REPO / p).read_bytes() != before[p]]
        if changed or git_diff(REPO, touched) != diff_before:
            log("mutations: the checkout differs from before the run in: " + ", ".join(changed or touched)
                + "; compare with `git diff`")
            status = 3
        if args.keep:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if results:
        print(table(results))
        ran = [r for r in results if not r.skipped]
        print(f"{sum(r.caught for r in ran)}/{len(ran)} caught ({len(results) - len(ran)} not run) "
              f"in {time.monotonic() - start:.0f} s")
    if status:
        return status
    return 0 if len(results) == len(mutations) and all(r.caught or r.skipped for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
