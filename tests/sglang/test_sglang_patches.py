"""The SGLang patch stack (`patches/sglang/v0.5.15.post1/`) against the pip-installed sglang 0.5.15.post1 wheel.

Pristine files are the wheel's, proven by the sha256 digests in its `dist-info/RECORD`; `make setup` applies the
stack to the installed package, so these tests also check that the tested sglang is the patched one.
"""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sglang

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sglang_patches.py"
_spec = importlib.util.spec_from_file_location("sglang_patches", SCRIPT)
sp = importlib.util.module_from_spec(_spec)
sys.modules["sglang_patches"] = sp  # dataclasses resolve their module through sys.modules
_spec.loader.exec_module(sp)


@pytest.fixture(scope="module")
def installed():
    return sp.installed_root()


def test_every_patch_applies_to_the_wheel_and_regenerates_byte_identically(installed):
    root, digests = installed
    assert sglang.__version__ == sp.SGLANG_VERSION == "0.5.15.post1"
    patches = sp.load_patches()
    # what no plugin seam reaches: server-argument fields, the fused and native FC2 inputs, the FP4-KV attention read
    assert [p.package_path for p in patches] == [
        "sglang/srt/server_args.py",
        "sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe.py",
        "sglang/srt/layers/moe/fused_moe_native.py",
        "sglang/srt/layers/attention/triton_backend.py",
    ]
    for patch in patches:
        original, state = sp.pristine(patch, root, digests)
        assert state == "patched", f"{patch.package_path} is not patched; run `make setup`"
        patched = sp.apply_hunks(patch, original)
        assert (root / patch.package_path).read_text() == patched
        regenerated = sp.make_patch(patch.description, patch.path, original, patched)
        assert regenerated == (sp.PATCH_DIR / patch.name).read_text(), patch.name
        assert sp.apply_hunks(patch, patched, reverse=True) == original
        assert patch.path.startswith("python/sglang/srt/")  # upstream repository layout


def test_cli_check_and_apply_are_idempotent(capsys):
    assert sp.main(["check"]) == 0
    assert sp.main(["apply"]) == 0
    assert "already applied" in capsys.readouterr().out


def test_a_changed_context_line_is_refused_naming_the_hunk(installed):
    root, digests = installed
    patch = next(p for p in sp.load_patches() if p.path.endswith("server_args.py"))
    original, _ = sp.pristine(patch, root, digests)
    context = '"Enable returning routed experts of each layer with responses.",'  # a context line of hunk 1
    assert original.count(context) == 1
    drifted = original.replace(context, '"Return routed experts.",')
    with pytest.raises(sp.PatchError, match=r"0001-server-args.patch: hunk @@ -\d+"):
        sp.apply_hunks(patch, drifted)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_apply_accepts_the_stack_in_upstream_layout(installed, tmp_path):
    """`git apply` in an upstream checkout layout (python/sglang/...) takes the patches as they are."""
    root, digests = installed
    patches = sp.load_patches()
    for patch in patches:
        original, _ = sp.pristine(patch, root, digests)
        dest = tmp_path / patch.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(original)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    files = [str(sp.PATCH_DIR / p.name) for p in patches]
    subprocess.run(["git", "apply", *files], cwd=tmp_path, check=True)
    for patch in patches:
        assert (tmp_path / patch.path).read_text() == (root / patch.package_path).read_text()
