from pathlib import Path

from setuptools import find_packages, setup

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
    packages=find_packages(include=["april_slime", "april_slime.*"]),
    # the published figures `april-slime bench reproduce` compares against
    package_data={"april_slime.workbench.bench": ["data/*.json"]},
    # torch is deliberately absent: slime images ship their own build, and the test setup pins
    # the CPU wheel. The loss/VCPO modules import it; the rollout side does not need it. The rollout
    # core decodes replies with orjson and checks their tokens with numpy (both in slime's images).
    install_requires=["aiohttp>=3.9", "numpy>=1.24", "orjson>=3.9", "pyyaml>=6.0"],
    extras_require={
        "bench": ["matplotlib>=3.7", "tqdm>=4.60"],
        "test": ["pytest>=7.4", "pytest-asyncio>=0.23", "matplotlib>=3.7", "tqdm>=4.60", "ruff==0.17.6"],
    },
    entry_points={"console_scripts": ["april-slime=april_slime.workbench.cli:main"]},
)
