"""[round] and [endpoints]: the games a round plays, who sits in the seats, and endpoint opponents."""
from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import Field, ValidationInfo, field_validator, model_validator

from unstable_dask.config.base import MAX_GAMES_PER_ROUND, Strict, reserved_uid

OpponentStrategy = Literal["mirror", "fixed", "lagged", "match-quality", "win-rate"]


class EnvSpec(Strict):
    env_id: str
    num_players: int = Field(2, ge=1)
    # Seats played by the checkpoint being trained/evaluated; the rest are opponents.
    num_actors: Optional[int] = Field(None, ge=1)
    weight: float = Field(1.0, gt=0.0)
    template: Optional[str] = None  # overrides [model].template for this env
    # Eval envs: opponents for the non-actor seats (e.g. ["random"], ["base"], a checkpoint uid).
    opponents: Optional[list[str]] = None

    @field_validator("opponents")
    @classmethod
    def _someone(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v is not None and not v:
            raise ValueError("an empty list names no opponent; name at least one (e.g. [\"random\"]), or leave "
                             "the key out to use round.opponents.fixed")
        return v

    @model_validator(mode="after")
    def _actors(self) -> "EnvSpec":
        if self.num_actors is None:
            self.num_actors = self.num_players
        if self.num_actors > self.num_players:
            raise ValueError(f"num_actors ({self.num_actors}) must be <= num_players ({self.num_players})")
        return self


class OpponentConfig(Strict):
    # mirror: the checkpoint plays every seat; fixed: uniform over `fixed`; lagged: uniform over
    # the last `lag` checkpoints; match-quality: every other checkpoint and `fixed`, weighted by
    # TrueSkill match quality; win-rate: one past checkpoint until the learner wins more than
    # `win_rate_threshold` of its last `win_rate_games` train games against it (UnstableBaselines).
    strategy: OpponentStrategy = "mirror"
    fixed: list[str] = ["random"]
    lag: int = Field(5, gt=0)
    win_rate_threshold: float = Field(0.7, ge=0.0, le=1.0)
    win_rate_games: int = Field(100, gt=0)

    @model_validator(mode="after")
    def _someone_to_play(self) -> "OpponentConfig":
        # Empty is a choice for strategies that also play checkpoints (match-quality: checkpoints
        # only); for "fixed" it leaves the learner nobody to play.
        if self.strategy == "fixed" and not self.fixed:
            raise ValueError("fixed: strategy 'fixed' needs at least one opponent in round.opponents.fixed")
        return self


class RoundConfig(Strict):
    # Each scheduled train start state (env, seed, seating, opponents) is played group_size times
    # with independent sampling: a GRPO group. Declared before train_games, which is checked against it.
    group_size: int = Field(1, ge=1)
    train_games: int = Field(16, ge=0, validate_default=True)  # games played, a multiple of group_size
    eval_games: int = Field(4, ge=0)
    eval_baseline: bool = False
    """Play every eval game a second time (split `baseline`: same env, seed, seats and opponents)
    with `legal-random`, the random agent that picks a legal move, in the learner's seats. The
    curves show its win rate beside the learner's: a model that only learned to move legally
    scores like it, so a learning claim is one whose interval lies above it."""
    games_per_task: int = Field(8, gt=0)  # a task = one Dask task writing one file per table
    concurrency: int = Field(8, gt=0)  # games in flight inside one task (one batched generate per step)
    max_turns: int = Field(200, gt=0)  # safety cap on turns per game
    error_allowance: int = Field(1, ge=0)  # invalid moves a player may make before forfeiting
    env_sampling: Literal["uniform", "weighted"] = "uniform"
    train_envs: list[EnvSpec] = [EnvSpec(env_id="SimpleTak-v0-train")]
    eval_envs: list[EnvSpec] = [EnvSpec(env_id="KuhnPoker-v0-train", num_actors=1, opponents=["random"])]
    opponents: OpponentConfig = OpponentConfig()

    @model_validator(mode="after")
    def _eval_opponents(self) -> "RoundConfig":
        # An eval env without its own opponents plays round.opponents.fixed (play/schedule.py)
        if self.eval_games and not self.opponents.fixed and any(e.opponents is None for e in self.eval_envs):
            raise ValueError("eval_envs without their own `opponents` play round.opponents.fixed, which is "
                             "empty: name the eval opponents")
        return self

    @model_validator(mode="after")
    def _games_cap(self) -> "RoundConfig":
        total = self.train_games + self.eval_games * (2 if self.eval_baseline else 1)
        if total > MAX_GAMES_PER_ROUND:
            what = "train_games + 2 x eval_games (eval_baseline)" if self.eval_baseline else "train_games + eval_games"
            raise ValueError(f"{what} = {total:,}: a round plays at most "
                             f"{MAX_GAMES_PER_ROUND:,} games (config.MAX_GAMES_PER_ROUND); play more rounds instead")
        return self

    @field_validator("train_games")
    @classmethod
    def _whole_groups(cls, v: int, info: ValidationInfo) -> int:
        g = info.data.get("group_size")
        if g and v % g:
            raise ValueError(f"must be a multiple of round.group_size ({g}): each start state is played "
                             f"group_size times")
        return v


class EndpointConfig(Strict):
    """An OpenAI-compatible chat endpoint (OpenRouter, OpenAI, a `vllm serve`) that plays opponent seats.

    The API key is read from the environment variable `api_key_env` on the worker when the round
    plays; the job (and so the lake's copy of it) holds only the variable's name.
    """
    base_url: str = Field(pattern=r"^https?://\S+$")
    model: str = Field(min_length=1)  # the served model id; the seats' model_uid in the lake
    api_key_env: Optional[str] = None  # None: no key (a local server)
    max_concurrency: int = Field(8, gt=0)  # requests in flight to this endpoint per worker process
    timeout: float = Field(60.0, gt=0.0)  # seconds per attempt (the openai client's timeout)
    max_retries: int = Field(3, ge=0)  # the openai client's retries on 408/409/429/5xx, timeouts, dropped connections
    # Sampling; None takes [model]'s value, so the endpoint plays under the learner's settings.
    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    max_tokens: Optional[int] = Field(None, gt=0)  # None: [model].max_new_tokens
    extra_body: dict[str, Any] = {}  # merged into every request body (e.g. OpenRouter's "provider")

    @model_validator(mode="before")
    @classmethod
    def _key_is_a_name(cls, data: Any) -> Any:
        # Checked on the whole table, so the message does not echo the value: a pasted key.
        var = data.get("api_key_env") if isinstance(data, dict) else None
        if isinstance(var, str) and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", var):
            raise ValueError("api_key_env must name the environment variable that holds the API key "
                             "(e.g. OPENROUTER_API_KEY), not the key itself (the value is not shown)")
        return data

    @field_validator("model")
    @classmethod
    def _own_uid(cls, v: str) -> str:
        if reserved_uid(v):
            raise ValueError("the endpoint's model id is its model_uid in the lake and may not be 'base', "
                             "'random' or a checkpoint uid (ckpt-<k>); serve it under another name")
        return v
