"""A real Slurm cluster on this machine for tests: munge, MariaDB + slurmdbd, slurmctld, two slurmd.

Entry points: ``tools/slurm_local up|down|status`` and ``python3 -m tools.slurm_local ...``.
"""
