"""The SGLang patch stack (`patches/sglang/v0.5.10.post1/`) against the pip-installed sglang 0.5.10.post1 wheel.

Pristine files are the wheel's, proven by the sha256 digests in its `dist-info/RECORD`; `make setup` applies the
stack to the installed package, so these tests also check that the tested sglang is the patched one.
"""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="sglang==0.5.10.post1 is installed by make setup")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "sglang_patches.py"
_spec = importlib.util.spec_from_file_location("sglang_patches", SCRIPT)
sp = importlib.util.module_from_spec(_spec)
sys.modules["sglang_patches"] = sp  # dataclasses resolve their module through sys.modules
_spec.loader.exec_module(sp)


@pytest.fixture(scope="module")
def installed():
    return sp.installed_root()


def test_every_patch_applies_to_the_wheel_and_regenerates_byte_identically(installed):
    root, digests = installed
    patches = sp.load_patches()
    assert len(patches) >= 5
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
    drifted = original.replace("enable_return_routed_experts: bool = False", "enable_return_routed_experts = False")
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


@pytest.mark.parametrize("kind", ["BatchTokenIDOutput", "BatchStrOutput"])
def test_multi_tokenizer_split_keeps_each_requests_trace_handle(kind):
    """The multi-tokenizer router splits a batch output per request (`_handle_output_by_index`); both branches a
    generate request takes carry its TRACE handle (0008)."""
    import dataclasses

    from tests.sglang_cpu import install_sgl_kernel_stand_in

    install_sgl_kernel_stand_in()
    io_struct = pytest.importorskip("sglang.srt.managers.io_struct")
    mixin = pytest.importorskip("sglang.srt.managers.multi_tokenizer_mixin")
    cls = getattr(io_struct, kind)
    handles = [{"trajectory": "a"}, None]
    values = {}
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            values[f.name] = [None, None]
    values.update(rids=["a", "b"], trace_handles=handles)
    out = cls(**values)
    assert mixin._handle_output_by_index(out, 0).trace_handles == [handles[0]]
    assert mixin._handle_output_by_index(out, 1).trace_handles == [None]
