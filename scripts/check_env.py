#!/usr/bin/env python3
"""Check a node before launching an april_slime job.

    python scripts/check_env.py [--slime-dir DIR] [--sglang-dir DIR] [--require-gpu]

Reports: Python, torch and its accelerator (CUDA or ROCm), the GPUs, april_slime, slime (import
path; version and module layout: the pinned 0.3.1 or 0.4.0's; git commit against the pinned one),
SGLang and sglang-router versions, Ray, and whether the patches in ``patches/`` are applied to the
slime checkout. Exits 1 when something required is
missing or wrong, 0 otherwise (warnings do not fail).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

PINNED_SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
MIN_PYTHON = (3, 11)  # april_slime's floor (asyncio.timeout); slime itself accepts 3.10
PATCH_DIR = Path(__file__).resolve().parent.parent / "patches"


class Report:
    def __init__(self) -> None:
        self.failed = False

    def line(self, level: str, what: str, detail: str) -> None:
        print(f"[{level:4}] {what:<16} {detail}")
        if level == "FAIL":
            self.failed = True

    def ok(self, what: str, detail: str) -> None:
        self.line("ok", what, detail)

    def warn(self, what: str, detail: str) -> None:
        self.line("warn", what, detail)

    def fail(self, what: str, detail: str) -> None:
        self.line("FAIL", what, detail)


def version_of(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git(directory: Path, *args: str) -> subprocess.CompletedProcess:
    # Discovery stops at the parent: a slime copy inside some other repository (site-packages in a
    # project's tree, an unpacked release) must not be read as that repository, whose HEAD is not
    # slime's and whose root would make `git apply` skip every file.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(directory.resolve().parent)}
    return subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, env=env)


def check_dir(r: Report, what: str, directory: Path) -> bool:
    """A directory given on the command line: fail with the reason when it cannot be used."""
    if not directory.exists():
        r.fail(what, f"{directory} does not exist")
        return False
    if not directory.is_dir():
        r.fail(what, f"{directory} is not a directory")
        return False
    return True


def check_python(r: Report, v: tuple[int, ...] = tuple(sys.version_info[:3])) -> None:
    text = f"{'.'.join(map(str, v[:3]))} ({sys.executable})"
    if tuple(v[:2]) >= MIN_PYTHON:
        r.ok("python", text)
    else:
        r.fail("python", f"{text}; april_slime needs >= {'.'.join(map(str, MIN_PYTHON))}")


def check_torch(r: Report, require_gpu: bool) -> None:
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        r.fail("torch", "not importable")
        return
    hip = getattr(torch.version, "hip", None)
    cuda = getattr(torch.version, "cuda", None)
    backend = f"ROCm {hip}" if hip else f"CUDA {cuda}" if cuda else "CPU only"
    r.ok("torch", f"{torch.__version__} ({backend})")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        (r.fail if require_gpu else r.warn)("gpus", "none visible")
        return
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(count)) / 2**30
    r.ok("gpus", f"{count} x {', '.join(names)} ({memory:.0f} GiB each)")
    if hip and not os.environ.get("RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"):
        r.warn("rocm env", "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES is unset; source scripts/rocm/env-mi300.sh")


def check_april(r: Report) -> None:
    try:
        module = importlib.import_module("april_slime")
    except ImportError as e:
        r.fail("april_slime", f"not importable: {e}")
        return
    r.ok("april_slime", f"{version_of('april_slime') or '?'} ({Path(module.__file__).parent})")
    for name in ("april_slime.rollout", "april_slime.core.scheduler", "april_slime.core.engine",
                 "april_slime.core.buffer"):
        try:
            importlib.import_module(name)
        except ImportError as e:
            r.fail(name, f"not importable: {e}")


def find_slime_dir(r: Report, given: str | None) -> Path | None:
    try:
        module = importlib.import_module("slime")
    except ImportError as e:
        r.fail("slime", f"not importable ({e}); install it from source: pip install -e <slime> --no-deps")
        return Path(given) if given else None
    location = Path(module.__file__).resolve().parent.parent
    r.ok("slime", f"importable from {location}")
    try:
        from april_slime import slime_compat
    except ImportError as e:
        r.fail("slime version", f"april_slime.slime_compat not importable: {e}")
        return Path(given) if given else location
    level, line = slime_compat.describe()
    r.line(level, "slime version", line)
    modules = ["slime.utils.types", "slime.rollout.sglang_rollout"]
    if slime_compat.layout() != "unknown":
        modules.insert(1, slime_compat.data_source_module())
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any import-time error makes the plugin unusable
            r.fail(name, f"import failed: {type(e).__name__}: {e}")
    return Path(given) if given else location


def check_slime_commit(r: Report, slime_dir: Path) -> None:
    head = git(slime_dir, "rev-parse", "HEAD")
    if head.returncode != 0:
        r.warn("slime commit", f"{slime_dir} is not a git checkout; cannot compare with {PINNED_SLIME_COMMIT[:9]}")
        return
    commit = head.stdout.strip()
    if commit == PINNED_SLIME_COMMIT:
        r.ok("slime commit", f"{commit[:9]} (pinned)")
    else:
        r.warn("slime commit", f"{commit[:9]}, pinned is {PINNED_SLIME_COMMIT[:9]}; patches may not apply")


def check_patches(r: Report, kind: str, directory: Path) -> None:
    patches = sorted(PATCH_DIR.glob(f"{kind}-*.patch"))
    if not patches:
        r.ok(f"{kind} patches", "none needed")
        return
    for patch in patches:
        applied = git(directory, "apply", "--check", "--reverse", str(patch)).returncode == 0
        applies = git(directory, "apply", "--check", str(patch)).returncode == 0
        if applied:
            r.ok(patch.name, f"applied in {directory}")
        elif applies:
            r.warn(patch.name, f"NOT applied; run: git -C {directory} apply {patch}")
        elif kind == "slime" and newer_slime():
            # written for the pinned commit; on a newer slime the files moved, and the loss runs without
            # per-token versions (only the staleness metrics need them)
            r.warn(patch.name, f"does not apply to this newer slime in {directory}: the loss gets no per-token "
                               "versions, so its staleness metrics are left out")
        else:
            r.fail(patch.name, f"neither applied nor applicable in {directory}")


def newer_slime() -> bool:
    try:
        from april_slime import slime_compat
    except ImportError:
        return False
    return slime_compat.layout() == "0.4"


def check_serving(r: Report) -> None:
    sglang = version_of("sglang")
    (r.ok if sglang else r.warn)("sglang", sglang or "not installed (needed on rollout nodes)")
    router = version_of("sglang-router") or version_of("sglang_router")
    (r.ok if router else r.warn)("sglang-router", router or "not installed")
    ray = version_of("ray")
    (r.ok if ray else r.fail)("ray", ray or "not installed")
    for dist in ("aiohttp", "numpy", "pyyaml"):
        v = version_of(dist)
        (r.ok if v else r.fail)(dist, v or "not installed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slime-dir", help="slime checkout (default: where slime is imported from)")
    parser.add_argument("--sglang-dir", help="SGLang checkout, to check SGLang patches")
    parser.add_argument("--require-gpu", action="store_true", help="fail when no GPU is visible")
    args = parser.parse_args(argv)

    r = Report()
    check_python(r)
    check_torch(r, args.require_gpu)
    check_april(r)
    slime_dir = find_slime_dir(r, args.slime_dir)
    if slime_dir is not None and check_dir(r, "slime dir", slime_dir):
        check_slime_commit(r, slime_dir)
        check_patches(r, "slime", slime_dir)
    if args.sglang_dir and check_dir(r, "sglang dir", Path(args.sglang_dir)):
        check_patches(r, "sglang", Path(args.sglang_dir))
    check_serving(r)
    print("environment:", "NOT READY" if r.failed else "ready")
    return 1 if r.failed else 0


if __name__ == "__main__":
    sys.exit(main())
