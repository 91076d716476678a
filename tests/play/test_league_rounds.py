"""Leagues with real rounds: run demo (builtin tiny model, a 2-round loop that runs a league after
every learner iteration), then leagues over its checkpoints, its base model and the random agent,
played on a real LocalCluster and committed and rated as rounds are."""
from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from unstable_dask import cli
from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.loop import league, loop

pytestmark = pytest.mark.slow
SETS = {"round.train_games": 4, "round.eval_games": 0, "round.games_per_task": 4, "round.concurrency": 4,
        "cluster.n_workers": 1, "cluster.dashboard": False, "model.max_new_tokens": 8,
        "model.lora": {"rank": 4, "alpha": 8}, "learn.batch_size": 8, "learn.mini_batch_size": 4,
        "learn.gradient_checkpointing": False,
        "league.games": [{"env_id": "KuhnPoker-v0-train"}], "league.deals_per_pair": 1,
        "league.first_pass": ["random", "base"], "league.budget_per_entrant": 6}
ENTRANTS = {"demo:ckpt-1", "demo:ckpt-2", "base:builtin:tiny", "random"}


@pytest.fixture(scope="module")
def run_lake(tmp_path_factory, cache) -> Path:
    """Run demo trained 2 iterations by `loop`, with `league.every = 1`: a league after each."""
    root = tmp_path_factory.mktemp("league")
    job = load_job("jobs/demo.toml", {"run.lake": str(root / "lake"), "run.reports": str(root / "reports"),
                                      "league.every": 1, **SETS})
    loop(job, rounds=2, rate=False)
    return root / "lake"


def job_on(lake: Path, **league):
    """The demo job on `lake`, with a league of its own."""
    return load_job("jobs/demo.toml", {"run.lake": str(lake), **SETS, **{f"league.{k}": v for k, v in league.items()}})


def copy(run_lake: Path, tmp_path: Path) -> Path:
    shutil.copytree(run_lake, tmp_path / "lake")
    return tmp_path / "lake"


def games(lake: Path, league_name: str) -> list[dict]:
    return Lake(lake).sql("SELECT round, game_id, group_id, seed, seats FROM games WHERE run = ? ORDER BY game_id",
                          [league_name]).to_pylist()


def check_duplicates(rows: list[dict]) -> None:
    """Every game once; every deal in both seat orders on one seed."""
    assert len(rows) == len({g["game_id"] for g in rows})
    deals: dict[str, list] = {}
    for g in rows:
        deals.setdefault(g["group_id"], []).append(g)
    for gid, pair in deals.items():
        assert len(pair) == 2 and pair[0]["seed"] == pair[1]["seed"], gid
        orders = {tuple(s["model_uid"] for s in sorted(g["seats"], key=lambda s: s["pid"])) for g in pair}
        a, b = next(iter(orders))
        assert orders == {(a, b), (b, a)}, gid
    # a deal is the same seed for every pair (duplicate format)
    by_deal = {}
    for g in rows:
        by_deal.setdefault(g["group_id"].rsplit("-d", 1)[1], set()).add(g["seed"])
    assert all(len(seeds) == 1 for seeds in by_deal.values())


def test_loop_ranks_each_new_checkpoint_in_a_league_every_iteration(run_lake):
    rows = games(run_lake, "demo-league")
    check_duplicates(rows)
    ratings = {r["entrant"]: r for r in Lake(run_lake).sql("SELECT * FROM league_ratings WHERE run = 'demo-league'").to_pylist()}
    assert set(ratings) == ENTRANTS
    assert [ratings[u]["iteration"] for u in ("base:builtin:tiny", "demo:ckpt-1", "demo:ckpt-2")] == [0, 1, 2]
    assert ratings["random"]["anchor"] and ratings["random"]["rating"] == 1000.0
    assert ratings["random"]["rank"] == 1  # the random agent beats the untrained tiny model
    # The league after iteration 1 knew only ckpt-1; ckpt-2 joined after iteration 2, with its first games.
    first_ckpt2 = min(g["round"] for g in rows if any(s["model_uid"] == "demo:ckpt-2" for s in g["seats"]))
    assert first_ckpt2 > 0
    assert len(rows) <= 6 * 4 and Lake(run_lake).rounds("demo") == [0, 1]


