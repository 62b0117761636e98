"""The walls, read from the imports, and the plugin's wheel.

The plugin, ``april_slime/``, has a face and two wings (docs/architecture.md):

* the rollout core, ``april_slime/core/``: no torch, no slime, nothing of the other rooms;
* the training wing, ``april_slime/training/``: pure torch, nothing of the other rooms;
* the slime face, the modules at the top of ``april_slime/``: the only modules that import slime
  (Megatron, SGLang); they use the core and the training wing.

The workbench, ``workbench/april_workbench/`` (emulator, bench, demo, experiments, localstack and
the ``april-slime`` command), is a package and a distribution of its own: it may use everything,
and nothing in the plugin imports it, so the plugin's wheel ships without it.

Every import is read, also the lazy ones inside functions, so a wall cannot be crossed by moving an
import into a function body.
"""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "april_slime"
WORKBENCH = REPO / "workbench" / "april_workbench"
SLIME_WORLD = ("slime", "megatron", "sglang", "sglang_router", "transformer_engine", "ray")
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str:
    if module == "april_workbench" or module.startswith("april_workbench."):
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
            if base.split(".")[0] in ("april_slime", "april_workbench"):
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def sources(*roots: Path) -> list[tuple[Path, Path]]:
    """(file, the package root it belongs to) for every module under the roots."""
    return [(path, root) for root in roots for path in sorted(root.rglob("*.py"))]


def wall_crossings(*roots: Path) -> list[str]:
    """Every import that crosses a wall, as 'file:line: what (why)', once per line and reason."""
    problems: dict[tuple[Path, int, str], str] = {}
    for path, root in sources(*roots):
        here = module_name(path, root)
        room = room_of(here)
        for line, target in imports_of(path, here):
            top, why = target.split(".")[0], None
            if top == "april_workbench" and room != "workbench":
                why = "the plugin never imports the workbench"
            elif top == "april_slime" and target != "april_slime":
                there = room_of(target)
                if room in ("core", "training") and there != room:
                    why = f"the {room} imports nothing of the {there}"
            elif top in SLIME_WORLD and room in ("core", "training"):
                why = f"only the face and the workbench import {top}"
            elif top == "torch" and room == "core":
                why = "the rollout core runs without torch"
            if why:
                problems.setdefault((path, line, why),
                                    f"{path.relative_to(root.parent)}:{line}: {here} imports {target} ({why})")
    return list(problems.values())


def import_cycles(*roots: Path) -> list[list[str]]:
    """Cycles among the packages' modules (module-level and lazy imports alike)."""
    modules = {module_name(p, root): p for p, root in sources(*roots)}
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


def oversized(*roots: Path) -> list[str]:
    """Modules over MAX_MODULE_LINES and classes over MAX_CLASS_LINES lines."""
    problems = []
    for path, root in sources(*roots):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(root.parent)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            problems.append(f"{rel}: {len(text.splitlines())} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                problems.append(f"{rel}: class {node.name} has {node.end_lineno - node.lineno + 1} lines "
                                f"(at most {MAX_CLASS_LINES})")
    return problems


# ------------------------------------------------------------------------------------ the packages
def test_no_import_crosses_a_wall():
    assert wall_crossings(PACKAGE, WORKBENCH) == []


def test_no_import_cycle():
    assert import_cycles(PACKAGE, WORKBENCH) == []


def test_no_module_or_class_outgrows_its_room():
    assert oversized(PACKAGE, WORKBENCH) == []


def test_every_room_is_where_the_architecture_page_says():
    assert {room_of(module_name(p, PACKAGE)) for p in PACKAGE.rglob("*.py")} == {"core", "training", "face"}
    assert {room_of(module_name(p, WORKBENCH)) for p in WORKBENCH.rglob("*.py")} == {"workbench"}
    for entry in ("rollout", "loss", "vcpo", "settings"):
        assert room_of(f"april_slime.{entry}") == "face"


# ------------------------------------------------------------------------------------ the checker
def _tree(tmp_path: Path, files: dict[str, str]) -> tuple[Path, Path]:
    """A plugin and a workbench in tmp_path; a file named workbench/... goes to the workbench."""
    plugin, workbench = tmp_path / "april_slime", tmp_path / "wb" / "april_workbench"
    for name, text in {"__init__.py": "", "core/__init__.py": "", "training/__init__.py": "",
                       "workbench/__init__.py": "", **files}.items():
        path = workbench / name.removeprefix("workbench/") if name.startswith("workbench/") else plugin / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return plugin, workbench


