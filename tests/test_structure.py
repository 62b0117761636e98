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


def plugin_imports(tree: ast.AST) -> list[tuple[int, str, str | None, str | None]]:
    """(line, module, imported name or None, the local name it is bound to) of every import of the
    plugin in a workbench file, at any depth."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("april_slime"):
            found += [(node.lineno, node.module, a.name, a.asname or a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None, a.asname) for a in node.names if a.name.startswith("april_slime")]
    return found


def plugin_uses(workbench: Path, plugin: Path, declared: set[str] | dict[str, str],
                public: set[str]) -> tuple[list[str], set[str]]:
    """What the workbench uses of the plugin beyond ``declared`` (its declared plugin modules) and
    ``public`` (the names of ``april_slime.__all__``), as 'file:line: what' problems, and the declared
    modules it does use. A private name is a problem wherever it comes from: imported
    (``from april_slime.core.x import _y``) or read off a plugin module (``x._y``)."""

    def is_module(dotted: str) -> bool:
        path = plugin.parent.joinpath(*dotted.split("."))
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    problems, used = [], set()
    for path, root in sources(workbench):
        rel = path.relative_to(root.parent)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        bound: dict[str, str] = {}  # local name -> the plugin module it stands for
        for line, module, name, alias in plugin_imports(tree):
            target = f"{module}.{name}" if name is not None and is_module(f"{module}.{name}") else module
            if name is not None and target == module and name.startswith("_"):
                problems.append(f"{rel}:{line}: private name {module}.{name}")
            if target == "april_slime" and name in public:
                continue
            if target not in declared:
                problems.append(f"{rel}:{line}: {target} is not declared in april_workbench.PLUGIN_MODULES")
            used.add(target)
            if target != module or name is None:
                bound[alias or target] = target
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_")):
                problems.append(f"{rel}:{node.lineno}: private name {bound[node.value.id]}.{node.attr}")
    return problems, used


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


def test_the_workbench_uses_the_plugin_only_through_its_declared_doors():
    import april_slime
    from april_workbench import PLUGIN_MODULES

    problems, used = plugin_uses(WORKBENCH, PACKAGE, PLUGIN_MODULES, set(april_slime.__all__))
    assert problems == []
    assert set(PLUGIN_MODULES) == used, "declared but no longer used: " + ", ".join(sorted(set(PLUGIN_MODULES) - used))


# the one module that reads slime's ``args`` (april_slime.slime_args; april_slime.job builds the job from it)
ARGS_SEAM = "april_slime.slime_args"
_READS_ALL = {"getattr", "hasattr", "vars", "setattr", "delattr", "dir"}


def args_reads(plugin: Path) -> list[str]:
    """Every place outside the seam that reads slime's ``args``: an attribute of a name ``args``
    (``args.x``) or of an attribute ``.args`` (``job.args.x``), ``args`` handed to ``getattr`` /
    ``vars`` and the like, or a class keeping its own ``self.args``. Handing ``args`` on to a function
    (slime's own, a user's) is not a read."""
    problems = []
    for path, root in sources(plugin):
        module = module_name(path, root)
        if module == ARGS_SEAM:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and _is_args(node.value):
                problems.append(f"{where}: reads {ast.unparse(node)}")
            elif (isinstance(node, ast.Attribute) and node.attr == "args" and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                problems.append(f"{where}: holds slime's args as self.args")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _READS_ALL
                  and node.args and _is_args(node.args[0])):
                problems.append(f"{where}: reads {ast.unparse(node)}")
    return problems


def _is_args(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "args") or (isinstance(node, ast.Attribute)
                                                                and node.attr == "args")


def test_slime_args_are_read_in_one_module():
    assert args_reads(PACKAGE) == []


@pytest.mark.parametrize("text, problem", [
    ("def f(args):\n    return args.rollout_batch_size\n", "reads args.rollout_batch_size"),
    ("def f(args):\n    return getattr(args, 'x', None)\n", "reads getattr(args, 'x', None)"),
    ("def f(args):\n    return vars(args)\n", "reads vars(args)"),
    ("def f(job):\n    return job.args.save\n", "reads job.args.save"),
    ("class A:\n    def __init__(self, args):\n        self.args = args\n", "holds slime's args as self.args"),
])
def test_the_args_checker_sees_each_kind_of_read(tmp_path, text, problem):
    plugin, _ = _tree(tmp_path, {"loss.py": text, "slime_args.py": "def read(args):\n    return args.x\n"})
    problems = args_reads(plugin)
    assert len(problems) == 1 and problem in problems[0], problems


def test_the_args_checker_lets_handing_args_on_pass(tmp_path):
    plugin, _ = _tree(tmp_path, {"slime_args.py": "def read(args):\n    return vars(args)\n", "loss.py": (
        "def f(args, job, slime):\n    slime.async_rm(args, 1)\n    slime.log(job.args, {})\n"
        "    return job.slime.save\n")})
    assert args_reads(plugin) == []


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


@pytest.mark.parametrize("text, problem", [
    ("from april_slime.core.engine import EngineClient\n", "april_slime.core.engine is not declared"),
    ("from april_slime.core import engine\n", "april_slime.core.engine is not declared"),
    ("import april_slime.core.engine\n", "april_slime.core.engine is not declared"),
    ("def f():\n    from april_slime.core.types import _private\n", "private name april_slime.core.types._private"),
    ("from april_slime.core import types\ntypes._hidden()\n", "private name april_slime.core.types._hidden"),
    ("from april_slime import loss as plugin_loss\nplugin_loss._helper\n", "private name april_slime.loss._helper"),
])
def test_the_workbench_checker_sees_each_undeclared_use(tmp_path, text, problem):
    plugin, workbench = _tree(tmp_path, {"core/engine.py": "", "core/types.py": "", "loss.py": "",
                                         "workbench/bench.py": text})
    problems, _ = plugin_uses(workbench, plugin, {"april_slime.core.types", "april_slime.loss"}, {"policy_loss"})
    assert len(problems) == 1 and problem in problems[0], problems


def test_the_workbench_checker_lets_declared_and_public_uses_pass(tmp_path):
    plugin, workbench = _tree(tmp_path, {"core/types.py": "", "loss.py": "", "workbench/bench.py": (
        "from april_slime import policy_loss\nfrom april_slime.core.types import Group\n"
        "from april_slime import loss\nloss.config_for\n")})
    problems, used = plugin_uses(workbench, plugin, {"april_slime.core.types", "april_slime.loss"}, {"policy_loss"})
    assert problems == [] and used == {"april_slime.core.types", "april_slime.loss"}


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


def test_slime_flags_list_every_flag_a_job_is_told_to_pass():
    """Every ``--flag april_slime.path`` the README, the docs, the example launchers, the workbench and
    the scripts put on a slime command line, and every path a start-time refusal asks a job for, is
    one of ``SLIME_FLAGS``, under that flag."""
    import re

    import april_slime
    from april_slime import job_checks
    from april_slime.core.config import MASKING_POST_PROCESS

    named = re.compile(r"""(--[a-z][a-z0-9-]*)["']?,?\s+["']?(april_slime\.[A-Za-z_.]*[A-Za-z_])""")
    texts = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "examples").rglob("*.*"),
             *(REPO / "scripts").rglob("*.*"), *WORKBENCH.rglob("*.py"), *PACKAGE.rglob("*.py")]
    found = {}
    for path in texts:
        if path.suffix in (".md", ".sh", ".py", ".yaml", ".txt"):
            for flag, target in named.findall(path.read_text(encoding="utf-8", errors="replace")):
                found.setdefault((flag, target), path.relative_to(REPO).as_posix())
    assert found, "no flag found: the pattern no longer matches how the docs write them"
    assert {f"{f} {t} ({where})" for (f, t), where in found.items() if april_slime.SLIME_FLAGS.get(f) != t} == set()
    demanded = {MASKING_POST_PROCESS, job_checks.CUSTOM_LOSS_PATH, job_checks.TIS_HOOK_PATH,
                job_checks.VCPO_HOOK_PATH, job_checks.OPOB_ADVANTAGES_PATH}
    assert demanded <= set(april_slime.SLIME_FLAGS.values())
    assert set(april_slime.SLIME_FLAGS.items()) == {(f, t) for f, t in found}, "a flag no page tells a job to pass"


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