def test_league_games_are_rated_as_a_trueskill_package_replay(run_lake):
    from helpers.reference_ratings import oracle
    job = load_job("jobs/demo.toml", {"run.lake": str(run_lake), **SETS})
    want, _ = oracle(run_lake, job.ratings, run="demo-league")
    got = Lake(run_lake).sql("SELECT entrant, mu, sigma FROM league_ratings WHERE run = 'demo-league'").to_pylist()
    assert {r["entrant"] for r in got} == {u for t, u in want if t == "*"}
    for r in got:
        assert r["mu"] == pytest.approx(want[("*", r["entrant"])][0], abs=1e-6)
        assert r["sigma"] == pytest.approx(want[("*", r["entrant"])][1], abs=1e-6)


def test_a_killed_league_plays_the_same_pass_again_and_no_game_twice(run_lake, tmp_path, local_client, monkeypatch):
    lake = copy(run_lake, tmp_path)
    job = job_on(lake, name="k-league", budget_per_entrant=5)
    commit = Lake.commit_round

    def dies_at_pass_1(self, run_name, round_, row):
        if run_name == "k-league" and round_ == 1:
            raise KeyboardInterrupt  # the driver dies after the pass's games are written, before its commit
        return commit(self, run_name, round_, row)

    monkeypatch.setattr(Lake, "commit_round", dies_at_pass_1)
    with pytest.raises(KeyboardInterrupt):
        league(job, client=local_client)
    monkeypatch.undo()
    assert Lake(lake).rounds("k-league") == [0]
    written = {g for f in (lake / "games/run=k-league/round=1").glob("*.parquet")
               for g in pq.read_table(f, columns=["game_id"]).column(0).to_pylist()}
    assert written  # the dead attempt's files, invisible
    res = league(job, client=local_client)
    rows = games(lake, "k-league")
    check_duplicates(rows)
    assert {g["game_id"] for g in rows if g["round"] == 1} == written  # the same pass, played again
    assert res.reason == "budget" and res.total == len(rows) <= 5 * 4


def test_an_extended_league_reuses_every_game_it_played(run_lake, tmp_path, local_client):
    lake = copy(run_lake, tmp_path)
    first = league(job_on(lake, name="x-league", entrants=["demo:ckpt-1", "base", "random"], budget_per_entrant=4),
                   client=local_client)
    before = {g["game_id"] for g in games(lake, "x-league")}
    assert first.total == len(before) and not any("ckpt-2" in g for g in before)
    second = league(job_on(lake, name="x-league", entrants=["demo:*", "base", "random"], budget_per_entrant=4),
                    client=local_client)
    rows = games(lake, "x-league")
    check_duplicates(rows)
    after = {g["game_id"] for g in rows}
    assert before < after and len(after) == second.total
    new = [g for g in rows if g["game_id"] not in before]
    first_pass = [g for g in new if g["round"] == min(x["round"] for x in new)]
    assert all(any(s["model_uid"] == "demo:ckpt-2" for s in g["seats"]) for g in first_pass)


def test_league_command_stops_when_the_pair_is_separated(run_lake, tmp_path, capsys):
    """`run league`: the random agent against the untrained base model separates in a few passes."""
    lake = copy(run_lake, tmp_path)
    code = cli.main(["league", "--job", "jobs/league-demo.toml", "--set", f'run.lake="{lake}"',
                     "--set", 'league.name="cli-league"', "--set", 'league.entrants=["base", "random"]', "--set", 'league.first_pass=["random"]',
                     "--set", "league.deals_per_pair=1", "--set", "model.max_new_tokens=8",
                     "--set", "cluster.n_workers=1", "--set", "cluster.dashboard=false"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0 and "every adjacent pair is separated" in out
    rows = Lake(lake).sql("SELECT * FROM league_ratings WHERE run = 'cli-league' ORDER BY rank").to_pylist()
    assert [r["entrant"] for r in rows] == ["random", "base:builtin:tiny"] and rows[0]["separated"]
    assert len(games(lake, "cli-league")) < 2 * 100
