"""Shell scripts, Dockerfiles and the environment checks: lint, syntax and behaviour.

Lint tests skip (one line) when shellcheck / hadolint is not installed; the CI setup installs
both. Patch tests run against the real slime release at the pinned commit
(``slime-624b824a8.tar.gz``, looked up like scripts/real-stack/setup.sh does, or
``$APRIL_SLIME_TARBALL``) and skip when it is absent.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PATCH = REPO / "patches" / "slime-forward-train-metadata.patch"
CHECK_SH = REPO / "patches" / "check.sh"
CHECK_ENV = REPO / "scripts" / "check_env.py"
BUILD_MI300 = REPO / "scripts" / "rocm" / "build-mi300.sh"
LAUNCHERS = REPO / "examples" / "qwen3-4B-dapo-math"
# files the slime patches touch, relative to slime's root
PATCHED_FILES = sorted(
    line.split(" b/", 1)[1].strip()
    for patch in sorted(PATCH.parent.glob("slime-*.patch"))
    for line in patch.read_text().splitlines()
    if line.startswith("diff --git ")
)


def tracked(*patterns: str) -> list[Path]:
    """Tracked files matching git pathspecs; a plain glob when this is not a git checkout."""
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "--", *patterns],
            capture_output=True, text=True, check=True,
        ).stdout
        files = [REPO / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):
        files = sorted({p for pattern in patterns for p in REPO.glob(pattern.replace("*.", "**/*."))})
    return [f for f in files if f.is_file()]


SHELL_SCRIPTS = tracked("*.sh", ".ci/run")
DOCKERFILES = [f for f in tracked("docker/Dockerfile*") if not f.name.endswith(".dockerignore")]


def tool(name: str) -> str:
    """Path of a lint tool; skips the test (one line) when it is not installed."""
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        pytest.skip(f"{name} not installed")
    return path


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120, **kw)


# ------------------------------------------------------------------------------------- lint


def test_the_lint_targets_are_found():
    names = {str(f.relative_to(REPO)) for f in SHELL_SCRIPTS}
    assert {".ci/run", "patches/check.sh", "scripts/rocm/build-mi300.sh",
            "scripts/rocm/env-mi300.sh", "examples/qwen3-4B-dapo-math/common.sh"} <= names
    assert {f.name for f in DOCKERFILES} >= {"Dockerfile.h100", "Dockerfile.mi300"}


def test_shellcheck_warning_level_is_clean():
    shellcheck = tool("shellcheck")
    # -x follows the `source` directives, so sourced files are checked in context as well
    result = run([shellcheck, "-x", "-S", "warning", "-f", "gcc", *SHELL_SCRIPTS], cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shellcheck_flags_what_it_should(tmp_path):
    """The lint above can fail: an unquoted array element and a bare cd are reported."""
    shellcheck = tool("shellcheck")
    bad = tmp_path / "bad.sh"
    bad.write_text('#!/bin/bash\nA=(--load ${DIR})\ncd "$DIR"\necho "${A[@]}"\n')
    out = run([shellcheck, "-S", "warning", "-f", "gcc", bad]).stdout
    assert "SC2206" in out and "SC2164" in out


def test_sourced_files_declare_their_shell():
    """Files that are only sourced carry a shell directive (else shellcheck stops at SC2148)."""
    for path in (LAUNCHERS / "common.sh", REPO / "scripts" / "rocm" / "env-mi300.sh"):
        assert path.read_text().splitlines()[0] == "# shellcheck shell=bash", path


def test_bash_syntax():
    for script in SHELL_SCRIPTS:
        result = run(["bash", "-n", script])
        assert result.returncode == 0, f"{script}: {result.stderr}"


def test_hadolint_is_clean():
    hadolint = tool("hadolint")
    result = run([hadolint, "--failure-threshold", "info", *DOCKERFILES], cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_flags_what_it_should(tmp_path):
    hadolint = tool("hadolint")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:24.04\nRUN cd /tmp && echo hi\n")
    result = run([hadolint, bad])
    assert result.returncode != 0 and "DL3003" in result.stdout


# ------------------------------------------------------------------------ pins and their docs


def script_defaults(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^(\w+)=\$\{\1:-([^}]+)\}", path.read_text(), flags=re.M))


def test_pins_agree_across_scripts_docs_and_images():
    pins = script_defaults(BUILD_MI300)
    readme = (REPO / "scripts" / "rocm" / "README.md").read_text()
    for name in ("SLIME_REF", "SGLANG_REF", "MEGATRON_REF", "AITER_REF", "TE_REF",
                 "SLIME_PATCH_VERSION", "RAY_VERSION", "SGLANG_ROUTER_VERSION",
                 "TORCH_MEMORY_SAVER_VERSION"):
        assert pins[name] in readme, f"{name}={pins[name]} is not in scripts/rocm/README.md"
    for apex in re.findall(r"\) echo ([0-9a-f]{40}) ;;", BUILD_MI300.read_text()):
        assert apex[:8] in readme, f"apex {apex} is not in scripts/rocm/README.md"
    check_env = CHECK_ENV.read_text()
    assert f'PINNED_SLIME_COMMIT = "{pins["SLIME_REF"]}"' in check_env
    assert f"ARG SLIME_COMMIT={pins['SLIME_REF']}" in (REPO / "docker" / "Dockerfile.h100").read_text()


# ------------------------------------------------------------------- slime at the pinned commit


def find_tarball() -> Path | None:
    if os.environ.get("APRIL_SLIME_TARBALL"):
        return Path(os.environ["APRIL_SLIME_TARBALL"])
    for shared in (REPO.parent / "shared", REPO.parent.parent / "shared", REPO / "shared"):
        found = sorted((shared / "third_party").glob("slime-*.tar.gz"))
        if found:
            return found[0]
    return None


@pytest.fixture(scope="module")
def slime_release(tmp_path_factory) -> Path:
    """The unpacked slime release (read-only: tests copy it)."""
    tarball = find_tarball()
    if tarball is None or not tarball.is_file():
        pytest.skip("slime release tarball not found (set APRIL_SLIME_TARBALL)")
    dest = tmp_path_factory.mktemp("slime-release")
    with tarfile.open(tarball) as tar:
        tar.extractall(dest, filter="data")
    (root,) = [p for p in dest.iterdir() if p.is_dir()]
    return root


@pytest.fixture
def slime_copy(slime_release, tmp_path) -> Path:
    dest = tmp_path / "slime"
    shutil.copytree(slime_release, dest)
    return dest


def digest(root: Path) -> dict[str, str]:
    return {f: hashlib.sha256((root / f).read_bytes()).hexdigest() for f in PATCHED_FILES}


def git_init(path: Path) -> None:
    for cmd in (["init", "-q"], ["add", "-A"],
                ["-c", "user.email=ci@example.invalid", "-c", "user.name=ci", "commit", "-qm", "base"]):
        subprocess.run(["git", "-C", str(path), *cmd], check=True, capture_output=True)


def test_check_sh_reports_and_modifies_nothing(slime_copy):
    before = digest(slime_copy)
    result = run(["bash", CHECK_SH, slime_copy])
    assert result.returncode == 0, result.stderr
    assert f"{PATCH.name}: applies to {slime_copy}" in result.stdout
    assert digest(slime_copy) == before


def test_check_sh_apply_then_already_applied(slime_copy):
    before = digest(slime_copy)
    result = run(["bash", CHECK_SH, "--apply", slime_copy])
    assert result.returncode == 0, result.stderr
    assert f"{PATCH.name}: applied to {slime_copy}" in result.stdout
    after = digest(slime_copy)
    assert all(after[f] != before[f] for f in PATCHED_FILES)
    assert '"metadata",' in (slime_copy / "slime" / "ray" / "rollout.py").read_text()
    again = run(["bash", CHECK_SH, "--apply", slime_copy])
    assert again.returncode == 0 and "already applied" in again.stdout
    assert digest(slime_copy) == after


def test_check_sh_apply_in_a_git_checkout_is_three_way(slime_copy):
    git_init(slime_copy)
    result = run(["bash", CHECK_SH, "--apply", slime_copy])
    assert result.returncode == 0, result.stderr
    status = subprocess.run(["git", "-C", str(slime_copy), "status", "--porcelain"],
                            capture_output=True, text=True, check=True).stdout
    # --3way records the result in the index: every patched file is staged
    assert sorted(line[3:] for line in status.splitlines()) == PATCHED_FILES
    assert all(line.startswith("M ") for line in status.splitlines())


def test_check_sh_inside_another_repository_patches_the_right_files(slime_copy, tmp_path):
    """A slime copy nested in an unrelated git repository: `git apply` would resolve paths from
    that repository's root and skip every file while reporting success."""
    outer = tmp_path / "outer"
    outer.mkdir()
    git_init_empty = ["git", "-C", str(outer), "init", "-q"]
    subprocess.run(git_init_empty, check=True)
    nested = outer / "vendor" / "slime"
    shutil.move(slime_copy, nested)
    before = digest(nested)
    result = run(["bash", CHECK_SH, "--apply", nested])
    assert result.returncode == 0, result.stderr
    assert all(digest(nested)[f] != before[f] for f in PATCHED_FILES)


