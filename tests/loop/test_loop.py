"""The overlapped loop (learn.max_staleness = k > 0): rounds play while the learner trains, and the
lake proves the bound: no update ever trained on a round played by a checkpoint more than k
iterations older than its parent, every round is trained on exactly once, and a loop killed
anywhere and started again finishes with nothing lost or doubled. Real rounds of the tiny model,
a real LocalCluster, the real CLI for the kills."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.loop import loop

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SETS = {"round.train_games": 8, "round.eval_games": 2, "round.games_per_task": 4, "cluster.n_workers": 1,
        "cluster.dashboard": False, "model.max_new_tokens": 8, "learn.batch_size": 8, "learn.mini_batch_size": 4,
        "learn.gradient_checkpointing": False}

# Per learner iteration: how stale each round it trained on was (the checkpoint that played the
# round against the one it trained from), from the lake alone.
STALENESS_SQL = """
WITH ck AS (SELECT uid, iteration FROM checkpoints WHERE run = $run
            UNION ALL SELECT 'base', 0),
     trained AS (SELECT c.iteration, unnest(c.rounds_trained) AS round FROM checkpoints c WHERE c.run = $run)
SELECT t.iteration, t.round, (t.iteration - 1) - ck.iteration AS staleness
FROM trained t JOIN rounds r ON r.run = $run AND r.round = t.round JOIN ck ON ck.uid = r.checkpoint_uid
ORDER BY t.round"""


def check_lake(lake: Path, run: str, rounds: int, k: int) -> list[dict]:
    """Every round committed and trained on once, staleness within k: by SQL over the lake."""
    db = Lake(lake)
    assert db.rounds(run) == list(range(rounds))
    rows = db.sql(STALENESS_SQL, {"run": run}).to_pylist()
    assert [r["round"] for r in rows] == list(range(rounds))  # each round trained on, once
    assert all(0 <= r["staleness"] <= k for r in rows), rows
    iterations = [c["iteration"] for c in db.table("checkpoints").rows(run)]
    assert sorted(iterations) == list(range(1, len(iterations) + 1))  # no iteration twice, none skipped
    steps = db.sql("SELECT iteration, staleness_max FROM learner_steps WHERE run = $run", {"run": run}).to_pylist()
    assert all(s["staleness_max"] <= k for s in steps)
    return rows


def test_overlapped_loop_keeps_the_staleness_bound_and_trains_every_round(tmp_path, cache):
    job = load_job("jobs/demo.toml", {"run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"),
                                      "learn.max_staleness": 1, **SETS})
    loop(job, rounds=4, rate=False)
    rows = check_lake(tmp_path / "lake", "demo", 4, 1)
    # It did overlap: some round was played by the checkpoint before the one that then trained on it.
    assert any(r["staleness"] == 1 for r in rows), rows


def _run(args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "unstable_dask.run", *args], cwd=cwd, env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_overlapped_loop_killed_anywhere_resumes_without_losing_or_doubling(tmp_path, cache):
    sets = [x for key, value in {"run.lake": f'"{tmp_path / "lake"}"', "run.reports": f'"{tmp_path / "reports"}"',
                                 "learn.max_staleness": 1, **SETS}.items()
            for x in ("--set", f"{key}={str(value).lower() if isinstance(value, bool) else value}")]
    cmd = ["loop", "--rounds", "4", *sets]
    for after in (9.0, 17.0, 26.0, 38.0):
        p = _run(cmd, tmp_path)
        try:
            if p.wait(timeout=after) == 0:
                break
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        lake = Lake(tmp_path / "lake")
        if lake.rounds("demo"):  # whatever survived a kill is consistent
            committed = lake.rounds("demo")
            assert committed == list(range(len(committed)))
    assert _run(cmd, tmp_path).wait(timeout=900) == 0
    check_lake(tmp_path / "lake", "demo", 4, 1)


def test_rollback_retires_checkpoints_and_their_rounds_and_the_loop_goes_on(tmp_path, cache):
    from unstable_dask.errors import JobError
    from unstable_dask.learn.rollback import rollback
    from unstable_dask.rate.ratings import rate
    job = load_job("jobs/demo.toml", {"run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"),
                                      **SETS})
    loop(job, rounds=3, rate=False)
    lake = Lake(job.run.lake)
    played = {r["round"]: r["checkpoint_uid"] for r in lake.sql("SELECT round, checkpoint_uid FROM rounds").to_pylist()}
    assert played == {0: "base", 1: "ckpt-1", 2: "ckpt-2"}
    with pytest.raises(JobError, match="ckpt-9"):
        rollback(job, "ckpt-9")
    done = rollback(job, "ckpt-1")
    assert done.checkpoints == ["ckpt-2", "ckpt-3"] and done.rounds == [2]
    assert done.next_round == 3 and "its next round is 3" in str(done) and "--rounds 4 or more" in str(done)
    lake = Lake(job.run.lake)
    assert lake.rounds("demo") == [0, 1] and [c["uid"] for c in lake.table("checkpoints").rows("demo")] == ["ckpt-1"]
    assert lake.sql("SELECT count(*) AS n FROM games WHERE round = 2").to_pylist() == [{"n": 0}]
    loop(job, rounds=5, rate=False)  # goes on from ckpt-1; retired numbers are not reused
    lake = Lake(job.run.lake)
    assert lake.rounds("demo") == [0, 1, 3, 4]
    lineage = {c["uid"]: (c["parent_uid"], c["rounds_trained"]) for c in lake.table("checkpoints").rows("demo")}
    assert lineage == {"ckpt-1": ("base", [0]), "ckpt-4": ("ckpt-1", [1]), "ckpt-5": ("ckpt-4", [3]),
                       "ckpt-6": ("ckpt-5", [4])}
    assert rate(job).games_rated > 0  # the ratings replay the rounds that stay


def test_a_nan_transform_stops_the_loop_in_one_line_and_rollback_lets_it_go_on(tmp_path, cache, capsys):
    """A step transform that divides by zero from round 1 on: `loop` trains ckpt-1, then stops
    with exit code 2 and one line naming the transform, committing no ckpt-2. `rollback --to base`
    retires ckpt-1 and the round it played, and the loop, with the transform fixed, goes on (it
    used to retrain iteration 1, which rollback had retired, and stop: no checkpoint was left to
    count claimed iterations from)."""
    import json

    from unstable_dask.cli import main
    lake = tmp_path / "lake"
    sets = [x for key, value in {"run.lake": f'"{lake}"', "run.reports": f'"{tmp_path / "reports"}"', **SETS}.items()
            for x in ("--set", f"{key}={str(value).lower() if isinstance(value, bool) else value}")]
    nan = ("SELECT * REPLACE (CASE WHEN round >= 1 THEN reward / (completion_tokens - completion_tokens) "
           "ELSE reward END AS reward) FROM steps")
    assert main(["loop", "--rounds", "3", *sets, "--set", f"learn.step_transforms={json.dumps([nan])}"]) == 2
    err = capsys.readouterr().err.strip()  # the loop's progress, then the error
    last = err.splitlines()[-1]
    assert "Traceback" not in err and [ln for ln in err.splitlines() if ln.startswith("error:")] == [last]
    assert "learn.step_transforms[0]" in last and "nothing was trained or committed" in last
    db = Lake(lake)
    assert db.rounds("demo") == [0, 1] and [c["uid"] for c in db.table("checkpoints").rows("demo")] == ["ckpt-1"]
    assert not list((lake / "adapters/demo").glob("ckpt-2.*"))
    assert main(["rollback", "--to", "base", *sets]) == 0
    assert "retired ckpt-1 and the round(s) they played [1]" in " ".join(capsys.readouterr().out.split())
    assert main(["loop", "--rounds", "4", *sets]) == 0  # up to round 3
    db = Lake(lake)
    assert db.rounds("demo") == [0, 2, 3]  # round 1 retired; numbers are not reused
    lineage = {c["uid"]: (c["parent_uid"], c["rounds_trained"]) for c in db.table("checkpoints").rows("demo")}
    assert lineage == {"ckpt-2": ("base", [0]), "ckpt-3": ("ckpt-2", [2]), "ckpt-4": ("ckpt-3", [3])}
    assert db.sql("SELECT count(*) AS n FROM learner_steps WHERE NOT isfinite(loss)").to_pylist() == [{"n": 0}]


def test_lock_step_loop_rates_and_reports_beside_the_next_round_and_times_each_phase(tmp_path, cache):
    """Lock-step: each iteration's rate and report run while the next round plays, and the last
    iteration's are done when `loop` returns; each iteration prints where its seconds went, and the
    lake holds the learner's phases by name."""
    import io

    from rich.console import Console
    job = load_job("jobs/demo.toml", {"run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"),
                                      **SETS})
    out = io.StringIO()
    results = loop(job, rounds=2, console=Console(file=out, width=400))
    text = out.getvalue()
    assert [r.iteration for r in results] == [1, 2]
    lines = [ln for ln in text.splitlines() if ln.startswith("iteration ")]
    assert [ln.split(":")[0] for ln in lines] == ["iteration 1", "iteration 2"]
    assert all(", rate " in ln and ", report " in ln and "(load " in ln for ln in lines), lines
    assert text.count("report: ") == 2 and (tmp_path / "reports" / "demo" / "index.html").is_file()
    phases = Lake(job.run.lake).sql(
        "SELECT iteration, metrics['time_model_load_s'] AS load, metrics['time_batch_query_s'] AS query, "
        "metrics['time_save_s'] AS save FROM learner_steps WHERE run = 'demo' ORDER BY iteration").to_pylist()
    assert [p["iteration"] for p in phases] == [1, 2] and all(p[k] > 0 for p in phases for k in ("load", "query", "save"))
    assert all(r.timings["time_commit_s"] > 0 for r in results)


