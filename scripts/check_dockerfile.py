#!/usr/bin/env python3
"""Check docker/Dockerfile without a Docker engine (what `make docker-check` runs in CI).

    python scripts/check_dockerfile.py                  # static checks, then the patch step on the pinned wheels
    python scripts/check_dockerfile.py --static-only    # static checks only (what `make docker` runs first)

Static checks: the base image is the official SGLang release image pinned to the version the patch stack is for
(`scripts/sglang_patches.py`); every pip package is pinned (`name==version`) and agrees with pyproject.toml's exact
pins; the sglang wheel is reinstalled (and megatron-core installed) before the patch step; the patch step runs
`apply` and then `check` of both patch stacks, `scripts/sglang_patches.py` and `scripts/megatron_patches.py` (the
scripts `make setup` uses), with nothing that could mask a failure; the final USER is not
root; the ENTRYPOINT is docker/entrypoint.sh and it has the rollout, trainer and controller roles; no ADD of a URL;
no secret-looking ENV / ARG; a .dockerignore keeps .git and .venv out of the context.

Patch step: the Dockerfile's patch RUN command, verbatim, in the repository root, against the sglang and megatron-core
wheels the Dockerfile pins, installed without dependencies into a temporary directory (the same files and RECORD the
image's site-packages holds). Its interpreter runs with `-S`, so the only sglang and megatron it sees are those.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE_REPOSITORY = "lmsysorg/sglang"
PATCH_SCRIPT = "scripts/sglang_patches.py"
PATCH_SCRIPTS = (PATCH_SCRIPT, "scripts/megatron_patches.py")  # each stack: `apply`, then `check`, in the patch step
ENTRYPOINT = "docker/entrypoint.sh"
REQUIRED_ROLES = ("rollout", "trainer", "controller")
REQUIRED_PACKAGES = ("megatron-core", "ray", "zstandard")
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW(OR)?D|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL", re.IGNORECASE)
SECRET_VALUE = re.compile(r"\b(hf_[A-Za-z0-9]{30,}|gh[pousr]_[A-Za-z0-9]{30,}|AKIA[0-9A-Z]{16}|sk-[A-Za-z0-9_-]{20,})")
URL = re.compile(r"^(https?|ftp)://|^git@|\.git(#.*)?$")
PIP_VALUE_OPTIONS = {
    "-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url", "-f", "--find-links",
    "-t", "--target", "--prefix", "--root", "--platform", "--python-version", "--implementation", "--abi",
}  # fmt: skip
PINNED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[A-Za-z0-9,._-]+\])?==([A-Za-z0-9.+!_-]+)$")


class CheckError(RuntimeError):
    """The Dockerfile breaks a rule, or its patch step fails."""


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction."""

    line: int  # 1-based line of the instruction's first line
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str  # continuation lines joined, comment lines inside a continuation dropped


@dataclass(frozen=True)
class PipInstall:
    """One `pip install` command of a RUN instruction."""

    line: int
    packages: tuple[str, ...]  # positional arguments: requirements or local paths
    options: tuple[str, ...]


