"""Capture component: producer, prompt order, capture engines (embedded transformers, SGLang)."""
