"""Ratings replay: equal to a plain loop over the `trueskill` package, deterministic, incremental."""
from __future__ import annotations

import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import trueskill

from unstable_dask.errors import JobError
from unstable_dask.jobfile import default_job
from unstable_dask.lake import Lake
from unstable_dask.rate import duels, ratings
from unstable_dask.skill import make_env

from helpers import synthetic_lake as sl
from helpers.reference_ratings import oracle

RUN = "syn"
FILES = [("ratings", "ratings"), ("rating_history", "rating_history"), ("head_to_head", "head_to_head"),
         ("ratings_state", "state")]


def job_for(lake_dir: Path, **ratings_cfg):
    job = default_job()
    job.run.lake, job.run.name = str(lake_dir), RUN
    for k, v in ratings_cfg.items():
        setattr(job.ratings, k, v)
    return job


def file_bytes(lake_dir: Path) -> dict[str, bytes]:
    return {t: (Path(Lake(lake_dir).partition_dir(t, RUN)) / f"{k}.parquet").read_bytes() for t, k in FILES}


@pytest.fixture
def syn_lake(tmp_path: Path) -> Path:
    sl.make_run(tmp_path / "lake", RUN, rounds=4, games_per_round=48, seed=1)
    return tmp_path / "lake"


@pytest.mark.parametrize("include_eval", [True, False])
def test_equals_trueskill_package_loop(syn_lake: Path, include_eval: bool) -> None:
    job = job_for(syn_lake, include_eval=include_eval, inherit_sigma_factor=1.5)
    res = ratings.rate(job)
    want, want_hist = oracle(syn_lake, job.ratings, include_eval)
    got = {(r["env_id"], r["model_uid"]): (r["mu"], r["sigma"]) for r in res.ratings.to_pylist()}
    assert set(got) == set(want)
    for key, (mu, sigma) in want.items():
        assert got[key][0] == pytest.approx(mu, abs=1e-6), key
        assert got[key][1] == pytest.approx(sigma, abs=1e-6), key
    hist = {(r["round"], r["model_uid"], r["env_id"]): (r["mu"], r["sigma"]) for r in res.rating_history.to_pylist()}
    assert set(hist) == set(want_hist)
    assert max(abs(hist[k][i] - want_hist[k][i]) for k in hist for i in (0, 1)) < 1e-6
    envs = {k[0] for k in got}
    assert ("KuhnPoker-v0-train" in envs) == include_eval


def test_fast_path_equals_package_on_random_duels() -> None:
    """Closed form vs the package on single games over a wide range of ratings, draws and dummies."""
    cfg = default_job().ratings
    margin = trueskill.calc_draw_margin(cfg.draw_probability, 2, env=make_env(cfg))
    rng = random.Random(7)
    for _ in range(3000):
        mu = [rng.uniform(-10, 60), rng.uniform(-10, 60)]
        sg = [rng.uniform(0.05, 9), rng.uniform(0.05, 9)]
        out, solo = rng.choice([1, 0, -1]), rng.random() < 0.2
        db = -1 if solo else 1
        kind = duels.SOLO if solo else duels.FAST
        mus, sgs = list(mu), list(sg)
        stop = duels.replay_duels(0, 1, [0], [db], [out], [kind], mus, sgs, [True, True], [-1, -1], cfg, margin)
        ranks = [0, 0] if out == 0 else [0, 1] if out > 0 else [1, 0]
        theirs = duels.package_rate(cfg, [(mu[0], sg[0]), (mu[1], sg[1]) if not solo else (cfg.mu, cfg.sigma)], ranks)
        if stop == 0:  # the closed form declined (package territory: FloatingPointError)
            continue
        assert mus[0] == pytest.approx(theirs[0][0], abs=1e-6) and sgs[0] == pytest.approx(theirs[0][1], abs=1e-6)
        if not solo:
            assert mus[1] == pytest.approx(theirs[1][0], abs=1e-6) and sgs[1] == pytest.approx(theirs[1][1], abs=1e-6)
        else:
            assert (mus[1], sgs[1]) == (mu[1], sg[1])  # the dummy is never written back


