"""The two workarounds SGLang 0.5.23 needs to serve on CPU from PyPI wheels.

    python cpu_workarounds.py install   # apply to the environment of this interpreter (idempotent)
    python cpu_workarounds.py check     # exit 1, naming what is missing, unless both are in place

1. ``sgl_kernel``: with ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports two CPU helpers from it, and PyPI
   has no CPU build. ``sgl_kernel_cpu.py`` (beside this file) provides them in plain torch; it is
   copied in as ``<site-packages>/sgl_kernel/__init__.py``. A real ``sgl_kernel`` build found there
   is left alone and reported.
2. torchvision 0.28.0 from PyPI is a CUDA build whose ``_meta_registrations.py`` registers fake
   kernels for ``torchvision::nms`` / ``qnms`` without checking that the operators exist (the other
   operators in that file are checked), so ``import sglang`` fails with ``operator torchvision::nms
   does not exist``. The two registrations get the same guard the others have.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
HELPERS_SOURCE = HERE / "sgl_kernel_cpu.py"
HELPERS_MARKER = "APRIL_SLIME_CPU_HELPERS"
GUARD_MARKER = "# april-slime: guarded, the CPU build has no torchvision ops"
UNGUARDED = {
    op: f'@torch.library.register_fake("torchvision::{op}")\n' for op in ("nms", "qnms")
}


def _guarded(op: str) -> str:
    return (f'@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() '
            f"else (lambda fn: fn))  {GUARD_MARKER}\n")


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


# ------------------------------------------------------------------ sgl_kernel
def helpers_problem(site: Path) -> str | None:
    init = site / "sgl_kernel" / "__init__.py"
    if not init.exists():
        return f"no sgl_kernel CPU helpers in {site}"
    text = init.read_text(encoding="utf-8")
    if HELPERS_MARKER not in text:
        return None  # a real sgl_kernel build: not ours to judge
    if text != HELPERS_SOURCE.read_text(encoding="utf-8"):
        return f"{init} is an older copy of {HELPERS_SOURCE.name}"
    return None


def install_helpers(site: Path) -> str:
    package = site / "sgl_kernel"
    init = package / "__init__.py"
    if init.exists() and HELPERS_MARKER not in init.read_text(encoding="utf-8"):
        return f"sgl_kernel: a real build is installed at {package}; left unchanged"
    wanted = HELPERS_SOURCE.read_text(encoding="utf-8")
    if init.exists() and init.read_text(encoding="utf-8") == wanted:
        return "sgl_kernel: CPU helpers already in place"
    package.mkdir(exist_ok=True)
    tmp = init.with_suffix(".tmp")
    tmp.write_text(wanted, encoding="utf-8")
    tmp.replace(init)
    return f"sgl_kernel: CPU helpers installed at {init}"


# ------------------------------------------------------------------ torchvision
def _meta_registrations(site: Path) -> Path | None:
    path = site / "torchvision" / "_meta_registrations.py"
    return path if path.exists() else None


def torchvision_problem(site: Path) -> str | None:
    path = _meta_registrations(site)
    if path is None:
        return None  # no torchvision, nothing to guard
    text = path.read_text(encoding="utf-8")
    unguarded = [op for op, line in UNGUARDED.items() if line in text]
    return f"{path}: unguarded register_fake for {', '.join(unguarded)}" if unguarded else None


def install_torchvision_guard(site: Path) -> str:
    path = _meta_registrations(site)
    if path is None:
        return "torchvision: not installed, nothing to guard"
    text = path.read_text(encoding="utf-8")
    patched = text
    for op, line in UNGUARDED.items():
        patched = patched.replace(line, _guarded(op))
    if patched == text:
        return "torchvision: nms/qnms registrations already guarded"
    if "import torchvision.extension" not in patched:
        raise SystemExit(f"{path}: unexpected layout (no `import torchvision.extension`); not patched")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(patched, encoding="utf-8")
    tmp.replace(path)
    for stale in (path.parent / "__pycache__").glob("_meta_registrations.*.pyc"):
        stale.unlink()
    return f"torchvision: guarded nms/qnms registrations in {path}"


# ------------------------------------------------------------------ entry
def problems(site: Path | None = None) -> list[str]:
    """What is missing in ``site``, or (None) where this interpreter imports from: a clone's .venv
    sees the shared layer's site-packages through a .pth file."""
    if site is not None:
        return [p for p in (helpers_problem(site), torchvision_problem(site)) if p]
    found = []
    kernel = importlib.util.find_spec("sgl_kernel")
    found.append(helpers_problem(Path(kernel.origin).parent.parent) if kernel and kernel.origin
                 else "no sgl_kernel importable")
    vision = importlib.util.find_spec("torchvision")
    if vision is not None and vision.origin:
        found.append(torchvision_problem(Path(vision.origin).parent.parent))
    return [p for p in found if p]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["install", "check"])
    parser.add_argument("--site-packages", type=Path, default=None,
                        help="the environment to act on (default: this interpreter's)")
    ns = parser.parse_args(argv)
    site = ns.site_packages or site_packages()
    if ns.command == "install":
        for line in (install_helpers(site), install_torchvision_guard(site)):
            print(f"[cpu-workarounds] {line}", file=sys.stderr)
    found = problems(ns.site_packages)
    for p in found:
        print(f"[cpu-workarounds] missing: {p}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
