"""`scripts/check_dockerfile.py` (what `make docker-check` runs): the real Dockerfile passes; broken copies fail with
a message naming the problem; the Dockerfile's patch step runs on the pinned sglang and megatron-core wheels and fails
on a bad hunk.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
_spec = importlib.util.spec_from_file_location("check_dockerfile", REPO / "scripts" / "check_dockerfile.py")
cd = importlib.util.module_from_spec(_spec)
sys.modules["check_dockerfile"] = cd  # dataclasses resolve their module through sys.modules
_spec.loader.exec_module(cd)

BASE = "FROM lmsysorg/sglang:v0.5.15.post1-cu130"
PATCH_RUN = "RUN python3 scripts/sglang_patches.py apply && python3 scripts/sglang_patches.py check"
MEGATRON_RUN = "    && python3 scripts/megatron_patches.py apply && python3 scripts/megatron_patches.py check"
REINSTALL = "    && python3 -m pip install --no-deps --force-reinstall sglang==0.5.15.post1 \\\n"


def broken(tmp_path: Path, old: str, new: str) -> Path:
    text = DOCKERFILE.read_text()
    assert old in text, f"the Dockerfile no longer contains {old!r}; update this test"
    path = tmp_path / "Dockerfile"
    path.write_text(text.replace(old, new))
    return path


def test_real_dockerfile_passes():
    assert cd.check(DOCKERFILE) == []


@pytest.mark.parametrize(
    "old, new, message",
    [
        (BASE, "FROM lmsysorg/sglang:latest", "is not pinned to a release tag"),
        (BASE, "FROM lmsysorg/sglang", "is not pinned to a release tag"),
        (BASE, "FROM lmsysorg/sglang:v0.5.10.post1-cu129", "is not SGLang 0.5.15.post1"),
        (BASE, "FROM python:3.12", "is not the official SGLang release image"),
        (BASE, "FROM ${BASE_IMAGE}", "uses a build variable"),
        (BASE, BASE + "@sha256:1234", "is not sha256:<64 hex digits>"),
        (PATCH_RUN, "", "the patch step is missing"),
        (PATCH_RUN, PATCH_RUN + " || true", "use only &&"),
        (PATCH_RUN, PATCH_RUN.replace(" && python3 scripts/sglang_patches.py check", ""), "and then"),
        (PATCH_RUN, "RUN python3 scripts/sglang_patches.py check", "and then"),
        (MEGATRON_RUN, "    && true", "must run `scripts/megatron_patches.py apply` and then"),
        (MEGATRON_RUN, "    && python3 scripts/megatron_patches.py apply", "then `scripts/megatron_patches.py check`"),
        (
            "scripts/sglang_patches.py scripts/megatron_patches.py scripts/",
            "scripts/sglang_patches.py scripts/",
            "scripts/megatron_patches.py is not copied",
        ),
        (REINSTALL, "", "wheel is not reinstalled before the patch step"),
        ("ray==2.60.0", "ray", "pip package 'ray' is not pinned"),
        ("ray==2.60.0", "ray>=2.40", "pip package 'ray>=2.40' is not pinned"),
        ("megatron-core==0.19.2 ", "", "megatron-core is not installed"),
        ("megatron-core==0.19.2", "megatron-core==0.19.1", "pyproject.toml pins megatron-core==0.19.2"),
        ("sglang==0.5.15.post1", "sglang==0.5.10.post1", "patches sglang 0.5.15.post1"),
        ("pip install --no-deps .", "pip install .", "installed with its dependencies"),
        ("USER trace", "USER root", "must not run as root"),
        ("USER trace", "USER 0:0", "must not run as root"),
        ("USER trace\n", "", "no USER instruction"),
        ('ENTRYPOINT ["/opt/trace/docker/entrypoint.sh"]', "ENTRYPOINT /opt/trace/docker/entrypoint.sh", "exec form"),
        ("COPY docker/entrypoint.sh docker/", "", "is not copied into the image"),
        ("USER trace", "ADD https://example.com/tool.tar.gz /opt/\nUSER trace", "ADD of the URL"),
        ("USER trace", "ENV HF_TOKEN=placeholder\nUSER trace", "ENV HF_TOKEN looks like a secret"),
        ("USER trace", "ARG WANDB_API_KEY\nUSER trace", "ARG WANDB_API_KEY looks like a secret"),
        ("USER trace", "RUN apt-get install -y curl\nUSER trace", "apt packages ['curl'] are not pinned"),
    ],
)
def test_broken_copy_fails_with_a_clear_message(tmp_path, old, new, message):
    errors = cd.check(broken(tmp_path, old, new))
    assert any(message in e for e in errors), errors


def test_cli_reports_the_problem_and_fails(tmp_path, capsys):
    path = broken(tmp_path, BASE, "FROM lmsysorg/sglang:latest")
    assert cd.main(["--dockerfile", str(path), "--static-only"]) == 1
    err = capsys.readouterr().err
    assert "1 problem(s)" in err and "lmsysorg/sglang:latest" in err and "v0.5.15.post1-cu130" in err


def copy_repo(tmp_path: Path) -> Path:
    """The files the checker and the patch step read, in a scratch repository."""
    repo = tmp_path / "repo"
    scripts = ("scripts/sglang_patches.py", "scripts/megatron_patches.py")
    for rel in ("Makefile", "pyproject.toml", ".dockerignore", *scripts, "docker/entrypoint.sh"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, repo / rel)
    shutil.copytree(REPO / "patches", repo / "patches")
    return repo


def test_entrypoint_without_a_role_fails(tmp_path):
    repo = copy_repo(tmp_path)
    script = repo / "docker" / "entrypoint.sh"
    script.write_text(script.read_text().replace("\ntrainer)\n", "\ntrainer-disabled)\n"))
    errors = cd.check(DOCKERFILE, repo)
    assert any("no case branch for role(s) ['trainer']" in e for e in errors), errors


def test_missing_dockerignore_fails(tmp_path):
    repo = copy_repo(tmp_path)
    (repo / ".dockerignore").unlink()
    assert any(".dockerignore is missing" in e for e in cd.check(DOCKERFILE, repo))


@pytest.mark.slow
def test_patch_step_runs_on_the_pinned_wheel():
    out = cd.run_patch_step(DOCKERFILE)
    stacks = (REPO / "patches" / "sglang" / "v0.5.15.post1", REPO / "patches" / "megatron" / "v0.19.2")
    patches = sorted(p.name for stack in stacks for p in stack.glob("*.patch"))
    assert any(n.startswith("0004-local-l2-norm") for n in patches)
    for name in patches:  # "applied": the scratch wheels were pristine, not the venv's patched packages
        assert f"{name}: applied to" in out and f"{name}: applies and regenerates byte-identically" in out


@pytest.mark.slow
def test_patch_step_fails_on_a_hunk_that_does_not_apply(tmp_path):
    repo = copy_repo(tmp_path)
    patch = repo / "patches" / "sglang" / "v0.5.15.post1" / "0001-server-args.patch"
    text = patch.read_text()
    context = '         "Enable returning routed experts of each layer with responses.",\n'
    assert context in text, "update this test: the context line it corrupts is gone"
    patch.write_text(text.replace(context, '         "Enable returning routed experts with responses.",\n', 1))
    with pytest.raises(cd.CheckError, match=r"patch step \(Dockerfile line \d+\) failed") as failure:
        cd.run_patch_step(DOCKERFILE, repo)
    assert "0001-server-args.patch: hunk @@ -2602 +2602 does not match" in str(failure.value)


def run_entrypoint(*args: str, **env: str) -> subprocess.CompletedProcess:
    """docker/entrypoint.sh with this interpreter's directory first on PATH (its python3 plays the image's)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(
        [str(REPO / "docker" / "entrypoint.sh"), *args],
        env={**base, "PATH": path, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_entrypoint_refuses_unknown_or_missing_roles_and_settings():
    for args in ((), ("bogus",)):
        done = run_entrypoint(*args)
        assert done.returncode == 2
        assert "use one of: controller trainer rollout ray-head ray-worker check" in done.stderr
    done = run_entrypoint("ray-worker")
    assert done.returncode == 2 and "ray-worker needs RAY_ADDRESS" in done.stderr


def test_entrypoint_check_role_runs_the_patch_check():
    done = run_entrypoint("check")
    assert done.returncode == 0, done.stderr
    assert "0001-server-args.patch: applies and regenerates byte-identically (installed file: patched)" in done.stdout
    assert "0001-distrib-optimizer-dtype-groups.patch: applies and regenerates byte-identically" in done.stdout