def test_extreme_upset_falls_back_to_mpmath() -> None:
    """Where float64 cannot rate an upset, the package raises; the replay uses mpmath instead."""
    cfg = job_for(Path("unused"), beta=0.5, tau=0.0).ratings
    margin = trueskill.calc_draw_margin(cfg.draw_probability, 2, env=make_env(cfg))
    env = make_env(cfg)
    strong, weak = env.create_rating(100.0, 1.0), env.create_rating(0.0, 1.0)
    with pytest.raises(FloatingPointError):
        env.rate([(weak,), (strong,)], ranks=[0, 1])
    mu, sg = [0.0, 100.0], [1.0, 1.0]
    stop = duels.replay_duels(0, 1, [0], [1], [1], [duels.FAST], mu, sg, [True, True], [-1, -1], cfg, margin)
    assert stop == 0 and mu == [0.0, 100.0]  # declined, untouched
    (mw, sw), (ms, ss) = duels.package_rate(cfg, [(0.0, 1.0), (100.0, 1.0)], [0, 1])
    assert mw > 0.0 and ms < 100.0 and 0 < sw <= 1.0 and 0 < ss <= 1.0


def test_byte_identical_and_full_equals_incremental(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        sl.make_run(d, RUN, rounds=4, games_per_round=36, seed=3, commit_last=False)
    first = ratings.rate(job_for(a))
    assert not first.incremental and first.rounds == [0, 1, 2]
    ratings.rate(job_for(b))
    assert file_bytes(a) == file_bytes(b)  # same lake -> same bytes
    for d in (a, b):
        sl.commit(d, RUN, 3, [])
    inc = ratings.rate(job_for(a))
    assert inc.incremental and inc.rounds == [0, 1, 2, 3]
    full = ratings.rate(job_for(b), full=True)
    assert not full.incremental
    assert file_bytes(a) == file_bytes(b)  # incremental replay == full replay, byte for byte
    again = ratings.rate(job_for(a))  # nothing new: replays nothing, changes nothing
    assert again.incremental and again.games_rated == 0 and file_bytes(a) == file_bytes(b)


def test_late_older_round_forces_full_replay(tmp_path: Path) -> None:
    lake_dir = tmp_path / "lake"
    rng = random.Random(0)
    rounds = {r: [sl.game(r, i, "E", [sl.seat(0, f"m{i % 3}", v), sl.seat(1, f"m{(i + 1) % 3}", -v)])
                  for i, v in enumerate(rng.choice([1.0, 0.0, -1.0]) for _ in range(20))] for r in range(4)}
    for r in (0, 1, 3):
        sl.write_round(lake_dir, RUN, r, rounds[r])
    sl.write_round(lake_dir, RUN, 2, rounds[2], do_commit=False)
    ratings.rate(job_for(lake_dir))
    sl.commit(lake_dir, RUN, 2, rounds[2])
    res = ratings.rate(job_for(lake_dir))
    assert not res.incremental and res.rounds == [0, 1, 2, 3]
    before = file_bytes(lake_dir)
    ratings.rate(job_for(lake_dir), full=True)
    assert file_bytes(lake_dir) == before


def test_changed_parameters_force_full_replay(syn_lake: Path) -> None:
    ratings.rate(job_for(syn_lake))
    res = ratings.rate(job_for(syn_lake, beta=5.0))
    assert not res.incremental
    want, _ = oracle(syn_lake, job_for(syn_lake, beta=5.0).ratings)
    got = {(r["env_id"], r["model_uid"]): r["mu"] for r in res.ratings.to_pylist()}
    assert max(abs(got[k] - want[k][0]) for k in want) < 1e-6


def test_mirror_inheritance_and_counts(tmp_path: Path) -> None:
    lake_dir = tmp_path / "lake"
    sl.write_checkpoint(lake_dir, RUN, 0, "c0", None)
    sl.write_checkpoint(lake_dir, RUN, 1, "c1", "c0")
    sl.write_checkpoint(lake_dir, RUN, 2, "c2", "c1")
    r0 = [sl.game(0, i, "E", [sl.seat(0, "c0", 1.0), sl.seat(1, "random", -1.0)]) for i in range(5)]
    r0.append(sl.game(0, 9, "E", [sl.seat(0, "c0", None), sl.seat(1, "random", 1.0)]))  # no reward: skipped
    sl.write_round(lake_dir, RUN, 0, r0)
    # c1 only plays itself; c2 (grandchild) plays itself in a 3-seat game.
    sl.write_round(lake_dir, RUN, 1, [sl.game(1, 0, "E", [sl.seat(0, "c1", 1.0), sl.seat(1, "c1", -1.0)]),
                                      sl.game(1, 1, "F", [sl.seat(p, "c2", float(p)) for p in range(3)])])
    res = ratings.rate(job_for(lake_dir, inherit_sigma_factor=3.0))
    rows = {(r["env_id"], r["model_uid"]): r for r in res.ratings.to_pylist()}
    c0, c1, c2 = rows[("*", "c0")], rows[("*", "c1")], rows[("*", "c2")]
    assert (c0["games"], c0["wins"], c0["mirror_games"]) == (5, 5, 0)
    assert (c1["games"], c1["mirror_games"]) == (0, 1) and (c2["games"], c2["mirror_games"]) == (0, 1)
    assert c1["mu"] == c0["mu"] and c1["sigma"] == pytest.approx(min(c0["sigma"] * 3.0, 25 / 3))
    assert c2["mu"] == c0["mu"]  # inherited through c1
    assert ("F", "c2") in rows and rows[("F", "c2")]["mu"] == 25.0  # no ancestor rated in env F
    assert res.mirror_games == 2 and res.skipped_games == 1 and res.games_rated == 5
    assert c1["bt_score"] is None  # no pairwise games
    h2h = res.head_to_head.to_pylist()
    assert {(r["model_a"], r["model_b"], r["wins_a"]) for r in h2h if r["env_id"] == "*"} == \
        {("c0", "random", 5), ("random", "c0", 0)}


def test_lineage_loop_is_a_job_error(tmp_path: Path) -> None:
    lake_dir = tmp_path / "lake"
    sl.write_checkpoint(lake_dir, RUN, 0, "a", "b")
    sl.write_checkpoint(lake_dir, RUN, 1, "b", "a")
    sl.write_round(lake_dir, RUN, 0, [sl.game(0, 0, "E", [sl.seat(0, "a", 1.0), sl.seat(1, "b", 0.0)])])
    with pytest.raises(JobError, match="loops back"):
        ratings.rate(job_for(lake_dir))


def test_a_run_without_rounds_is_an_error_not_empty_ratings(tmp_path: Path) -> None:
    """A run with no committed round (a typo in run.name, or an empty lake): one line naming the
    run and the runs there; nothing written (it used to write empty ratings and exit 0)."""
    lake_dir = tmp_path / "lake"
    sl.write_round(lake_dir, "other", 0, [sl.game(0, 0, "E", [sl.seat(0, "a", 1.0), sl.seat(1, "b", 0.0)])])
    with pytest.raises(JobError, match=r"run 'syn' has no committed round .* \(runs there: 'other'\)"):
        ratings.rate(job_for(lake_dir))
    assert not (lake_dir / "ratings").exists()


def test_rate_racing_a_commit_equals_rate_full(tmp_path: Path, monkeypatch) -> None:
    """Round 3 is committed while `rate` reads the lake (right after it has read the rounds log):
    rate counts the games of exactly the rounds it records, so the next incremental rate equals
    `rate --full`, byte for byte (it used to count round 3's games twice, for good)."""
    from unstable_dask.lake import delta as dl
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        sl.make_run(d, RUN, rounds=4, games_per_round=36, seed=3, commit_last=False)
    visible = Lake(a).table("games").read().num_rows  # nothing of round 3 yet
    real, landed = dl.snapshot, []

    def snapshot(lake, table, version=None):
        out = real(lake, table, version)
        if table == "rounds" and not landed:  # the commit lands between rate's reads of the logs
            landed.append(True)
            sl.commit(a, RUN, 3, [])
        return out

    monkeypatch.setattr(dl, "snapshot", snapshot)
    raced = ratings.rate(job_for(a))
    monkeypatch.undo()
    assert landed and raced.rounds == [0, 1, 2]
    assert sum(r["games"] + r["mirror_games"] for r in raced.ratings.to_pylist() if r["env_id"] == "*") > 0
    assert Lake(a).table("games").read().num_rows > visible  # round 3 is visible now
    after = ratings.rate(job_for(a))
    assert after.incremental and after.rounds == [0, 1, 2, 3]
    sl.commit(b, RUN, 3, [])
    ratings.rate(job_for(b), full=True)
    assert file_bytes(a) == file_bytes(b)


def test_rate_over_a_lost_games_log_fails_and_keeps_the_ratings(tmp_path: Path) -> None:
    """`games/_delta_log` is gone: rate fails naming the table; the ratings it wrote before stay
    (it used to write empty ratings and exit 0)."""
    import shutil
    lake_dir = tmp_path / "lake"
    sl.make_run(lake_dir, RUN, rounds=2, games_per_round=12, seed=5)
    ratings.rate(job_for(lake_dir))
    before = file_bytes(lake_dir)
    shutil.rmtree(lake_dir / "games/_delta_log")
    with pytest.raises(JobError, match="table 'games' has no Delta log"):
        ratings.rate(job_for(lake_dir))
    assert file_bytes(lake_dir) == before


def _flip(path: Path, at: float, n: int = 4) -> None:
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)
    data[i:i + n] = bytes(b ^ 0xFF for b in data[i:i + n])
    path.write_bytes(bytes(data))


