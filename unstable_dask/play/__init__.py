"""Play: a round's games scheduled, played on the cluster's resident engines, and committed.

Reads: the job, the run's committed checkpoints (and ratings, for match-quality opponents).
Writes: the `games` and `turns` files of each task, then the round's commit (`rounds`).
"""