def test_check_sh_fails_loudly_and_touches_nothing_when_a_patch_does_not_apply(slime_copy):
    target = slime_copy / "slime" / "ray" / "rollout.py"
    target.write_text(target.read_text().replace('"teacher_log_probs",', '"teacher_logprobs",'))
    before = digest(slime_copy)
    result = run(["bash", CHECK_SH, "--apply", slime_copy])
    assert result.returncode == 1
    assert f"{PATCH.name}: DOES NOT APPLY" in result.stderr
    assert digest(slime_copy) == before


def test_check_sh_missing_directory(tmp_path):
    result = run(["bash", CHECK_SH, tmp_path / "nope"])
    assert result.returncode == 1
    assert f"{tmp_path / 'nope'} does not exist" in result.stderr


def test_check_sh_usage():
    assert run(["bash", CHECK_SH]).returncode == 2
    assert run(["bash", CHECK_SH, "--apply"]).returncode == 2


# ------------------------------------------------------------------------------ check_env.py


@pytest.fixture(scope="module")
def check_env_main():
    spec = importlib.util.spec_from_file_location("check_env", CHECK_ENV)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture
def check_env(check_env_main, capsys):
    """Runs scripts/check_env.py in this process (its imports, torch included, are paid once)."""
    def call(*args: str | Path) -> subprocess.CompletedProcess:
        capsys.readouterr()
        code = check_env_main([str(a) for a in args])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)
    return call


