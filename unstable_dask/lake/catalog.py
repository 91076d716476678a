"""The table catalog: every lake table's schema, partitioning, key columns and commit rule.

One place for the tables' contract. The lake (lake.py, delta.py), the jobs that write tables
(round, learn, rate) and lake/README.md (its column tables are generated from here, a test
fails when they drift) all read it; this module imports nothing of the project.

Commit rules:
  data     Parquet files written by workers, visible once the marker of their partition is
           committed (games and turns by a `rounds` row, learner_steps and baselines by a
           `checkpoints` row).
  marker   a Delta commit that claims a partition (one per run and round/iteration, exclusive)
           and names the data files it makes visible.
  replace  derived tables rewritten whole per run by one job (ratings): one file per run,
           replaced atomically; a re-run gives the same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pyarrow as pa

SEAT = pa.struct([
    ("pid", pa.int32()),
    ("model_uid", pa.string()),  # checkpoint uid, "base", "random", an adapter dir's name, an endpoint's model id
    ("is_learner", pa.bool_()),  # seat played by the checkpoint this round trains/evaluates
    ("role", pa.string()),
    ("reward", pa.float64()),  # final reward from the env
    ("invalid_move", pa.bool_()),  # the game ended because this seat made an invalid move
    ("reason", pa.string()),
])


def _f(name: str, type_: pa.DataType, doc: str = "") -> pa.Field:
    """A field whose meaning travels with it (lake/README.md is generated from these docs)."""
    return pa.field(name, type_, metadata={"doc": doc} if doc else None)


GAMES = pa.schema([
    _f("game_id", pa.string(), "`<run>-r<round>-<split>-<index>`, deterministic, one per game (a league's: "
       "`<group_id>-s<seat rotation>`)"),
    _f("split", pa.string(), "`train` (learner data), `eval` (against fixed opponents), `baseline` "
       "(round.eval_baseline) or `league` (a league's games)"),
    _f("env_id", pa.string(), "TextArena env id, e.g. `SimpleTak-v0-train`"),
    _f("seed", pa.int64(), "the env's reset seed, from (run seed, round, split, group index); shared by a group"),
    _f("group_id", pa.string(), "`<run>-r<round:04d>-<split>-g<index:05d>`: the games of one start state (see Groups); "
       "a league's: one duplicate deal, `<league>-<a>-vs-<b>-<env_id>-p<players>-<template>-d<deal:04d>`"),
    _f("num_players", pa.int32(), "seats"),
    _f("num_turns", pa.int32(), "moves played (invalid attempts included)"),
    _f("started_at", pa.timestamp("us", tz="UTC")),
    _f("finished_at", pa.timestamp("us", tz="UTC")),
    _f("worker", pa.string(), "`host:pid` of the Dask worker"),
    _f("task", pa.string(), "the task (file) key"),
    _f("seats", pa.list_(SEAT), "per seat: pid, model_uid, is_learner, role, reward (final), invalid_move, reason"),
])

TURNS = pa.schema([
    _f("game_id", pa.string(), "the game"),
    _f("turn", pa.int32(), "0-based index over all moves of the game"),
    _f("pid", pa.int32(), "who moved"),
    _f("model_uid", pa.string(), "the model in that seat"),
    _f("is_learner", pa.bool_(), "the seat is the checkpoint being trained"),
    _f("split", pa.string(), "copied from the game"),
    _f("env_id", pa.string(), "copied from the game"),
    _f("seed", pa.int64(), "the game's env seed"),
    _f("group_id", pa.string(), "the game's group (GRPO compares the (group_id, pid) attempts)"),
    _f("observation", pa.string(), "what the env showed the player"),
    _f("prompt", pa.string(), "exact text fed to the model (null for the random agent)"),
    _f("completion", pa.string(), "raw model output: completion_token_ids decoded, special tokens skipped"),
    _f("action", pa.string(), "what was sent to the env (the `\\boxed{}` answer, or the whole completion)"),
    _f("format_ok", pa.bool_(), "a non-empty \\boxed{} answer was found"),
    _f("invalid_move", pa.bool_(), "the env rejected the move (a resubmission, or the forfeit)"),
    _f("step_info", pa.string(), "the env's step info as JSON"),
    _f("prompt_tokens", pa.int32(), "tokens fed (after left-truncation)"),
    _f("completion_tokens", pa.int32(), "tokens generated"),
    _f("completion_token_ids", pa.list_(pa.int32()),
       "the exact ids the engine generated, EOS included when generated (null for `random`)"),
    _f("truncated", pa.bool_(), "generation stopped at max_new_tokens"),
    _f("logprobs", pa.list_(pa.float32()),
       "behaviour log-prob of each id in completion_token_ids (see Behaviour log-probs)"),
    _f("latency_s", pa.float64(), "wall time of the batched generate call this turn was in (per-game play and "
       "endpoints: its own request's)"),
    _f("adapter_sha256", pa.string(), "sha256 of the LoRA weights the engine says produced the completion "
       "(null: the base model, an agent or an endpoint); the learner checks it against the checkpoint's"),
    _f("error", pa.string(), "why an endpoint request finally failed (then completion is null and the env got an "
       "empty action); null otherwise and in files written before the column existed"),
])

ROUNDS = pa.schema([
    _f("attempt", pa.string(), "the driver attempt whose files are the round's data"),
    _f("checkpoint_uid", pa.string(), "the checkpoint this round played (null: a league's pass)"),
    _f("games", pa.int64(), "rows of `games` this commit made visible (counted by the commit; every reader checks them)"),
    _f("turns", pa.int64(), "rows of `turns` this commit made visible (likewise)"),
    _f("tasks", pa.int64()), _f("completion_tokens", pa.int64()),
    _f("temperature", pa.float64(), "sampling settings the games were played with (null: not recorded)"),
    _f("top_p", pa.float64()),
    _f("max_new_tokens", pa.int64()),
    _f("engine", pa.string(), "the inference engines that played its model turns, e.g. `vllm 0.32.0 (cpu)` or `hf` "
       "(model.backend `auto` picks where the engine starts); null: none, or not recorded"),
    _f("in_flight_frac", pa.float64(), "games in flight / round.concurrency, time-weighted over its tasks' wall "
       "time (per-game play keeps it near 1 until a task's games run out; lock-step steps wait for their slowest)"),
    _f("prefix_cache_hit_rate", pa.float64(), "prompt tokens the engines took from their prefix caches / prompt "
       "tokens of the turns they played (vLLM; null: hf, which has none)"),
    _f("job_fingerprint", pa.string(), "sha256 of the validated job, 16 hex"),
    _f("job", pa.string(), "the validated job as JSON"),
    _f("started_at", pa.timestamp("us", tz="UTC")),
    _f("committed_at", pa.timestamp("us", tz="UTC")),
    _f("files", pa.list_(pa.string()), "the data files this commit added, relative to the lake (compaction may merge them later)"),
])

CHECKPOINTS = pa.schema([
    _f("attempt", pa.string(), "the learner attempt whose adapter and learner_steps are this checkpoint's"),
    _f("uid", pa.string(), "`ckpt-<k>`"),
    _f("parent_uid", pa.string(), "the checkpoint it was trained from"),
    _f("adapter_path", pa.string(), "relative to the lake root; null for the base model"),
    _f("adapter_sha256", pa.string(), "sha256 of the adapter's weights file (adapter_model.safetensors)"),
    _f("base_model", pa.string()),
    _f("rounds_trained", pa.list_(pa.int64()), "rounds the batches were sampled from"),
    _f("algorithm", pa.string()),
    _f("created_at", pa.timestamp("us", tz="UTC")),
    _f("files", pa.list_(pa.string()), "the data files this commit makes visible, relative to the lake"),
    _f("steps", pa.int64(), "rows of `learner_steps` this commit made visible, one per update (counted by the "
       "commit; every reader checks them)"),
    _f("baselines", pa.int64(), "rows of `baselines` this commit made visible (likewise; null: committed before "
       "the table existed)"),
])

LEARNER_STEPS = pa.schema([
    _f("update", pa.int32(), "numbers the updates inside an iteration"),
    _f("algorithm", pa.string()), _f("checkpoint_uid", pa.string(), "the checkpoint this update produced"),
    _f("loss", pa.float64()), _f("pg_loss", pa.float64()),
    _f("entropy", pa.float64(), "mean entropy (nats) of the learner's sampling distribution at the completion tokens"),
    _f("logp_gap_mean", pa.float64(), "mean |log pi_old - log pi_b| over tokens with engine log-probs: "
       "learner vs engine numerics (and staleness)"),
    _f("logp_gap_max", pa.float64()),
    _f("outside_nucleus_frac", pa.float64(), "share of trained tokens outside the learner's top-p nucleus (pi_old = 0)"),
    _f("is_weight_mean", pa.float64(), "importance weights pi_old / pi_b before bounding (learn.is_mode)"),
    _f("is_weight_max", pa.float64()),
    _f("is_bounded_frac", pa.float64(), "share of weights above learn.is_cap (mask mode: or below 1/is_cap)"),
    _f("is_ess", pa.float64(), "effective sample size of the weights, as a share of the tokens"),
    _f("zero_std_group_frac", pa.float64(), "share of the batch's groups whose advantages were all 0 (dropped unless an entropy bonus or a KL penalty gives them a gradient)"),
    _f("rows_dropped", pa.int64(), "batch rows of those groups"),
    _f("skipped_steps", pa.int32(), "optimizer steps skipped because the gradient was exactly 0"),
    _f("staleness_max", pa.int32(), "learner iterations between the checkpoint that played a row and the one trained"),
    _f("staleness_mean", pa.float64()),
    _f("dtype", pa.string(), "precision of the learner's forward passes (learn.dtype)"),
    _f("logp_mean", pa.float64()),
    _f("optimizer_steps", pa.int32(), "optimizer steps of the update (GRPO/GSPO: ppo_epochs x mini-batches, else 1); loss terms are their means"),
    _f("grad_norm", pa.float64(), "before clipping"), _f("lr", pa.float64()),
    _f("samples", pa.int64(), "batch rows"), _f("tokens", pa.int64(), "tokens seen"),
    _f("train_tokens", pa.int64(), "completion tokens trained"),
    _f("tokens_per_s", pa.float64()), _f("step_time_s", pa.float64()),
    _f("mean_train_len", pa.float64(), "mean prompt + completion length"),
    _f("pct_truncated", pa.float64(), "share of completions cut at max_new_tokens"),
    _f("reward_mean", pa.float64()), _f("step_reward_mean", pa.float64()),
    _f("advantage_mean", pa.float64(), "the advantages the actor trained on (A2C: its transformed GAE)"),
    _f("advantage_std", pa.float64()),
    _f("batch_seed", pa.int64(), "the sampling seed (a batch is a pure function of lake, SQL, seed)"),
    _f("rounds", pa.list_(pa.int64()), "the rounds the batch came from"),
    _f("device", pa.string(), "cpu / cuda"),
    _f("cuda_mem_allocated", pa.int64(), "bytes, on GPU only"), _f("cuda_mem_reserved", pa.int64()), _f("cuda_mem_peak", pa.int64()),
    # single-GPU mode: the resident engine sleeps during the update
    _f("engine_sleep_s", pa.float64()), _f("engine_wake_s", pa.float64()), _f("cuda_free_engine_asleep", pa.int64()),
    _f("table_versions", pa.string(),
       "JSON {table: Delta version} of the snapshot the batch was read from (`learn --preview --at-version`)"),
    _f("created_at", pa.timestamp("us", tz="UTC")),
    _f("metrics", pa.map_(pa.string(), pa.float64()),
       "the algorithm's own metrics, by name (`metrics['clip_frac']`): A2C's value_loss, value_mae, "
       "critic_grad_norm, critic_lr; GRPO / GSPO's kl, clip_frac (share of tokens, GSPO: sequences, whose "
       "gradient the clip removed), clip_frac_first (its first optimizer step's), ppo_kl (mean over trained "
       "tokens of log pi_old - log pi); lakes written before the map hold these as columns"),
])

# The role-advantage EMA's state after a round (learn/ema.py), committed with the iteration whose
# window ended at that round: the next batch query starts from it instead of scanning all history.
BASELINES = pa.schema([
    _f("round", pa.int64(), "the newest round the state covers: b after every train game of rounds <= round"),
    _f("transform", pa.string(), "JSON list of the final transforms up to and including the stateful one "
       "(their reprs, user SQL verbatim): a state is reused only by the identical chain"),
    _f("is_learner", pa.bool_(), "the key: learner seats and opponents' seats have separate EMAs"),
    _f("env_id", pa.string(), "the key's env (RoleAdvantageByEnvFormatter); null for RoleAdvantageFormatter"),
    _f("pid", pa.int32(), "the key's seat"),
    _f("games", pa.int64(), "games that fed the EMA (n)"),
    _f("b", pa.float64(), "the EMA after the key's last game of those rounds (b0 = 0)"),
])

RATINGS = pa.schema([
    _f("model_uid", pa.string()), _f("env_id", pa.string(), "`*` = all envs"),
    _f("mu", pa.float64(), "TrueSkill"), _f("sigma", pa.float64()), _f("conservative", pa.float64(), "mu - 3 sigma"),
    _f("games", pa.int64()), _f("wins", pa.int64()), _f("draws", pa.int64()), _f("losses", pa.int64()),
    _f("mirror_games", pa.int64(), "self-play games, not rated"),
    _f("bt_score", pa.float64(), "Bradley-Terry on the Elo scale, mean 1000"),
    _f("bt_ci_low", pa.float64(), "95% bootstrap interval"), _f("bt_ci_high", pa.float64()),
    _f("rank", pa.int64(), "1 + models whose BT lower bound is above this upper bound"),
])
RATING_HISTORY = pa.schema([
    _f("round", pa.int64()), _f("model_uid", pa.string()), _f("env_id", pa.string()),
    _f("mu", pa.float64()), _f("sigma", pa.float64()), _f("conservative", pa.float64()),
])
HEAD_TO_HEAD = pa.schema([
    _f("env_id", pa.string()), _f("model_a", pa.string()), _f("model_b", pa.string()),
    _f("games", pa.int64()), _f("wins_a", pa.int64()), _f("draws", pa.int64()),
    _f("win_rate_a", pa.float64(), "(wins_a + draws / 2) / games"),
])
# Replay state. kind='slot': one (env_id, model_uid) with mu, sigma and W/D/L counters;
# kind='pair': pairwise counts of model_uid (a) vs model_b with wins = wins_a, losses = wins_b.
RATINGS_STATE = pa.schema([
    _f("kind", pa.string()), _f("env_id", pa.string()), _f("model_uid", pa.string()), _f("model_b", pa.string()),
    _f("mu", pa.float64()), _f("sigma", pa.float64()), _f("games", pa.int64()), _f("wins", pa.int64()),
    _f("draws", pa.int64()), _f("losses", pa.int64()), _f("mirror_games", pa.int64()),
])

# A league (`run league`, play/league.py + rate/league.py): per entrant and per pair of entrants,
# written under the league's run by the league's rate step after every pass.
LEAGUE_RATINGS = pa.schema([
    _f("entrant", pa.string(), "its uid, the seats' model_uid in the league's games: `random`, `base:<model>`, "
       "`<run>:ckpt-<k>`, `endpoint:<model>`, `adapter:<folder>`"),
    _f("kind", pa.string(), "agent / base / checkpoint / endpoint / adapter"),
    _f("source_run", pa.string(), "a checkpoint's run (null for other kinds)"),
    _f("checkpoint", pa.string(), "a checkpoint's uid in its run, `ckpt-<k>`"),
    _f("iteration", pa.int64(), "a checkpoint's learner iteration; 0 for a base model (where a run's curve starts)"),
    _f("base_model", pa.string(), "the base model it plays on (null: the random agent, endpoints, adapters)"),
    _f("rating", pa.float64(), "Bradley-Terry on the Elo scale, anchored: the anchor entrant at league.anchor_rating"),
    _f("rating_low", pa.float64(), "central league.confidence bootstrap interval, each resample anchored "
       "(the anchor's is a point; null without ratings.bootstrap)"),
    _f("rating_high", pa.float64()),
    _f("anchor", pa.bool_(), "the entrant the scale is fixed on"),
    _f("mu", pa.float64(), "TrueSkill of the league's games, replayed in (pass, game_id) order (not anchored)"),
    _f("sigma", pa.float64()),
    _f("games", pa.int64()), _f("wins", pa.int64()), _f("draws", pa.int64()), _f("losses", pa.int64()),
    _f("rank", pa.int64(), "position by rating, 1 = strongest"),
    _f("p_above_next", pa.float64(), "share of bootstrap resamples rating it above the next entrant of the ranking"),
    _f("separated", pa.bool_(), "p_above_next >= league.confidence: the league stops when every adjacent pair is "
       "(null for the last)"),
    _f("passes", pa.int64(), "committed passes (rounds) of the league these ratings cover"),
])
LEAGUE_PAIRS = pa.schema([
    _f("entrant", pa.string()), _f("opponent", pa.string(), "every other rated entrant, met or not"),
    _f("games", pa.int64(), "games between the two (0: never met)"),
    _f("wins", pa.int64(), "the entrant's"), _f("draws", pa.int64()), _f("losses", pa.int64()),
    _f("score", pa.float64(), "(wins + draws / 2) / games; null when they never met"),
    _f("p_above", pa.float64(), "share of bootstrap resamples rating the entrant above the opponent"),
    _f("gap_sd", pa.float64(), "bootstrap standard deviation of the rating difference (Elo points)"),
])


def _strip(schema: pa.Schema) -> pa.Schema:
    """The schema files are written with: the docs stay here, not in every file's footer."""
    return pa.schema([f.remove_metadata() for f in schema])


