"""Rate: every committed game replayed in canonical order into TrueSkill and Bradley-Terry.

Reads: `games`, `checkpoints` (lineage), the saved replay state. Writes: `ratings`,
`rating_history`, `head_to_head`, `ratings_state` (a pure function of the lake).
"""
