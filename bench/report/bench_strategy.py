"""Strategy, not only legal moves: every run of a lake against the right baseline, read from the lake.

For each run: `game` (the eval games' TextArena game), `seed`, `start` (`base`, or the SFT checkpoint
RL continued from: the checkpoints the run began with whose algorithm is `sft`; a run of SFT checkpoints
only started from `base`), `algorithm` (of its newest checkpoint), `taught_by` (the
experts whose ExpertMove step transform scored the learner's moves: [] is RL from the game's reward
alone), `model`, `job` (its
whole validated job, from the lake's `rounds.job` of its newest round with train games), `wall_minutes`, and `final`: the learner's eval
score (win rate, draws half) against `random` (else the first eval opponent) pooled over the run's
last 3 rounds with eval games, with one Wilson 95% interval, `games`, `rounds`, and legal-random's
on the same rounds' replays of the same games (`legal_random_score`, `legal_random_ci`), every other
round.eval_baseline agent's (`baselines`), each with the paired `gap` (the learner's score minus the
agent's, game by game on the same games, with its 95% interval; `legal_random_gap`), and the draw rate against minimax where minimax is an opponent or a
baseline agent (`final_by_opponent`: the same per eval opponent). Then: its wall minutes from the first
round's start to the last commit (pauses of a resumed run included), the minutes its rounds took and
its learner's optimizer updates took (no pauses, no engine or learner start-up); per round: the minutes
from the run's start to that round's commit, the eval win rate (draws half)
against each fixed opponent with its Wilson 95% interval, the same games' `legal-random` baseline
(round.eval_baseline: the random agent, which plays legal moves, in the learner's seats on the
same seeds) with its interval, the number of the learner's eval turns, their format success (with
its interval) and invalid-move rate, and whether the learner's interval lies entirely above the
baseline's. On Kuhn Poker, where the best reply to the random agent is simple to state (bet when
you may, never fold: bench_kuhn_policies.py), also what the learner chose: the share of its eval decisions with
`[bet]` legal that bet, and of those facing a bet that fold; the invalid-move rate of each kind of
decision; the share of its training turns that faced a bet, and of those the share it folded and
the game's reward to its seat after a fold and after a call; of its training turns with `[bet]`
legal, how many bet and the game's reward after a bet and after a check (what the learner was
trained on: did the move it grew pay, and was the better one sampled at all?); and the policy's
sampling entropy on the round's own training samples (learner_steps.entropy of the updates that
trained on them: what `learn.entropy_coef` holds up). The probes of report/strength.py (take-a-win,
forced-block, optimal, first-free, bet-with-K, bet-with-J-or-Q, fold-with-J): the learner's rate per round
(`learner_probes`), the same probes over its train decisions with its seat's game reward after
making the probed move and after not (`train_probes`: what the update was fed), and `final.probes`
over the verdict's rounds for the learner and each baseline agent, with Wilson intervals (a first-free rate near 1 is a fixed fill order, not strategy). Every league of the lake that ranked
the run's checkpoints (a self-play run's verdict) adds its Spearman correlation of iteration and
rating and the last checkpoint's and base model's ratings with intervals. Nothing is typed by hand:
run it again on the same lakes and the file is the same.

    python bench/report/bench_strategy.py --lake lake [--lake other-lake ...] [--runs NAME ...] [--keep]

Writes bench/results/strategy.json and prints one markdown row per run (its last round).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py, tests/helpers
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]
MEASURES = ["unstable_dask/report/", "unstable_dask/lake/", "unstable_dask/play/"]  # what bench/stale.py checks for changes since a result's commit


from unstable_dask.config import LEGAL_RANDOM_UID  # noqa: E402
from unstable_dask.learn.transforms import ExpertMove, parse_transforms  # noqa: E402
from unstable_dask.play.experts import game_of  # noqa: E402

from common import RESULTS, row, save  # noqa: E402

FINAL_ROUNDS = 3  # `final`: pooled over the run's last 3 rounds with eval games

# The learner's eval decisions in Kuhn Poker, by the legal actions of the hand being played (the
# observation holds the whole game, so the last "available actions" line is the current one); and
# how often its training games put a bet in front of it (self-play: only as often as it bets itself).
KUHN_SQL = r"""
SELECT round, avg((move = 'bet')::DOUBLE) FILTER (WHERE ev AND can_bet) AS bet_share, count(*) FILTER (WHERE ev AND can_bet) AS bet_legal_turns,
       avg((move = 'fold')::DOUBLE) FILTER (WHERE ev AND facing_bet) AS fold_share, count(*) FILTER (WHERE ev AND facing_bet) AS facing_bet_turns,
       avg(invalid_move::DOUBLE) FILTER (WHERE ev AND can_bet) AS invalid_when_bet_legal,
       avg(invalid_move::DOUBLE) FILTER (WHERE ev AND facing_bet) AS invalid_facing_bet,
       avg(facing_bet::DOUBLE) FILTER (WHERE NOT ev) AS train_facing_bet_share,
       avg((move = 'fold')::DOUBLE) FILTER (WHERE NOT ev AND facing_bet) AS train_fold_share,
       count(*) FILTER (WHERE NOT ev AND facing_bet AND move = 'call') AS train_calls,
       avg(seat_reward) FILTER (WHERE NOT ev AND facing_bet AND move = 'fold') AS train_reward_after_fold,
       avg(seat_reward) FILTER (WHERE NOT ev AND facing_bet AND move = 'call') AS train_reward_after_call,
       count(*) FILTER (WHERE NOT ev AND can_bet) AS train_bet_legal_turns,
       count(*) FILTER (WHERE NOT ev AND can_bet AND move = 'bet') AS train_bets,
       avg(seat_reward) FILTER (WHERE NOT ev AND can_bet AND move = 'bet') AS train_reward_after_bet,
       avg(seat_reward) FILTER (WHERE NOT ev AND can_bet AND move = 'check') AS train_reward_after_check
