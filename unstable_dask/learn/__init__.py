"""Learn: one SQL query over committed rounds picks a batch, an algorithm updates the LoRA
adapter, and the adapter is committed as the next checkpoint.

Reads: `turns`, `games` (through the `seats` view), `rounds`, `checkpoints`, `baselines`, the parent adapter.
Writes: the adapter (+ optimizer state), `learner_steps`, `baselines` (the role-advantage EMA's
state after the window), then the iteration's commit (`checkpoints`).
"""
