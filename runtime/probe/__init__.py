"""The ``--probe`` job (``python3 -m runtime.probe``): the environment contract, and the site facts.

``__main__`` is the entry (one task of a probe job: what it received, the route from trainer rank 0
to the capture, the site facts); ``measure`` measures one node's facts (memory, host-to-device,
disk, a Mooncake put); ``link`` measures a Mooncake transfer from the capture node to the trainer
node. Nothing is imported here, so ``python3 -m runtime.probe`` with a stock python3 still says in
one line what is missing.
"""
