"""[ratings] and [league]: how matches become ratings, and which entrants a league ranks."""
from __future__ import annotations

import re
from typing import Literal, NamedTuple, Optional, Union

from pydantic import Field, field_validator

from unstable_dask.config.base import BASE_UID, MAX_BOOTSTRAP, MAX_RATING_SCALE, NAME, RANDOM_UID, Strict, expert_parts


class RatingsConfig(Strict):
    mu: float = Field(25.0, ge=-MAX_RATING_SCALE, le=MAX_RATING_SCALE)
    """TrueSkill: a new model's prior mean skill."""
    sigma: float = Field(25.0 / 3.0, gt=0.0, le=MAX_RATING_SCALE)
    """TrueSkill: a new model's prior standard deviation."""
    beta: float = Field(4.0, gt=0.0, le=MAX_RATING_SCALE)
    """TrueSkill: the performance noise of one game (a skill gap of beta wins about 76% of games)."""
    tau: float = Field(25.0 / 300.0, ge=0.0, le=MAX_RATING_SCALE)
    """TrueSkill: dynamics, added (in quadrature) to a model's sigma before each game, so its skill
    can keep moving."""
    draw_probability: float = Field(0.10, ge=0.0, lt=1.0)
    """TrueSkill: the assumed share of drawn games between equal models."""
    inherit_sigma_factor: float = Field(2.0, ge=1.0)
    """A new checkpoint starts at its parent's mu and sigma times this factor (capped at `sigma`)."""
    bootstrap: int = Field(200, ge=0, le=MAX_BOOTSTRAP)
    """Bradley-Terry bootstrap resamples for the 95% intervals (0: no intervals; a league needs them)."""
    include_eval: bool = True
    """Eval games against fixed opponents update the ratings too (a league's games always do)."""


# League entrants (league.entrants): the forms a spec may take. Only the form is checked when a
# job loads; a run's checkpoints are looked up in the lake when the league starts (play/league.py).
SELECTOR = re.compile(r"ckpt-\d+|\*|every-[1-9]\d*")  # one checkpoint, all, or every k-th iteration
_RUN_SELECTOR = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.-]*):(.+)")
KIND_PREFIXES = ("base:", "endpoint:", "adapter:")  # league uids of entrants that are not a run's checkpoint


class EntrantSpec(NamedTuple):
    kind: Literal["random", "expert", "base", "checkpoints", "name"]
    run: Optional[str] = None  # checkpoints: the run (None: the job's own run)
    value: Optional[str] = None  # base: the model (None: [model].base); checkpoints: the selector; name: itself

    @property
    def single(self) -> bool:
        """Names one entrant (not `*` or `every-<k>`)."""
        return self.kind != "checkpoints" or (self.value or "").startswith("ckpt-")


def entrant_spec(spec: str) -> EntrantSpec:
    """What a league entrant spec names: `random`; an expert agent (`minimax`, `minimax@0.3`); `base` or `base:<model>` (a base model, no adapter);
    `<run>:<selector>` or `<selector>` (checkpoints of a run, or of this job's run; selector `ckpt-<k>`,
    `*`, `every-<k>`); else a name: an endpoint of [endpoints] or a LoRA adapter directory."""
    if spec == RANDOM_UID:
        return EntrantSpec("random")
    if expert_parts(spec) is not None:  # ValueError for a bad eps
        return EntrantSpec("expert", None, spec)
    if spec == BASE_UID or spec.startswith("base:"):
        model = spec.removeprefix("base").removeprefix(":") or None
        if spec != BASE_UID and model is None:
            raise ValueError("'base:' names no model (e.g. 'base:builtin:smollm2-135m-instruct')")
        return EntrantSpec("base", None, model)
    if SELECTOR.fullmatch(spec):
        return EntrantSpec("checkpoints", None, spec)
    m = _RUN_SELECTOR.fullmatch(spec)
    if m is None:
        return EntrantSpec("name", None, spec)
    run, selector = m.groups()
    if not SELECTOR.fullmatch(selector):
        raise ValueError(f"{spec!r}: {selector!r} selects no checkpoints of run {run!r}; expected ckpt-<k>, * or every-<k>")
    if f"{run}:" in KIND_PREFIXES:
        raise ValueError(f"{spec!r}: a run named {run!r} cannot enter a league (its uids would read as an {run}'s)")
    return EntrantSpec("checkpoints", run, selector)


