"""Cluster kinds: GPU discovery and local-gpu worker specs (fake device ids, real workers on the
CPU), jobqueue batch scripts, user errors, and no lost games when a worker retires or dies mid-task.
"""
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from distributed import Client, Nanny, Scheduler, SpecCluster

from unstable_dask.cluster.client import cpu_share, job_script, local_gpu_workers, open_client, task_resources, visible_gpus
from unstable_dask.config import ClusterConfig
from unstable_dask.errors import JobError
from unstable_dask.lake import Lake

# ---------------------------------------------------------------- GPU discovery and local-gpu

def test_visible_gpus_from_cuda_visible_devices():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,5"}) == ["2", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,1"}) == ["0"]  # CUDA stops at an invalid id
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8f2e, GPU-91aa"}) == ["GPU-8f2e", "GPU-91aa"]


def test_visible_gpus_asks_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-a)'\necho 'GPU 1: NVIDIA H100 (UUID: GPU-b)'\n"
                    "echo '  MIG 1g.10gb Device 0: (UUID: MIG-x)'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert visible_gpus({}) == ["0", "1"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert visible_gpus({}) == []  # no nvidia-smi: no GPU, and no CUDA touched


def test_local_gpu_worker_specs():
    specs = local_gpu_workers(ClusterConfig(kind="local-gpu", n_workers=4, threads_per_worker=2), ["3", "7"])
    assert list(specs) == ["gpu-3", "gpu-7"]
    for dev, spec in zip(["3", "7"], specs.values()):
        opts = spec["options"]
        assert spec["cls"] is Nanny
        assert opts["env"]["CUDA_VISIBLE_DEVICES"] == dev
        assert opts["env"]["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
        assert opts["resources"] == {"GPU": 1}
        assert opts["nthreads"] == 2
        assert opts["memory_limit"] == 0  # "auto" on a GPU worker: the nanny never kills the engine
    one = local_gpu_workers(ClusterConfig(kind="local-gpu", n_workers=1, memory_limit="8GB"), ["0", "1"])
    assert list(one) == ["gpu-0"] and one["gpu-0"]["options"]["memory_limit"] == 8_000_000_000
    lived = local_gpu_workers(ClusterConfig(kind="local-gpu", lifetime="1h", lifetime_stagger="5m"), ["0"])
    assert lived["gpu-0"]["options"]["lifetime_restart"] is True


def test_local_gpu_without_gpus_is_a_user_error():
    with pytest.raises(JobError, match="cluster.kind 'local-gpu' found no GPU"):
        local_gpu_workers(ClusterConfig(kind="local-gpu"), [])


def _worker_view(dask_worker):
    import multiprocessing
    w = dask_worker
    return {"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "daemon": multiprocessing.current_process().daemon,
            "memory_limit": w.memory_manager.memory_limit, "resources": dict(w.state.total_resources)}


@pytest.mark.slow
def test_local_gpu_cluster_pins_one_fake_device_per_worker(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # two fake GPUs; nothing here touches CUDA
    cfg = ClusterConfig(kind="local-gpu", n_workers=2, dashboard=False)
    with open_client(cfg) as client:
        client.wait_for_workers(2, timeout=60)
        views = client.run(_worker_view)
        names = {w["name"]: w["resources"] for w in client.scheduler_info(n_workers=-1)["workers"].values()}
        seen = client.gather(client.map(lambda i: os.environ["CUDA_VISIBLE_DEVICES"], range(8),
                                        resources=task_resources(cfg), pure=False))
    assert sorted(v["cuda"] for v in views.values()) == ["0", "1"]
    assert all(v["daemon"] is False and v["memory_limit"] is None and v["resources"] == {"GPU": 1}
               for v in views.values())
    assert names == {"gpu-0": {"GPU": 1}, "gpu-1": {"GPU": 1}}
    assert set(seen) == {"0", "1"}


def _thread_env():
    return os.environ.get("OMP_NUM_THREADS"), os.environ.get("MALLOC_TRIM_THRESHOLD_")


def test_cpu_share_gives_each_local_worker_its_own_cores():
    assert [cpu_share(i, 2, [0, 1]) for i in range(2)] == ["0", "1"]
    # several cores each: one left to the worker's own serving processes, as vLLM's auto binding does
    assert [cpu_share(i, 2, list(range(8))) for i in range(2)] == ["0,1,2", "4,5,6"]
    assert [cpu_share(i, 3, [0, 1]) for i in range(3)] == ["0", "1", "0"]  # more workers than cores


def _bind():
    return os.environ.get("VLLM_CPU_OMP_THREADS_BIND")


@pytest.mark.slow
def test_local_workers_split_the_cores_whatever_cluster_came_before(monkeypatch):
    # Dask's nanny leaves its worker settings in the driver's os.environ and reads them back for
    # the next cluster; a 2-worker cluster after a 1-worker one then oversubscribed the cores.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cores = os.cpu_count() or 1
    for n in (1, 2, 1):
        with open_client(ClusterConfig(kind="local", n_workers=n, dashboard=False)) as client:
            seen = client.run(_thread_env)
            bound = client.run(_bind)
        # No MALLOC_TRIM_THRESHOLD_: glibc keeps its dynamic mmap threshold (faster torch).
        assert sorted(seen.values()) == [(str(max(1, cores // n)), None)] * n
        # vLLM's compute threads: vLLM's own choice for one worker, cores of their own for several
        assert sorted(bound.values(), key=str) == ([None] if n == 1 else sorted(cpu_share(i, n) for i in range(n)))
        assert _thread_env() == (None, None)


# A fresh interpreter that opens a 2-worker local cluster and only then imports torch and builds a
# CPU learner, as `loop` does: it prints torch's threads before and after the Trainer.
_LATE_TORCH = """
from unstable_dask.cluster.client import open_client
from unstable_dask.config import ClusterConfig
from unstable_dask.jobfile import load_job
with open_client(ClusterConfig(kind="local", n_workers=2, dashboard=False)):
    import torch
    before = torch.get_num_threads()
    from unstable_dask.learn.trainer import Trainer
    Trainer(load_job(None), None, torch.device("cpu"))
    print(before, torch.get_num_threads())
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to tell 1 thread from all")
@pytest.mark.parametrize("exported", [None, "1"])
def test_learner_in_the_driver_computes_on_the_cores_the_process_started_with(exported):
    # A local cluster's nannies write their workers' OMP_NUM_THREADS (1 each with 2 workers on 2
    # cores) into the driver's environment, and torch imported after that took it: the learner of
    # `loop` computed on one core of two. A value the user exported is kept.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if exported:
        env["OMP_NUM_THREADS"] = exported
    out = subprocess.run([sys.executable, "-c", _LATE_TORCH], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split()[-2:])
    if exported:
        assert after == 1
    else:
        assert before == 1  # what the nannies' value gave torch
        assert after == min(len(os.sched_getaffinity(0)), _physical_cores())


def _physical_cores() -> int:
    import psutil
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


# ---------------------------------------------------------------- batch scripts

GPU_SLURM = dict(kind="slurm", queue="gpu", account="proj7", walltime="02:00:00", cores=8, memory="64GB",
                 gpus_per_job=1, lifetime="100m", lifetime_stagger="5m", job_script_prologue=["module load cuda/12"])


def test_slurm_job_script():
    s = job_script(ClusterConfig(**GPU_SLURM))
    for line in ["#SBATCH -p gpu", "#SBATCH -A proj7", "#SBATCH -t 02:00:00", "#SBATCH --cpus-per-task=8",
                 "#SBATCH --gres=gpu:1", "export DASK_DISTRIBUTED__WORKER__DAEMON=False", "module load cuda/12"]:
        assert line in s.splitlines(), line
    cmd = s.strip().splitlines()[-1]
    assert "--resources GPU=1" in cmd and "--lifetime 100m --lifetime-stagger 5m" in cmd
    assert "--lifetime-restart" not in cmd  # the job must end so the batch system frees it
    # the last --memory-limit wins: a GPU worker's nanny does not kill the engine
    assert cmd.rsplit("--memory-limit", 1)[1].split()[0] == "0"
    cpu = job_script(ClusterConfig(kind="slurm", gpus_per_job=0, memory_limit="12GB"))
    assert "gres" not in cpu and "--resources" not in cpu and "--lifetime" not in cpu
    assert cpu.rsplit("--memory-limit", 1)[1].split()[0] == "12GB"
    # a worker gets 180 s to start (its imports: jobqueue's 60 ran out on a loaded node), or the job's own
    assert cmd.split("--death-timeout", 1)[1].split()[0] == "180"
    slow = job_script(ClusterConfig(kind="slurm", gpus_per_job=0, death_timeout=600))
    assert slow.strip().splitlines()[-1].split("--death-timeout", 1)[1].split()[0] == "600"


def test_pbs_lsf_sge_job_scripts():
    pbs = job_script(ClusterConfig(**{**GPU_SLURM, "kind": "pbs", "gpus_per_job": 2}))
    assert "#PBS -l select=1:ncpus=8:ngpus=2:mem=60GB" in pbs and "#PBS -l walltime=02:00:00" in pbs
    assert "#PBS -A proj7" in pbs and "--resources GPU=2" in pbs and "--lifetime 100m" in pbs
    lsf = job_script(ClusterConfig(**{**GPU_SLURM, "kind": "lsf"}))
    assert "#BSUB -W 2:00" in lsf and '#BSUB -gpu "num=1"' in lsf and '#BSUB -P "proj7"' in lsf
    sge = job_script(ClusterConfig(**{**GPU_SLURM, "kind": "sge"}))
    assert "#$ -l gpu=1" in sge and "#$ -l h_rt=02:00:00" in sge and "#$ -P proj7" in sge


def test_user_directives_and_resources_are_kept():
    s = job_script(ClusterConfig(kind="slurm", job_extra_directives=["--gpus-per-node=a100:1"],
                                 worker_extra_args=["--resources", "SSD=1"],
                                 extra={"local_directory": "/scratch/me", "log_directory": "/tmp/logs"}))
    assert "#SBATCH --gpus-per-node=a100:1" in s and "--gres" not in s  # the site's own GPU syntax wins
    assert "--resources SSD=1 GPU=1" in s and "--resources GPU" not in s
    assert "--local-directory /scratch/me" in s


@pytest.mark.parametrize("cluster, key", [
    (dict(kind="slurm", walltime="1 hour"), "cluster.walltime"),
    (dict(kind="slurm", lifetime="soon"), "cluster.lifetime"),
    (dict(kind="slurm", lifetime="50m", lifetime_stagger="whenever"), "cluster.lifetime_stagger"),
    (dict(kind="slurm", walltime="01:00:00", lifetime="58m", lifetime_stagger="4m"), "cluster.lifetime"),
    (dict(kind="slurm", lifetime="1m", lifetime_stagger="2m"), "cluster.lifetime_stagger"),
    (dict(kind="slurm", adapt_min=1), "cluster.adapt_min"),
    (dict(kind="slurm", adapt_min=3, adapt_max=2), "cluster.adapt_min"),
    (dict(kind="slurm", jobs=0), "cluster.jobs"),
    (dict(kind="pbs", processes=2, gpus_per_job=1), "cluster.processes"),
    (dict(kind="slurm", processes=8, cores=4, gpus_per_job=0), "cluster.processes"),
    (dict(kind="slurm", memory="lots"), "cluster.memory"),
    (dict(kind="slurm", extra={"coress": 4}), "cluster.extra.coress"),
    (dict(kind="slurm", extra={"cores": 4}), "cluster.extra.cores"),
    (dict(kind="local"), "cluster.kind"),
])
def test_bad_values_are_one_line_errors_naming_the_key(cluster, key):
    with pytest.raises(JobError) as e:
        job_script(ClusterConfig(**cluster))
    msg = str(e.value)
    assert key in msg and "\n" not in msg


def test_bad_memory_limit_and_missing_address():
    with pytest.raises(JobError, match="cluster.memory_limit"):
        local_gpu_workers(ClusterConfig(kind="local-gpu", memory_limit="huge"), ["0"])
    with pytest.raises(JobError, match="cluster.address"):
        with open_client(ClusterConfig(kind="address")):
            pass


def test_task_resources():
    assert task_resources(ClusterConfig(kind="local")) is None
    assert task_resources(ClusterConfig(kind="local-gpu")) == {"GPU": 1}
    assert task_resources(ClusterConfig(kind="slurm", gpus_per_job=2)) == {"GPU": 2}
    assert task_resources(ClusterConfig(kind="pbs", gpus_per_job=0)) is None
    assert task_resources(ClusterConfig(kind="address", address="tcp://x:1")) is None  # unknown without a client


@pytest.mark.slow
def test_address_kind_connects_and_reads_worker_resources():
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}}
    workers = {"g": {"cls": Nanny, "options": {"nthreads": 1, "resources": {"GPU": 1}}}}
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster:
        cfg = ClusterConfig(kind="address", address=cluster.scheduler_address, dashboard=False)
        with open_client(cfg) as client:
            client.wait_for_workers(1, timeout=30)
            assert task_resources(cfg, client) == {"GPU": 1}
            assert client.submit(lambda: 41 + 1).result() == 42


# ---------------------------------------------------------------- no lost games

RUN = "retire"


def _play(key: str, lake: str, log: str, seconds: float, die_first: bool = False) -> int:
    """A stand-in for a round task: write games, work, write turns; every write is atomic."""
    from distributed import get_worker
    name = str(get_worker().name)
    with open(log, "a") as f:
        f.write(f"{key} {name}\n")
    attempts = Path(log).read_text().split().count(key)
    rows = [dict(game_id=f"{key}-g{i}", split="train", env_id="SimpleTak-v0-train", seed=i, num_players=2,
                 num_turns=1, worker=name, task=key, seats=[]) for i in range(3)]
    Lake(lake).write("games", RUN, 0, key, rows)
    if die_first and attempts == 1:
        os._exit(1)  # preempted: the process vanishes after its first file is written
    time.sleep(seconds)
    Lake(lake).write("turns", RUN, 0, key, [dict(game_id=r["game_id"], turn=0, pid=0, worker=name) for r in rows])
    return len(rows)


def _check_lake(lake: Path, keys: list[str]) -> dict:
    """One file per task and table, 3 games each, and games/turns of a task from the same attempt."""
    by_key = {}
    for key in keys:
        games = sorted(p.name for p in (lake / f"games/run={RUN}/round=0").glob(f"{key}*"))
        turns = sorted(p.name for p in (lake / f"turns/run={RUN}/round=0").glob(f"{key}*"))
        assert games == [f"{key}.parquet"] and turns == [f"{key}.parquet"]
        g = pq.read_table(lake / f"games/run={RUN}/round=0/{key}.parquet").to_pylist()
        assert [r["game_id"] for r in g] == [f"{key}-g{i}" for i in range(3)]
        by_key[key] = g[0]["worker"]
    Lake(lake).commit_round(RUN, 0, dict(checkpoint_uid="base", games=3 * len(keys), turns=3 * len(keys), tasks=len(keys)))
    con = Lake(lake).connect()
    assert con.sql("SELECT count(*), count(DISTINCT game_id) FROM games").fetchall()[0] == (3 * len(keys), 3 * len(keys))
    return by_key


@pytest.mark.slow
def test_worker_reaching_lifetime_mid_task_loses_no_games(tmp_path):
    lake, log = tmp_path / "lake", tmp_path / "attempts.log"
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}}
    workers = {  # "short" retires gracefully after 4 s, as a jobqueue worker with --lifetime does
        "short": {"cls": Nanny, "options": {"nthreads": 1, "lifetime": "4s", "lifetime_stagger": "0s",
                                            "lifetime_restart": False}},
        "long": {"cls": Nanny, "options": {"nthreads": 3}}}
    keys = [f"task-{i:04d}" for i in range(3)]
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        short = next(a for a, w in client.scheduler_info(n_workers=-1)["workers"].items() if w["name"] == "short")
        # Prefer "short" (a loose restriction), so its first task is cut by the retirement.
        futures = [client.submit(_play, k, str(lake), str(log), 6.0, workers=[short], allow_other_workers=True,
                                 pure=False) for k in keys]
        assert client.gather(futures) == [3, 3, 3]
        assert "short" not in {w["name"] for w in client.scheduler_info(n_workers=-1)["workers"].values()}
    attempts = [line.split() for line in log.read_text().splitlines()]
    cut = [k for k, w in attempts if w == "short"]
    assert cut, "the short-lived worker started no task"
    assert all((k, "long") in {(a, b) for a, b in attempts} for k in cut)  # each cut task was retried
    assert set(_check_lake(lake, keys).values()) == {"long"}  # the retry's files replaced the first ones


@pytest.mark.slow
def test_preempted_worker_mid_task_loses_no_games(tmp_path):
    lake, log = tmp_path / "lake", tmp_path / "attempts.log"
    keys = [f"task-{i:04d}" for i in range(2)]
    with open_client(ClusterConfig(kind="local", n_workers=2, dashboard=False)) as client:
        futures = [client.submit(_play, k, str(lake), str(log), 0.5, die_first=True, pure=False) for k in keys]
        assert client.gather(futures) == [3, 3]
    attempts = [line.split()[0] for line in log.read_text().splitlines()]
    assert sorted(attempts) == sorted(keys * 2)  # each task died once and ran again
    _check_lake(lake, keys)