def _rewrite_first_mu(path: Path) -> None:
    """The same file, well formed, metadata kept, one value changed: damage no decoder notices."""
    import pyarrow as pa
    t = pq.read_table(path)
    mu = t.column("mu").to_pylist()
    mu[0] = (mu[0] or 0.0) + 7.0
    pq.write_table(t.set_column(t.column_names.index("mu"), "mu", pa.array(mu, pa.float64())), path)


@pytest.mark.parametrize("damage", ["flip-state", "flip-history", "value-state", "value-history"])
def test_a_damaged_replay_state_is_replayed_not_trusted(tmp_path: Path, damage: str, caplog) -> None:
    """The saved ratings_state (or the rating_history it continues) is damaged between two rate
    jobs (4 flipped bytes, or a value changed in a well-formed file): the next rate equals a full
    replay on an intact copy of the lake, byte for byte, and says it replayed."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        sl.make_run(d, RUN, rounds=4, games_per_round=36, seed=3, commit_last=False)
        ratings.rate(job_for(d))
        sl.commit(d, RUN, 3, [])
    table, key = ("ratings_state", "state") if damage.endswith("state") else ("rating_history", "rating_history")
    victim = Path(Lake(a).partition_dir(table, RUN)) / f"{key}.parquet"
    if damage.startswith("flip"):
        _flip(victim, 0.3)
    else:
        _rewrite_first_mu(victim)
    with caplog.at_level("WARNING", logger="unstable_dask.rate"):
        res = ratings.rate(job_for(a))
    assert not res.incremental and "cannot be trusted" in caplog.text
    ratings.rate(job_for(b), full=True)
    assert file_bytes(a) == file_bytes(b)
