"""Endpoint opponents against a stub OpenAI-compatible server (stdlib http.server, no model):
the openai client's retries on 429 and timeouts (counted at the server), the concurrency bound,
failed requests recorded as turn failures the game goes on from, keys kept out of the lake, and
the job-file checks. The same paths against a real `vllm serve` are in test_endpoints_vllm.py."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq
import pytest

from unstable_dask.config import EndpointConfig, ModelConfig, RoundConfig
from unstable_dask.errors import JobError
from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.play.opponents import Endpoint, RandomAgent
from unstable_dask.play.schedule import GameSpec, TaskSpec
from unstable_dask.play.task import play_task

KEY = "sk-test-5f0c1e7d9a2b4c6e8f10"  # what a leak would look like: grepped for in the lake
ANSWER = "I check. \\boxed{[check]}"
MODEL = "stub/model-1"


class Stub(ThreadingHTTPServer):
    """Answers /v1/chat/completions as `behave(n, body)` says: (status, seconds to wait, payload)."""
    daemon_threads = True

    def __init__(self, behave: Callable[[int, dict], tuple[int, float, dict]]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.behave = behave
        self.lock = threading.Lock()
        self.requests, self.in_flight, self.max_in_flight = 0, 0, 0
        self.bodies: list[dict] = []
        self.auth: set[str] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        srv: Stub = self.server  # type: ignore[assignment]
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            n = srv.requests
            srv.requests += 1
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
            srv.bodies.append(body)
            srv.auth.add(self.headers.get("Authorization", ""))
        try:
            status, wait, payload = srv.behave(n, body)
            time.sleep(wait)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 429:
                self.send_header("retry-after-ms", "1")  # the client honours it: a fast test
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up on this request (its timeout)
        finally:
            with srv.lock:
                srv.in_flight -= 1

    def log_message(self, *args) -> None:
        pass


def completion(body: dict, text: str = ANSWER) -> dict:
    return {"id": "cmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}}


def ok(n: int, body: dict) -> tuple[int, float, dict]:
    return 200, 0.05, completion(body)


def too_many(n: int, body: dict) -> tuple[int, float, dict]:
    return 429, 0.0, {"error": {"message": "rate limited", "type": "rate_limit"}}


@pytest.fixture
def stub(request):
    srv = Stub(request.param)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def play(tmp_path: Path, stub: Stub, games: int = 6, **endpoint) -> list[dict]:
    """KuhnPoker games, the endpoint in seat 0 against the random agent; the turns written."""
    cfg = EndpointConfig(**({"base_url": stub.url, "model": MODEL} | endpoint))
    seats = (Endpoint("stub", MODEL).seat(0), RandomAgent().seat(1))
    specs = tuple(GameSpec(f"t-r0000-eval-{i:05d}", "eval", "KuhnPoker-v0-train", 100 + i, f"t-r0000-eval-g{i:05d}",
                           "qwen3-zs", seats) for i in range(games))
    lake = tmp_path / "lake"
    play_task(TaskSpec("task-0000", "t", 0, specs), ModelConfig(max_new_tokens=32), RoundConfig(concurrency=games),
              Lake(lake), endpoints={"stub": cfg})
    turns = pq.read_table(next((lake / "turns").rglob("*.parquet"))).to_pylist()
    return [t for t in turns if t["model_uid"] == MODEL]


@pytest.mark.parametrize("stub", [lambda n, body: too_many(n, body) if n < 3 else ok(n, body)], indirect=True)
def test_rate_limits_are_retried_by_the_client_and_a_step_goes_out_with_bounded_concurrency(tmp_path, stub):
    turns = play(tmp_path, stub, max_concurrency=2, max_retries=3)
    assert turns and all(t["error"] is None and t["completion"] == ANSWER for t in turns)
    assert stub.requests == len(turns) + 3  # the three 429s were retried, nothing else
    assert stub.max_in_flight == 2  # six games ask at once; two requests in flight at a time
    assert all(t["prompt_tokens"] == 7 and t["completion_tokens"] == 5 for t in turns)  # the endpoint's usage
    body = stub.bodies[-1]
    assert body["model"] == MODEL and body["max_tokens"] == 32  # [model].max_new_tokens by default
    [msg] = body["messages"]  # the `chat` template's user text; the server applies its own chat template
    assert msg["role"] == "user" and msg["content"] in {t["prompt"] for t in turns}
    assert "<|im_start|>" not in msg["content"] and "Observation:" in msg["content"]


@pytest.mark.parametrize("stub", [too_many], indirect=True)
def test_a_request_that_keeps_failing_is_that_turns_failure_and_the_game_goes_on(tmp_path, stub):
    turns = play(tmp_path, stub, games=2, max_retries=2)
    assert stub.requests == 3 * len(turns)  # one try and two retries per turn
    for t in turns:
        assert t["completion"] is None and t["format_ok"] is None and t["action"] == ""
        assert t["error"].startswith("RateLimitError") and "rate limited" in t["error"]
        assert t["invalid_move"]  # the env took the empty action as an invalid move
    games = pq.read_table(next((tmp_path / "lake" / "games").rglob("*.parquet"))).to_pylist()
    # error_allowance 1: the second invalid move ends the game, by KuhnPoker's rules
    assert len(games) == 2 and all(g["seats"][0]["invalid_move"] for g in games)


@pytest.mark.parametrize("stub", [lambda n, body: (200, 1.5, completion(body))], indirect=True)
def test_a_timeout_is_retried_then_recorded_as_the_turns_failure(tmp_path, stub):
    turns = play(tmp_path, stub, games=1, timeout=0.2, max_retries=1)
    assert stub.requests == 2 * len(turns)
    assert all(t["error"].startswith("APITimeoutError") and t["completion"] is None for t in turns)
    assert all(0.2 <= t["latency_s"] < 5 for t in turns)  # two attempts and the client's backoff


def _echo_auth(n: int, body: dict) -> tuple[int, float, dict]:
    return 401, 0.0, {"error": {"message": f"bad key {KEY}"}}  # a server that echoes the key back


@pytest.mark.parametrize("stub", [_echo_auth], indirect=True)
def test_the_key_is_read_from_the_environment_and_never_written(tmp_path, stub, monkeypatch):
    monkeypatch.setenv("STUB_KEY", KEY)
    turns = play(tmp_path, stub, games=1, api_key_env="STUB_KEY", max_retries=0)
    assert stub.auth == {f"Bearer {KEY}"}
    assert turns and all("AuthenticationError" in t["error"] and "bad key ***" in t["error"] for t in turns)
    leaks = [p for p in (tmp_path / "lake").rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert leaks == []


@pytest.mark.parametrize("stub", [ok], indirect=True)
def test_no_key_env_sends_a_placeholder_not_openai_api_key(tmp_path, stub, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # meant for api.openai.com, not for this base_url
    play(tmp_path, stub, games=1)
    assert stub.auth == {"Bearer EMPTY"}


def _job(**over):
    endpoints = {"gem": {"base_url": "https://openrouter.ai/api/v1", "model": "google/gemini-2.0-flash-lite-001",
                         "api_key_env": "UNSTABLE_DASK_TEST_NO_SUCH_KEY"}}
    return load_job("jobs/demo.toml", {"endpoints": endpoints, "round.train_games": 0, "round.eval_games": 2,
                                       "round.eval_envs": [{"env_id": "KuhnPoker-v0-train", "num_actors": 1,
                                                            "opponents": ["gem"]}]} | over)


@pytest.mark.parametrize("stub", [ok], indirect=True)
def test_per_game_play_awaits_endpoint_replies_beside_engine_requests(tmp_path, stub, monkeypatch):
    """Per-game play (an engine with agenerate, as vLLM's): the engine's seat and the endpoint's seat
    of each game take turns, each game awaiting its own request; the games' endpoint requests overlap."""
    from unstable_dask.inference import engine as engines
    from unstable_dask.play.opponents import BASE

    from helpers.adapters import AsyncHF
    real = engines.get_engine
    monkeypatch.setattr(engines, "get_engine", lambda cfg: AsyncHF(real(cfg)))
    cfg = EndpointConfig(base_url=stub.url, model=MODEL)
    seats = (BASE.seat(0, is_learner=True), Endpoint("stub", MODEL).seat(1))
    specs = tuple(GameSpec(f"t-r0000-eval-{i:05d}", "eval", "KuhnPoker-v0-train", 100 + i, f"t-r0000-eval-g{i:05d}",
                           "qwen3-zs", seats) for i in range(4))
    lake = tmp_path / "lake"
    out = play_task(TaskSpec("task-0000", "t", 0, specs), ModelConfig(backend="hf", max_new_tokens=8),
                    RoundConfig(concurrency=4, error_allowance=6), Lake(lake), endpoints={"stub": cfg})
    assert out["way"] == "per-game" and out["games"] == 4
    turns = pq.read_table(next((lake / "turns").rglob("*.parquet"))).to_pylist()
    mine = [t for t in turns if t["model_uid"] == MODEL]
    assert mine and all(t["completion"] == ANSWER and t["action"] == "[check]" for t in mine)
    assert all(t["completion_token_ids"] for t in turns if t["model_uid"] == "base")
    assert stub.requests == len(mine) and stub.max_in_flight > 1


def test_job_checks_opponent_names_and_endpoint_tables():
    job = _job()
    assert job.endpoints["gem"].max_concurrency == 8
    with pytest.raises(JobError, match=r"key 'round.eval_envs\[0\].opponents\[0\]' names opponent 'gemx'.*'gem'"):
        _job(**{"round.eval_envs": [{"env_id": "KuhnPoker-v0-train", "num_actors": 1, "opponents": ["gemx"]}]})
    with pytest.raises(JobError, match=r"key 'round.opponents.fixed\[1\]' names opponent 'nope'"):
        _job(**{"round.opponents": {"strategy": "fixed", "fixed": ["gem", "nope"]}})
    with pytest.raises(JobError, match=r"endpoint name 'random'"):
        load_job("jobs/demo.toml", {"endpoints": {"random": {"base_url": "http://x", "model": "m"}}})
    with pytest.raises(JobError, match=r"'endpoints.e.model' has value 'ckpt-3'"):
        load_job("jobs/demo.toml", {"endpoints": {"e": {"base_url": "http://x", "model": "ckpt-3"}}})
    with pytest.raises(JobError, match=r"missing required key 'endpoints.e.base_url'"):
        load_job("jobs/demo.toml", {"endpoints": {"e": {"model": "m"}}})
    with pytest.raises(JobError) as pasted:  # a key pasted where its variable's name belongs
        load_job("jobs/demo.toml", {"endpoints": {"e": {"base_url": "http://x", "model": "m", "api_key_env": KEY}}})
    assert "not the key itself" in str(pasted.value) and KEY not in str(pasted.value)


def test_a_round_that_seats_an_endpoint_needs_its_key_and_writes_nothing_without_it(tmp_path, monkeypatch):
    from unstable_dask.play.round import play_round
    job = _job(**{"run.lake": str(tmp_path / "lake")})
    with pytest.raises(JobError, match=r"key 'endpoints.gem.api_key_env' has value 'UNSTABLE_DASK_TEST_NO_SUCH_KEY': "
                                       r"that environment variable is not set"):
        play_round(job, client=object())  # refused before any cluster is used
    assert not (tmp_path / "lake").exists()


def _no_move(n: int, body: dict) -> tuple[int, float, dict]:
    return 200, 0.0, completion(body, "I pass.")  # not a KuhnPoker move: the endpoint keeps the turn


@pytest.mark.parametrize("stub", [_no_move], indirect=True)
def test_a_round_whose_server_dies_mid_round_still_commits_with_the_failed_turns(tmp_path, stub, monkeypatch):
    """The stub stands in for the server test_endpoints_vllm.py kills; here it runs without vLLM."""
    from distributed import Client

    from unstable_dask.lake import Lake
    from unstable_dask.play import round as round_mod
    real = round_mod.play_task

    def play_then_stop(task, model_cfg, round_cfg, lake, progress, endpoints):
        steps = []

        def after_step(games: int, tokens: int) -> None:
            steps.append(games)
            if len(steps) == 2:  # two steps answered, then the server is gone: connections refused
                stub.shutdown()
                stub.server_close()
            progress(games, tokens)
        return real(task, model_cfg, round_cfg, lake, after_step, endpoints)

    monkeypatch.setattr(round_mod, "play_task", play_then_stop)  # the in-process worker calls this
    stub_endpoint = {"base_url": stub.url, "model": MODEL, "max_retries": 1}
    job = load_job("jobs/demo.toml", {
        "run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"),
        "endpoints": {"stub": stub_endpoint}, "model.max_new_tokens": 4, "round.train_games": 0,
        "round.eval_games": 2, "round.error_allowance": 4,
        "round.eval_envs": [{"env_id": "KuhnPoker-v0-train", "num_actors": 1, "opponents": ["stub"]}]})
    with Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=None) as client:
        s = round_mod.play_round(job, client=client)
    assert s.games == 2 and Lake(job.run.lake).last_round(job.run.name) == 0
    sql = "SELECT * FROM turns WHERE model_uid = ? ORDER BY game_id, turn"
    turns = Lake(job.run.lake).sql(sql, [MODEL]).to_pylist()
    answered = [t for t in turns if t["error"] is None]
    failed = [t for t in turns if t["error"] is not None]
    assert answered and all(t["completion"] == "I pass." for t in answered)
    assert failed and all(t["error"].startswith("APIConnectionError") and t["completion"] is None
                          and t["action"] == "" and t["invalid_move"] for t in failed)
