"""The Arena views of the report, on a lake written by real rounds of the builtin tiny model:
three models (base, ckpt-1, the random agent) meet in two envs, with mirror self-play beside.
Every matrix cell, average win rate and rank change shown in headless Chromium is checked against
a count made here straight from the games' seats, not from the rate job's tables."""
from __future__ import annotations

from collections import defaultdict
from itertools import combinations
from pathlib import Path

import pytest

from unstable_dask.jobfile import load_job
from unstable_dask.lake import Lake
from unstable_dask.rate import ratings
from unstable_dask.report import report

from helpers.browser import opened


def _counts(games: list[dict]) -> dict[tuple[str, str, str], list[int]]:
    """(env, a, b) -> [a's wins, draws, b's wins] over every non-mirror 2+ model game, both orders,
    env '*' for all; a model holding several seats is one team with their mean reward."""
    out: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for g in games:
        if any(s["reward"] is None or s["model_uid"] is None for s in g["seats"]):
            continue  # the rate job skips these too
        team: dict[str, list[float]] = defaultdict(list)
        for s in g["seats"]:
            team[s["model_uid"]].append(s["reward"])
        mean = {m: sum(r) / len(r) for m, r in team.items()}
        for a, b in combinations(sorted(mean), 2):
            k = 0 if mean[a] > mean[b] else 1 if mean[a] == mean[b] else 2
            for env in ("*", g["env_id"]):
                out[(env, a, b)][k] += 1
                out[(env, b, a)][2 - k] += 1
    return out


@pytest.mark.slow
def test_arena_views_show_the_lakes_counts(tmp_path: Path, local_client) -> None:
    from unstable_dask.learn.learner import learn
    from unstable_dask.play.round import play_round
    wn = {"env_id": "WinningNumber-v0-train", "num_players": 2, "num_actors": 1}  # wins, draws and losses occur
    job = load_job("jobs/demo.toml", {
        "run.lake": str(tmp_path / "lake"), "run.reports": str(tmp_path / "reports"), "model.max_new_tokens": 8,
        "round.train_games": 8, "round.eval_games": 24, "round.games_per_task": 16, "round.concurrency": 16,
        "round.train_envs": [wn, {"env_id": "SimpleTak-v0-train", "num_players": 2, "num_actors": 2}],  # mirror
        "round.eval_envs": [wn | {"opponents": ["random"]}, {"env_id": "KuhnPoker-v0-train", "num_actors": 1,
                                                             "opponents": ["random"]}],
        "round.opponents": {"strategy": "fixed", "fixed": ["random"]},
        "learn.batch_size": 8, "learn.mini_batch_size": 8, "learn.gradient_checkpointing": False})
    play_round(job, client=local_client)  # base vs random
    learn(job)
    for e in job.round.eval_envs:  # ckpt-1 meets base and random
        e.opponents = ["random", "base"]
    play_round(job, client=local_client)
    ratings.rate(job)
    page = report.report(job)

    games = Lake(job.run.lake).sql("SELECT env_id, seats FROM games").to_pylist()
    mirror = [g for g in games if len({s["model_uid"] for s in g["seats"]}) == 1]
    assert mirror, "the lake needs mirror games for this test to show they are left out"
    counts = _counts(games)
    models = {"base", "ckpt-1", "random"}
    assert {a for _, a, _ in counts} == models
    expect = {}  # (env, a, b) -> (win fraction or None, decisive games)
    for (env, a, b), (w, _, lost) in counts.items():
        expect[(env, a, b)] = (w / (w + lost) if w + lost else None, w + lost)
    avg = defaultdict(list)
    for (env, a, _), (wf, _) in expect.items():
        if wf is not None:
            avg[(env, a)].append(wf)
    rated = {(r["env_id"], r["model_uid"]): r["rank"] for r in
             Lake(job.run.lake).sql("SELECT env_id, model_uid, rank FROM ratings").to_pylist()}

    with opened(page) as (pg, errors):
        pg.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")

        def cells(table_id: str) -> dict[tuple[str, str], str]:
            return {(c["a"], c["b"]): c["v"] for c in pg.eval_on_selector_all(
                f"#{table_id} td[data-a]", "els => els.map(e => ({a: e.dataset.a, b: e.dataset.b, v: e.dataset.v}))")}

        names = pg.locator("#envs > details > summary").all_inner_texts()
        assert sorted(names) == sorted({g["env_id"] for g in games})
        assert pg.locator(f"#wf-env-{names.index('SimpleTak-v0-train') + 1}").count() == 0  # mirror only: no matrix
        envs = {"*": "all"} | {e: f"env-{names.index(e) + 1}" for (e, _, _) in counts if e != "*"}
        assert len(envs) == 3
        for env, key in envs.items():
            wf, bc = cells(f"wf-{key}"), cells(f"bc-{key}")
            shown = {k for k in wf}
            want = {(a, b) for (e, a, b) in expect if e == env}
            assert want <= shown  # pairs that never met show empty cells
            for (a, b), v in wf.items():
                w, n = expect.get((env, a, b), (None, 0))
                assert (v == "" and w is None) or float(v) == pytest.approx(w), (env, a, b, v, w)
                assert int(bc[(a, b)]) == n
            # games per pair: all games, draws included
            rows = pg.locator(f"#pairs-{key} tbody tr").all_inner_texts()
            got = {tuple(r.split("\t")[:2]): [int(x) for x in r.split("\t")[2:6]] for r in rows}
            assert got == {(a, b): [sum(c), *c] for (e, a, b), c in counts.items() if e == env and a < b}
            # the leaderboard's average win rate and, per env, the rank change against overall
            board = "lb-all" if env == "*" else f"lb-env-{key.split('-')[1]}"
            for tr in pg.locator(f"#{board} tbody tr").all():
                model = tr.locator("td.model").inner_text()
                v = tr.locator("td.avg-win").get_attribute("data-v")
                want_avg = avg.get((env, model))
                assert (v == "" and not want_avg) or float(v) == pytest.approx(sum(want_avg) / len(want_avg))
                if env != "*":
                    change = tr.locator("td.rank-change").get_attribute("data-v")
                    overall, here = rated[("*", model)], rated[(env, model)]
                    assert change == ("" if overall is None or here is None else str(overall - here))
        # Sorting a matrix column puts the rows in that column's order (our script runs).
        col = pg.locator("#wf-all thead th").nth(1)
        col.click()
        vals = [float(v) for v in pg.eval_on_selector_all(
            "#wf-all tbody tr", "rows => rows.map(r => r.cells[1].dataset.v)") if v not in ("", None)]
        assert vals == sorted(vals, reverse=True) and len(vals) >= 2
        assert errors == []
