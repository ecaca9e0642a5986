"""The capture-fit and throughput model of a recipe: one home for the arithmetic that the launcher's
``--plan`` shows and the recipe checks refuse on (torch-free, below both: it imports nothing of
``runtime.recipe.checks`` and nothing of ``runtime.shared``).

- ``report``: :class:`~runtime.recipe.fit.report.FitReport`, what each part returns: a titled
  section of (label, value) rows, findings (ok / warn / blocker, with options) and raw numbers;
- ``store_budget``: the largest sample, one global step of them, and what the Mooncake store may
  hold at a producer pause (the watermark and segment checks use it);
- ``host_memory``: what lives in each node's host memory (Mooncake segment shares, streamed experts);
- ``expert_streaming``: the resident/streamed split of the SGLang target and its fit;
- ``capture_hbm``: the capture GPUs' memory at the SGLang TP size: resident, streamed or offloaded
  experts, and the alternatives (more nodes, larger GPUs);
- ``capture_node``: the plan's "capture node fit" section: host memory per node, the HBM fit, and the
  options when the target does not fit;
- ``trainer_memory``: the draft's parameter counts and the bytes per trainer rank;
- ``prefill``: one capture prefill per accelerator, split into routed experts, the dense rest and
  attention (causal full attention and linear attention, from the target's layer mix);
- ``slurm_request``: what the job asks Slurm for: ``--mem`` per component from the host-memory
  figure plus a stated margin, against the site's cap;
- ``throughput``: capture, commit, transfer and train seconds per sample, the bottleneck, the run
  time with and without the trainer's feature cache.

Every number is computed at ``data.max_length`` (the worst case) from the recipe and the hardware
assumptions in its ``plan`` section.
"""
