"""The DSpark trainer: draft model and loss, FSDP2, LR schedules, checkpoints,
metrics. Entry point: ``python3 -m runtime.trainer --recipe RESOLVED``.

Modules, one job each:

- ``setup``: the door: ``trainer_setup`` reads the resolved recipe and the launcher's environment once
  and builds every part's frozen settings (``TrainerSetup``); no module below it takes the recipe
- ``settings``: ``RunSettings``, the run's derived values (rank, device, dtypes, steps, folders)
- ``draft_spec``: the draft's shape, built once from the recipe
- ``layout``: anchors, block slots, labels, eval mask and slot weights of one sample
- ``attention_mask``: the DSpark block mask (dense for SDPA, BlockMask for flex_attention)
- ``rope``: rotary embeddings (plain, linear, dynamic NTK, YaRN)
- ``model``: the draft (Qwen3-style layers, context projection, Markov and confidence heads)
- ``vocab_objective``: the chunked CE + L1 terms with their gradients, never materialising
  ``[blocks, slots, vocab]`` in fp32
- ``objective``: the whole DSpark loss of one sample (vocabulary terms + confidence BCE + metrics)
- ``frozen_vocab``: the target's embedding and lm_head, read by tensor name
- ``schedules``: learning-rate schedules with a checkpointable state
- ``checkpoints``: torch.distributed.checkpoint save/load, ``trainer_state.json``, ``latest``, keep-K
- ``export``: the draft as safetensors + config.json in SGLang's DSpark draft layout
- ``metrics``: metrics.jsonl, TensorBoard, W&B, progress lines
- ``guard``: the finite-update guard
- ``gate``: the smoke gate, one object the loop calls at named points; writes ``trainer_gate.json``
- ``sources``: where samples come from (the Mooncake data plane, or a folder of files for tests)
- ``loop``: the training loop that ties these together; one step is fetch -> forward/backward ->
  apply update -> report
"""