def covers(specs: list[EntrantSpec], one: EntrantSpec, run_name: str, base: str) -> bool:
    """Whether `one` (a single entrant) is among the entrants `specs` name, without reading the lake:
    listed itself, or a checkpoint whose run's `*` or `every-<k>` is listed."""
    def norm(s: EntrantSpec) -> EntrantSpec:
        return s._replace(run=s.run or run_name) if s.kind == "checkpoints" else s._replace(value=s.value or base) \
            if s.kind == "base" else s
    one = norm(one)
    k = int((one.value or "-0").rsplit("-", 1)[1]) if one.kind == "checkpoints" else 0
    return any(s == one or (s.kind == one.kind == "checkpoints" and s.run == one.run and s.value is not None and
                            (s.value == "*" or (s.value.startswith("every-") and k % int(s.value[6:]) == 0)))
               for s in map(norm, specs))


class LeagueGame(Strict):
    env_id: str
    """A registered TextArena env id."""
    num_players: int = Field(2, ge=2)
    """Seats in the game: a pairing needs two sides; more than 2 rotates the two through the seats."""
    template: Optional[str] = None
    """The prompt template in this game; unset: [model].template."""


class LeagueConfig(Strict):
    """[league]: entrants ranked against each other by seat-balanced duplicate games (play/league.py)."""
    name: Optional[str] = Field(None, pattern=NAME)
    """The run the league's games and ratings are written under (split `league`); default `<run.name>-league`."""
    entrants: list[str] = ["*", "base", "random"]
    """`random`; an expert agent (`minimax`, `kuhn-best`, `<expert>@<eps>`); `base` or `base:<model>` (a base model with no adapter: an HF id, a folder, builtin:...);
    `<run>:ckpt-<k>`, `<run>:*`, `<run>:every-<k>` (checkpoints of any run in the lake; without `<run>:`
    the job's own run); an endpoint of [endpoints]; a LoRA adapter directory."""
    games: list[LeagueGame] = []
    """The games every pairing plays (env ids with settings); empty: the env ids of round.train_envs."""
    deals_per_pair: int = Field(2, gt=0)
    """Duplicate deals a pairing plays each time it is chosen, per game; a deal (one env seed) is played
    once per seat rotation: 2 games in a 2-player game, every seat taken by each side in turn."""
    anchor: str = RANDOM_UID
    """The entrant whose rating is fixed at `anchor_rating`, so ratings compare across leagues."""
    anchor_rating: float = 1000.0
    """The anchor's rating, on the Bradley-Terry Elo scale (400 points: 10:1 odds)."""
    first_pass: list[str] = []
    """Entrants every entrant plays first (a few anchors spread over the field); empty: [anchor]."""
    pairing: Literal["adaptive", "round-robin"] = "adaptive"
    """adaptive: after the first pass, only adjacent pairs of the ranking not yet separated, where a game
    says most; round-robin: every pair, every pass (the baseline adaptive pairing is measured against)."""
    pairs_per_pass: Optional[int] = Field(None, gt=0)
    """Most pairings a pass plays (the most informative first); unset: every unseparated adjacent pair."""
    confidence: float = Field(0.95, gt=0.5, lt=1.0)
    """Adjacent entrants are separated when the bootstrap puts the higher one above in this share of
    resamples; also the level of the rating intervals. The league stops when every adjacent pair is."""
    budget_per_entrant: int = Field(100, gt=0)
    """The game budget: the league plays at most this many games times its number of entrants, in all (the
    games already in the lake count), so extending a league, or `loop` adding checkpoints, makes room for them."""
    seed: int = 0
    """Deal seeds and the bootstrap derive from it: the schedule is a function of (lake, [league], seed)."""
    every: int = Field(0, ge=0)
    """`loop` runs the league after every k-th learner iteration (0: never), so a run gets a strength curve."""

    @field_validator("entrants")
    @classmethod
    def _entrants(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("a league needs entrants")
        for spec in v:
            entrant_spec(spec)
        twice = sorted({s for s in v if v.count(s) > 1})
        if twice:
            raise ValueError(f"{twice[0]!r} is listed twice")
        return v

    @field_validator("anchor", "first_pass")
    @classmethod
    def _single(cls, v: Union[str, list[str]]) -> Union[str, list[str]]:
        for spec in [v] if isinstance(v, str) else v:
            if not entrant_spec(spec).single:
                raise ValueError(f"{spec!r} names several entrants; expected one (e.g. 'random', 'run:ckpt-3')")
        return v
