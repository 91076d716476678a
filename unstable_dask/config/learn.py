"""[learn]: the settings every algorithm has (each algorithm adds its own in its file)."""
from __future__ import annotations

import math
from typing import Literal, Optional, Union

from pydantic import Field, ValidationInfo, field_validator, model_validator

from unstable_dask.config.base import MAX_UPDATES, Strict


class LearnConfig(Strict):
    """[learn]: the settings every algorithm has.

    Each algorithm declares its own settings (and its default reward transforms) in a subclass in
    its file, `learn/algorithms/<name>.py`; jobfile.py validates `[learn]` with the subclass that
    `algorithm` names, so a key the chosen algorithm does not have is an error, not ignored.
    """
    algorithm: str = "reinforce"
    """The learning algorithm, a name of learn/algorithms' ALGORITHMS; its own keys join these."""
    batch_size: int = Field(32, gt=0)
    """Rows (learner turns) per sampled batch; GRPO/GSPO and A2C take whole groups / seats up to it."""
    mini_batch_size: int = Field(8, gt=0)
    """Micro-batch: rows per forward/backward pass; gradients accumulate over the batch."""
    lr: float = Field(1e-5, gt=0.0, le=1.0)
    """AdamW learning rate of the LoRA adapter (at most 1: a larger step diverges at once)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """How lr moves over the run's updates, counted along the checkpoint lineage (a resumed learner
    continues the count of its parent): constant; or from lr at the first update down to lr_end at
    update lr_decay_updates, on a line or a half cosine, and lr_end after it. The step actually taken
    is learner_steps.lr. A2C's critic keeps critic_lr."""
    lr_end: float = Field(0.0, ge=0.0)
    """The learning rate a decaying lr_schedule ends at (at most lr)."""
    lr_decay_updates: int = Field(1000, gt=0)
    """Updates of the run (learn.updates_per_round per iteration, all iterations so far) over which a
    decaying lr_schedule goes from lr to lr_end."""
    grad_clip: float = Field(0.2, gt=0.0)
    """Clip of the gradient's global norm before each optimizer step (UnstableBaselines: 0.2)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Weight of the policy's entropy bonus (verl's entropy_coeff): the loss minus entropy_coef times
    the entropy (nats) of the sampling distribution (temperature, top-p) at the completion tokens,
    aggregated as the policy loss is: a brake on the policy's collapse onto the moves it samples
    most. It acts on every token, not on moves: on the Kuhn job 0.05 spread probability onto text
    that is not a move and did not bring back a dropped move (BENCHMARKS.md). 0: off, as in UB."""
    max_train_len: Optional[int] = Field(None, gt=0)
    """Truncate prompt + completion to this many tokens (prompt first, from the left); unset: no cut."""
    mask_after_action: bool = False
    """Train only on a completion's tokens up to its move: the tokens after the one that completes
    it (the `}` of the `\\boxed{}` the round read the move from, else the `]` of the first move by the
    env's own rule, e.g. TicTacToe's first `[digit]`, which the env reads) get no gradient and count in no normaliser. They carry the move's
    advantage but not the move: noise in its gradient (a move-only answer "[4]" then 35 tokens of
    text). A completion with no move keeps all its tokens (what the invalid-move penalty acts on).
    model.stop = ["]"] cuts at play time instead. Off: every completion token is trained on."""
    window: Union[Literal["latest", "all"], int] = "latest"
    """Rounds a batch is sampled from: the newest (on-policy), all, or the last k (an integer >= 1)."""
    updates_per_round: int = Field(1, gt=0, le=MAX_UPDATES)
    """Sampled batches (updates) per learner iteration, each with its own seed."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass: measured on CPU (SmolLM2, ~430-token rows,
    micro-batches of 8), 0.31x the update's peak memory at 0.70x the speed (BENCHMARKS.md)."""
    share_prefix: bool = True
    """Without gradient checkpointing: forward the tokens every row of a micro-batch starts with once
    and let each row attend to their keys and values (gradient flows through them), and order a
    step's rows by content when that computes fewer positions than ordering them by length (turns of
    one seat share their rules text). The loss is the same up to float rounding. Ignored under
    gradient checkpointing, where transformers drops the key/value cache."""
    resident: Literal["auto", "always", "never"] = "auto"
    """Keep the learner's model (the frozen base in its LoRA layers) and tokenizer loaded in its process
    between iterations, loading only the parent adapter's weights into it (learn/resident.py): auto
    keeps it on CPU and on a GPU, beside a resident engine only when it fits in half of what the
    engine's gpu_memory_utilization leaves free; never builds it every iteration."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the update runs; auto: a GPU worker of the cluster, or this machine's GPU, else CPU."""
    devices: int = Field(1, gt=0)
    """Data-parallel ranks of an update: > 1 runs it on that many Dask workers (one GPU each on a GPU
    cluster; torch.distributed, NCCL on CUDA, gloo on CPU), gradients summed over them, rank 0
    commits; the same adapter as one process up to float summation order (learn/distributed.py)."""
    collective_timeout_s: float = Field(600.0, gt=0)
    """With learn.devices > 1: how long a rank waits at the rendezvous or a collective for a silent
    peer before the update fails (a peer whose worker died fails it at once)."""
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
    # Declared after `device`, which its check reads.
    quantization: Literal["none", "4bit", "8bit"] = "none"
    """QLoRA: the frozen base in 4 bit (NF4) or 8 bit through bitsandbytes, CUDA only; the adapter
    stays standard peft LoRA (served on the unquantized base)."""
    final_transforms: list[str] = []
    """Reward transforms once per game and learner seat (names with arguments, or one SELECT over
    `final`); each algorithm's class sets its default."""
    step_transforms: list[str] = ["RewardForFormat(1.5)", "PenaltyForInvalidMove(1.0, -1.0)"]
    """Reward transforms once per turn (names, or one SELECT over `steps`): UnstableBaselines' defaults."""
    sampling_transforms: list[str] = []
    """Reward transforms over the sampled batch (names, or one SELECT over `batch`); each
    algorithm's class sets its default."""

    def silent_rows_have_gradient(self) -> bool:
        """Whether a row whose advantage is 0 still gives its loss a gradient (an entropy bonus or a
        KL penalty does). The trainer then keeps groups whose advantages are all 0 beside groups
        with signal (those terms join the step); a batch with no signal at all makes no step either
        way (trainer.drop_silent_groups)."""
        return self.entropy_coef > 0

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
        if self.lr_schedule != "constant" and self.lr_end > self.lr:
            raise ValueError(f"lr_end ({self.lr_end:g}) must be <= lr ({self.lr:g}): a schedule decays")
        return self

    def shares_prefix(self) -> bool:
        """Whether the update computes a micro-batch's shared prefix once (learn.share_prefix)."""
        return self.share_prefix and not self.gradient_checkpointing

    def lr_at(self, update: int) -> float:
        """The learning rate of the run's update number `update` (0: its first) under lr_schedule."""
        if self.lr_schedule == "constant":
            return self.lr
        frac = min(update / self.lr_decay_updates, 1.0)
        shape = 1.0 - frac if self.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.lr_end + (self.lr - self.lr_end) * shape

    @field_validator("window")
    @classmethod
    def _window(cls, v: Union[str, int]) -> Union[str, int]:
        if isinstance(v, int) and v <= 0:
            raise ValueError("expected 'latest', 'all' or a positive number of rounds")
        return v
