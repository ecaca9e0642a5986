"""Code that runs inside the allocation: capture, transport, MoE exchange, trainer.

This package's __init__ stays empty of imports: the login-node launcher imports
``runtime.recipe`` and must not pay for torch.
"""