@dataclass(frozen=True)
class Table:
    name: str
    documented: pa.Schema  # fields carry their meaning as metadata {"doc": ...}
    partition: Optional[str]  # below run=<run>/: "round", "iteration", or None (one file per run)
    keys: tuple[str, ...]  # columns a file must have, with these types, to belong to the table
    rule: str  # "data" | "marker" | "replace" (see the module doc)
    marker: Optional[str] = None  # for data tables: the marker table that commits them
    # for data tables: the marker's column holding how many of its rows a commit made visible
    # (the commit counts them; readers compare the Delta log's row counts with it)
    counted_by: Optional[str] = None
    view: bool = True  # a DuckDB view of this name exists
    # for data tables added after the counts: every commit that made files of it visible counted
    # them, so a lake without its log (written before the table) is one with no rows of it
    optional: bool = False
    doc: str = ""

    @property
    def schema(self) -> pa.Schema:
        return _strip(self.documented)


TABLES: dict[str, Table] = {t.name: t for t in [
    Table("games", GAMES, "round", ("game_id", "seats"), "data", "rounds", doc="one row per game",
          counted_by="games"),
    Table("turns", TURNS, "round", ("game_id", "turn", "pid"), "data", "rounds", doc="one row per move",
          counted_by="turns"),
    Table("rounds", ROUNDS, "round", ("checkpoint_uid",), "marker", doc="one row per committed round: its commit"),
    Table("checkpoints", CHECKPOINTS, "iteration", ("uid",), "marker",
          doc="one row per learner iteration: the learner's commit"),
    Table("learner_steps", LEARNER_STEPS, "iteration", ("update",), "data", "checkpoints",
          doc="one row per update (one sampled batch)", counted_by="steps"),
    Table("baselines", BASELINES, "iteration", ("transform",), "data", "checkpoints",
          doc="the role-advantage EMA's state after a round, per transform and key", counted_by="baselines",
          optional=True),
    Table("ratings", RATINGS, None, ("model_uid",), "replace", doc="per model and env, recomputed by `run rate`"),
    Table("rating_history", RATING_HISTORY, None, ("round",), "replace", doc="the ratings after every committed round"),
    Table("head_to_head", HEAD_TO_HEAD, None, ("model_a",), "replace", doc="pairwise results (both directions)"),
    Table("ratings_state", RATINGS_STATE, None, ("kind",), "replace", view=False,
          doc="the replay state `rate` continues from (internal)"),
    Table("league_ratings", LEAGUE_RATINGS, None, ("entrant",), "replace",
          doc="a league's leaderboard: one row per entrant, on one anchored scale"),
    Table("league_pairs", LEAGUE_PAIRS, None, ("entrant", "opponent"), "replace",
          doc="a league's pairs: one row per ordered pair of entrants"),
]}

