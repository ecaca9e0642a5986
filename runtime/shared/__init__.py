"""The light shared layer: torch-free modules that the launcher (login node), the tools and the
runtime components all import.

- ``contracts``: every cross-process contract (environment names, store keys, the sample contract
  and its one check, the producer/consumer protocols, the smoke-gate records);
- ``data_files``: pre-tokenized data files and their manifests (read, verify, hash, write);
- ``sglang_fit``: does the target fit the SGLang capture node, and what would expert offload cost;
- ``sglang_patch``: the SGLang capture patch manifest, checker and applier (``tools/check_patch``
  is its command line).

The recipe schema (``runtime.recipe``) belongs to the same layer. Nothing here imports torch, and
nothing here imports the rest of ``runtime`` (tests/test_architecture.py enforces both).
"""
