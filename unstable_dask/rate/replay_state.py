"""The rate job's replay state: every mu/sigma and counter, saved in the lake table `ratings_state`.

A later rate job continues from the saved state instead of replaying every round; that is only
sound while the state is exactly what the last rate wrote for the same rating parameters and
lineage. `load` checks both (checksums and a fingerprint kept in the state's metadata) and
returns None where a full replay is needed; `save` writes the state last, as the rate job's
commit point.
"""
from __future__ import annotations

import hashlib
import json
import logging
from typing import Optional

import numpy as np
import pyarrow as pa

from unstable_dask.config import RatingsConfig
from unstable_dask.errors import JobError
from unstable_dask.lake import Lake, catalog, storage

log = logging.getLogger("unstable_dask.rate")
SCHEMA = catalog.SCHEMAS["ratings_state"]
HISTORY_SCHEMA = catalog.SCHEMAS["rating_history"]


class State:
    """mu/sigma/counters per slot = track * M + model, plus pairwise counts per track."""

    def __init__(self, envs: list[str], models: list[str], parent_of: dict[str, str]):
        self.envs, self.models = envs, models  # envs[0] == OVERALL; models sorted
        self.env_ix = {e: i for i, e in enumerate(envs)}
        self.model_ix = {m: i for i, m in enumerate(models)}
        M, n = len(models), len(envs) * len(models)
        self.mu, self.sg, self.seen = [0.0] * n, [0.0] * n, [False] * n
        self.counts = np.zeros((n, 5), dtype=np.int64)  # games, wins, draws, losses, mirror
        self.pairs: dict[tuple[int, int, int], np.ndarray] = {}  # (track, a, b), a < b -> [wins_a, draws, wins_b]
        pm = [self.model_ix.get(parent_of.get(m, ""), -1) for m in models]
        for m in range(M):  # a lineage loop would make enter_track spin forever
            p, steps = pm[m], 0
            while p >= 0:
                p, steps = pm[p], steps + 1
                if steps > M:
                    raise JobError(f"checkpoints table: the lineage of {models[m]!r} loops back on itself")
        self.parent = [t * M + p if p >= 0 else -1 for t in range(len(envs)) for p in pm]

    def slot(self, env: str, model: str) -> int:
        return self.env_ix[env] * len(self.models) + self.model_ix[model]

    def add_pairs(self, track: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """Count pairwise results of models a vs b (out: +1 a won, 0 draw, -1 b won) per track."""
        M = len(self.models)
        swap = a > b
        lo, hi = np.where(swap, b, a), np.where(swap, a, b)
        res = np.where(swap, -out, out)  # from lo's side
        cell = ((track.astype(np.int64) * M + lo) * M + hi) * 3 + (1 - res)  # 0 lo won, 1 draw, 2 hi won
        uniq, n = np.unique(cell, return_counts=True)
        for c, k in zip(uniq.tolist(), n.tolist()):
            key = (c // 3 // (M * M), c // 3 // M % M, c // 3 % M)
            self.pairs.setdefault(key, np.zeros(3, dtype=np.int64))[c % 3] += k


def fingerprint(cfg: RatingsConfig, models: list[str], parent_of: dict[str, str]) -> str:
    blob = json.dumps({"ts": [cfg.mu, cfg.sigma, cfg.beta, cfg.tau, cfg.draw_probability, cfg.inherit_sigma_factor,
                              cfg.include_eval], "lineage": [[m, parent_of.get(m)] for m in models]})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def digest(table: pa.Table) -> str:
    """sha256 of a table's values (column by column: nulls, then values), whatever its chunks or
    file: what `rate` wrote is what the next `rate` continues from, or it replays in full."""
    h = hashlib.sha256()
    for name in table.column_names:
        col = table.column(name)
        h.update(name.encode() + b"\0" + pa.compute.is_null(col).to_numpy(zero_copy_only=False).tobytes())
        if pa.types.is_string(col.type):
            h.update(json.dumps(col.to_pylist()).encode())
        else:
            h.update(pa.compute.fill_null(col, pa.scalar(0, col.type)).to_numpy(zero_copy_only=False).tobytes())
    return h.hexdigest()


def load(lake: Lake, run_name: str, cfg: RatingsConfig, parent_of: dict[str, str],
                committed: list[int]) -> Optional[tuple[pa.Table, list[int], pa.Table]]:
    """The saved state, its rounds and the rating history written with it, if it may be extended
    by the rounds committed since; else None (a full replay). A state or history that is not
    what the last rate wrote (checksums in the state's metadata) is replayed, never trusted."""
    path = lake.file("ratings_state", run_name, None, "state")
    history_path = lake.file("rating_history", run_name, None, "rating_history")
    if storage.size(path) is None:
        return None
    try:
        table = storage.read_table(path)
        meta = json.loads(table.schema.metadata[b"unstable_dask"])
        history = storage.read_table(history_path).cast(HISTORY_SCHEMA)
        whole = meta["sha256"] == digest(table) and meta["history_sha256"] == digest(history)
    except Exception as e:  # noqa: BLE001 - torn, bit-flipped, older or missing: any state not proven whole
        whole, why = False, f"{type(e).__name__}: {str(e)[:200]}"
    else:
        why = "its checksum does not match"
    if not whole:
        log.warning("rate: the saved replay state of run %r (%s) cannot be trusted (%s); replaying every round",
                    run_name, path, why)
        return None
    done = meta["rounds"]
    models = sorted(set(table.column("model_uid").to_pylist()) | set(table.column("model_b").drop_null().to_pylist()))
    if meta["fingerprint"] != fingerprint(cfg, models, parent_of) or not set(done) <= set(committed):
        return None
    if any(r <= max(done, default=-1) for r in set(committed) - set(done)):
        return None  # a round older than the state was committed late: canonical order changed
    return table, done, history.filter(pa.compute.is_in(history.column("round"), pa.array(done, pa.int64())))


def table_of(st: State) -> pa.Table:
    """The state as `ratings_state` rows: a "slot" row per (track, model) rated, a "pair" row per pair met."""
    M, rows = len(st.models), []
    for s in np.flatnonzero(np.array(st.seen, dtype=bool)).tolist():
        g, w, d, lost, mir = st.counts[s].tolist()
        rows.append({"kind": "slot", "env_id": st.envs[s // M], "model_uid": st.models[s % M], "model_b": None,
                     "mu": st.mu[s], "sigma": st.sg[s], "games": g, "wins": w, "draws": d, "losses": lost, "mirror_games": mir})
    for (t, a, b), (wa, d, wb) in sorted(st.pairs.items()):
        rows.append({"kind": "pair", "env_id": st.envs[t], "model_uid": st.models[a], "model_b": st.models[b],
                     "mu": None, "sigma": None, "games": int(wa + d + wb), "wins": int(wa), "draws": int(d),
                     "losses": int(wb), "mirror_games": 0})
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    return table.sort_by([("kind", "ascending"), ("env_id", "ascending"), ("model_uid", "ascending"),
                          ("model_b", "ascending")])


def restore(st: State, table: pa.Table) -> None:
    """Put saved `ratings_state` rows back into a fresh State (its envs and models include theirs)."""
    for row in table.to_pylist():
        if row["kind"] == "slot":
            s = st.slot(row["env_id"], row["model_uid"])
            st.mu[s], st.sg[s], st.seen[s] = row["mu"], row["sigma"], True
            st.counts[s] = [row["games"], row["wins"], row["draws"], row["losses"], row["mirror_games"]]
        else:
            key = (st.env_ix[row["env_id"]], st.model_ix[row["model_uid"]], st.model_ix[row["model_b"]])
            st.pairs[key] = np.array([row["wins"], row["draws"], row["losses"]], dtype=np.int64)


def save(lake: Lake, run_name: str, state: pa.Table, history: pa.Table, cfg: RatingsConfig,
         parent_of: dict[str, str], committed: list[int]) -> str:
    """Write the state with what `load` checks (rounds, fingerprint, checksums of it and of the
    history written beside it); the rate job writes it last, so a torn job replays in full."""
    models = sorted(set(state.column("model_uid").to_pylist()) | set(state.column("model_b").drop_null().to_pylist()))
    meta = {"rounds": committed, "fingerprint": fingerprint(cfg, models, parent_of), "sha256": digest(state),
            "history_sha256": digest(history)}
    return lake.write("ratings_state", run_name, None, "state",
                      state.replace_schema_metadata({"unstable_dask": json.dumps(meta)}))
