"""Capture component: producer, prompt order, capture engines (embedded transformers, SGLang).

The embedded engine owns its model loading (``model_loading``: the plain Hugging Face loader and
the expert-parallel one built on runtime/moe) and its settings (``embedded_settings``). Data files
and the sample contract live in the light layer's runtime/shared; the capture-fit arithmetic in its
runtime/recipe/fit.
"""
