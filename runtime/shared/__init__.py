"""The light shared layer: torch-free modules that the launcher (login node), the tools and the
runtime components all import.

- ``contracts``: every cross-process contract (environment names, store keys, the sample contract
  and its one check, the producer/consumer protocols, the smoke-gate records);
- ``data_files``: pre-tokenized data files and their manifests (read, verify, hash, write);
- ``sglang_patch_manifest``: the SGLang capture patch manifest (``patches/sglang/MANIFEST.yaml``);
- ``sglang_patch_check``: is the installed SGLang patched with it (the fast check the launcher, the
  smoke gate and the SGLang engine run; applying the patch is runtime/sglang_patching, run by
  ``tools/check_patch``);
- ``lifecycle``, ``prompt_order``: a child that dies with its parent; g -> epoch and data row.
- ``acceptance_length``: the evaluation's headline figure, pooled and per-decode mean, defined once,
  and the one reader of it in ``results.json`` (old runs' files too);
- ``speedup_trust``: a measured speed-up's spread, the load it was taken under and its verdict, and
  the cores a process is given;
- ``draft_provenance``: the run a checkpoint or export records, and the evaluation's refusal of
  another run's draft;
- ``gpu_presence``: whether this machine shows an NVIDIA GPU, without torch.

The recipe schema, its checks and the capture-fit and throughput model (``runtime.recipe``, with
``runtime.recipe.fit``) are the same layer's lower floor: this package imports them, never the reverse. Nothing here imports torch, and
nothing here imports the rest of ``runtime`` (tests/test_architecture.py enforces both).
"""
