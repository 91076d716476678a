"""Where the action falls in a lake's completions: how many of each turn's tokens come after the
move the env reads (issue 48: "answers that are the move").

The move of a completion is read as a round reads it (play/prompts.action_end, the learner's
`mask_after_action` cut too): the last closed `\\boxed{}` when there is one (the action ends at that
box's `}`), else the whole text goes to the env, which takes the first match of its own rule
(prompts.move_rule: TicTacToe `[digit]`, Kuhn Poker `[check|bet|call|fold]`; another env: the first
`[...]`). The token where the action ends is the
first whose decoded prefix reaches that character: the token a stop string at the action's last
character (model.stop) would end the turn on. Per run, model and env: turns, completion tokens per
turn, the action's end (token and character index), the share of turns with no action, and the
share of completion tokens after the action (the tokens that carry the move's advantage as noise).
The round times come from the `rounds` table (committed_at - started_at).

    python bench/play/bench_action_position.py --lake /tmp/lake-stop [/tmp/lake-stop-on ...] [--run smollm2-learn]
        [--name action_position]

Writes bench/results/<name>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package, bench/common.py
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
MEASURES = ["unstable_dask/play/prompts.py", "unstable_dask/inference/"]  # for bench/stale.py

from unstable_dask.play.prompts import action_end, prompt_answer_prefix  # noqa: E402

from common import row, save  # noqa: E402


def token_end(tokenizer, ids: list[int], char_end: int) -> int:
    """Tokens up to and including the one whose text reaches character `char_end` of the completion."""
    for n in range(1, len(ids) + 1):
        if len(tokenizer.decode(ids[:n], skip_special_tokens=True)) >= char_end:
            return n
    return len(ids)


def summarise(rows: list[dict], tokenizer) -> dict:
    tokens = [r["completion_tokens"] for r in rows]
    ends_tok, ends_char, after, with_action = [], [], 0, 0
    for r in rows:
        end = action_end(r["completion"] or "", r["env_id"], prompt_answer_prefix(r["prompt"] or ""))
        if end is None:
            continue
        n = token_end(tokenizer, list(r["completion_token_ids"]), end)
        ends_tok.append(n)
        ends_char.append(end)
        after += r["completion_tokens"] - n
        with_action += r["completion_tokens"]

    def stats(xs: list) -> dict:
        return {"mean": round(statistics.fmean(xs), 2), "median": statistics.median(xs), "min": min(xs),
                "max": max(xs)} if xs else {}
    return {"turns": len(rows), "completion_tokens": stats(tokens),
            "truncated_share": round(sum(bool(r["truncated"]) for r in rows) / len(rows), 3),
            "no_action_share": round(1 - len(ends_tok) / len(rows), 3),
            "action_end_token": stats(ends_tok), "action_end_char": stats(ends_char),
            "completion_chars": stats([len(r["completion"] or "") for r in rows]),
            # of the completion tokens of turns with an action, the share after it
            "share_tokens_after_action": round(after / with_action, 3) if with_action else None,
            # of all completion tokens, the share that is not the action (after it, or of a turn without one)
            "share_tokens_not_action": round(1 - sum(ends_tok) / sum(tokens), 3) if tokens else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lake", required=True, nargs="+", help="one or more lakes (e.g. the same seeds without and with model.stop)")
    ap.add_argument("--run", default=None, help="one run of the lake (default: every run)")
    ap.add_argument("--name", default="action_position")
    args = ap.parse_args()

    from unstable_dask.lake import Lake
    out = []
    for uri in args.lake:
        out += measure(Lake(uri), args.run)
    path = save(args.name, {"records": out}, settings=vars(args))
    print(f"wrote {path}")


def measure(lake, run_name: str | None) -> list[dict]:
    from transformers import AutoTokenizer

    from unstable_dask.inference.weights import resolve_model
    """One record per run, model and env of `lake` (of run `run_name` only, if given)."""
    where = "" if run_name is None else "WHERE run = $run"
    params = {} if run_name is None else {"run": run_name}
    rounds = lake.sql(f"SELECT run, round, job, epoch(committed_at - started_at) AS round_s, completion_tokens "
                      f"FROM rounds {where} ORDER BY run, round", params).to_pylist()
    turns = lake.sql(f"SELECT run, round, model_uid, env_id, prompt, completion, completion_tokens, completion_token_ids, "
                     f"truncated FROM turns WHERE completion_token_ids IS NOT NULL "
                     f"{'' if run_name is None else 'AND run = $run'}", params).to_pylist()
    if not turns:
        sys.exit(f"{lake.uri}: no model turns{'' if run_name is None else ' in run ' + run_name}")
    jobs = {r["run"]: json.loads(r["job"]) for r in rounds}
    out = []
    for run in sorted({t["run"] for t in turns}):
        model = jobs[run]["model"]
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(model["base"]))
        groups: dict[tuple, list] = {}
        for t in turns:
            if t["run"] == run:
                groups.setdefault((t["model_uid"], t["env_id"]), []).append(t)
        for (uid, env), rows in sorted(groups.items()):
            rec = {"lake": str(lake.uri), "run": run, "model_uid": uid, "env_id": env, "base": model["base"], "template": model["template"],
                   "max_new_tokens": model["max_new_tokens"], "temperature": model["temperature"],
                   "stop": model.get("stop", []),
                   "rounds": [{"round": r["round"], "round_s": r["round_s"], "completion_tokens": r["completion_tokens"]}
                              for r in rounds if r["run"] == run],
                   **summarise(rows, tokenizer)}
            out.append(rec)
            print(row(run, uid, env, rec["turns"], rec["completion_tokens"].get("mean"),
                      rec["action_end_token"].get("mean"), rec["action_end_char"].get("mean"),
                      rec["no_action_share"], rec["share_tokens_after_action"], rec["share_tokens_not_action"]))
    return out


if __name__ == "__main__":
    main()