def test_a_failing_report_stops_the_lock_step_loop_one_round_later_losing_nothing(tmp_path, cache, monkeypatch):
    """The report runs beside the next round: its failure surfaces after that round is committed,
    and the same command, run again, trains on it and goes on."""
    from unstable_dask.report import report

    def broken(job):
        raise RuntimeError("report broke")
    job = load_job("jobs/demo.toml", {"run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"),
                                      **SETS})
    with monkeypatch.context() as m:
        m.setattr(report, "report", broken)
        with pytest.raises(RuntimeError, match="report broke"):
            loop(job, rounds=3)
    lake = Lake(job.run.lake)
    assert lake.rounds("demo") == [0, 1] and [c["uid"] for c in lake.table("checkpoints").rows("demo")] == ["ckpt-1"]
    loop(job, rounds=3)
    check_lake(tmp_path / "lake", "demo", 3, 0)


def test_an_eval_only_round_has_nothing_to_train_and_the_loop_trains_the_next_one(tmp_path, cache):
    """A checkpoint's yardstick round (`run round --set round.train_games=0`) leaves the learner
    nothing to train on: learn says so in one line, and loop plays on and trains the next round."""
    from unstable_dask.learn.learner import learn
    from unstable_dask.play.round import play_round
    sets = {"run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"), **SETS}
    job = load_job("jobs/demo.toml", sets)
    loop(job, rounds=1, rate=False)
    play_round(load_job("jobs/demo.toml", sets | {"round.train_games": 0}))  # round 1: eval games only
    res = learn(job)
    assert res.skipped and res.uid == "ckpt-1" and "no later committed round has turns to train on" in str(res)
    loop(job, rounds=3, rate=False)
    lake = Lake(job.run.lake)
    assert lake.rounds("demo") == [0, 1, 2]
    lineage = {c["uid"]: (c["parent_uid"], c["rounds_trained"]) for c in lake.table("checkpoints").rows("demo")}
    assert lineage == {"ckpt-1": ("base", [0]), "ckpt-2": ("ckpt-1", [2])}
    played = {r["round"]: r["checkpoint_uid"] for r in lake.sql("SELECT round, checkpoint_uid FROM rounds").to_pylist()}
    assert played == {0: "base", 1: "ckpt-1", 2: "ckpt-1"}
