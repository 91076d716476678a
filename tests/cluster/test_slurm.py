"""A real round through `kind = "slurm"` on a real single-node SLURM (make slurm-test).

The fixture starts slurmctld/slurmd/munged with scripts/slurm-localhost.sh when they are not
running (root and Debian's apt needed; CI runs as root on a fresh machine) and stops them again
if it started them. The node has two fake GRES GPUs, so two `--gres=gpu:1` jobs see
CUDA_VISIBLE_DEVICES 0 and 1.
"""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

from unstable_dask.cluster.client import open_client, task_resources
from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm-localhost.sh"
DIR = os.environ.get("SLURM_LOCAL_DIR", "/tmp/unstable-dask-slurm")

# Workers in SLURM jobs cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [
    pytest.mark.slurm, pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="starting a localhost SLURM needs root"),
    pytest.mark.skipif(shutil.which("apt-get") is None and shutil.which("slurmctld") is None,
                       reason="needs Debian's slurm packages (or apt-get to install them)"),
]


def _script(cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), cmd], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SLURM_LOCAL_DIR": DIR})


def _squeue() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True, timeout=30)
    return out.stdout.split("\n")[:-1]


@pytest.fixture(scope="module")
def slurm():
    started = False
    if _script("status").returncode != 0:
        t0 = time.perf_counter()
        r = _script("start")
        assert r.returncode == 0, r.stderr + r.stdout
        print(f"\nSLURM started in {time.perf_counter() - t0:.1f} s")
        started = True
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = f"{DIR}/slurm.conf"  # sbatch/squeue/scancel read it; jobs inherit it
    yield
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old
    if started:
        _script("stop")


def _job(tmp_path, **cluster):
    over = {"run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"),
            "round.train_games": 6, "round.eval_games": 2, "round.games_per_task": 2, "round.concurrency": 2,
            "model.max_new_tokens": 16,
            # Two one-core jobs, one fake GPU each; the scheduler listens on loopback only.
            "cluster.kind": "slurm", "cluster.queue": "debug", "cluster.cores": 1, "cluster.memory": "2GB",
            "cluster.gpus_per_job": 1, "cluster.jobs": 2, "cluster.walltime": "00:20:00",
            "cluster.interface": "lo", "cluster.dashboard": False,
            "cluster.extra": {"log_directory": str(tmp_path / "slurm-logs")}}
    over.update({f"cluster.{k}": v for k, v in cluster.items()})
    return load_job("jobs/demo.toml", over)


def _worker_env(dask_worker):
    return {"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "job": os.environ.get("SLURM_JOB_ID"),
            "resources": dict(dask_worker.state.total_resources)}


def _wait_empty_queue(seconds: float = 30.0) -> float:
    t0 = time.perf_counter()
    while _squeue() and time.perf_counter() - t0 < seconds:
        time.sleep(0.2)
    return time.perf_counter() - t0


def test_round_on_slurm_with_two_gpu_pinned_workers(slurm, tmp_path):
    from unstable_dask.play.round import play_round
    job = _job(tmp_path)
    assert task_resources(job.cluster) == {"GPU": 1}
    t0 = time.perf_counter()
    with open_client(job.cluster) as client:
        client.wait_for_workers(2, timeout=120)
        print(f"\ntwo SLURM workers ready in {time.perf_counter() - t0:.1f} s")
        assert len(_squeue()) == 2
        env = client.run(_worker_env)
        summary = play_round(job, client=client)
    assert sorted(e["cuda"] for e in env.values()) == ["0", "1"]  # each worker pinned to its own GPU
    assert len({e["job"] for e in env.values()}) == 2  # one SLURM job per worker
    assert all(e["resources"] == {"GPU": 1} for e in env.values())
    assert summary.games == 8 and summary.round == 0
    con = Lake(job.run.lake).connect()
    assert con.sql("SELECT count(*), count(DISTINCT game_id) FROM games").fetchall()[0] == (8, 8)
    assert con.sql("SELECT count(DISTINCT worker) FROM games").fetchall()[0][0] == 2  # both workers played
    waited = _wait_empty_queue()
    assert _squeue() == [], "closing the cluster must cancel its jobs"
    print(f"squeue empty {waited:.1f} s after close")


@pytest.mark.timeout(480)
def test_round_survives_worker_lifetime_on_slurm(slurm, tmp_path):
    """Workers retire at --lifetime mid-round; adapt submits replacements; no game is lost.

    The lifetime must be longer than one task (engine start + games_per_task games), or every
    attempt is cut and the round never ends. To cut the round whatever the machine's speed, the
    round starts when the first workers are 15 s old, so they retire 3-7 s into it.
    """
    from unstable_dask.play.round import play_round
    job = _job(tmp_path, lifetime="20s", lifetime_stagger="2s", jobs=2)
    job = job.model_copy(update={"round": job.round.model_copy(update={"train_games": 40, "eval_games": 0})})
    with open_client(job.cluster) as client:
        client.wait_for_workers(2, timeout=120)
        t_ready = time.perf_counter()
        first_jobs = {e["job"] for e in client.run(_worker_env).values()}
        time.sleep(max(0.0, 15.0 - (time.perf_counter() - t_ready)))
        summary = play_round(job, client=client)
        retired = [e for _, e in client.get_events("all") if e.get("action") == "remove-worker"]
        # On a slow machine the round spans several worker generations and may end between two,
        # with no worker alive: wait (bounded) for one from a job submitted after the first two.
        jobs_seen: set = set()
        t0 = time.perf_counter()
        while not jobs_seen - first_jobs and time.perf_counter() - t0 < 120:
            jobs_seen |= {e["job"] for e in client.run(_worker_env).values()}
            time.sleep(0.5)
    assert retired, "no worker reached its lifetime during the round"
    assert jobs_seen - first_jobs, "retired workers were not replaced by new jobs"
    assert summary.games == 40
    con = Lake(job.run.lake).connect()
    assert con.sql("SELECT count(*), count(DISTINCT game_id) FROM games").fetchall()[0] == (40, 40)
    files = list((Path(job.run.lake) / "games" / "run=demo" / "round=0").glob("*.parquet"))
    assert len(files) == 20  # one file per task, retried or not
    _wait_empty_queue()
    assert _squeue() == []
    print(f"\nround of 40 games: {summary.wall_s:.1f} s; {len(retired)} workers retired mid-round ({sum(e['expected'] for e in retired)} gracefully); "
          f"jobs {sorted(first_jobs)} -> {sorted(jobs_seen)}")