def test_check_env_python_floor_is_the_plugins(capsys):
    spec = importlib.util.spec_from_file_location("check_env_floor", CHECK_ENV)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.Report()
    module.check_python(report, (3, 10, 14))
    assert report.failed and "april_slime needs >= 3.11" in capsys.readouterr().out
    report = module.Report()
    module.check_python(report, (3, 11, 0))
    assert not report.failed


def test_check_env_runs_as_a_script():
    result = run([sys.executable, CHECK_ENV, "--slime-dir", "/nonexistent"])
    assert "[FAIL] slime dir        /nonexistent does not exist" in result.stdout
    assert result.stdout.rstrip().endswith("environment: NOT READY") and result.returncode == 1


def line_of(output: str, what: str) -> str:
    lines = [line for line in output.splitlines() if line[7:].startswith(what)]
    assert lines, f"no '{what}' line in:\n{output}"
    return lines[0]


def test_check_env_missing_slime_dir(check_env):
    result = check_env("--slime-dir", "/nonexistent")
    assert result.returncode == 1
    assert line_of(result.stdout, "slime dir").startswith("[FAIL]")
    assert "/nonexistent does not exist" in result.stdout
    assert "not a git checkout" not in result.stdout
    assert "neither applied nor applicable" not in result.stdout


def test_check_env_missing_sglang_dir(check_env):
    result = check_env("--sglang-dir", "/nonexistent-sglang")
    assert "[FAIL] sglang dir" in result.stdout and "/nonexistent-sglang does not exist" in result.stdout
    assert result.returncode == 1


