"""Report: offline HTML pages of a run, its leaderboards and curves, and the trackers mirror.

Reads: every table of the lake through SQL. Writes: reports/<run>/index.html (outside the lake),
and W&B / MLflow runs.
"""
