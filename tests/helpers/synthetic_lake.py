"""A synthetic lake for the ratings/report tests: games with known strengths, written like a run.

Everything goes through `Lake.write` and `Lake.commit_round`, as the round and learn jobs
write it. `HOSTILE` strings land in completions, observations, prompts and model names so the
report tests can check that model text is shown as text and never runs.
"""
from __future__ import annotations

import math
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa

from unstable_dask.lake import Lake, catalog

HOSTILE = [
    "<script>window.__pwned = 1</script>",
    '<img src=x onerror="window.__pwned = 2">',
    '</script><script>window.__pwned = 3</script>',
    '"><svg onload="window.__pwned = 4">',
    "{{ 7*7 }} & &amp; \\boxed{[0 1]}",
]
T0 = datetime(2025, 7, 1, tzinfo=timezone.utc)


def seat(pid: int, uid: str, reward: float, learner: bool = False) -> dict:
    return {"pid": pid, "model_uid": uid, "is_learner": learner, "role": f"Player {pid}", "reward": reward,
            "invalid_move": False, "reason": "game over"}


def game(round_: int, idx: int, env_id: str, seats: list[dict], split: str = "train", turns: int = 4) -> dict:
    # every game its own group (round.group_size = 1), as a round without groups writes them
    return {"game_id": f"r{round_:04d}-g{idx:05d}", "split": split, "env_id": env_id, "seed": round_ * 100000 + idx,
            "group_id": f"r{round_:04d}-{split}-g{idx:05d}", "num_players": len(seats), "num_turns": turns,
            "started_at": T0 + timedelta(minutes=round_), "finished_at": T0 + timedelta(minutes=round_, seconds=30),
            "worker": "w0", "task": "t0", "seats": seats}


def commit(lake_dir: Path, run: str, round_: int, games: list[dict], checkpoint: str = "ckpt-0") -> None:
    Lake(lake_dir).commit_round(run, round_, {
        "checkpoint_uid": checkpoint, "games": len(games), "turns": sum(g["num_turns"] for g in games), "tasks": 1,
        "completion_tokens": 0, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 64,
        "job_fingerprint": "synthetic", "job": "{}", "started_at": T0,
        "committed_at": T0 + timedelta(minutes=round_ + 1)})


def write_round(lake_dir: Path, run: str, round_: int, games: list[dict], turns: Optional[list[dict]] = None,
                checkpoint: str = "ckpt-0", do_commit: bool = True) -> None:
    Lake(lake_dir).write("games", run, round_, "task-0", games)
    if turns:
        Lake(lake_dir).write("turns", run, round_, "task-0", turns)
    if do_commit:
        commit(lake_dir, run, round_, games, checkpoint)


def write_checkpoint(lake_dir: Path, run: str, iteration: int, uid: str, parent: Optional[str],
                     steps: Optional[list[dict]] = None) -> None:
    if steps:  # before the checkpoints row, which commits them
        Lake(lake_dir).write("learner_steps", run, iteration, "steps", steps)
    Lake(lake_dir).commit("checkpoints", run, iteration, uid, {
        "uid": uid, "parent_uid": parent, "adapter_path": f"adapters/{run}/{uid}", "base_model": "builtin:tiny",
        "rounds_trained": [iteration - 1] if iteration else [], "algorithm": "reinforce",
        "created_at": T0 + timedelta(minutes=iteration)})


def outcome(rng: random.Random, a: float, b: float, draw: float = 0.1) -> tuple[float, float]:
    """Rewards of a BT game between strengths a and b (natural-log scale), with some draws."""
    if rng.random() < draw:
        return 0.0, 0.0
    return (1.0, -1.0) if rng.random() < 1.0 / (1.0 + math.exp(b - a)) else (-1.0, 1.0)


