"""unstable_dask: self-play on TextArena games as Dask batch jobs over a Parquet/DuckDB lake."""
