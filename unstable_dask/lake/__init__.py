"""The lake: every table's schema, where its files live, how a commit makes them visible, and
how jobs read a committed snapshot with SQL. Every other stage reads and writes through here.

Reads: Parquet files and the Delta logs under the lake root (a folder or s3://bucket/prefix).
Writes: data files (workers), commits of rounds and learner iterations (drivers), the ratings
tables, the duckdb shell catalog `lake.duckdb`.
"""

from unstable_dask.lake.lake import Lake, Table

__all__ = ["Lake", "Table"]
