"""``tools/verify_data``: check a pre-tokenized JSONL before a run (SHA-256, rows, ids, masks, lengths).

Every problem is one line naming the file, the row and the fix; the exit code is 1 then.

Examples::

    tools/verify_data --recipe tiny
    tools/verify_data train.jsonl --expected-sha256 manifest --vocab-size 163840 --max-length 65536 --rows 462
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runtime.shared.data_files import DataFileError, verify_data_file
from runtime.user_errors import run_command
from tools.recipe_args import load_tool_recipe


def main(argv: list[str] | None = None) -> int:
    """Command line entry point (one line and exit 2 for bad input; 1 when the file fails a check)."""
    return run_command(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/verify_data",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "path", nargs="?", type=Path, help="pre-tokenized JSONL (default: the recipe's data.train_path)"
    )
    parser.add_argument("--recipe", help="take the path and every expectation from this recipe (e.g. tiny)")
    parser.add_argument("--expected-sha256", help="64 hex digits, or 'manifest' for the SHA-256 its manifest records")
    parser.add_argument("--vocab-size", type=int, help="every id must be below this")
    parser.add_argument("--max-length", type=int, help="no row may be longer")
    parser.add_argument("--rows", type=int, help="expected row count")
    args = parser.parse_args(argv)
    path, expected, vocab, max_length, rows = (
        args.path,
        args.expected_sha256,
        args.vocab_size,
        args.max_length,
        args.rows,
    )
    if args.recipe:
        tool = load_tool_recipe(args.recipe)
        data = tool.recipe.data
        path = path or tool.path(data.train_path)
        expected = expected or data.expected_sha256
        vocab = vocab or tool.recipe.capture.vocab_size
        max_length = max_length or data.max_length
        rows = rows or data.num_rows
    if path is None:
        parser.error("give the data file (or --recipe NAME)")
    for flag, value in (("--vocab-size", vocab), ("--max-length", max_length), ("--rows", rows)):
        if value is not None and value < 1:
            raise DataFileError(f"{flag} is {value}; fix: use a value >= 1, or leave it out to skip that check")
    try:
        summary = verify_data_file(path, expected, vocab, max_length, rows)
    except DataFileError as exc:
        print(f"verify_data: FAILED: {exc}", file=sys.stderr)
        return 1
    for warning in summary.warnings[:20]:
        print(f"verify_data: warning: {warning}", file=sys.stderr)
    print(
        f"verify_data: OK {summary.path}: {summary.rows} rows, {summary.tokens} tokens ({summary.masked_tokens} "
        f"assistant), rows {summary.min_row_tokens}..{summary.max_row_tokens} tokens, sha256 {summary.sha256}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
