"""Lakes written the way rounds write them, for the tests that need committed data without playing:
random rounds with GRPO groups (`make_lake`), and minimal one-game rounds (`write_round`) for the
commit protocol's races."""
from __future__ import annotations

import random

from unstable_dask.lake import Lake
from unstable_dask.lake.commit import now

RUN = "t"


def make_lake(root, rounds=3, games=40, seed=0, first=1, encode=None, uid="base"):
    """Random committed rounds: mirror and vs-random train games, eval games, two envs; games of
    one env and seed in a round form a group. `encode` (text -> ids) makes prompt_tokens and
    completion_token_ids what an engine with that tokenizer would have written; `uid` is the
    checkpoint that played them (the run's newest, as a real round's)."""
    rng = random.Random(seed)
    # the weights an engine serving `uid` would report: its committed adapter's digest
    sha = {c["uid"]: c["adapter_sha256"] for c in Lake(root).table("checkpoints").rows(RUN)}.get(uid)
    for r in range(first, first + rounds):
        games_rows, turns_rows = [], []
        ids = [f"g{rng.randrange(10**6):06d}-{i}" for i in range(games)]
        for gid in ids:
            env = rng.choice(["EnvA-v0", "EnvB-v0"])
            split = "eval" if rng.random() < 0.2 else "train"
            mirror = rng.random() < 0.6
            gseed = rng.randrange(6)  # few seeds, so GRPO groups have several members
            group = f"r{r}-{env}-{gseed}"
            seats = []
            for pid in range(2):
                learner = mirror or pid == 0
                seats.append(dict(pid=pid, model_uid=uid if learner else "random", is_learner=learner,
                                  role=f"Player {pid}", reward=rng.choice([-1.0, 0.0, 1.0, rng.uniform(-2, 2)]),
                                  invalid_move=False, reason=""))
            n = rng.randrange(1, 6)
            games_rows.append(dict(game_id=gid, split=split, env_id=env, seed=gseed, group_id=group, num_players=2,
                                   num_turns=n, seats=seats))
            for t in range(n):
                pid = t % 2
                learner = seats[pid]["is_learner"]
                prompt, n_c = f"p{gseed}-{t % 3}", rng.randrange(1, 9)
                turns_rows.append(dict(
                    game_id=gid, turn=t, pid=pid, model_uid=seats[pid]["model_uid"], is_learner=learner,
                    split=split, env_id=env, seed=gseed, group_id=group, observation="obs",
                    prompt=prompt if learner else None, completion="c" if learner else None,
                    action="[0]", format_ok=rng.random() < 0.7, invalid_move=rng.random() < 0.2,
                    prompt_tokens=len(encode(prompt)) if encode else 5, completion_tokens=n_c,
                    completion_token_ids=[rng.randrange(3, 300) for _ in range(n_c)] if learner else None,
                    truncated=False, logprobs=None, adapter_sha256=sha if learner else None))
        Lake(root).write("games", RUN, r, "task0", games_rows)
        Lake(root).write("turns", RUN, r, "task0", turns_rows)
        Lake(root).commit_round(RUN, r, dict(checkpoint_uid=uid, games=len(ids), temperature=1.0, top_p=1.0,
                                           max_new_tokens=8))
    return root


def game_row(gid: str) -> dict:
    t = now()
    seat = dict(pid=0, model_uid="base", is_learner=True, role="P0", reward=1.0, invalid_move=False, reason="")
    return dict(game_id=gid, split="train", env_id="E", seed=1, num_players=1, num_turns=1, started_at=t,
                finished_at=t, worker="w", task="t", seats=[seat])


def write_round(lake, rnd: int, attempt: str, n: int = 2) -> None:
    for i in range(n):
        Lake(lake).write("games", "r", rnd, f"task-{i:04d}.{attempt}", [game_row(f"{attempt}-{rnd}-{i}")])
        Lake(lake).write("turns", "r", rnd, f"task-{i:04d}.{attempt}", [{"game_id": f"{attempt}-{rnd}-{i}", "turn": 0, "pid": 0}])


def commit_in_process(lake: str, attempt: str, barrier, out) -> None:
    barrier.wait()
    try:
        Lake(lake).commit_round("r", 0, {"attempt": attempt, "checkpoint_uid": "base"})
        out.put(attempt)
    except FileExistsError:
        out.put("lost")


def tiny_lake(root, **kw):
    """`make_lake`'s random rounds with prompt token counts of the builtin tiny tokenizer, so the
    learner's exact-token checks pass on them."""
    from transformers import AutoTokenizer

    from unstable_dask.inference.weights import resolve_model
    tok = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny"))
    return make_lake(root, encode=lambda text: tok(text, add_special_tokens=False)["input_ids"], **kw)
