"""tools/check_patch against the real SGLang 0.5.23 wheel (downloaded once into .cache/sglang) and
against trees built from it in both layouts: installed package and git checkout. GNU patch does the
patching; nothing is mocked."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from runtime.sglang_patching.gnu_patch import patched_files
from runtime.sglang_patching.pinned_wheel import check_wheel, extract_from_wheel, fetch_wheel
from runtime.sglang_patching.tree import check_tree, package_root
from runtime.shared.data_files import sha256_file
from runtime.shared.sglang_patch_check import (
    APPLY_FIX,
    RECORD_NAME,
    check_hooks,
    check_installed,
    installed_sglang_root,
)
from runtime.shared.sglang_patch_manifest import Manifest, PatchError, Target, check_patch_file, load_manifest
from tools import patch_check as patch_check_cli

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def manifest() -> Manifest:
    return load_manifest()


@pytest.fixture(scope="module")
def target(manifest: Manifest) -> Target:
    return manifest.resolve(None)[0]


@pytest.fixture(scope="module")
def wheel(target: Target) -> Path:
    return fetch_wheel(target)


def _tree(wheel: Path, target: Target, root: Path, version: str | None = None) -> Path:
    """The touched files of the wheel (plus package markers) under ``root``, as in site-packages."""
    extract_from_wheel(wheel, target.files, root)
    if version is not None:
        (root / "sglang" / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    return root


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_patch_applies_compiles_and_has_its_hooks_on_the_pinned_wheel(target: Target, wheel: Path) -> None:
    report = check_wheel()
    assert report.ok, report.render()
    assert report.state == "pristine" and report.version == "0.5.23"
    text = "\n".join(report.steps)
    assert "the patch applies (dry-run)" in text
    assert f"{len(target.files)} patched files byte-compile; {len(target.hooks)} hook symbols present" in text
    assert sha256_file(wheel) == target.wheel.sha256


def test_manifest_lists_exactly_the_files_the_patch_touches(target: Target) -> None:
    assert sorted(patched_files(target.patch_file.read_text())) == sorted(target.files)
    assert {h.file for h in target.hooks} <= set(target.files)
    assert target.patch_id == "kimi_k3_dspark_sglang_0.5.23/2"
    assert f'DSPARK_CAPTURE_PATCH = "{target.patch_id}"' in target.patch_file.read_text()


def test_apply_is_idempotent_and_leaves_a_record(wheel: Path, target: Target, tmp_path: Path) -> None:
    root = _tree(wheel, target, tmp_path / "site-packages")
    first = check_tree(root, apply=True)
    assert first.ok and first.state == "patched", first.render()
    record = json.loads((root / "sglang" / RECORD_NAME).read_text())
    assert record["target"] == target.name and record["patch_sha256"] == target.patch_sha256
    assert set(record["files"]) == set(target.files)
    assert all(record["files"][n] == sha256_file(root / n) for n in target.files)
    assert check_hooks(root, target.hooks) == []
    before = _snapshot(root)
    second = check_tree(root, apply=True)
    assert second.ok and "nothing to do: already applied" in second.steps, second.render()
    assert _snapshot(root) == before
    assert not list(root.rglob("*.orig")) and not list(root.rglob("*.rej"))


def test_pristine_files_lack_the_hooks(wheel: Path, target: Target, tmp_path: Path) -> None:
    root = _tree(wheel, target, tmp_path)
    missing = check_hooks(root, target.hooks)
    assert len(missing) == len(target.hooks)
    assert any("SchedulerBatchResultProcessor._dspark_capture_prefill is not defined" in m for m in missing)


def test_both_layouts_git_checkout_and_package_folder(wheel: Path, target: Target, tmp_path: Path) -> None:
    checkout = tmp_path / "sglang-checkout"
    _tree(wheel, target, checkout / "python")
    (checkout / "python" / "sglang" / "_version.py").unlink()  # a checkout has no generated version file
    report = check_tree(checkout, apply=True)
    assert report.ok and report.tree == str((checkout / "python").resolve()), report.render()
    assert report.version is None
    # the package folder itself names the same tree
    again = check_tree(checkout / "python" / "sglang")
    assert again.ok and again.state == "patched", again.render()
    with pytest.raises(PatchError, match="holds no SGLang source"):
        package_root(tmp_path)


def test_patched_tree_without_record_is_found_by_reverse_dry_run(wheel: Path, target: Target, tmp_path: Path) -> None:
    root = _tree(wheel, target, tmp_path)
    assert check_tree(root, apply=True).ok
    (root / "sglang" / RECORD_NAME).unlink()
    report = check_tree(root)
    assert report.ok and report.state == "patched"
    assert "reverse dry-run" in " ".join(report.steps)
    applied = check_tree(root, apply=True)
    assert any("wrote" in s for s in applied.steps) and (root / "sglang" / RECORD_NAME).is_file()


def test_refuses_a_tree_patched_by_another_patch_version(wheel: Path, target: Target, tmp_path: Path) -> None:
    # recorded: the record names another target
    root = _tree(wheel, target, tmp_path / "a")
    assert check_tree(root, apply=True).ok
    record_path = root / "sglang" / RECORD_NAME
    record = json.loads(record_path.read_text())
    record.update(target="kimi_k3_dspark_sglang_0.5.22", patch_sha256="ab" * 32)
    record_path.write_text(json.dumps(record))
    before = _snapshot(root)
    report = check_tree(root, apply=True)
    assert not report.ok and report.state == "patched-other"
    assert "kimi_k3_dspark_sglang_0.5.22" in report.problems[0] and target.name in report.problems[0]
    assert "pip install --force-reinstall --no-deps sglang==0.5.23" in report.fix and APPLY_FIX in report.fix
    assert _snapshot(root) == before

    # reinstalled: pip --force-reinstall restored pristine files but left the old record behind
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(root, [n for n in archive.namelist() if n.startswith("sglang/") and n.endswith(".py")])
    report = check_tree(root, apply=True)
    assert report.ok, report.render()
    assert json.loads(record_path.read_text())["patch_sha256"] == target.patch_sha256

    # unrecorded: an older patch left its DSPARK_CAPTURE_PATCH value and code the patch does not fit
    other = _tree(wheel, target, tmp_path / "b")
    assert check_tree(other, apply=True).ok
    (other / "sglang" / RECORD_NAME).unlink()
    hooked = other / "sglang/srt/managers/scheduler_components/batch_result_processor.py"
    text = hooked.read_text().replace(target.patch_id, "kimi_k3_dspark_sglang_0.5.23/0")
    hooked.write_text(text.replace("to the sink, never into JSON lists", "older wording"))
    report = check_tree(other, apply=True)
    assert not report.ok and report.state == "patched-other"
    assert "carries dspark-capture patch 'kimi_k3_dspark_sglang_0.5.23/0'" in report.problems[0]


def test_refuses_a_tree_the_patch_does_not_fit_and_leaves_it_untouched(
    wheel: Path, target: Target, tmp_path: Path
) -> None:
    root = _tree(wheel, target, tmp_path)
    edited = root / "sglang/srt/managers/scheduler.py"
    edited.write_text(
        edited.read_text().replace("req.tokenizer = self.tokenizer", "req.tokenizer = self.tokenizer  # local")
    )
    before = _snapshot(root)
    report = check_tree(root, apply=True)
    assert not report.ok and report.state == "foreign", report.render()
    assert "does not fit this tree" in report.problems[0] and "scheduler.py" in report.problems[0]
    assert _snapshot(root) == before


def test_refuses_another_sglang_version(wheel: Path, target: Target, tmp_path: Path) -> None:
    root = _tree(wheel, target, tmp_path, version="0.5.22")
    report = check_tree(root, apply=True)
    assert not report.ok and "has sglang 0.5.22" in report.problems[0]
    assert "sglang==0.5.23" in report.fix


def test_aliases_resolve_to_the_current_target_with_a_notice(manifest: Manifest) -> None:
    for alias in ("9acd9cba39f522da71c6d9b9695f2ceb41d36b18", "9acd9cb", "f8493a4", "ee560a2"):
        resolved, notice = manifest.resolve(alias)
        assert resolved.name == manifest.current
        assert notice and alias in notice and manifest.current in notice
    assert manifest.resolve("kimi_k3_dspark_sglang_0.5.23")[1] is None
    with pytest.raises(PatchError, match="Did you mean 'kimi_k3_dspark_sglang_0.5.23'"):
        manifest.resolve("kimi_k3_dspark_sglang_0.5.2")


def test_a_changed_patch_file_is_refused(target: Target, tmp_path: Path) -> None:
    folder = tmp_path / "patches"
    shutil.copytree(REPO / "patches" / "sglang", folder)
    patch = folder / target.patch_file.relative_to(REPO / "patches" / "sglang")
    patch.write_text(patch.read_text().replace("dspark-capture patch", "dspark capture patch", 1))
    changed = load_manifest(folder / "MANIFEST.yaml").resolve(None)[0]
    with pytest.raises(PatchError, match="regenerate it with tools/check_patch --regenerate"):
        check_patch_file(changed)


def test_manifest_errors_name_the_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "MANIFEST.yaml"
    text = (REPO / "patches/sglang/MANIFEST.yaml").read_text()
    path.write_text(text.replace("current: kimi_k3_dspark_sglang_0.5.23", "current: nope"))
    with pytest.raises(PatchError, match=r"MANIFEST.yaml: field 'current' is 'nope'"):
        load_manifest(path)
    path.write_text(text.replace("    target: kimi_k3_dspark_sglang_0.5.23\n", "    target: gone\n", 1))
    with pytest.raises(PatchError, match=r"aliases.9acd9cba39f522da71c6d9b9695f2ceb41d36b18.target must name"):
        load_manifest(path)


def test_check_installed_follows_the_installed_package(
    wheel: Path, target: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site-packages"
    _tree(wheel, target, site)
    info = site / "sglang-0.5.23.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    importlib.invalidate_caches()
    assert installed_sglang_root() == site.resolve()

    unpatched = check_installed()
    assert not unpatched.ok and unpatched.state == "pristine" and unpatched.fix == APPLY_FIX

    assert patch_check_cli.main(["--apply"]) == 0  # --apply without --tree patches the installed package
    assert check_installed().ok
    assert check_installed("f8493a4").notices  # an alias works and says so

    changed = site / target.files[0]
    changed.write_text(changed.read_text() + "# local edit\n")
    report = check_installed()
    assert not report.ok and "changed after the patch was applied" in report.problems[0]


def test_cli_exit_codes(wheel: Path, target: Target, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _tree(wheel, target, tmp_path / "good")
    assert patch_check_cli.main(["--tree", str(good)]) == 0
    bad = _tree(wheel, target, tmp_path / "bad", version="0.4.0")
    assert patch_check_cli.main(["--tree", str(bad)]) == 1
    assert patch_check_cli.main(["--target", "no-such-target"]) == 2
    out = capsys.readouterr()
    assert "result: OK" in out.out and "result: FAILED" in out.out and "no patch target or alias" in out.err


def test_the_wheel_holds_every_file_the_patch_touches(wheel: Path, target: Target) -> None:
    with zipfile.ZipFile(wheel) as archive:
        assert set(target.files) <= set(archive.namelist())
