from pathlib import Path

from setuptools import find_namespace_packages, setup

setup(
    name="april_slime",
    version="0.1.0",
    description=(
        "Partial rollouts (APRIL / CoPRIS) and off-policy correction (decoupled PPO, TIS/MIS, VCPO) "
        "as a drop-in plugin for the slime RL framework"
    ),
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    # The plugin only: its face, the rollout core and the training wing (core/ and training/ have no
    # __init__.py, hence namespace discovery). The workbench (emulator, bench, demo, the
    # `april-slime` command) is its own distribution in workbench/ (workbench/pyproject.toml).
    packages=find_namespace_packages(include=["april_slime", "april_slime.*"], exclude=["*.__pycache__"]),
    # torch is deliberately absent: slime images ship their own build, and the test setup pins
    # the CPU wheel. The loss/VCPO modules import it; the rollout side does not need it. The rollout
    # core decodes replies with orjson and checks their tokens with numpy (both in slime's images).
    install_requires=["aiohttp>=3.9", "numpy>=1.24", "orjson>=3.9", "pyyaml>=6.0"],
    extras_require={"test": ["pytest>=7.4", "pytest-asyncio>=0.23", "ruff==0.17.6"]},
)
