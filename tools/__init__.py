"""Operator tools: data prep/verify, tiny target, patch check, run comparison, local Slurm, benchmarks."""
