"""How long the launcher's data preflight takes at K3 size, against hashing the same file.

    python3 -m tools.bench.data_check [--rows 462] [--tokens 65536]

Writes a synthetic file of ``rows`` rows of ``tokens`` tokens (the K3 v1c prompt set is 462 rows of
up to 64K), then times in the same run: the SHA-256 alone (the old preflight, the baseline) and
the full check the launcher now runs (SHA-256 + every row: JSON, ids in the vocabulary, 0/1 mask
not all zero, lengths). Prints both times and the ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from runtime.shared.data_files import sha256_file, verify_data_file

VOCAB_SIZE = 163_840


def write_file(path: Path, rows: int, tokens: int) -> None:
    """``rows`` rows of ``tokens`` random ids with a mask over the second half."""
    rng = random.Random(0)
    with path.open("w") as handle:
        for index in range(rows):
            ids = [rng.randrange(VOCAB_SIZE) for _ in range(tokens)]
            mask = [0] * (tokens // 2) + [1] * (tokens - tokens // 2)
            handle.write(json.dumps({"id": f"row-{index}", "input_ids": ids, "loss_mask": mask}) + "\n")
            if (index + 1) % 50 == 0:
                print(f"  wrote {index + 1}/{rows} rows", flush=True)


def main() -> None:
    """Run the benchmark and print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=462)
    parser.add_argument("--tokens", type=int, default=65_536)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "train.jsonl"
        print(f"writing {args.rows} rows x {args.tokens} tokens ...", flush=True)
        write_file(path, args.rows, args.tokens)
        size = path.stat().st_size
        started = time.perf_counter()
        digest = sha256_file(path)
        hash_s = time.perf_counter() - started
        started = time.perf_counter()
        summary = verify_data_file(path, expected_sha256=digest, vocab_size=VOCAB_SIZE, max_length=args.tokens)
        check_s = time.perf_counter() - started
    print(f"file: {summary.rows} rows, {summary.tokens:,} tokens, {size / 2**20:.0f} MiB")
    print(f"sha256 only (baseline): {hash_s:.2f} s")
    print(f"full preflight check:   {check_s:.2f} s")
    print(f"ratio full / sha256:    {check_s / hash_s:.1f}")


if __name__ == "__main__":
    main()
