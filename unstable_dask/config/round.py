"""[round] and [endpoints]: the games a round plays, who sits in the seats, and endpoint opponents."""
from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import Field, ValidationInfo, field_validator, model_validator

from unstable_dask.config.base import EXPERT_UIDS, LEGAL_RANDOM_UID, MAX_GAMES_PER_ROUND, Strict, expert_parts, reserved_uid

OpponentStrategy = Literal["mirror", "fixed", "lagged", "match-quality", "win-rate"]


class EnvSpec(Strict):
    env_id: str
    """A registered TextArena env id (e.g. `SimpleTak-v0-train`, `KuhnPoker-v0-train`)."""
    num_players: int = Field(2, ge=1)
    """Seats in the game."""
    num_actors: Optional[int] = Field(None, ge=1)
    """Seats played by the checkpoint being trained or evaluated (rotating with the game), the rest
    by opponents; at most num_players; unset: every seat (mirror self-play)."""
    weight: float = Field(1.0, gt=0.0)
    """With round.env_sampling = "weighted": this env's relative share of the games."""
    template: Optional[str] = None
    """The prompt template in this env; unset: [model].template."""
    opponents: Optional[list[str]] = None
    """Opponents for the non-actor seats, drawn uniformly (`random`, `base`, an expert agent such as
    `minimax` or `minimax@0.3`, a checkpoint uid `ckpt-<k>`, an endpoint of [endpoints], a LoRA adapter folder); unset:
    round.opponents.fixed in eval games, round.opponents.strategy in train games."""

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
    strategy: OpponentStrategy = "mirror"
    """Who fills the non-actor train seats. mirror: the checkpoint itself; fixed: uniform over
    `fixed`; lagged: uniform over the last `lag` checkpoints; match-quality: every other checkpoint
    and `fixed`, weighted by TrueSkill match quality; win-rate: one past checkpoint until the learner
    wins more than `win_rate_threshold` of its last `win_rate_games` train games against it
    (UnstableBaselines)."""
    fixed: list[str] = ["random"]
    """The fixed opponents (names as in an env's `opponents`): the pool of strategy "fixed", joined
    to the checkpoints by "match-quality", and the eval opponents of eval envs without their own."""
    lag: int = Field(5, gt=0)
    """strategy "lagged": how many of the latest checkpoints are drawn from."""
    win_rate_threshold: float = Field(0.7, ge=0.0, le=1.0)
    """strategy "win-rate": the learner's win rate (share of games) against the current opponent
    that moves it on to the checkpoint about to play."""
    win_rate_games: int = Field(100, gt=0)
    """strategy "win-rate": how many of the learner's latest train games against the opponent the
    win rate counts (draws and mirror games do not count)."""

    @model_validator(mode="after")
    def _someone_to_play(self) -> "OpponentConfig":
        # Empty is a choice for strategies that also play checkpoints (match-quality: checkpoints
        # only); for "fixed" it leaves the learner nobody to play.
        if self.strategy == "fixed" and not self.fixed:
            raise ValueError("fixed: strategy 'fixed' needs at least one opponent in round.opponents.fixed")
        return self