@pytest.mark.parametrize("name, text, why", [
    ("core/engine.py", "import torch\n", "runs without torch"),
    ("core/engine.py", "def f():\n    from slime.utils import misc\n", "only the face"),
    ("core/engine.py", "from april_slime.training import offpolicy\n", "the core imports nothing of the training"),
    ("core/engine.py", "from .. import rollout\n", "the core imports nothing of the face"),
    ("training/ess.py", "from april_slime.core.config import AprilConfig\n", "imports nothing of the core"),
    ("training/ess.py", "import megatron.core\n", "only the face"),
    ("rollout.py", "from april_workbench.emulator import cluster\n", "never imports the workbench"),
    ("loss.py", "import april_workbench\n", "never imports the workbench"),
    ("core/engine.py", "def f():\n    from april_workbench.bench import runner\n", "never imports the workbench"),
    ("training/ess.py", "from april_workbench import demo\n", "never imports the workbench"),
])
def test_the_checker_sees_each_kind_of_crossing(tmp_path, name, text, why):
    problems = wall_crossings(*_tree(tmp_path, {name: text}))
    assert len(problems) == 1 and why in problems[0], problems


def test_the_checker_lets_the_allowed_imports_pass(tmp_path):
    root = _tree(tmp_path, {
        "core/engine.py": "import asyncio\nimport aiohttp\nfrom april_slime.core import types\n",
        "core/types.py": "",
        "training/ess.py": "import torch\nfrom april_slime.training import offpolicy\n",
        "training/offpolicy.py": "",
        "rollout.py": "import slime\nfrom april_slime.core import engine\nfrom april_slime.training import ess\n",
        "workbench/emulator.py": "import torch\nimport slime\nfrom april_slime import rollout\n"
                                 "from april_slime.core import engine\nfrom april_workbench import bench\n",
        "workbench/bench.py": "",
    })
    assert wall_crossings(*root) == []
    assert import_cycles(*root) == []


def test_the_checker_sees_a_cycle_and_an_oversized_class(tmp_path):
    root = _tree(tmp_path, {
        "workbench/band.py": "from april_workbench.runner import run\n",
        "workbench/runner.py": "def f():\n    from april_workbench import band\n",
        "core/big.py": "class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES,
    })
    assert [set(c) for c in import_cycles(*root)] == [{"april_workbench.band", "april_workbench.runner"}]
    assert oversized(*root) == [f"april_slime/core/big.py: class Big has {MAX_CLASS_LINES + 1} lines "
                               f"(at most {MAX_CLASS_LINES})"]


# ------------------------------------------------------------------------------------ the doors
def test_the_public_surface_is_declared_in_one_place_and_loads():
    import april_slime
    from april_slime.core.config import MASKING_POST_PROCESS

    assert set(april_slime.SLIME_FLAGS.values()) >= {
        "april_slime.rollout.generate_rollout", "april_slime.rollout.AprilDataSource",
        "april_slime.loss.policy_loss", "april_slime.vcpo.before_train_step"}
    for path in april_slime.SLIME_FLAGS.values():  # what a slime job names on its command line
        module, _, name = path.rpartition(".")
        assert callable(getattr(importlib.import_module(module), name)), path
        assert getattr(april_slime, name) is getattr(importlib.import_module(module), name)
    for name in april_slime.__all__:
        assert getattr(april_slime, name) is not None, name
    # every path a start-time refusal asks the job for is a flag listed here
    assert april_slime.SLIME_FLAGS["--custom-reward-post-process-path"] == MASKING_POST_PROCESS
    with pytest.raises(AttributeError, match="public names"):
        april_slime.scheduler  # noqa: B018


def test_importing_the_plugin_loads_neither_torch_nor_the_workbench():
    code = ("import sys, april_slime, april_slime.rollout; "
            "print(sorted(m for m in ('torch', 'april_workbench') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)


@pytest.mark.parametrize("module", ["april_workbench.emulator", "april_workbench.localstack"])
def test_python_dash_m_entry_points_still_answer(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: python -m {module}")


def test_the_console_command_belongs_to_the_workbench():
    project = tomllib.loads((REPO / "workbench" / "pyproject.toml").read_text(encoding="utf-8"))
    module, _, name = project["project"]["scripts"]["april-slime"].partition(":")
    assert module.startswith("april_workbench.") and callable(getattr(importlib.import_module(module), name))
    assert "april_slime" in project["project"]["dependencies"]
    assert "console_scripts" not in (REPO / "setup.py").read_text(encoding="utf-8")


def test_the_plugin_wheel_holds_the_plugin_and_no_workbench(tmp_path):
    """Build the plugin's wheel from a copy of the repository's layout: every plugin module is in
    it, and nothing of the workbench (no module, no console command)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(PACKAGE, src / "april_slime", ignore=ignore)
    shutil.copytree(WORKBENCH.parent, src / "workbench", ignore=ignore)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"),
                          str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    [wheel] = (tmp_path / "dist").glob("april_slime-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    modules = {n for n in names if n.endswith(".py")}
    assert modules == {p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py")}
    assert not [n for n in names if "workbench" in n or "entry_points" in n]