FROM (SELECT round, split = 'eval' AS ev, invalid_move, seat_reward,
             regexp_extract(lower(action), '\[(check|bet|call|fold)\]', 1) AS move,  -- the env's reading
             contains(legal, '[bet]') AS can_bet, contains(legal, '[fold]') AS facing_bet
      FROM (SELECT t.round, t.split, t.invalid_move, t.action, g.seat.reward AS seat_reward,
                   regexp_extract(t.observation, '(?s).*available actions are: ([^\n]*)', 1) AS legal
            FROM turns t LEFT JOIN (SELECT game_id, unnest(seats) AS seat FROM games WHERE run = $1) g
              ON g.game_id = t.game_id AND g.seat.pid = t.pid
            WHERE t.run = $1 AND t.split IN ('eval', 'train') AND t.is_learner AND t.env_id LIKE 'KuhnPoker%'))
GROUP BY round"""


def league_rows(lake, run_name: str) -> list[dict]:
    """Every league of the lake that ranked this run's checkpoints: the run's curve there (Spearman of
    iteration and rating, the last checkpoint's and the base model's ratings with intervals)."""
    from bench_league_run import league_curves
    names = [r["run"] for r in lake.sql("SELECT DISTINCT run FROM league_ratings WHERE source_run = ? ORDER BY run",
                                        params=[run_name]).to_pylist()]
    out = []
    for league in names:
        c = league_curves(lake, league)[1][run_name]
        out.append({"league": league, "points": c["points"], "spearman": c["spearman"],
                    "adjacent_separated": c["adjacent_separated"], "last_above_base": c["last_above_base"],
                    "last_checkpoint": c["last"], "base_model": c["base"]})
    return out


def run_rows(con, run_name: str) -> dict:
    from unstable_dask.report import strength
    from unstable_dask.report.report import round_curves
    rows = round_curves(con, run_name)
    # The job that trained: the newest round with train games (a later eval-only round may run
    # another job, e.g. a yardstick with more eval games), else the newest round's.
    meta = con.sql("""SELECT min(started_at), max(committed_at), coalesce(arg_max(job, round) FILTER (WHERE round IN
                          (SELECT round FROM games WHERE run = $1 AND split = 'train')), arg_max(job, round))
                      FROM rounds WHERE run = $1""", params=[run_name]).fetchall()[0]
    last_ckpt = con.sql("SELECT max(created_at) FROM checkpoints WHERE run = ?", params=[run_name]).fetchall()[0][0]
    end = max(t for t in (meta[1], last_ckpt) if t is not None)
    job = json.loads(meta[2])
    # The wall span includes any pause of a run resumed later; the time spent playing and updating does not.
    [(play_s, learn_s)] = con.sql("""SELECT (SELECT sum(epoch(committed_at) - epoch(started_at)) FROM rounds WHERE run = $1),
        (SELECT sum(step_time_s) FROM learner_steps WHERE run = $1)""", params=[run_name]).fetchall()
    kuhn = {r[0]: r[1:] for r in con.sql(KUHN_SQL, params=[run_name]).fetchall()}
    # When each round's eval verdict was in, from the run's start (a claim "within N minutes" reads this).
    at = dict(con.sql("""SELECT round, (epoch(committed_at) - epoch(min(started_at) OVER ())) / 60 FROM rounds
                         WHERE run = ?""", params=[run_name]).fetchall())
    entropy = dict(con.sql("""SELECT r, avg(entropy) FROM (SELECT unnest(rounds) AS r, entropy FROM learner_steps
                              WHERE run = ?) GROUP BY r""", params=[run_name]).fetchall())
    probes = strength.probe_counts(con, run_name)
    trained = strength.train_probe_rewards(con, run_name)
    rounds = []
    for k in sorted({r["round"] for r in rows}):
        ev = {r["opponent"]: r for r in rows if r["round"] == k and r["split"] == "eval" and r["opponent"] != "*"}
        base = {r["opponent"]: r for r in rows if r["round"] == k and r["split"] == "baseline" and r["opponent"] != "*"
                and r["player"] == LEGAL_RANDOM_UID}
        for opp, e in ev.items():
            b = base.get(opp)
            rounds.append({
                "round": k, "checkpoint": e["checkpoint_uid"], "opponent": opp, "eval_games": e["games"],
                "minutes_from_start": at.get(k),
                "win_rate": e["win_rate"], "win_rate_ci": [e["win_rate_low"], e["win_rate_high"]],
                "legal_random_win_rate": b and b["win_rate"],
                "legal_random_ci": b and [b["win_rate_low"], b["win_rate_high"]],
                "above_baseline": bool(b and e["win_rate_low"] > b["win_rate_high"]),
                "eval_turns": e["turns"], "format_success": e["format_success"],
                "format_success_ci": [e["format_success_low"], e["format_success_high"]],
                "invalid_rate": e["invalid_rate"],
                "learner_entropy": entropy.get(k),
                "learner_probes": {p["probe"]: p["rate"] for p in strength.probe_rows(probes, [k])
                                   if p["split"] == "eval"},
                "train_probes": {probe: t for (r, probe), t in sorted(trained.items()) if r == k}})
            if k in kuhn:  # what it chose, not only how it scored
                rounds[-1].update(zip(("kuhn_bet_share", "kuhn_bet_legal_turns", "kuhn_fold_share",
                                       "kuhn_facing_bet_turns", "kuhn_invalid_when_bet_legal",
                                       "kuhn_invalid_facing_bet", "kuhn_train_facing_bet_share", "kuhn_train_fold_share",
                                       "kuhn_train_calls", "kuhn_train_reward_after_fold",
                                       "kuhn_train_reward_after_call", "kuhn_train_bet_legal_turns",
                                       "kuhn_train_bets", "kuhn_train_reward_after_bet",
                                       "kuhn_train_reward_after_check"), kuhn[k]))
    games = [g for (g,) in con.sql("SELECT DISTINCT env_id FROM games WHERE run = ? AND split = 'eval' ORDER BY 1",
                                   params=[run_name]).fetchall()]
    verdict = final(rows, lambda window: strength.paired_gaps(con, run_name, window))
    if verdict["final"]:  # the probes over the verdict's rounds: learner and baseline agents
        verdict["final"]["probes"] = strength.probe_rows(probes, verdict["final"]["rounds"])
    return {"run": run_name, "job": job, "seed": job["run"]["seed"], "game": "+".join(dict.fromkeys(map(game_of, games))),
            "eval_envs": games, "start": start(con, run_name),
            "taught_by": [t.expert for t in parse_transforms(job["learn"].get("step_transforms", []), "step")
                          if isinstance(t, ExpertMove)],
            "algorithm": algorithm(con, run_name) or job["learn"]["algorithm"], "model": job["model"]["base"],
            "opponents": job["round"]["opponents"]["strategy"],
            "wall_minutes": (end - meta[0]).total_seconds() / 60, "play_minutes": (play_s or 0) / 60,
            "update_minutes": (learn_s or 0) / 60, **verdict, "rounds": rounds}


def start(con, run_name: str) -> str:
    """What RL started from: `base`, or the last of the SFT checkpoints the run began with (the
    checkpoints table's algorithm; RL continues from the newest of them). A run of SFT checkpoints
    only (SFT, DAgger) started from `base`: nothing continued from them."""
    ckpts = con.sql("SELECT uid, algorithm FROM checkpoints WHERE run = ? ORDER BY iteration", params=[run_name]).fetchall()
    sft = [uid for uid, _ in itertools.takewhile(lambda c: c[1] == "sft", ckpts)]
    return sft[-1] if sft and len(sft) < len(ckpts) else "base"


def algorithm(con, run_name: str) -> str | None:
    """The algorithm that wrote the run's newest checkpoint (None: no checkpoint yet)."""
    return con.sql("SELECT arg_max(algorithm, iteration) FROM checkpoints WHERE run = ?", params=[run_name]).fetchall()[0][0]


def final(rows: list[dict], gaps: Callable[[list[int]], dict] = lambda window: {}, k: int = FINAL_ROUNDS) -> dict:
    """The run's verdict: per eval opponent, the learner's score (win rate, draws half) pooled over the
    last k rounds with eval games, one Wilson 95% interval, beside each round.eval_baseline agent's on
    the same rounds' replays of the same games (legal-random: `legal_random_*`); `final` is the one
    against `random` (else the first opponent), `final_by_opponent` all of them. Against minimax (an
    opponent or a baseline agent) the draw rate is what a perfect player maxes (1.0). `gaps(window)`
    (strength.paired_gaps) gives each agent's `gap`: the learner's score minus the agent's game by
    game on those games, with its 95% interval (`legal_random_gap` for legal-random)."""
    from unstable_dask.report import strength
    window = strength.pool_window(rows, max((r["round"] for r in rows), default=-1), k)
    pooled = strength.pooled(rows, window)
    paired = gaps(window)
    out = {}
    for ev in (p for p in pooled if p["split"] == "eval" and p["opponent"] not in ("self", "solo")):
        base = {b["player"]: b for b in pooled if b["split"] == "baseline" and b["opponent"] == ev["opponent"]}
        lr = base.get(LEGAL_RANDOM_UID)
        rec = {"score": ev["score"], "score_ci": [ev["low"], ev["high"]], "games": ev["games"], "rounds": window,
               "draw_rate": ev["draw_rate"],
               "legal_random_score": lr and lr["score"], "legal_random_ci": lr and [lr["low"], lr["high"]],
               "legal_random_games": lr and lr["games"],
               "above_legal_random": bool(lr and ev["low"] > lr["high"]),
               "baselines": {a: {"score": b["score"], "ci": [b["low"], b["high"]], "games": b["games"],
                                 "draw_rate": b["draw_rate"], "gap": _gap(paired.get((ev["opponent"], a)))}
                             for a, b in base.items()}}
        rec["legal_random_gap"] = rec["baselines"].get(LEGAL_RANDOM_UID, {}).get("gap")
        # minimax itself where it replayed, else a variant (minimax-first, minimax@eps)
        minimax = [b for a, b in sorted(base.items(), key=lambda ab: ab[0] != "minimax") if a.startswith("minimax")]
        if ev["opponent"].startswith("minimax"):
            rec["minimax_draw_rate"] = ev["draw_rate"]  # the learner's draws against minimax
        elif minimax:
            rec["minimax_draw_rate"] = minimax[0]["draw_rate"]  # minimax's own, on the learner's games
        out[ev["opponent"]] = rec
    main = out.get("random") or next(iter(out.values()), None)
    return {"final": main, "final_by_opponent": out}


def _gap(g: dict | None) -> dict | None:
    return g and {"gap": g["gap"], "ci": [g["low"], g["high"]], "pairs": g["pairs"]}


def merge_runs(old: list[dict], new: list[dict]) -> list[dict]:
    """The records of `old` that `new` does not read again, then `new`: a record is one run, seed and
    lake (one job's seeds share its run name, each in its own lake; a run rolled back and continued
    in a copy of its lake is a second record beside the first)."""
    again = {(r["run"], r["seed"], r["lake"]) for r in new}
    return [r for r in old if (r["run"], r["seed"], r.get("lake")) not in again] + new


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lake", action="append", required=True)
    ap.add_argument("--runs", nargs="*")
    ap.add_argument("--keep", action="store_true",
                    help="keep the runs already in strategy.json that these lakes do not hold (a lake per machine, "
                         "session or seed); a run, seed and lake these lakes hold is read again")
    ap.add_argument("--compare", nargs="+", metavar="RUN",
                    help="also draw these runs' eval win-rate curves on one chart: bench/results/strategy_compare.svg")
    args = ap.parse_args()
    from unstable_dask.lake import Lake
    runs = []
    for uri in args.lake:
        con = Lake(uri).connect()
        try:
            names = args.runs or [r for (r,) in con.sql(
                "SELECT DISTINCT run FROM checkpoints ORDER BY run").fetchall()]  # learning runs, not leagues
            runs += [dict(run_rows(con, n), lake=uri, leagues=league_rows(Lake(uri), n)) for n in names]
        finally:
            con.close()
    if args.keep and (RESULTS / "strategy.json").exists():
        runs = merge_runs(json.loads((RESULTS / "strategy.json").read_text())["runs"], runs)
    save("strategy", {"runs": runs}, settings=vars(args))
    if args.compare:
        compare(runs, args.compare)
    print(row("run", "seed", "start", "minutes", "final score [95% CI], last 3 rounds", "legal-random [95% CI]", "games"))
    for r in runs:
        f = r.get("final")
        if f:
            lr = f["legal_random_ci"]
            taught = "".join(f", scored by {t}" for t in r.get("taught_by", []))
            print(row(r["run"], r["seed"], r["start"] + taught, f"{r['wall_minutes']:.0f}",
                      f"{f['score']:.3f} [{f['score_ci'][0]:.3f}, {f['score_ci'][1]:.3f}]",
                      f"{f['legal_random_score']:.3f} [{lr[0]:.3f}, {lr[1]:.3f}]" if lr else "not played", f["games"]))
    print(row("run", "seed", "algorithm", "minutes: wall (playing + updating)", "round", "eval win rate [95% CI]", "legal-random [95% CI]",
              "above", "format", "invalid"))
    for r in runs:
        for x in r["rounds"][-1:]:
            lr = x["legal_random_ci"]
            print(row(r["run"], r["seed"], r["algorithm"], f"{r['wall_minutes']:.0f} ({r['play_minutes'] + r['update_minutes']:.0f})", x["round"],
                      f"{x['win_rate']:.2f} [{x['win_rate_ci'][0]:.2f}, {x['win_rate_ci'][1]:.2f}]",
                      f"{x['legal_random_win_rate']:.2f} [{lr[0]:.2f}, {lr[1]:.2f}]" if lr else "not played",
                      "yes" if x["above_baseline"] else "no", f"{x['format_success'] or 0:.2f}",
                      f"{x['invalid_rate'] or 0:.2f}"))
        for g in r["leagues"]:
            rho = "n/a" if g["spearman"] is None else f"{g['spearman']:.2f}"
            print(f"  {r['run']} in league {g['league']}: Spearman(iteration, rating) {rho} over {g['points']} points; "
                  f"{_rated(g['last_checkpoint'])} vs base {_rated(g['base_model'])}; "
                  f"last checkpoint above the base model: {g['last_above_base']}")


def compare(runs: list[dict], names: list[str]) -> None:
    """The named runs' eval win rate vs the random agent by learner update, with Wilson 95% bands,
    and legal-random's (the mean over every round of these runs: each measured on its own seeds)."""
    from unstable_dask.report import charts
    by_name = {r["run"]: r for r in runs}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise SystemExit(f"--compare: no run {missing[0]!r} in these lakes or in strategy.json")
    series, bands, base = {}, {}, []
    for n in names:
        rounds = [x for x in by_name[n]["rounds"] if x["win_rate"] is not None]
        label = f"{by_name[n]['algorithm']}, seed {by_name[n]['seed']}"
        label = f"{n} ({label})" if label in series else label  # a second run of one algorithm and seed
        series[label] = [(x["round"], x["win_rate"]) for x in rounds]
        bands[label] = [(x["round"], *x["win_rate_ci"]) for x in rounds]
        base += [x["legal_random_win_rate"] for x in rounds if x["legal_random_win_rate"] is not None]
    if base:
        last = max(x for pts in series.values() for x, _ in pts)
        series["legal-random (mean)"] = [(0, sum(base) / len(base)), (last, sum(base) / len(base))]
    chart = charts.line(series, "learner updates (round = checkpoint that played it)", "eval win rate vs random",
                        y_range=(0, 1), width=480, height=300, bands=bands)
    if chart is not None:
        (RESULTS / "strategy_compare.svg").write_text(
            charts.svg(chart, "Kuhn Poker: eval win rate by update (Wilson 95% CIs)"), encoding="utf-8")


def _rated(r: dict | None) -> str:
    if r is None:
        return "not rated"
    ci = f" [{r['rating_low']:.0f}, {r['rating_high']:.0f}]" if r["rating_low"] is not None else ""
    return f"{r['entrant']} {r['rating']:.0f}{ci}"


if __name__ == "__main__":
    main()