def turn_rows(g: dict, rng: random.Random, hostile: bool) -> list[dict]:
    rows = []
    for t in range(g["num_turns"]):
        s = g["seats"][t % len(g["seats"])]
        text = HOSTILE[(t + len(rows)) % len(HOSTILE)] if hostile else f"move {t}"
        row = {"game_id": g["game_id"], "turn": t, "pid": s["pid"], "model_uid": s["model_uid"],
               "is_learner": s["is_learner"], "split": g["split"], "env_id": g["env_id"], "seed": g["seed"],
               "group_id": g["group_id"], "observation": f"[GAME] board {t}\n{text}",
               "prompt": f"<|im_start|>user\n{text}<|im_end|>", "completion": f"I think {text} so \\boxed{{[{t}]}}",
               "action": f"[{t}]", "format_ok": rng.random() < 0.8, "invalid_move": rng.random() < 0.1,
               "step_info": "{}", "prompt_tokens": 50 + t, "completion_tokens": 10 + rng.randrange(20),
               "truncated": False, "latency_s": 0.01}
        # one id and one behaviour log-prob per completion token, as the engines write them (stand-in ids)
        n = row["completion_tokens"]
        row.update(completion_token_ids=[(31 * t + k) % 4096 for k in range(n)], logprobs=[-0.5] * n)
        rows.append(row)
    return rows


def make_run(lake_dir: Path, run: str = "syn", rounds: int = 3, games_per_round: int = 30, seed: int = 0,
             hostile: bool = True, commit_last: bool = True) -> dict[str, float]:
    """A training run: checkpoint k plays round k (mirror, vs its predecessors, eval vs random,
    single-player and 3-player games). Returns the true strengths."""
    rng = random.Random(seed)
    uids = [f"ckpt-{k}" for k in range(rounds)]
    strength = {"random": -1.0, **{u: 0.6 * k for k, u in enumerate(uids)}}
    if hostile:  # a hostile model name, too
        strength[HOSTILE[1]] = 0.3
    for k, uid in enumerate(uids):
        steps = [{"iteration": k, "step": s, "update": s, "loss": 1.0 / (k + s + 1), "grad_norm": 0.1 * s, "lr": 1e-5,
                  "reward_mean": 0.1 * k, "tokens_per_s": 1000.0 + s, "cuda_mem_allocated": None} for s in range(3)]
        write_checkpoint(lake_dir, run, k, uid, uids[k - 1] if k else None, steps if k else None)
    for r, uid in enumerate(uids):
        games, turns = [], []
        for i in range(games_per_round):
            kind = i % 6
            if kind == 0:  # mirror self-play
                ra, rb = outcome(rng, 0.0, 0.0)
                seats, env, split = [seat(0, uid, ra, True), seat(1, uid, rb, True)], "SimpleTak-v0-train", "train"
            elif kind in (1, 2):  # vs an earlier checkpoint (or the hostile name)
                opp = rng.choice(uids[:r] or [HOSTILE[1] if hostile else "random"])
                ra, rb = outcome(rng, strength[uid], strength[opp])
                pair = [seat(0, uid, ra, True), seat(1, opp, rb)]
                seats, env, split = (pair if i % 2 else [dict(pair[1], pid=0), dict(pair[0], pid=1)]), \
                    "SimpleTak-v0-train", "train"
            elif kind == 3:  # eval vs random
                ra, rb = outcome(rng, strength[uid], strength["random"])
                seats, env, split = [seat(0, "random", rb), seat(1, uid, ra, True)], "KuhnPoker-v0-train", "eval"
            elif kind == 4:  # single-player
                win = rng.random() < 1.0 / (1.0 + math.exp(-strength[uid]))
                seats, env, split = [seat(0, uid, 1.0 if win else -1.0, True)], "GuessTheNumber-v0", "eval"
            else:  # N players; a model may hold two seats (merged into one team); ties possible
                others = rng.sample(["random"] + uids[:r + 1], k=min(2, r + 1))
                players = [uid] + others
                perf = [strength[p] + rng.gauss(0, 1) for p in players]
                best = max(perf)
                seats = [seat(p, m, 1.0 if v == best else (0.0 if rng.random() < 0.3 else -1.0), m == uid)
                         for p, (m, v) in enumerate(zip(players, perf))]
                env, split = "SecretMafia-v0", "train"
            g = game(r, i, env, seats, split, turns=2 + rng.randrange(4))
            games.append(g)
            if i < 8:
                turns += turn_rows(g, rng, hostile)
        write_round(lake_dir, run, r, games, turns, uid, do_commit=commit_last or r < rounds - 1)
    return strength


