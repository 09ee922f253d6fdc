#!/usr/bin/env python3
"""Apply, regenerate and check TRACE's SGLang patch stack (`patches/sglang/v<version>/`).

Each patch is a unified diff of one file in the upstream repository layout (`python/sglang/srt/...`), preceded by
a short description. Pristine sources come from the pip-installed wheel, verified against the sha256 digests in its
`dist-info/RECORD`; a file that is already patched is turned back into its pristine form by reverse-applying its
patch (and verified the same way). Patches are applied exactly (context and line numbers must match; no fuzz).

    python scripts/sglang_patches.py apply              # patch the installed sglang (idempotent)
    python scripts/sglang_patches.py check              # patches apply to the pristine wheel files and
                                                        # regenerate byte-identically; installed state reported
    python scripts/sglang_patches.py export TREE        # write the patched files into an upstream-layout tree
    python scripts/sglang_patches.py regenerate TREE    # rewrite the patches from an edited tree
                                                        # (TREE/python/sglang/srt/...), keeping descriptions

A new patch starts as a file holding its description and the two header lines `--- a/<path>` / `+++ b/<path>`;
`regenerate` fills in the hunks. After changing patches, reinstall the pristine wheel before `apply`.

The machinery is generic over a `Stack` (the distribution, its pinned version, the patch directory):
`scripts/megatron_patches.py` runs it for the megatron-core stack.
"""

from __future__ import annotations

import argparse
import base64
import difflib
import hashlib
import importlib.metadata
import re
import sys
from dataclasses import dataclass
from pathlib import Path

SGLANG_VERSION = "0.5.15.post1"
REPO = Path(__file__).resolve().parent.parent
PATCH_DIR = REPO / "patches" / "sglang" / f"v{SGLANG_VERSION}"
UPSTREAM_PREFIX = "python/"  # upstream keeps the package under python/sglang
HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass(frozen=True)
class Stack:
    """A patch stack: the pip distribution it patches, the pinned version and the directory of its patches."""

    dist: str
    version: str
    patch_dir: Path


SGLANG = Stack("sglang", SGLANG_VERSION, PATCH_DIR)


class PatchError(RuntimeError):
    """A patch does not apply, or a file is neither pristine nor patched."""


@dataclass(frozen=True)
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: tuple[str, ...]  # each starts with ' ', '-' or '+', newline included


@dataclass(frozen=True)
class FilePatch:
    """One patch file: description, the upstream path it changes, and its hunks."""

    name: str
    description: str
    path: str  # upstream layout, e.g. python/sglang/srt/server_args.py
    hunks: tuple[Hunk, ...]

    @property
    def package_path(self) -> str:
        return self.path.removeprefix(UPSTREAM_PREFIX)


def parse_patch(name: str, text: str) -> FilePatch:
    lines = text.splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("--- a/"))
    except StopIteration:
        raise PatchError(f"{name}: no '--- a/<path>' header") from None
    path = lines[start][len("--- a/") :].rstrip("\n")
    if lines[start + 1].rstrip("\n") != f"+++ b/{path}":
        raise PatchError(f"{name}: expected '+++ b/{path}' after the '---' header")
    hunks, i = [], start + 2
    while i < len(lines):
        m = HUNK_RE.match(lines[i])
        if not m:
            raise PatchError(f"{name}: line {i + 1} is not a hunk header: {lines[i]!r}")
        old_len = int(m.group(2) or 1)
        new_len = int(m.group(4) or 1)
        body, i = [], i + 1
        while i < len(lines) and not lines[i].startswith("@@"):
            body.append(lines[i])
            i += 1
        if sum(ln[0] in " -" for ln in body) != old_len or sum(ln[0] in " +" for ln in body) != new_len:
            raise PatchError(f"{name}: hunk at -{m.group(1)} has line counts that do not match its header")
        hunks.append(Hunk(int(m.group(1)), old_len, int(m.group(3)), new_len, tuple(body)))
    return FilePatch(name, "".join(lines[:start]), path, tuple(hunks))


def apply_hunks(patch: FilePatch, text: str, reverse: bool = False) -> str:
    """`text` with the patch applied (or reversed); PatchError naming the hunk that does not match."""
    src = text.splitlines(keepends=True)
    out, pos = [], 0
    take, give = (" +", " -") if reverse else (" -", " +")
    for h in patch.hunks:
        line, count = (h.new_start, h.new_len) if reverse else (h.old_start, h.old_len)
        start = line if count == 0 else line - 1  # an empty range names the line it follows
        expected = [ln[1:] for ln in h.lines if ln[0] in take]
        if start < pos or src[start : start + len(expected)] != expected:
            raise PatchError(f"{patch.name}: hunk @@ -{h.old_start} +{h.new_start} does not match {patch.path}")
        out.extend(src[pos:start])
        out.extend(ln[1:] for ln in h.lines if ln[0] in give)
        pos = start + len(expected)
    out.extend(src[pos:])
    return "".join(out)


