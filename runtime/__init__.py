"""Code that runs inside the allocation: capture, transport, MoE exchange, trainer; the light layer
(recipe, shared) they share with the launcher; and sglang_patching, which applies the SGLang capture
patch for the tools (and checks it against the pinned wheel for the launcher).

This package's __init__ stays empty of imports: the login-node launcher imports
``runtime.recipe`` and must not pay for torch.
"""
