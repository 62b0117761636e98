"""The package's walls, read from its imports.

The package has a face and three wings (README, "Where things live"):

* the rollout core, ``april_slime/core/``: no torch, no slime, nothing of the other rooms;
* the training wing, ``april_slime/training/``: pure torch, nothing of the other rooms;
* the slime face, the modules at the top of ``april_slime/``: the only modules that import slime
  (Megatron, SGLang); they use the core and the training wing;
* the workbench, ``april_slime/workbench/``: emulator, bench, demo, experiments, localstack and the
  ``april-slime`` command; it may use everything, and nothing outside it imports it (the two
  ``python -m`` entry points ``april_slime/emulator.py`` and ``april_slime/localstack.py`` are its
  doors, so they count as workbench).

Every import is read, also the lazy ones inside functions, so a wall cannot be crossed by moving an
import into a function body.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "april_slime"
WORKBENCH_DOORS = {"april_slime.emulator", "april_slime.localstack"}
SLIME_WORLD = ("slime", "megatron", "sglang", "sglang_router", "transformer_engine", "ray")
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str:
    if module in WORKBENCH_DOORS or module.startswith("april_slime.workbench"):
        return "workbench"
    if module.startswith("april_slime.core"):
        return "core"
    if module.startswith("april_slime.training"):
        return "training"
    return "face"


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, at any depth."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            # `from april_slime import rollout` imports the module april_slime.rollout
            if base == "april_slime" or base.startswith("april_slime."):
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def wall_crossings(root: Path) -> list[str]:
    """Every import that crosses a wall, as 'file:line: what (why)', once per line and reason."""
    problems: dict[tuple[Path, int, str], str] = {}
    for path in sorted(root.rglob("*.py")):
        here = module_name(path, root)
        room = room_of(here)
        for line, target in imports_of(path, here):
            top, why = target.split(".")[0], None
            if top == "april_slime" and target != "april_slime":
                there = room_of(target)
                if there == "workbench" and room != "workbench":
                    why = "nothing outside the workbench imports it"
                elif room in ("core", "training") and there != room:
                    why = f"the {room} imports nothing of the {there}"
            elif top in SLIME_WORLD and room in ("core", "training"):
                why = f"only the face and the workbench import {top}"
            elif top == "torch" and room == "core":
                why = "the rollout core runs without torch"
            if why:
                problems.setdefault((path, line, why),
                                    f"{path.relative_to(root.parent)}:{line}: {here} imports {target} ({why})")
    return list(problems.values())


def import_cycles(root: Path) -> list[list[str]]:
    """Cycles among the package's modules (module-level and lazy imports alike)."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    edges = {m: set() for m in modules}
    for m, p in modules.items():
        for _, target in imports_of(p, m):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != m and not m.startswith(target + "."):  # a package's own __init__
                edges[m].add(target)
    cycles, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(modules):
        if m not in state:
            visit(m)
    return cycles


def oversized(root: Path) -> list[str]:
    """Modules over MAX_MODULE_LINES and classes over MAX_CLASS_LINES lines."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(root.parent)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            problems.append(f"{rel}: {len(text.splitlines())} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                problems.append(f"{rel}: class {node.name} has {node.end_lineno - node.lineno + 1} lines "
                                f"(at most {MAX_CLASS_LINES})")
    return problems


# ------------------------------------------------------------------------------------ the package
def test_no_import_crosses_a_wall():
    assert wall_crossings(PACKAGE) == []


def test_no_import_cycle():
    assert import_cycles(PACKAGE) == []


def test_no_module_or_class_outgrows_its_room():
    assert oversized(PACKAGE) == []


def test_every_room_is_where_the_readme_says():
    rooms = {room_of(module_name(p, PACKAGE)) for p in PACKAGE.rglob("*.py")}
    assert rooms == {"core", "training", "face", "workbench"}
    for entry in ("rollout", "loss", "vcpo", "settings"):
        assert room_of(f"april_slime.{entry}") == "face"


# ------------------------------------------------------------------------------------ the checker
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "april_slime"
    for name, text in {"__init__.py": "", "core/__init__.py": "", "training/__init__.py": "",
                       "workbench/__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize("name, text, why", [
    ("core/engine.py", "import torch\n", "runs without torch"),
    ("core/engine.py", "def f():\n    from slime.utils import misc\n", "only the face"),
    ("core/engine.py", "from april_slime.training import offpolicy\n", "the core imports nothing of the training"),
    ("core/engine.py", "from .. import rollout\n", "the core imports nothing of the face"),
    ("training/ess.py", "from april_slime.core.config import AprilConfig\n", "imports nothing of the core"),
    ("training/ess.py", "import megatron.core\n", "only the face"),
    ("rollout.py", "from april_slime.workbench.emulator import cluster\n", "nothing outside the workbench"),
    ("loss.py", "from april_slime import workbench\n", "nothing outside the workbench"),
])
def test_the_checker_sees_each_kind_of_crossing(tmp_path, name, text, why):
    problems = wall_crossings(_tree(tmp_path, {name: text}))
    assert len(problems) == 1 and why in problems[0], problems


def test_the_checker_lets_the_allowed_imports_pass(tmp_path):
    root = _tree(tmp_path, {
        "core/engine.py": "import asyncio\nimport aiohttp\nfrom april_slime.core import types\n",
        "core/types.py": "",
        "training/ess.py": "import torch\nfrom april_slime.training import offpolicy\n",
        "training/offpolicy.py": "",
        "rollout.py": "import slime\nfrom april_slime.core import engine\nfrom april_slime.training import ess\n",
        "emulator.py": "from april_slime.workbench import emulator\n",
        "workbench/emulator.py": "import torch\nfrom april_slime import rollout\n",
    })
    assert wall_crossings(root) == []
    assert import_cycles(root) == []


def test_the_checker_sees_a_cycle_and_an_oversized_class(tmp_path):
    root = _tree(tmp_path, {
        "workbench/band.py": "from april_slime.workbench.runner import run\n",
        "workbench/runner.py": "def f():\n    from april_slime.workbench import band\n",
        "core/big.py": "class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES,
    })
    assert [set(c) for c in import_cycles(root)] == [{"april_slime.workbench.band", "april_slime.workbench.runner"}]
    assert oversized(root) == [f"april_slime/core/big.py: class Big has {MAX_CLASS_LINES + 1} lines "
                               f"(at most {MAX_CLASS_LINES})"]


# ------------------------------------------------------------------------------------ the doors
SLIME_PATHS = (  # what a slime job names on its command line
    "april_slime.rollout.generate_rollout",
    "april_slime.rollout.AprilDataSource",
    "april_slime.loss.policy_loss",
    "april_slime.loss.tis",
    "april_slime.vcpo.before_train_step",
    "april_slime.vcpo.opob_advantages",
)


@pytest.mark.parametrize("path", SLIME_PATHS)
def test_every_import_path_a_slime_job_names_loads(path):
    module, _, name = path.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))


@pytest.mark.parametrize("module", ["april_slime.emulator", "april_slime.localstack"])
def test_python_dash_m_entry_points_still_answer(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: python -m {module}")


def test_the_console_command_points_at_the_workbench_cli():
    setup = (PACKAGE.parent / "setup.py").read_text(encoding="utf-8")
    entry = re.search(r'"april-slime=([\w.]+):(\w+)"', setup)
    assert entry and callable(getattr(importlib.import_module(entry.group(1)), entry.group(2)))
