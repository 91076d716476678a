"""What one learner iteration trains: its checkpoint, parent, rounds and the lake snapshot it reads
(made by learner.plan / learner.recorded_plan, checked by guards.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Plan:
    run_name: str
    iteration: int
    uid: str
    parent_uid: str
    parent_adapter: Optional[str]  # absolute dir, None for the base model
    rounds: list[int]
    # {table: Delta version}: every batch of the iteration reads this one snapshot, and
    # learner_steps records it, so `learn --preview --at-version <uid>` reads the same rows later.
    versions: dict[str, int] = field(default_factory=dict)
    seeds: dict[int, int] = field(default_factory=dict)  # update -> recorded batch seed (replays only)
    # uid -> (iteration, adapter sha256) of every checkpoint of the run, the base model (0, None) included
    lineage: dict[str, tuple[int, Optional[str]]] = field(default_factory=dict)
