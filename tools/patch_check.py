"""``tools/check_patch``: the command line over ``runtime/sglang_patching`` (check and apply on a tree
or the pinned wheel, regenerate) and :mod:`runtime.shared.sglang_patch_check` (the installed
package); see ``patches/sglang/README.md``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runtime.sglang_patching.pinned_wheel import check_wheel
from runtime.sglang_patching.regenerate import regenerate
from runtime.sglang_patching.tree import check_tree
from runtime.shared.sglang_patch_check import check_installed, installed_sglang_root
from runtime.shared.sglang_patch_manifest import MANIFEST_PATH, PatchError
from runtime.user_errors import file_kind_problem

# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``tools/check_patch [--target NAME] [--tree PATH | --installed] [--apply] [--regenerate TREE]``."""
    parser = argparse.ArgumentParser(
        prog="tools/check_patch",
        description="Check (and apply) the versioned SGLang capture patch. Without --tree or --installed it "
        "checks the pinned PyPI wheel (downloaded once into .cache/sglang).",
    )
    parser.add_argument("--target", help="patch target or alias (default: the manifest's current target)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--tree", type=Path, help="an SGLang tree: site-packages, the sglang package folder, or a git checkout"
    )
    where.add_argument("--installed", action="store_true", help="the sglang package this Python imports")
    where.add_argument("--regenerate", type=Path, metavar="EDITED_TREE", help="rewrite the patch from an edited tree")
    parser.add_argument(
        "--apply", action="store_true", help="patch the tree (idempotent; default: the installed package)"
    )
    args = parser.parse_args(argv)

    try:
        if args.regenerate:
            path = regenerate(args.regenerate, args.target)
            print(f"wrote {path} and updated {MANIFEST_PATH}; now run tools/check_patch")
            return 0
        if args.tree is not None:
            kind = file_kind_problem(args.tree)
            if kind not in (None, "a folder"):
                raise PatchError(f"--tree {args.tree} is {kind}; fix: give an SGLang tree (a folder)")
            report = check_tree(args.tree, args.target, apply=args.apply)
        elif args.installed or args.apply:
            root = installed_sglang_root()
            if args.apply:
                if root is None:
                    raise PatchError(f"sglang is not installed for {sys.executable}; pip install it first")
                report = check_tree(root, args.target, apply=True)
            else:
                report = check_installed(args.target)
        else:
            report = check_wheel(args.target)
    except PatchError as exc:
        print(f"check_patch: {exc}", file=sys.stderr)
        return 2
    print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
