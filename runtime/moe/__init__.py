"""Expert-parallel MoE exchange (NCCL all-to-all default, DeepEP/Mooncake opt-in) and MXFP4 experts.

Modules, one job each:

- ``routing``: router top-k (softmax or sigmoid with a selection bias).
- ``plan``: pure index arithmetic of the exchange (send rows, expert-major order, fixed-order sums).
- ``exchange``: the backend interface; ``exchange_nccl`` the all-to-all default (gloo on CPU);
  ``exchange_low_latency`` + ``exchange_deepep`` / ``exchange_mooncake`` the opt-in kernels;
  ``exchange_limits`` their shape limits and start-up errors; ``selection`` recipe/CLI choice.
- ``mxfp4`` (torch reference) and ``mxfp4_triton`` (GPU kernel): MXFP4 pack/quantize/dequantize.
- ``grouped_gemm`` and ``experts``: local experts, dense or resident in MXFP4.
- ``layer``: the expert-parallel MoE layer and the dense single-process reference.
- ``hf_adapter``: shards a Hugging Face MoE model's experts over an expert-parallel group.
- ``exchange_threads``: the exchange between the embedded capture engine's replicas, which are
  threads of one process (the engine's loader, runtime/capture/model_loading.py, uses it).
- ``streaming`` and ``streaming_modules``: routed experts kept in pinned host memory and streamed
  into reused device buffers a copy stream ahead of compute (the split arithmetic is torch-free, in
  runtime/recipe/streaming_budget.py).

This package knows nothing of engines: capture imports moe, never the reverse.
"""
