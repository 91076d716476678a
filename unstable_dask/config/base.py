"""What every setting shares: the limits that keep a run finite, the strict base model, reserved uids."""
from __future__ import annotations

import math
import re
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, field_validator

# Limits, one place (docs/job-keys.md shows them). Far past any real run; they turn a typo into an error at
# load instead of a scheduler that never ends or a number the lake cannot store.
MAX_INT = 2**53  # every integer setting, anywhere in a job (exact as JSON and float64, fits int64)
MAX_GAMES_PER_ROUND = 1_000_000  # round.train_games + round.eval_games (scheduling takes ~0.1 ms a game)
MAX_MODEL_LEN = 2**20  # model.max_model_len: past the longest context of any model served today
# Prompt tokens model.max_model_len must leave beside max_new_tokens: the templates' own text is
# ~40-60 tokens, a game's observation tens to hundreds more; less cuts every prompt to noise.
MIN_PROMPT_TOKENS = 128
# Below it (and above 0, greedy) sampling is greedy in all but name: vLLM samples greedily under
# 1e-5 while the learner would divide the logits by T, and logits / 1e-300 overflow to inf.
MIN_TEMPERATURE = 0.01
MAX_UPDATES = 1_000  # learn.updates_per_round: sampled batches per learner iteration (runs use 1-8)
MAX_EPOCHS = 100  # passes over one batch (ppo_epochs)
MAX_BOOTSTRAP = 10_000  # Bradley-Terry resamples: 200 give a 95% interval; 10,000 already take minutes
MAX_RATING_SCALE = 1e6  # |ratings.mu|, sigma, beta, tau: squares stay far inside float64 (tau=1e300 overflows)
MAX_WORKERS = 1_024  # cluster.n_workers: worker processes started on one machine


def _insane(v: Any) -> Optional[str]:
    """Why a value is past the limits every setting obeys, or None. Walks lists and dicts (the
    pass-through `extra` tables); nested models check their own fields."""
    if isinstance(v, bool) or isinstance(v, BaseModel):
        return None
    if isinstance(v, int) and abs(v) > MAX_INT:
        return f"integers are limited to {MAX_INT:,} in size (config.MAX_INT)"
    if isinstance(v, float) and not math.isfinite(v):
        return "must be a finite number"
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, (list, tuple)) else ()
    for k, x in items:
        why = _insane(x)
        if why:
            return f"[{k!r}] {why}" if why[0] != "[" else f"[{k!r}]{why}"
    return None


class Strict(BaseModel):
    # strict: a number must be a number (no `true` for 1, no "4" for 4; an int is fine for a float);
    # allow_inf_nan: every float setting is finite. `_sane` applies MAX_INT to every field.
    # use_attribute_docstrings: a field's docstring is its description (cleanrl style, one place).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)

    @field_validator("*")
    @classmethod
    def _sane(cls, v: Any) -> Any:
        why = _insane(v)
        if why:
            raise ValueError(why)
        return v


# Opponent names that are not checkpoints or endpoints; also their model_uids in the lake.
BASE_UID = "base"
RANDOM_UID = "random"
# The eval baseline (round.eval_baseline): the random agent, which plays a legal move, in the learner's seats.
LEGAL_RANDOM_UID = "legal-random"
CHECKPOINT_UID = re.compile(r"ckpt-\d+")  # the learner names its checkpoints ckpt-<k> (learn.py)
# Expert agents (play/experts.py): opponent names, alone or as `<expert>@<eps>` (a uniformly random
# legal move with probability eps, the expert's move otherwise); the name is the seat's model_uid.
EXPERT_UIDS = ("minimax", "minimax-first", "kuhn-best")
NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # run and endpoint names: safe in paths and messages


def reserved_uid(uid: str) -> bool:
    return (uid in (BASE_UID, RANDOM_UID, LEGAL_RANDOM_UID) or CHECKPOINT_UID.fullmatch(uid) is not None
            or uid.partition("@")[0] in EXPERT_UIDS)


def expert_parts(uid: str) -> Optional[tuple[str, float]]:
    """(expert, eps) of an expert agent's name ('minimax' -> ('minimax', 0.0)), None for any other
    name; ValueError for an expert's name whose eps is not a number in [0, 1]."""
    name, at, eps = uid.partition("@")
    if name not in EXPERT_UIDS:
        return None
    if not at:
        return name, 0.0
    if not re.fullmatch(r"\d+(\.\d*)?|\.\d+", eps) or float(eps) > 1:
        raise ValueError(f"{uid!r}: an expert's epsilon form is '{name}@<eps>' with eps a number in [0, 1] "
                         f"(the share of uniformly random legal moves), got {eps!r}")
    return name, float(eps)