def parse_dockerfile(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile (backslash continuations joined, comments dropped)."""
    out: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not parts and (not stripped or stripped.startswith("#")):
            continue
        if parts and stripped.startswith("#"):
            continue  # Docker drops comment lines inside a continuation
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped)
        keyword, _, args = " ".join(p for p in parts if p).partition(" ")
        out.append(Instruction(start, keyword.upper(), args.strip()))
        parts = []
    if parts:
        raise CheckError(f"line {start}: the last instruction ends in a line continuation")
    return out


def shell_commands(script: str) -> list[tuple[list[str], str]]:
    """A RUN's shell script split into simple commands, each with the operator that follows it ('' at the end)."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands: list[tuple[list[str], str]] = []
    words: list[str] = []
    for token in lexer:
        if token and set(token) <= set(";&|"):
            commands.append((words, token))
            words = []
        else:
            words.append(token)
    commands.append((words, ""))
    return [(w, op) for w, op in commands if w]


def pip_installs(instructions: list[Instruction]) -> list[PipInstall]:
    """Every `pip install` in the RUN instructions, with its positional arguments and options."""
    out = []
    for ins in instructions:
        if ins.keyword != "RUN":
            continue
        for words, _ in shell_commands(ins.args):
            try:
                i = next(k for k, w in enumerate(words) if Path(w).name in ("pip", "pip3"))
            except StopIteration:
                continue
            if i + 1 >= len(words) or words[i + 1] != "install":
                continue
            packages, options, rest = [], [], iter(words[i + 2 :])
            for w in rest:
                if w.startswith("-"):
                    options.append(w)
                    if w in PIP_VALUE_OPTIONS:
                        options.append(next(rest, ""))
                else:
                    packages.append(w)
            out.append(PipInstall(ins.line, tuple(packages), tuple(options)))
    return out


def read_pins(repo: Path) -> tuple[str, dict[str, str]]:
    """(the SGLang version the patch stack is for, pyproject.toml's exact `name==version` dependency pins)."""
    script = (repo / PATCH_SCRIPT).read_text()
    m = re.search(r'^SGLANG_VERSION = "([^"]+)"', script, re.MULTILINE)
    if not m:
        raise CheckError(f"{PATCH_SCRIPT} defines no SGLANG_VERSION")
    pyproject = (repo / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.MULTILINE | re.DOTALL)
    pins = dict(re.findall(r'"([A-Za-z0-9._-]+)==([^"]+)"', deps.group(1) if deps else ""))
    return m.group(1), {_norm(k): v for k, v in pins.items()}


def _norm(name: str) -> str:
    """A package name in PEP 503 normal form (megatron_core -> megatron-core)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def check_base(instructions: list[Instruction], sglang: str) -> list[str]:
    froms = [i for i in instructions if i.keyword == "FROM"]
    if not froms:
        return ["no FROM instruction"]
    ins = froms[-1]
    words = [w for w in ins.args.split() if not w.startswith("--")]
    image = words[0] if words else ""
    where = f"FROM at line {ins.line}"
    if "$" in image:
        return [f"{where}: base image {image!r} uses a build variable; write the pinned image literally"]
    name, _, digest = image.partition("@")
    repository, _, tag = name.rpartition(":") if ":" in name.split("/")[-1] else (name, "", "")
    errors = []
    if repository != BASE_REPOSITORY:
        errors.append(f"{where}: base image {image!r} is not the official SGLang release image {BASE_REPOSITORY}")
    if not tag or tag == "latest":
        errors.append(
            f"{where}: base image {image!r} is not pinned to a release tag; use {BASE_REPOSITORY}:v{sglang}-cu130"
        )
    elif not re.fullmatch(rf"v{re.escape(sglang)}(-cu\d+)?(-amd64|-arm64)?", tag):
        errors.append(
            f"{where}: base image tag {tag!r} is not SGLang {sglang}, the version {PATCH_SCRIPT} patches; "
            f"use v{sglang}-cu130"
        )
    if digest and not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        errors.append(f"{where}: digest {digest!r} is not sha256:<64 hex digits>")
    return errors


def check_pins(instructions: list[Instruction], sglang: str, pins: dict[str, str]) -> list[str]:
    errors, seen = [], {}
    installs = pip_installs(instructions)
    for pip in installs:
        if any(o in ("-r", "--requirement") for o in pip.options):
            errors.append(f"line {pip.line}: pip install -r: list the packages, pinned, in the Dockerfile")
        for package in pip.packages:
            if package == "." or package.startswith(("/", "./")):
                if "--no-deps" not in pip.options:
                    errors.append(
                        f"line {pip.line}: local package {package!r} installed with its dependencies; use --no-deps "
                        "(pyproject asks for torch >= 2.11, SGLang's image keeps its own torch)"
                    )
                seen["."] = pip
                continue
            m = PINNED.match(package)
            if not m:
                errors.append(f"line {pip.line}: pip package {package!r} is not pinned; write it as name==version")
                continue
            name, version = _norm(m.group(1)), m.group(3)
            seen[name] = pip
            if name in pins and pins[name] != version:
                errors.append(f"line {pip.line}: {name}=={version}, but pyproject.toml pins {name}=={pins[name]}")
            if name == "sglang" and version != sglang:
                errors.append(f"line {pip.line}: sglang=={version}, but {PATCH_SCRIPT} patches sglang {sglang}")
    errors += [f"{n} is not installed (pip install {n}==<version>)" for n in REQUIRED_PACKAGES if n not in seen]
    if "." not in seen:
        errors.append("the TRACE packages are not installed (pip install --no-deps .)")
    reinstall = seen.get("sglang")
    if reinstall is None or not {"--no-deps", "--force-reinstall"} <= set(reinstall.options):
        errors.append(
            f"the sglang {sglang} wheel is not reinstalled before the patch step "
            f"(pip install --no-deps --force-reinstall sglang=={sglang}); the patch script verifies files against "
            "the wheel's RECORD"
        )
    for ins in instructions:
        if ins.keyword != "RUN":
            continue
        for words, _ in shell_commands(ins.args):
            if words[:2] in (["apt-get", "install"], ["apt", "install"]):
                loose = [w for w in words[2:] if not w.startswith("-") and "=" not in w]
                if loose:
                    errors.append(f"line {ins.line}: apt packages {loose} are not pinned; write them as name=version")
    return errors


def patch_step(instructions: list[Instruction]) -> Instruction:
    """The one RUN that calls the patch script; CheckError naming what is wrong with it."""
    runs = [i for i in instructions if i.keyword == "RUN" and "sglang_patches.py" in i.args]
    if len(runs) != 1:
        raise CheckError(
            f"expected one RUN calling {PATCH_SCRIPT} (apply, then check), found {len(runs)}: the patch step is missing"
            if not runs
            else f"expected one RUN calling {PATCH_SCRIPT}, found {len(runs)} (lines {[r.line for r in runs]})"
        )
    ins = runs[0]
    commands = shell_commands(ins.args)
    masking = sorted({op for _, op in commands if op and op != "&&"})
    if masking:
        raise CheckError(
            f"line {ins.line}: the patch step joins commands with {masking}; "
            "use only && so that a failing hunk fails the build"
        )
    for script in PATCH_SCRIPTS:
        calls = [words[words.index(w) + 1 :] for words, _ in commands for w in words if w.endswith(script)]
        subcommands = [c[0] if c else "" for c in calls]
        if subcommands[:1] != ["apply"] or "check" not in subcommands:
            raise CheckError(
                f"line {ins.line}: the patch step must run `{script} apply` and then `{script} check`; "
                f"it runs {subcommands or 'no ' + script}"
            )
    return ins


def check_patch_step(instructions: list[Instruction], repo: Path) -> list[str]:
    try:
        step = patch_step(instructions)
    except CheckError as e:
        return [str(e)]
    errors = []
    before = [i for i in instructions if i.line < step.line]
    copied = " ".join(i.args for i in before if i.keyword == "COPY")
    sources = {w for i in before if i.keyword == "COPY" for w in shlex.split(i.args)[:-1] if not w.startswith("--")}
    for script in PATCH_SCRIPTS:
        if not sources & {script, "scripts", "scripts/", "."}:
            errors.append(f"line {step.line}: {script} is not copied into the image before the patch step")
    if "patches/" not in copied:
        errors.append(f"line {step.line}: patches/ is not copied into the image before the patch step")
    for package, what in (("sglang", "the sglang wheel reinstall"), ("megatron-core", "the megatron-core install")):
        if not [p for p in pip_installs(before) if any(_norm(x.split("==")[0]) == package for x in p.packages)]:
            errors.append(f"line {step.line}: {what} must come before the patch step")
    makefile = (repo / "Makefile").read_text()
    for script in PATCH_SCRIPTS:
        if f"{script} apply" not in makefile:
            errors.append(f"Makefile does not run `{script} apply`: the image must patch with the script tests use")
    return errors


def check_user_entrypoint(instructions: list[Instruction], repo: Path) -> list[str]:
    errors = []
    users = [i for i in instructions if i.keyword == "USER"]
    if not users:
        errors.append("no USER instruction: the image would run as root; add a non-root USER")
    elif users[-1].args.split(":")[0] in ("root", "0"):
        errors.append(f"line {users[-1].line}: the final USER is {users[-1].args!r}; the image must not run as root")
    entries = [i for i in instructions if i.keyword == "ENTRYPOINT"]
    if not entries:
        return errors + ["no ENTRYPOINT: the image needs docker/entrypoint.sh with its roles"]
    try:
        argv = json.loads(entries[-1].args)
    except json.JSONDecodeError:
        argv = None
    if not isinstance(argv, list) or not argv or not Path(str(argv[0])).name == Path(ENTRYPOINT).name:
        errors.append(f'line {entries[-1].line}: ENTRYPOINT must be the exec form ["<dir>/{ENTRYPOINT}"]')
    if not any(i.keyword == "COPY" and ENTRYPOINT in i.args for i in instructions):
        errors.append(f"{ENTRYPOINT} is not copied into the image")
    script = repo / ENTRYPOINT
    if not script.exists():
        return errors + [f"{ENTRYPOINT} does not exist"]
    roles = set()
    for line in script.read_text().splitlines():
        m = re.match(r"^\s*([a-z][\w|\s-]*)\)\s*$", line)
        if m:
            roles.update(r.strip() for r in m.group(1).split("|"))
    missing = [r for r in REQUIRED_ROLES if r not in roles]
    if missing:
        errors.append(f"{ENTRYPOINT} has no case branch for role(s) {missing}")
    if not os.access(script, os.X_OK):
        errors.append(f"{ENTRYPOINT} is not executable (chmod +x; git keeps the mode)")
    return errors


def check_hygiene(instructions: list[Instruction], repo: Path) -> list[str]:
    errors = []
    for ins in instructions:
        if ins.keyword == "ADD":
            sources = [w for w in shlex.split(ins.args) if not w.startswith("--")][:-1]
            errors += [
                f"line {ins.line}: ADD of the URL {s!r}; fetch it in a RUN that checks a checksum"
                for s in sources
                if URL.search(s)
            ]
        if ins.keyword in ("ENV", "ARG"):
            words = shlex.split(ins.args)
            names = [w.split("=", 1)[0] for w in words] if all("=" in w for w in words) else words[:1]
            errors += [
                f"line {ins.line}: {ins.keyword} {n} looks like a secret; pass secrets at run time, never in the image"
                for n in names
                if SECRET_NAME.search(n)
            ]
        if SECRET_VALUE.search(ins.args):
            errors.append(f"line {ins.line}: {ins.keyword} holds a value shaped like an access token")
    ignore = repo / ".dockerignore"
    if not ignore.exists():
        errors.append(".dockerignore is missing: the build context would include .git, .venv and out/")
    else:
        rules = [r.strip() for r in ignore.read_text().splitlines() if r.strip() and not r.startswith("#")]
        if not (rules[:1] == ["*"] or {".git", ".venv"} <= {r.strip("/") for r in rules}):
            errors.append(".dockerignore must exclude .git and .venv (or start with '*' and list what the image needs)")
    return errors


def check(dockerfile: Path, repo: Path = REPO) -> list[str]:
    """Every rule the Dockerfile breaks, as messages naming the line and the fix; empty when it passes."""
    instructions = parse_dockerfile(dockerfile.read_text())
    sglang, pins = read_pins(repo)
    return (
        check_base(instructions, sglang)
        + check_pins(instructions, sglang, pins)
        + check_patch_step(instructions, repo)
        + check_user_entrypoint(instructions, repo)
        + check_hygiene(instructions, repo)
    )


def run_patch_step(dockerfile: Path, repo: Path = REPO, work: Path | None = None) -> str:
    """Run the Dockerfile's patch step, verbatim, in `repo` on the sglang and megatron-core wheels it pins; its
    output, or CheckError."""
    instructions = parse_dockerfile(dockerfile.read_text())
    step = patch_step(instructions)
    sglang, pins = read_pins(repo)
    with tempfile.TemporaryDirectory(prefix="trace-docker-check-") as tmp:
        work = work or Path(tmp)
        site, bin_dir = work / "site", work / "bin"
        for name, version in (("sglang", sglang), ("megatron-core", pins["megatron-core"])):
            if (site / f"{name.replace('-', '_')}-{version}.dist-info").exists():
                continue
            pip = ["-m", "pip", "install", "-q", "--no-deps", "--target", str(site), f"{name}=={version}"]
            done = subprocess.run([sys.executable, *pip], capture_output=True, text=True)
            if done.returncode:
                raise CheckError(f"could not install the {name} {version} wheel: {done.stderr.strip()[-2000:]}")
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name in ("python3", "python"):
            shim = bin_dir / name
            shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
            shim.chmod(0o755)
        env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONPATH=str(site))
        done = subprocess.run(["/bin/sh", "-c", step.args], cwd=repo, env=env, capture_output=True, text=True)
        output = (done.stdout + done.stderr).strip()
        if done.returncode:
            raise CheckError(f"the patch step (Dockerfile line {step.line}) failed:\n{output}")
        return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dockerfile", type=Path, default=REPO / "docker" / "Dockerfile")
    parser.add_argument("--static-only", action="store_true", help="skip running the patch step")
    args = parser.parse_args(argv)
    try:
        errors = check(args.dockerfile)
        if errors:
            print(f"{args.dockerfile}: {len(errors)} problem(s):", file=sys.stderr)
            for e in errors:
                print(f"  - {e}", file=sys.stderr)
            return 1
        print(f"{args.dockerfile}: static checks passed")
        if not args.static_only:
            print(run_patch_step(args.dockerfile))
            print(f"{args.dockerfile}: patch step passed on the pinned sglang and megatron-core wheels")
    except CheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