def make_patch(description: str, path: str, old: str, new: str) -> str:
    """The patch text for `path` changed from `old` to `new` (3 lines of context)."""
    diff = difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path}", f"b/{path}", n=3
    )
    lines = list(diff)
    if not lines:
        raise PatchError(f"{path}: no change to write a patch for")
    lines[0], lines[1] = f"--- a/{path}\n", f"+++ b/{path}\n"  # difflib appends tabs/dates to headers otherwise
    if any(not ln.endswith("\n") for ln in lines):
        raise PatchError(f"{path}: files must end with a newline")
    return description + "".join(lines)


def load_patches(stack: Stack = SGLANG) -> list[FilePatch]:
    files = sorted(stack.patch_dir.glob("*.patch"))
    if not files:
        raise PatchError(f"no patches under {stack.patch_dir}")
    return [parse_patch(f.name, f.read_text()) for f in files]


def installed_root(stack: Stack = SGLANG) -> tuple[Path, dict[str, str]]:
    """The installed distribution's site directory and its RECORD digests (path -> urlsafe-b64 sha256)."""
    dist = importlib.metadata.distribution(stack.dist)
    if dist.version != stack.version:
        raise PatchError(f"installed {stack.dist} is {dist.version}; these patches are for {stack.version}")
    digests = {}
    for line in (dist.read_text("RECORD") or "").splitlines():
        path, digest, _ = line.rsplit(",", 2)
        if digest.startswith("sha256="):
            digests[path] = digest[len("sha256=") :]
    return Path(dist.locate_file("")), digests


def _digest(text: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()


def pristine(patch: FilePatch, root: Path, digests: dict[str, str], stack: Stack = SGLANG) -> tuple[str, str]:
    """(pristine text, state of the installed file: 'pristine' or 'patched'), verified against RECORD."""
    want = digests.get(patch.package_path)
    if want is None:
        raise PatchError(f"{patch.package_path} is not in the {stack.dist} {stack.version} wheel RECORD")
    current = (root / patch.package_path).read_text()
    if _digest(current) == want:
        return current, "pristine"
    try:
        original = apply_hunks(patch, current, reverse=True)
    except PatchError:
        original = None
    if original is None or _digest(original) != want or apply_hunks(patch, original) != current:
        raise PatchError(
            f"{patch.package_path} is neither the pristine {stack.version} file nor that file with {patch.name}; "
            f"reinstall {stack.dist} (pip install --force-reinstall --no-deps {stack.dist}=={stack.version})"
        )
    return original, "patched"


def cmd_apply(stack: Stack = SGLANG) -> int:
    root, digests = installed_root(stack)
    for patch in load_patches(stack):
        original, state = pristine(patch, root, digests, stack)
        if state == "pristine":
            (root / patch.package_path).write_text(apply_hunks(patch, original))
        print(f"{patch.name}: {'applied' if state == 'pristine' else 'already applied'} to {patch.package_path}")
    return 0


def cmd_check(stack: Stack = SGLANG) -> int:
    root, digests = installed_root(stack)
    for patch in load_patches(stack):
        original, state = pristine(patch, root, digests, stack)
        text = (stack.patch_dir / patch.name).read_text()
        again = make_patch(patch.description, patch.path, original, apply_hunks(patch, original))
        if again != text:
            raise PatchError(f"{patch.name}: regenerating from the pristine file does not give the same bytes")
        print(f"{patch.name}: applies and regenerates byte-identically (installed file: {state})")
    return 0


def cmd_export(tree: Path, stack: Stack = SGLANG) -> int:
    root, digests = installed_root(stack)
    for patch in load_patches(stack):
        original, _ = pristine(patch, root, digests, stack)
        out = tree / patch.path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(apply_hunks(patch, original))
        print(f"{patch.name}: wrote {out}")
    return 0


def cmd_regenerate(tree: Path, stack: Stack = SGLANG) -> int:
    root, digests = installed_root(stack)
    for patch in load_patches(stack):
        original, _ = pristine(patch, root, digests, stack)
        edited = (tree / patch.path).read_text()
        (stack.patch_dir / patch.name).write_text(make_patch(patch.description, patch.path, original, edited))
        print(f"{patch.name}: regenerated")
    return 0


def main(argv: list[str] | None = None, stack: Stack = SGLANG, doc: str | None = __doc__) -> int:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("apply")
    sub.add_parser("check")
    sub.add_parser("export").add_argument("tree", type=Path, help="directory to write the patched files into")
    sub.add_parser("regenerate").add_argument("tree", type=Path, help="edited upstream-layout tree")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "apply":
            return cmd_apply(stack)
        if args.cmd == "check":
            return cmd_check(stack)
        if args.cmd == "export":
            return cmd_export(args.tree, stack)
        return cmd_regenerate(args.tree, stack)
    except PatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