def duel_table(n: int, strengths: np.ndarray, rng: np.random.Generator, env_ids: list[str], round_: int,
               start: int = 0, draw: float = 0.1, prefix: str = "m") -> pa.Table:
    """n 2-player games between random distinct models as an Arrow `games` table (fast, for benches)."""
    M = len(strengths)
    a = rng.integers(0, M, n)
    b = (a + rng.integers(1, M, n)) % M
    p_a = 1.0 / (1.0 + np.exp(strengths[b] - strengths[a]))
    u = rng.random(n)
    ra = np.where(u < draw, 0.0, np.where(rng.random(n) < p_a, 1.0, -1.0))
    names = np.array([f"{prefix}{k:04d}" for k in range(M)], dtype=object)
    seats = pa.StructArray.from_arrays([
        pa.array(np.tile([0, 1], n), pa.int32()), pa.array(np.stack([names[a], names[b]], 1).ravel(), pa.string()),
        pa.array(np.zeros(2 * n, bool)), pa.array(np.tile(["Player 0", "Player 1"], n)),
        pa.array(np.stack([ra, -ra], 1).ravel()), pa.array(np.zeros(2 * n, bool)), pa.array(np.full(2 * n, "done"))],
        fields=list(catalog.SEAT))
    ids = np.arange(start, start + n)
    return pa.table({
        "game_id": pa.array([f"r{round_:04d}-g{k:08d}" for k in ids.tolist()]), "split": pa.array(np.full(n, "train")),
        "env_id": pa.array(np.array(env_ids, dtype=object)[ids % len(env_ids)]), "seed": pa.array(ids, pa.int64()),
        "group_id": pa.array([f"r{round_:04d}-train-g{k:08d}" for k in ids.tolist()]),
        "num_players": pa.array(np.full(n, 2), pa.int32()), "num_turns": pa.array(np.full(n, 5), pa.int32()),
        "started_at": pa.array(np.full(n, T0)), "finished_at": pa.array(np.full(n, T0)),
        "worker": pa.array(np.full(n, "w0")), "task": pa.array(np.full(n, "t0")),
        "seats": pa.ListArray.from_arrays(pa.array(np.arange(0, 2 * n + 1, 2), pa.int32()), seats)})


def play_league_pass(lake_dir: Path, league: str, round_: int, specs: list, strength: dict[str, float],
                     rng: random.Random, seat_edge: float = 0.3) -> None:
    """A league pass (play/league.py GameSpecs of 2-player games) played by formula and committed like
    a round: seat 0 wins with probability sigmoid(s0 - s1 + seat_edge) (10% draws)."""
    games = []
    for g in specs:
        a, b = (s.model_uid for s in g.seats)
        ra, rb = outcome(rng, strength[a] + seat_edge, strength[b])
        games.append({**game(round_, 0, g.env_id, [seat(0, a, ra), seat(1, b, rb)], g.split),
                      "game_id": g.game_id, "group_id": g.group_id, "seed": g.seed})
    write_round(lake_dir, league, round_, games, checkpoint=None)


def run_league(job, strength: dict[str, float], seed: int = 0) -> list:
    """A league driven as `run league` drives it, with passes played by formula (play_league_pass):
    rate, plan, play, until a plan is empty. Returns every plan (play/league.py Pass), the empty last."""
    from unstable_dask.play.league import plan_pass
    from unstable_dask.rate.league import rate_league
    rng, plans = random.Random(seed), []
    while True:
        rate_league(job)
        plans.append(plan_pass(job, Lake(job.run.lake)))
        if not plans[-1].games:
            return plans
        last = Lake(job.run.lake).last_round(job.league_name)
        play_league_pass(Path(job.run.lake), job.league_name, 0 if last is None else last + 1, plans[-1].games,
                         strength, rng)