def test_check_env_file_instead_of_directory(check_env, tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    result = check_env("--slime-dir", f)
    assert f"{f} is not a directory" in result.stdout and result.returncode == 1


def test_check_env_release_without_git(check_env, slime_copy):
    result = check_env("--slime-dir", slime_copy)
    assert "is not a git checkout" in line_of(result.stdout, "slime commit")
    assert "NOT applied" in line_of(result.stdout, PATCH.name)
    run(["bash", CHECK_SH, "--apply", slime_copy])
    assert line_of(check_env("--slime-dir", slime_copy).stdout, PATCH.name).startswith("[ok")


def test_check_env_does_not_read_an_outer_repository_as_slime(check_env, slime_copy, tmp_path):
    outer = tmp_path / "outer"
    shutil.copytree(slime_copy, outer / "vendor" / "slime")
    git_init(outer)
    result = check_env("--slime-dir", outer / "vendor" / "slime")
    assert "is not a git checkout" in line_of(result.stdout, "slime commit")
    assert "NOT applied" in line_of(result.stdout, PATCH.name)


# ------------------------------------------------------------------------------- launchers


@pytest.fixture
def launcher_env(tmp_path) -> dict:
    """A fake slime checkout and a `ray` that records its arguments instead of starting Ray."""
    slime = tmp_path / "slime dir"
    (slime / "scripts" / "models").mkdir(parents=True)
    (slime / "scripts" / "models" / "qwen3-4B.sh").write_text("MODEL_ARGS=(--num-layers 36)\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ray = bin_dir / "ray"
    ray.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                   "with open(os.environ['RAY_LOG'], 'a') as f:\n"
                   "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n")
    ray.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODE", "ROLLOUT_", "HIP_", "NUM_GPUS"))}
    env.update(
        PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env.get("PATH", "")]),
        SLIME_DIR=str(slime), MODEL_DIR=str(tmp_path / "my models"), DATA_DIR=str(tmp_path / "my data"),
        RAY_LOG=str(tmp_path / "ray.log"),
    )
    env.pop("APRIL_SLIME_DIR", None)
    return env


def submitted(env: dict) -> list[str]:
    calls = [json.loads(line) for line in Path(env["RAY_LOG"]).read_text().splitlines()]
    assert calls[0][:2] == ["start", "--head"]
    assert calls[1][:2] == ["job", "submit"]
    return calls[1]


