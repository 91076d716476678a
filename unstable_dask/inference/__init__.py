"""Inference: one engine resident per worker process (vLLM, transformers, or an endpoint), the
weights it loads, and the sampling distribution whose log-probs it records.

Reads: model weights (builtin models are built into the machine's cache), LoRA adapters.
Writes: nothing to the lake; it returns generations (token ids, behaviour log-probs) to play.
"""
