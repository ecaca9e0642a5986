"""Apply, check and regenerate the SGLang capture patch (torch-free; run by ``tools/check_patch``,
``tools/bootstrap_sglang`` through it, and the launcher's pre-flight check of the pinned wheel on a
login node without SGLang).

The light layer keeps only what a running job needs: the manifest
(:mod:`runtime.shared.sglang_patch_manifest`) and the check of an installed, already patched SGLang
(:mod:`runtime.shared.sglang_patch_check`). Everything here downloads, unpacks, runs GNU ``patch``
or writes into an SGLang tree, so the capture engine never imports it:

- ``gnu_patch``: run ``patch -p1`` (dry runs, reverse runs) and read which files a patch touches;
- ``tree``: check (and with ``apply`` patch) an SGLang source tree in either layout: classify it
  (pristine, patched by this patch, patched by another version, changed), apply into a temporary
  copy, byte-compile every patched file, check the hooks, patch the tree and write the record;
- ``pinned_wheel``: the pinned PyPI wheel, downloaded once with ``pip download`` into
  ``.cache/sglang``, unpacked and checked like a tree;
- ``regenerate``: rewrite the patch (and its SHA-256 in the manifest) from an edited tree.

GNU ``patch`` does the patching (``apt-get install patch`` where it is missing).
"""