class RoundConfig(Strict):
    # Declared before train_games, which is checked against it.
    group_size: int = Field(1, ge=1)
    """Each scheduled train start state (env, seed, seating, opponents) is played this many times with
    independent sampling: a GRPO group (group_id in games and turns); GRPO and GSPO need >= 2."""
    train_games: int = Field(16, ge=0, validate_default=True)
    """Train games a round plays (the learner's data): a multiple of group_size."""
    eval_games: int = Field(4, ge=0)
    """Eval games a round plays, against fixed opponents (round.eval_envs); never trained on."""
    eval_baseline: list[str] = []
    """Agents that replay every eval game in the learner's seats (split `baseline`: same env, seed,
    seats and opponents), one replay each: `legal-random` (the random agent that picks a legal move),
    an expert (`minimax`, `kuhn-best`, `<expert>@<eps>`, on games it solves). `true` means
    `["legal-random"]`, `false` none. Each one's score is shown beside the learner's: a model that
    only learned to move legally scores like legal-random, so a learning claim is one whose interval
    lies above it; an expert's shows how far there is to go."""
    pool_rounds: int = Field(3, gt=0)
    """The pooled figures beside the per-round ones (`loop`'s lines, the report): score, baselines
    and probes over the eval games of this many latest rounds, with one Wilson 95% interval."""
    games_per_task: int = Field(8, gt=0)
    """Games per Dask task; a task writes one file per table."""
    concurrency: int = Field(8, gt=0)
    """Games in flight inside one task (one batched generate per step)."""
    max_turns: int = Field(200, gt=0)
    """Safety cap on turns per game: a game that reaches it ends as a draw for everyone."""
    error_allowance: int = Field(1, ge=0)
    """Invalid moves a player may make before forfeiting (TextArena's default 1)."""
    env_sampling: Literal["uniform", "weighted"] = "uniform"
    """How each game's env is drawn from its list: uniformly, or by the envs' `weight`."""
    train_envs: list[EnvSpec] = [EnvSpec(env_id="SimpleTak-v0-train")]
    """[[round.train_envs]]: the games train games are drawn from."""
    eval_envs: list[EnvSpec] = [EnvSpec(env_id="KuhnPoker-v0-train", num_actors=1, opponents=["random"])]
    """[[round.eval_envs]]: the games eval games are drawn from."""
    opponents: OpponentConfig = OpponentConfig()
    """[round.opponents]: who fills the non-actor seats of train games."""

    @model_validator(mode="after")
    def _eval_opponents(self) -> "RoundConfig":
        # An eval env without its own opponents plays round.opponents.fixed (play/schedule.py)
        if self.eval_games and not self.opponents.fixed and any(e.opponents is None for e in self.eval_envs):
            raise ValueError("eval_envs without their own `opponents` play round.opponents.fixed, which is "
                             "empty: name the eval opponents")
        return self

    @field_validator("eval_baseline", mode="before")
    @classmethod
    def _baseline_agents(cls, v: Any) -> Any:
        if isinstance(v, bool):  # the form of job files written before agents could be named
            return [LEGAL_RANDOM_UID] if v else []
        if isinstance(v, list):
            for name in v:
                if not isinstance(name, str):
                    continue  # the list[str] check names it
                if name != LEGAL_RANDOM_UID and expert_parts(name) is None:  # ValueError for a bad eps
                    raise ValueError(f"{name!r} is no baseline agent: expected {LEGAL_RANDOM_UID!r} or an expert "
                                     f"({', '.join(repr(e) for e in EXPERT_UIDS)}, or '<expert>@<eps>')")
            if len(set(v)) < len(v):
                raise ValueError("names an agent twice; each replays the eval games once")
        return v

    @model_validator(mode="after")
    def _games_cap(self) -> "RoundConfig":
        total = self.train_games + self.eval_games * (1 + len(self.eval_baseline))
        if total > MAX_GAMES_PER_ROUND:
            what = ("train_games + eval_games x (1 + baseline agents)" if self.eval_baseline
                    else "train_games + eval_games")
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
    """The OpenAI-compatible API's base URL, e.g. `https://openrouter.ai/api/v1`."""
    model: str = Field(min_length=1)
    """The served model id; also the seats' model_uid in the lake (endpoints with the same model
    share one rating)."""
    api_key_env: Optional[str] = None
    """The environment variable that holds the API key on the workers (its name, never the key);
    unset: no key (a local server)."""
    max_concurrency: int = Field(8, gt=0)
    """Requests in flight to this endpoint per worker process."""
    timeout: float = Field(60.0, gt=0.0)
    """Seconds per attempt (the openai client's timeout)."""
    max_retries: int = Field(3, ge=0)
    """The openai client's retries, with backoff, on 408/409/429/5xx, timeouts and dropped connections."""
    temperature: Optional[float] = Field(None, ge=0.0)
    """Sampling temperature; unset: [model].temperature, so the endpoint plays under the learner's settings."""
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    """Nucleus sampling; unset: [model].top_p."""
    max_tokens: Optional[int] = Field(None, gt=0)
    """Most tokens per answer; unset: [model].max_new_tokens."""
    extra_body: dict[str, Any] = {}
    """Merged into every request body (e.g. OpenRouter's `provider = { sort = "throughput" }`)."""

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
