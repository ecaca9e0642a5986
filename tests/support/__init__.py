"""Helpers shared by the tests (no tests here), imported as ``tests.support.<module>``:

- ``tiny_moe``: the one factory of small random Qwen3-MoE configs and checkpoints;
- ``trainer_runs``: a tiny synthetic target and sample folder, resolved trainer recipes, and real
  trainer ranks started as ``python3 -m runtime.trainer`` processes;
- ``launcher_cli``: ``python3 -m launcher ...`` as a subprocess with fresh loopback ports.
"""