# Delta tables: the ones whose visibility is a commit in a log.
DELTA_TABLES = tuple(n for n, t in TABLES.items() if t.rule in ("data", "marker"))
VIEWS = tuple(n for n, t in TABLES.items() if t.view)
SCHEMAS: dict[str, pa.Schema] = {n: t.schema for n, t in TABLES.items()}
PARTITION: dict[str, str] = {n: t.partition for n, t in TABLES.items() if t.partition}
HIVE_TYPES = {"run": pa.string(), "round": pa.int64(), "iteration": pa.int64()}


def counts(marker: str) -> dict[str, str]:
    """{data table: the marker column counting its rows} of a marker table."""
    return {n: t.counted_by for n, t in TABLES.items() if t.marker == marker and t.counted_by}


def data_tables(marker: str) -> list[str]:
    """The data tables a marker table's commit makes visible."""
    return [n for n, t in TABLES.items() if t.marker == marker]


def with_partitions(table: str) -> pa.Schema:
    """The table's schema plus the columns that come from the path (run, round / iteration)."""
    t = TABLES[table]
    extra = ["run"] + ([t.partition] if t.partition else [])
    return pa.schema(list(t.schema) + [pa.field(c, HIVE_TYPES[c]) for c in extra])


def _type_name(t: pa.DataType) -> str:
    return str(t).replace("timestamp[us, tz=UTC]", "timestamp (UTC)").replace("large_", "")


def columns_markdown(table: str) -> str:
    """The column table of lake/README.md for one table (generated: tests compare it)."""
    t = TABLES[table]
    part = f", {t.partition}" if t.partition else ""
    lines = [f"### {table} — {t.doc}", "", "| column | type | meaning |", "|---|---|---|",
             f"| run{part} | string{', int64' if part else ''} | from the path (hive partitions) |"]
    for f in t.documented:
        doc = (f.metadata or {}).get(b"doc", b"").decode()
        lines.append(f"| {f.name} | {_type_name(f.type)} | {doc.replace('|', '/')} |")
    return "\n".join(lines)


def readme_tables() -> str:
    return "\n\n".join(columns_markdown(n) for n in TABLES) + "\n"


if __name__ == "__main__":  # regenerates the column tables of lake/README.md
    print(readme_tables(), end="")
