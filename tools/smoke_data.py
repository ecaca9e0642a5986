"""``tools/derive_smoke_data``: the smoke gate's fixture, the N longest rows of the full data.

    tools/derive_smoke_data --recipe kimi_k3_v1c
        reads the recipe's data.train_path (checked against data.expected_sha256) and writes the
        smoke overlay's data.train_path with its num_rows longest rows (4 for K3, all at 65,536
        tokens), plus a manifest recording the SHA-256 and where the rows came from; the smoke
        overlay's ``expected_sha256: manifest`` then takes the SHA from that manifest.
    tools/derive_smoke_data --input FULL.jsonl --expected-sha256 HEX --rows 4 --output SMOKE.jsonl

The longest rows exercise the 64K paths (capture offsets, trainer memory) that a short row would not.
Rows keep their order in the full file; ties in length go to the earlier row.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from runtime.shared.data_files import (
    DataFileError,
    check_data_sha256,
    iter_rows,
    rows_text,
    sha256_file,
    write_manifest,
    write_rows,
)
from runtime.user_errors import output_place, run_command
from tools.data_prepare import refuse_to_replace_pinned_data
from tools.recipe_args import load_tool_recipe


def derive(input_path: Path, expected_sha256: str, num_rows: int, output_path: Path) -> dict:
    """Write the ``num_rows`` longest rows of ``input_path`` to ``output_path`` with a manifest."""
    source_sha = check_data_sha256(
        input_path, expected_sha256, recipe_file=str(input_path), field_name="--expected-sha256"
    )
    rows = list(iter_rows(input_path))
    if len(rows) < num_rows:
        raise DataFileError(
            f"{input_path} has {len(rows)} rows, fewer than the {num_rows} asked for; fix: ask for at most "
            f"{len(rows)} (--rows, or the smoke overlay's data.num_rows), or give the full data file"
        )
    longest = sorted(rows, key=lambda r: (-r.num_tokens, r.index))[:num_rows]
    chosen = sorted(longest, key=lambda r: r.index)
    out_rows = [{"id": r.id, "input_ids": list(r.input_ids), "loss_mask": list(r.loss_mask)} for r in chosen]
    refuse_to_replace_pinned_data(output_path, hashlib.sha256(rows_text(out_rows).encode()).hexdigest())
    write_rows(output_path, out_rows)
    manifest = {
        "file": output_path.name,
        "sha256": sha256_file(output_path),
        "rows": len(chosen),
        "tokens": sum(r.num_tokens for r in chosen),
        "masked_tokens": sum(sum(r.loss_mask) for r in chosen),
        "max_row_tokens": max(r.num_tokens for r in chosen),
        "derived_from": {
            "file": input_path.name,
            "sha256": source_sha,
            "rows": len(rows),
            "selection": f"the {num_rows} longest rows",
            "row_indices": [r.index for r in chosen],
        },
    }
    write_manifest(output_path, manifest)
    return manifest


def main(argv: list[str] | None = None) -> int:
    """Command line entry; returns the exit code (one line and 2 for bad input)."""
    return run_command(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/derive_smoke_data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", help="take input, rows and output from this recipe and its smoke overlay")
    parser.add_argument("--input", type=Path, help="full pre-tokenized JSONL")
    parser.add_argument("--expected-sha256", help="SHA-256 of --input (64 hex digits or 'manifest')")
    parser.add_argument("--rows", type=int, help="how many rows (the longest)")
    parser.add_argument("--output", type=Path, help="smoke JSONL to write")
    args = parser.parse_args(argv)
    if args.recipe:
        full = load_tool_recipe(args.recipe)
        smoke = load_tool_recipe(args.recipe, smoke=True)
        input_path = full.path(full.recipe.data.train_path)
        expected = full.recipe.data.expected_sha256
        output_path = smoke.path(smoke.recipe.data.train_path)
        num_rows = smoke.recipe.data.num_rows or 4
        if output_path == input_path:
            raise DataFileError(f"recipe {args.recipe}: the smoke overlay does not set its own data.train_path")
    else:
        if args.rows is not None and args.rows < 1:
            raise DataFileError(f"--rows is {args.rows}; fix: use a value >= 1 (the smoke gate takes 4)")
        if not (args.input and args.expected_sha256 and args.rows and args.output):
            parser.error("give --recipe, or all of --input, --expected-sha256, --rows and --output")
        input_path, expected, num_rows, output_path = args.input, args.expected_sha256, args.rows, args.output
    output_place(Path(output_path), "--output", fix="write the fixture into a folder of its own, e.g. .cache/data/")
    if output_path.resolve() == input_path.resolve():
        raise DataFileError(
            f"--output {output_path} is the input file: deriving would replace the full data with its smoke rows. "
            "Fix: give another --output (or set the smoke overlay's data.train_path)"
        )
    manifest = derive(input_path, expected, num_rows, output_path)
    print(
        f"[derive_smoke_data] {manifest['rows']} rows ({manifest['max_row_tokens']} tokens the longest) -> "
        f"{output_path}; sha256 {manifest['sha256']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
