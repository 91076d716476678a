"""A job's settings: one TOML file describes a run, and every default lives here, in these models.

jobfile.py reads a file into them (`load_job(path)`; `default_job()` is the embedded default:
CPU, builtin tiny model, LocalCluster, ./lake, ./reports) and checks what spans several keys.
Errors a user can fix raise `JobError` with one sentence naming the file, the key, the bad value
and what was expected.

One module per table of the job file (base.py: what they all share); every name is importable
from here.
"""
from __future__ import annotations

import hashlib
import json
import re

from pydantic import Field, SerializeAsAny, field_validator

from unstable_dask.config.base import (
    BASE_UID,
    CHECKPOINT_UID,
    EXPERT_UIDS,
    LEGAL_RANDOM_UID,
    MAX_BOOTSTRAP,
    MAX_EPOCHS,
    MAX_GAMES_PER_ROUND,
    MAX_INT,
    MAX_MODEL_LEN,
    MAX_RATING_SCALE,
    MAX_UPDATES,
    MAX_WORKERS,
    MIN_PROMPT_TOKENS,
    MIN_TEMPERATURE,
    NAME,
    RANDOM_UID,
    Strict,
    expert_parts,
    reserved_uid,
)
from unstable_dask.config.league import (
    KIND_PREFIXES,
    SELECTOR,
    EntrantSpec,
    LeagueConfig,
    LeagueGame,
    RatingsConfig,
    covers,
    entrant_spec,
)
from unstable_dask.config.learn import LearnConfig
from unstable_dask.config.model import LoraConfig, ModelConfig, VllmConfig
from unstable_dask.config.round import EndpointConfig, EnvSpec, OpponentConfig, OpponentStrategy, RoundConfig
from unstable_dask.config.run import ClusterConfig, ClusterKind, RunConfig

__all__ = ["BASE_UID", "CHECKPOINT_UID", "EXPERT_UIDS", "KIND_PREFIXES", "LEGAL_RANDOM_UID", "MAX_BOOTSTRAP", "MAX_EPOCHS",
           "MAX_GAMES_PER_ROUND", "MAX_INT", "MAX_MODEL_LEN", "MAX_RATING_SCALE", "MAX_UPDATES", "MAX_WORKERS",
           "MIN_PROMPT_TOKENS", "MIN_TEMPERATURE", "NAME", "RANDOM_UID", "SELECTOR", "ClusterConfig", "ClusterKind",
           "EndpointConfig", "EntrantSpec", "EnvSpec", "Job", "LearnConfig", "LeagueConfig", "LeagueGame", "LoraConfig",
           "ModelConfig", "OpponentConfig", "OpponentStrategy", "RatingsConfig", "RoundConfig", "RunConfig", "Strict",
           "VllmConfig", "covers", "entrant_spec", "expert_parts", "reserved_uid"]


class Job(Strict):
    run: RunConfig = RunConfig()
    """[run]: the run's name, and where its lake and reports live."""
    model: ModelConfig = ModelConfig()
    """[model]: the base model, its engine and sampling."""
    cluster: ClusterConfig = ClusterConfig()
    """[cluster]: what the Dask workers run on."""
    round: RoundConfig = RoundConfig()
    """[round]: the games a round plays and who sits in the seats."""
    # The chosen algorithm's subclass of LearnConfig (jobfile.py picks it by learn.algorithm), kept
    # whole when the job is dumped (SerializeAsAny), so the lake's copy of the job has every setting.
    learn: SerializeAsAny[LearnConfig]
    """[learn]: the learner; `algorithm` chooses the algorithm, whose own keys join the shared ones."""
    ratings: RatingsConfig = RatingsConfig()
    """[ratings]: how games become ratings (TrueSkill per game, Bradley-Terry with intervals)."""
    endpoints: dict[str, EndpointConfig] = {}
    """[endpoints.<name>]: OpenAI-compatible chat endpoints that play opponent seats under that name."""
    league: LeagueConfig = LeagueConfig()
    """[league]: entrants ranked against each other by seat-balanced duplicate games."""
    source: str = Field("<default>", exclude=True)
    """Where the job came from (a path or "<default>"), for messages; not a key of the file."""

    @field_validator("endpoints")
    @classmethod
    def _endpoint_names(cls, v: dict[str, EndpointConfig]) -> dict[str, EndpointConfig]:
        for name in v:
            if not re.fullmatch(NAME, name) or reserved_uid(name):
                raise ValueError(f"endpoint name {name!r}: expected letters, digits, '_', '.', '-', and not "
                                 f"'base', 'random', an expert's name ({', '.join(EXPERT_UIDS)}) or a checkpoint uid (ckpt-<k>)")
        return v

    @property
    def league_name(self) -> str:
        """The run a league's games are written under."""
        return self.league.name or f"{self.run.name}-league"

    def named_opponents(self) -> list[tuple[str, str]]:
        """(key, name) of every opponent the round settings name: the fixed list, then each env's."""
        lists = [("round.opponents.fixed", self.round.opponents.fixed)]
        for split in ("train", "eval"):
            lists += [(f"round.{split}_envs[{i}].opponents", e.opponents or [])
                      for i, e in enumerate(getattr(self.round, f"{split}_envs"))]
        return [(f"{key}[{j}]", name) for key, names in lists for j, name in enumerate(names)]

    def opponent_error(self, key: str, name: str) -> str:
        """The one message for an opponent name a round cannot seat (at load and when a round starts)."""
        declared = ", ".join(repr(n) for n in self.endpoints) or "none declared"
        return (f"{self.source}: key '{key}' names opponent {name!r}: expected 'random', 'base', an expert "
                f"({', '.join(repr(e) for e in EXPERT_UIDS)}, or '<expert>@<eps>'), an endpoint "
                f"of [endpoints] ({declared}), a checkpoint uid of run {self.run.name!r} (ckpt-<k>), "
                f"or a LoRA adapter directory")

    def fingerprint(self) -> str:
        """A short hash of the validated job, stored with every round commit."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
