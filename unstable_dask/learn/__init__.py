"""Learn: one SQL query over committed rounds picks a batch, an algorithm updates the LoRA
adapter, and the adapter is committed as the next checkpoint.

Reads: `turns`, `games` (through the `seats` view), `rounds`, `checkpoints`, the parent adapter.
Writes: the adapter (+ optimizer state), `learner_steps`, then the iteration's commit (`checkpoints`).
"""
