"""The learning algorithms: the one list of them, and what each algorithm file declares.

Adding an algorithm is one file plus one line in ALGORITHMS. The file reads top to bottom, cleanrl
style: its math in the module docstring, then

    SPEC = Spec(...)            what the learn job must give it (sampled unit, behaviour
                                log-probs, a critic, groups)
    class Config(LearnConfig)   its `[learn]` settings: the shared ones (config.LearnConfig) plus its
                                own, each with its default and a docstring, and its default reward
                                transforms; `algorithm` is a Literal of its name
    def update(models, batch, args: Config, device) -> dict
                                one update on one sampled batch; returns its metrics, numbers
                                by name: learner_steps' own columns where one has the name, the
                                rest (the algorithm's own: A2C's value_loss, GRPO's clip_frac)
                                in its `metrics` map, so a new metric needs no schema edit

jobfile.py validates a job's `[learn]` table with the Config of the algorithm it names, so a key
that algorithm does not have is refused. Algorithm files import torch inside their functions,
never at module level: loading a job reads their Config and must not import torch (seconds).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from unstable_dask.config import LearnConfig
    from unstable_dask.learn.passes import Mismatch
    from unstable_dask.learn.tokens import Tokens

# name -> module. The one registration of an algorithm.
ALGORITHMS = {
    "reinforce": "unstable_dask.learn.algorithms.reinforce",
    "a2c": "unstable_dask.learn.algorithms.a2c",
    "grpo": "unstable_dask.learn.algorithms.grpo",
    "gspo": "unstable_dask.learn.algorithms.gspo",
    "sft": "unstable_dask.learn.algorithms.sft",
}


@dataclass(frozen=True)
class Spec:
    """What an algorithm needs from the learn job."""
    # What the batch query samples whole: "turn" (single turns), "seat" (all turns of one seat of a
    # game, in order: GAE needs them) or "group" (all turns of the G attempts of one (group_id, pid)).
    unit: str
    # "rewards": sampling transforms run in the batch query, on the rewards; "advantages": the
    # update applies them to the advantages it computes itself (Batch.transform, e.g. A2C's GAE).
    sampling_on: str = "rewards"
    behaviour_logprobs: bool = False  # update reads Batch.behaviour, the engine's log-probs (importance weights)
    critic: bool = False  # the trainer builds a value model (Models.critic)
    needs_groups: bool = False  # round.group_size >= 2 (group-relative advantages)
    # Where the rows come from. "played": the learner's own turns as the engine generated them, through
    # the job's reward transforms (rewards.batch_query), with the guards of played rows: exact token
    # ids, served weights, max_staleness. "selected": any turns the job's `learn.select` SELECT picks
    # (an expert's), their observation and action rendered in the learner's template and tokenized as
    # the engine would (learn/selection.py): no engine made them, so those guards do not apply (SFT).
    rows: str = "played"


class Models(Protocol):
    """The trainable state an update works on (the Trainer)."""
    policy: "torch.nn.Module"  # peft model: disable_adapter() gives the frozen base
    optimizer: "torch.optim.Optimizer"
    critic: Optional["torch.nn.Module"]  # Spec.critic: a ModuleDict(body=backbone + LoRA, head=Linear)
    critic_optimizer: Optional["torch.optim.Optimizer"]


@dataclass
class Batch:
    """One sampled batch as every update sees it (rows in the batch query's order)."""
    tokens: "Tokens"
    advantages: "torch.Tensor"  # [B] float64: the query's `advantage` column
    temperature: list[float]  # the sampling settings each row was generated with (its round's)
    top_p: list[float]
    behaviour: "torch.Tensor"  # [B, T-1] the engine's log-probs, aligned like the learner's (passes.py)
    known: "torch.Tensor"  # [B] bool: `behaviour` holds the row's log-probs (else its IS weight is 1)
    seats: list[tuple]  # (round, game_id, pid) per row
    turns: list[int]
    final_reward: list[float]  # the seat's final reward after the final transforms
    step_reward: list[float]  # the turn's reward after the step transforms
    seed: int = 0  # the batch seed: rows are shuffled into optimizer steps with it
    # pi_b against pi_old, token by token; the importance weights (learn.is_mode, learn.is_cap)
    mismatch: "Mismatch" = field(default_factory=lambda: _mismatch("truncate", 2.0))
    # [B] bool: rows played by the weights the learner started from (the parent checkpoint), on the
    # first update of an iteration only: their pi_old / pi_b gap can only be numerics, so a large one
    # stops the job (learn.max_logp_gap); None: no such check (later updates: the policy has moved).
    fresh: Optional["torch.Tensor"] = None
    # Spec.sampling_on == "advantages": the job's sampling transforms, on per-row values.
    transform: Callable[[Sequence[float]], list[float]] = list

    @property
    def size(self) -> int:
        return len(self.turns)


    def fresh_rows(self, rows: list[int]) -> Optional["torch.Tensor"]:
        """`fresh` for a micro-batch's rows (what Mismatch.weights takes)."""
        return None if self.fresh is None else self.fresh[rows]


def _mismatch(mode: str, cap: float) -> "Mismatch":
    from unstable_dask.learn.passes import Mismatch
    return Mismatch(mode, cap)


def module(name: str) -> ModuleType:
    return importlib.import_module(ALGORITHMS[name])


def spec(name: str) -> Spec:
    return module(name).SPEC


def config_class(name: str) -> "type[LearnConfig]":
    """The `[learn]` settings class of an algorithm."""
    return module(name).Config


def owners(key: str) -> list[str]:
    """The algorithms whose settings include `key` (for the message when another one is chosen)."""
    return [n for n in ALGORITHMS if key in config_class(n).model_fields]
