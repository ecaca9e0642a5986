"""Judge a trained draft where it is used: speculative decoding of the target with the draft.

- :mod:`runtime.evaluate.verify`: the acceptance rules (greedy: longest matching prefix plus the
  target's token; sampled: the rejection rule of speculative sampling), pure functions.
- :mod:`runtime.evaluate.target`: the target with a KV cache kept across verify steps and rolled
  back to the accepted prefix; it also hands out the aux-layer hidden states the draft reads.
- :mod:`runtime.evaluate.draft`: loading a draft (trainer checkpoint, export folder, any DSpark
  draft in SGLang's format, or an untrained one) and proposing one block.
- :mod:`runtime.evaluate.decoder`: the speculative decode loop and plain target decoding.
- :mod:`runtime.evaluate.eval_sets`: the recipe's eval sets (SHA-256 checked) as prompt token ids.
- :mod:`runtime.evaluate.report`: acceptance length, per-slot rates, calibration, speed.
- :mod:`runtime.evaluate.sglang_route`: the same figures from an SGLang server serving the draft.

It may import capture and trainer; nothing else in runtime imports it.
"""