def value_of(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_h100_launcher_command_line(launcher_env):
    result = run(["bash", LAUNCHERS / "run-h100.sh"], env={**launcher_env, "MODE": "copris"})
    assert result.returncode == 0, result.stderr[-2000:]
    argv = submitted(launcher_env)
    # paths with spaces stay one argument each
    assert value_of(argv, "--hf-checkpoint") == f"{launcher_env['MODEL_DIR']}/Qwen3-4B"
    assert value_of(argv, "--prompt-data") == f"{launcher_env['DATA_DIR']}/dapo-math-17k/dapo-math-17k.jsonl"
    assert value_of(argv, "--custom-config-path") == str(LAUNCHERS / "configs" / "copris.yaml")
    # the 16K budget of the benchmark's headline
    assert value_of(argv, "--rollout-max-response-len") == "16384"
    assert value_of(argv, "--actor-num-gpus-per-node") == "8"
    assert value_of(argv, "--num-layers") == "36"
    (runtime_arg,) = [a for a in argv if a.startswith("--runtime-env-json=")]
    runtime_env = json.loads(runtime_arg.removeprefix("--runtime-env-json="))
    assert runtime_env["env_vars"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_mi300_launcher_command_line(launcher_env):
    env = {**launcher_env, "MODE": "april", "HIP_VISIBLE_DEVICES": "0,1,2,3", "ROLLOUT_MAX_RESPONSE_LEN": "12288"}
    result = run(["bash", LAUNCHERS / "run-mi300.sh"], env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    argv = submitted(launcher_env)
    assert value_of(argv, "--actor-num-gpus-per-node") == "4"
    assert value_of(argv, "--rollout-max-response-len") == "12288"
    assert "--no-gradient-accumulation-fusion" in argv
    assert value_of(argv, "--custom-config-path").endswith("configs/april.yaml")


def test_launcher_rejects_unknown_mode(launcher_env):
    result = run(["bash", LAUNCHERS / "run-h100.sh"], env={**launcher_env, "MODE": "coprsi"})
    assert result.returncode == 2
    assert "MODE must be slime, sync, april or copris (got 'coprsi')" in result.stderr
    assert not Path(launcher_env["RAY_LOG"]).exists()


# --------------------------------------------------------------------------- build-mi300.sh


def fake_torch(tmp_path: Path, version: str, hip: str | None) -> dict:
    """Environment in which `import torch` finds a stand-in reporting the given build."""
    pkg = tmp_path / "fake-torch" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        f"import types\n__version__ = {version!r}\nversion = types.SimpleNamespace(hip={hip!r})\n")
    return {**os.environ, "WORKDIR": str(tmp_path / "w"), "PYTHONPATH": str(pkg.parent),
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


def test_build_mi300_refuses_a_torch_that_is_not_rocm(tmp_path):
    """The preflight stops before any clone or pip call."""
    result = run(["bash", BUILD_MI300], env=fake_torch(tmp_path, "2.13.0+cu130", None))
    assert result.returncode == 1
    assert "torch 2.13.0+cu130 is not a ROCm build" in result.stderr
    assert not (tmp_path / "w").exists()


def test_build_mi300_refuses_python_below_3_11(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    python = fake / "python"
    # a Python that reports 3.10 for the version probe
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    env = {**os.environ, "WORKDIR": str(tmp_path / "w"), "PATH": os.pathsep.join([str(fake), os.environ["PATH"]])}
    result = run(["bash", BUILD_MI300], env=env)
    assert result.returncode == 1
    assert "april_slime needs Python >= 3.11" in result.stderr


# The SGLang and Megatron steps, run offline: local repositories stand in for the upstream ones
# (the *_REPO variables), a `pip` that records its arguments stands in for pip, and the slime
# checkout holds only the patch folders the steps read.

GIT_ID = ["-c", "user.email=ci@example.invalid", "-c", "user.name=ci"]


def make_repo(path: Path, files: dict[str, str]) -> str:
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git_init(path)
    return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()


def diff_of(repo: Path, name: str, new_text: str) -> str:
    """A git patch changing one file of `repo`, which is left as it was."""
    target = repo / name
    old_text = target.read_text()
    target.write_text(new_text)
    patch = subprocess.run(["git", "-C", str(repo), "diff"], capture_output=True, text=True, check=True).stdout
    target.write_text(old_text)
    return patch


@pytest.fixture
def build_env(tmp_path) -> dict:
    env = fake_torch(tmp_path, "2.9.1+rocm7.2.0", "7.2.0")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pip = bin_dir / "pip"
    pip.write_text('#!/bin/sh\necho "$*" >> "$PIP_LOG"\n')
    pip.chmod(0o755)
    env.update(
        PATH=os.pathsep.join([str(bin_dir), env["PATH"]]), PIP_LOG=str(tmp_path / "pip.log"),
        SLIME_DIR=str(tmp_path / "slime"), CHECK_ENV="0",
        **{f"SKIP_{step}": "1" for step in ("SLIME", "AITER", "TE", "SGLANG", "MEGATRON", "APEX",
                                             "RAY", "SLIME_INSTALL", "APRIL")},
    )
    (tmp_path / "slime" / "docker" / "patch" / "v0.5.15.post1").mkdir(parents=True)
    (tmp_path / "slime" / "docker" / "amd_patch" / "latest").mkdir(parents=True)
    return env


def pip_calls(env: dict) -> list[str]:
    log = Path(env["PIP_LOG"])
    return log.read_text().splitlines() if log.exists() else []


MEGATRON_CORE = "".join(f"v{i} = {i}\n" for i in range(12))


@pytest.fixture
def megatron_upstream(tmp_path, build_env) -> Path:
    repo = tmp_path / "upstream-megatron"
    build_env["MEGATRON_REF"] = make_repo(repo, {"megatron/core.py": MEGATRON_CORE})
    build_env["MEGATRON_REPO"] = str(repo)
    slime = Path(build_env["SLIME_DIR"]) / "docker"
    (slime / "amd_patch" / "latest" / "amd_megatron_fused_kernels_init.patch").write_text(
        diff_of(repo, "megatron/core.py", MEGATRON_CORE.replace("v1 = 1", "v1 = 'hip'")))
    return repo


def test_build_megatron_applies_amd_then_version_patch(tmp_path, build_env, megatron_upstream):
    patch_dir = Path(build_env["SLIME_DIR"]) / "docker" / "patch" / "v0.5.15.post1"
    (patch_dir / "megatron.patch").write_text(
        diff_of(megatron_upstream, "megatron/core.py", MEGATRON_CORE.replace("v9 = 9", "v9 = 'slime'")))
    result = run(["bash", BUILD_MI300], env={**build_env, "SKIP_MEGATRON": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    patched = MEGATRON_CORE.replace("v1 = 1", "v1 = 'hip'").replace("v9 = 9", "v9 = 'slime'")
    assert (tmp_path / "w" / "Megatron-LM" / "megatron" / "core.py").read_text() == patched
    assert pip_calls(build_env)[-1] == "install --no-build-isolation -e ."


def test_build_megatron_stops_on_a_patch_that_does_not_apply(tmp_path, build_env, megatron_upstream):
    """Where the old script skipped an AMD patch whose --check failed, the build now stops."""
    patch_dir = Path(build_env["SLIME_DIR"]) / "docker" / "patch" / "v0.5.15.post1"
    (patch_dir / "megatron.patch").write_text(
        # written against a different line than upstream has
        diff_of(megatron_upstream, "megatron/core.py", MEGATRON_CORE.replace("v9 = 9", "v9 = 'slime'"))
        .replace("-v9 = 9", "-v9 = 99"))
    result = run(["bash", BUILD_MI300], env={**build_env, "SKIP_MEGATRON": "0"})
    assert result.returncode == 1
    assert "build-mi300: megatron.patch does not apply to Megatron-LM at" in result.stderr
    assert "install --no-build-isolation -e ." not in pip_calls(build_env)


def test_build_megatron_stops_when_a_patch_is_missing(build_env, megatron_upstream):
    result = run(["bash", BUILD_MI300], env={**build_env, "SKIP_MEGATRON": "0"})
    assert result.returncode == 1
    assert "megatron.patch is missing" in result.stderr


def test_build_sglang_patches_then_installs_the_hip_extras(tmp_path, build_env):
    repo = tmp_path / "upstream-sglang"
    build_env["SGLANG_REF"] = make_repo(repo, {
        "python/sglang/srt/server.py": "WEIGHT_VERSION = None\n",
        "python/pyproject.toml": '[project]\nname = "sglang"\n[project.optional-dependencies]\nsrt = ["torch"]\n',
        "python/pyproject_other.toml": ('[project]\nname = "sglang"\n[project.optional-dependencies]\n'
                                        'srt_hip = ["torch"]\nall_hip = ["sglang[srt_hip]"]\n'),
        "sgl-kernel/pyproject.toml": "cuda\n",
        "sgl-kernel/pyproject_rocm.toml": "rocm\n",
        "sgl-kernel/setup_rocm.py": ("import os, pathlib\npathlib.Path('built-for')"
                                     ".write_text(os.environ['AMDGPU_TARGET'] + open('pyproject.toml').read())\n"),
        "python/sglang/srt/layers/quantization/configs/N=1,device_name=AMD_Instinct_MI300X.json": "{}\n",
    })
    build_env["SGLANG_REPO"] = str(repo)
    patch_dir = Path(build_env["SLIME_DIR"]) / "docker" / "patch" / "v0.5.15.post1"
    (patch_dir / "sglang.patch").write_text(
        diff_of(repo, "python/sglang/srt/server.py", "WEIGHT_VERSION = 'slime'\n"))
    result = run(["bash", BUILD_MI300], env={**build_env, "SKIP_SGLANG": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    tree = tmp_path / "w" / "sglang"
    assert (tree / "python/sglang/srt/server.py").read_text() == "WEIGHT_VERSION = 'slime'\n"
    # the HIP extras come from pyproject_other.toml, moved over the CUDA pyproject.toml
    assert "all_hip" in (tree / "python" / "pyproject.toml").read_text()
    assert (tree / "sgl-kernel" / "built-for").read_text() == "gfx942rocm\n"
    assert (tree / "python/sglang/srt/layers/quantization/configs/N=1,device_name=AMD_Instinct_MI300X_VF.json").exists()
    calls = pip_calls(build_env)
    assert "install -e python[all_hip]" in calls
    assert "install sglang-router==0.3.2" in calls
    # a second run finds the patched tree and says so, rather than building on top of it
    again = run(["bash", BUILD_MI300], env={**build_env, "SKIP_SGLANG": "0"})
    assert again.returncode == 1 and "sglang has local changes" in again.stderr


def test_build_apex_commit_follows_torch(tmp_path, build_env):
    repo = tmp_path / "upstream-apex"
    make_repo(repo, {"setup.py": ""})
    env = {**fake_torch(tmp_path / "t213", "2.13.0+rocm7.2", "7.2"), "PATH": build_env["PATH"],
           "PIP_LOG": build_env["PIP_LOG"], "SLIME_DIR": build_env["SLIME_DIR"], "CHECK_ENV": "0",
           "APEX_REPO": str(repo), "WORKDIR": build_env["WORKDIR"],
           **{k: v for k, v in build_env.items() if k.startswith("SKIP_")}, "SKIP_APEX": "0"}
    result = run(["bash", BUILD_MI300], env=env)
    assert result.returncode == 1
    assert "no pinned ROCm/apex commit for torch 2.13; set APEX_REF" in result.stderr
