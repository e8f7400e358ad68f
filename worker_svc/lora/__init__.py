"""Multi-LoRA serving on the worker: PEFT adapters loaded into slots, applied batched per step.

- weights.py: a PEFT directory -> per-(layer, projection) A/B matrices laid out for the fused
  projections, scaling folded in, ranks padded to --max-lora-rank;
- layers.py: `LoRALinear` (base projection + segmented LoRA delta) and the step's `LoRABatch`;
- manager.py: `LoRAManager`, the host LRU (--max-cpu-loras) and the device slots (--max-loras).
"""
