"""Expert-parallel MoE exchange (NCCL all-to-all default, DeepEP/Mooncake opt-in) and MXFP4 experts."""
