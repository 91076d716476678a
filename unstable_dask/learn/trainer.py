"""The learner's model state: base model + LoRA policy (+ a critic), optimizers, save/load, and
the step that turns a batch query's rows into an algorithm's update (algorithms.py).

A checkpoint directory is a standard peft adapter (adapter_config.json + adapter_model.safetensors,
loadable by PeftModel.from_pretrained and vLLM's LoRARequest) plus what resuming exactly needs:
optimizer.pt (AdamW state), trainer_state.json, and when the algorithm has a critic (A2C) critic/
(its adapter, value_head.pt, critic_optimizer.pt). Precision (learn.dtype, compute_dtype): bf16
autocast on CUDA and on CPUs with native bf16 matmuls, attention then in fp32 on a CPU
(fp32_attention), else fp32; LoRA weights stay fp32; with learn.quantization a 4/8-bit bitsandbytes
base (QLoRA). The adapter files are the same either way.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional, cast

import pyarrow as pa
import torch

from unstable_dask.config import Job
from unstable_dask.errors import JobError
from unstable_dask.learn import algorithms, distributed, resident, selection
from unstable_dask.learn.passes import Mismatch
from unstable_dask.learn.rewards import transform_values
from unstable_dask.learn.tokens import behaviour_logprobs, prompt_ids, through_action, tokenize
from unstable_dask.learn.transforms import Z_EPS, parse_transforms
from unstable_dask.play.prompts import prompt_answer_prefix


def model_dtype(job: Job, device: torch.device) -> torch.dtype:
    name = job.model.dtype
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def lora_config(job: Job, task_type: str):
    from peft import LoraConfig
    lc = job.model.lora
    return LoraConfig(r=lc.rank, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                      target_modules=list(lc.target_modules), task_type=task_type)


def _quantized(cls, path: str, job: Job, device: torch.device):
    """QLoRA's frozen base: 4-bit NF4 (double-quantized, bf16 compute) or 8-bit, through bitsandbytes."""
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig
    compute = model_dtype(job, device)
    bnb = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute)
           if job.learn.quantization == "4bit" else BitsAndBytesConfig(load_in_8bit=True))
    # A bitsandbytes model cannot be moved once loaded: it is placed on this GPU while loading.
    gpu = device.index if device.index is not None else torch.cuda.current_device()
    model = cls.from_pretrained(path, dtype=compute, quantization_config=bnb, device_map={"": gpu})
    # Freezes the base and upcasts the remaining half-precision weights (norms, head) to fp32, as
    # QLoRA trains; gradient checkpointing is switched on by _backbone like for any base.
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def _backbone(cls, path: str, job: Job, device: torch.device):
    if job.learn.quantization == "none":
        model = cls.from_pretrained(path, dtype=model_dtype(job, device)).to(device)
    else:
        model = _quantized(cls, path, job, device)
    model.config.use_cache = False  # training: no KV cache (and required by gradient checkpointing)
    if job.learn.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _adamw(params, lr: float, job: Job) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, weight_decay=job.learn.weight_decay)


class Trainer:
    def __init__(self, job: Job, parent_adapter: Optional[str], device: torch.device):
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

        from unstable_dask.cluster.client import driver_threads
        from unstable_dask.inference.weights import resolve_model
        self.job, self.cfg, self.device = job, job.learn, device
        if device.type == "cpu":  # not the thread count a local cluster's nannies left in os.environ
            torch.set_num_threads(driver_threads())
        path = resolve_model(job.model.base)
        keep = self.cfg.resident != "never"
        self.tokenizer = resident.tokenizer(path, lambda: AutoTokenizer.from_pretrained(path), keep)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id
        if parent_adapter:
            check_lora_shape(job, Path(parent_adapter))
        torch.manual_seed(job.run.seed)  # a fresh LoRA init (A ~ kaiming, B = 0)
        self._models: list[tuple[tuple, Any]] = []  # (resident key, LoRA-wrapped model): what release() hands back
        self.policy = self._adapted(AutoModelForCausalLM, "CAUSAL_LM", path, parent_adapter)
        self.dtype = compute_dtype(self.cfg.dtype, device, self.policy.config.hidden_size)
        if device.type == "cpu" and self.dtype == torch.bfloat16:
            fp32_attention(self.policy)
        self.optimizer = _adamw(self.policy.parameters(), self.cfg.lr, job)
        self.updates = 0
        if parent_adapter and (Path(parent_adapter) / "optimizer.pt").is_file():
            self.optimizer.load_state_dict(torch.load(Path(parent_adapter) / "optimizer.pt", map_location=device))
            _apply_settings(self.optimizer, self.cfg.lr, self.cfg.weight_decay)  # the job's, not the parent's
            state = Path(parent_adapter) / "trainer_state.json"
            self.updates = json.loads(state.read_text())["updates"] if state.is_file() else 0
        self.algorithm = algorithms.module(self.cfg.algorithm)
        self.spec: algorithms.Spec = self.algorithm.SPEC
        if not isinstance(self.cfg, self.algorithm.Config):
            raise TypeError(f"job.learn is a {type(self.cfg).__name__}, not {self.cfg.algorithm}'s Config: "
                            "load jobs with jobfile.load_job / validate_job")
        self.sampling = (parse_transforms(self.cfg.sampling_transforms, "sampling")
                         if self.spec.sampling_on == "advantages" else [])
        self.critic = self.critic_optimizer = None
        if self.spec.critic:
            cdir = Path(parent_adapter) / "critic" if parent_adapter else None
            saved = cdir is not None and (cdir / "adapter_config.json").is_file()
            body = self._adapted(AutoModel, "FEATURE_EXTRACTION", path, str(cdir) if saved else None)
            head = torch.nn.Linear(self.policy.config.hidden_size, 1)
            torch.nn.init.zeros_(head.weight)  # V = 0 at start: the first advantages are the returns
            torch.nn.init.zeros_(head.bias)
            if cdir is not None and (cdir / "value_head.pt").is_file():
                head.load_state_dict(torch.load(cdir / "value_head.pt", map_location="cpu"))
            self.critic = torch.nn.ModuleDict({"body": body, "head": head}).to(device)
            if device.type == "cpu" and self.dtype == torch.bfloat16:
                fp32_attention(body)
            self.critic_optimizer = _adamw(self.critic.parameters(), cast(Any, self.cfg).critic_lr, job)
            if cdir is not None and (cdir / "critic_optimizer.pt").is_file():
                self.critic_optimizer.load_state_dict(torch.load(cdir / "critic_optimizer.pt", map_location=device))
                _apply_settings(self.critic_optimizer, cast(Any, self.cfg).critic_lr, self.cfg.weight_decay)
        torch.manual_seed(job.run.seed + self.updates)  # LoRA dropout's stream, whichever way the models came

    def _adapted(self, cls, task: str, path: str, adapter: Optional[str]) -> Any:
        """The frozen base wrapped in LoRA: with `adapter`'s weights, else freshly initialised. A
        model this process kept from its last iteration (learn.resident) takes the adapter's weights
        in place: no base load, no LoRA layers built again (tests/learn/test_learn.py: the same
        adapter files as loading both each time)."""
        from peft import PeftModel, get_peft_model
        from peft.utils import load_peft_weights, set_peft_model_state_dict
        key = (cls.__name__, path, str(self.device), self.job.model.dtype, self.cfg.quantization,
               self.cfg.gradient_checkpointing, repr(self.job.model.lora))
        model = resident.take(key, self.cfg.resident != "never") if adapter else None
        if adapter and model is not None:
            loaded: Any = set_peft_model_state_dict(model, load_peft_weights(adapter, device=str(self.device)))
            missing = [k for k in loaded.missing_keys if "lora_" in k]
            if loaded.unexpected_keys or missing:  # check_lora_shape passed: a bug, not a user's error
                raise RuntimeError(f"adapter {adapter} does not fit the kept LoRA layers: unexpected "
                                   f"{loaded.unexpected_keys[:3]}, missing {missing[:3]}")
            model.eval()  # as from_pretrained leaves a model; the algorithms switch to train themselves
        elif adapter:
            model = PeftModel.from_pretrained(_backbone(cls, path, self.job, self.device), adapter, is_trainable=True)
        else:
            model = get_peft_model(_backbone(cls, path, self.job, self.device), lora_config(self.job, task))
        self._models.append((key, model))
        return model

    def release(self, engine_memory_share: Optional[float] = None) -> None:
        """After the iteration's updates: hand the LoRA-wrapped models back to the process's
        resident set, where learn.resident allows (`engine_memory_share`: the gpu_memory_utilization
        of an engine resident on this GPU); the next Trainer loads its parent's weights into them.
        The Trainer is done after it."""
        for key, model in self._models:
            if resident.fits(self.cfg.resident, self.device, model, engine_memory_share):
                for p in model.parameters():
                    p.grad = None
                resident.give_back(key, model)
        self._models = []

    def batch(self, table: pa.Table, seed: int = 0, guard_uid: Optional[str] = None) -> algorithms.Batch:
        """The tensors an update needs from the batch query's rows: exact ids, advantages, settings."""
        col = lambda name: table.column(name).to_pylist()  # noqa: E731
        if self.spec.rows == "selected":
            return self.selected_batch(table, seed)
        where = [f"turn {t} of game {g} (round {r})" for r, g, t in zip(col("round"), col("game_id"), col("turn"))]
        prompts = prompt_ids(self.tokenizer, col("prompt"), col("prompt_tokens"), where)
        completions, logprobs = col("completion_token_ids"), col("logprobs")
        if self.cfg.mask_after_action:
            completions, logprobs = through_action(self.tokenizer, completions, logprobs,
                                                   [prompt_answer_prefix(p or "") for p in col("prompt")],
                                                   col("env_id"))
        tokens = tokenize(prompts, completions, self.cfg.max_train_len, self.pad_id)
        behaviour, known = behaviour_logprobs(tokens, logprobs)
        return algorithms.Batch(
            tokens=tokens, advantages=torch.tensor(col("advantage"), dtype=torch.float64),
            temperature=col("temperature"), top_p=col("top_p"), behaviour=behaviour, known=known,
            seats=list(zip(col("round"), col("game_id"), col("pid"))), turns=col("turn"),
            final_reward=col("final_reward"), step_reward=col("step_reward"), seed=seed,
            mismatch=Mismatch(self.cfg.is_mode, self.cfg.is_cap),
            fresh=None if guard_uid is None else torch.tensor([u == guard_uid for u in col("model_uid")]),
            transform=lambda values: transform_values(self.sampling, table, values))

    def selected_batch(self, table: pa.Table, seed: int = 0) -> algorithms.Batch:
        """The Batch of selected turns (Spec.rows "selected", SFT): observation and action rendered in
        the learner's template and tokenized as the engine would (learn/selection.py); the model's own
        distribution (temperature 1, top-p 1), no engine log-probs, every row weighted 1."""
        col = lambda name: table.column(name).to_pylist()  # noqa: E731
        prompts, completions = selection.token_ids(self.job, table, self.tokenizer)
        if self.cfg.mask_after_action:
            completions, _ = through_action(self.tokenizer, completions, env_ids=col("env_id"))
        tokens = tokenize(prompts, completions, self.cfg.max_train_len, self.pad_id)
        n = table.num_rows
        return algorithms.Batch(
            tokens=tokens, advantages=torch.ones(n, dtype=torch.float64), temperature=[1.0] * n, top_p=[1.0] * n,
            behaviour=torch.zeros(tokens.loss_mask[:, 1:].shape), known=torch.zeros(n, dtype=torch.bool),
            seats=list(zip(col("round"), col("game_id"), col("pid"))), turns=col("turn"),
            final_reward=[0.0] * n, step_reward=[0.0] * n, seed=seed, mismatch=Mismatch(self.cfg.is_mode, self.cfg.is_cap))

    def update(self, table: pa.Table, seed: int = 0, guard_uid: Optional[str] = None) -> dict:
        """One update on a batch from the lake query (`seed`: its batch seed); returns the
        learner_steps metrics. `guard_uid`: the checkpoint whose weights the learner holds now (the
        first update of an iteration): its rows' gap to the engine's log-probs can only be numerics
        or other weights, and above learn.max_logp_gap it stops the job. Later updates' gaps include
        the policy's own move (lr x updates), so they are recorded, not judged."""
        t0 = time.perf_counter()
        for group in self.optimizer.param_groups:  # learn.lr_schedule: this update's step of the run
            group["lr"] = self.cfg.lr_at(self.updates)
        table, dropped = (drop_silent_groups(table, drop=not self.cfg.silent_rows_have_gradient())
                          if self.spec.unit == "group" else (table, {}))
        m: dict = dict(dropped, dtype=str(self.dtype).removeprefix("torch."), lr=self.optimizer.param_groups[0]["lr"],
                       samples=table.num_rows, reward_mean=_mean(table, "env_reward"),
                       step_reward_mean=_mean(table, "step_reward"))
        if table.num_rows == 0:  # every group scored alike: nothing to learn from, nothing moves
            m.update(loss=0.0, pg_loss=0.0, optimizer_steps=0, skipped_steps=0, step_time_s=time.perf_counter() - t0)
            return m
        batch = self.batch(table, seed, guard_uid)
        # cache_enabled=False: autocast caches the bf16 copy of each weight for the whole context, so
        # with several optimizer steps inside it every forward after the first would see the LoRA
        # weights as they were before the first step (the policy would never move: ppo_kl exactly 0).
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16,
                            cache_enabled=False):
            m.update(self.algorithm.update(self, batch, self.cfg, self.device))
        distributed.gather_mismatch(batch.mismatch)  # every rank's rows: the whole batch's metrics and guard
        m.update(batch.mismatch.metrics())
        gap = batch.mismatch.fresh_gap()
        if gap is not None and gap > self.cfg.max_logp_gap:
            raise JobError(f"{self.job.source}: learn.max_logp_gap: the engine's log-probs differ from the learner's by "
                           f"{gap:.3g} nats a token on average on the rows {guard_uid} played (at most "
                           f"{self.cfg.max_logp_gap:g} accepted; bf16 vs fp32 numerics give ~2e-3): the rounds were not "
                           f"played by the weights, template or tokenizer of {guard_uid} that this learner loaded")
        self.updates += 1
        tokens = batch.tokens
        lengths = tokens.attention_mask.sum(-1).float()
        elapsed = time.perf_counter() - t0
        # Advantage metrics describe what the actor trained on: the update's own when it computes
        # them (A2C's transformed GAE), else the query's.
        m.setdefault("advantage_mean", batch.advantages.mean().item())
        m.setdefault("advantage_std", batch.advantages.std(unbiased=False).item())
        m.update(tokens=int(lengths.sum()), train_tokens=int(tokens.loss_mask.sum()),
                 tokens_per_s=float(lengths.sum()) / max(elapsed, 1e-9), step_time_s=elapsed,
                 mean_train_len=lengths.mean().item(), pct_truncated=100.0 * tokens.truncated.float().mean().item())
        return m

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(str(directory))
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        if self.critic is not None:
            cdir, critic = directory / "critic", cast(Any, self.critic)  # ModuleDict(body, head)
            critic.body.save_pretrained(str(cdir))
            torch.save(critic.head.state_dict(), cdir / "value_head.pt")
            torch.save(cast(torch.optim.Optimizer, self.critic_optimizer).state_dict(), cdir / "critic_optimizer.pt")


def _apply_settings(optimizer: torch.optim.Optimizer, lr: float, weight_decay: float) -> None:
    """A resumed AdamW keeps its moments but takes this job's lr and weight decay: load_state_dict
    restores the parent's, which would silently win over a changed learn.lr."""
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = lr, weight_decay


def check_lora_shape(job: Job, adapter: Path) -> None:
    """The parent adapter's LoRA shape is the job's: peft would load the parent's and ignore model.lora."""
    saved = json.loads((adapter / "adapter_config.json").read_text())
    want = job.model.lora
    pairs = [("rank", saved.get("r"), want.rank), ("alpha", saved.get("lora_alpha"), want.alpha),
             ("target_modules", sorted(saved.get("target_modules") or []), sorted(want.target_modules))]
    for key, had, asked in pairs:
        if had != asked:
            raise JobError(f"{job.source}: key 'model.lora.{key}' has value {asked!r} but the run's newest checkpoint "
                           f"was trained with {had!r}; an adapter keeps its shape for the whole run: change it back, "
                           "or start a new run (run.name)")


CPU_BF16_MIN_HIDDEN = 512  # below it, bf16's casts cost a CPU more than its matmuls save


CPU_ATTENTION = "unstable_dask-sdpa-fp32"  # the name transformers' attention registry knows it by


def _sdpa_fp32(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast("cpu", enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)
    return out.to(query.dtype), weights


def fp32_attention(model: Any) -> None:
    """Compute `model`'s attention (transformers' SDPA, with its masks) in float32 under a CPU's bf16
    autocast; the projections around it stay bf16. torch's CPU flash-attention kernel runs forward
    and backward 1.8x faster in fp32 than in bf16 (50.7 vs 28.7 ms a SmolLM2 layer of 8 rows), and
    attention was a quarter of a bf16 update (bench/learn/bench_share_prefix.py). A transformers
    without the attention registry keeps its own."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return
    AttentionInterface.register(CPU_ATTENTION, _sdpa_fp32)
    AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "set_attn_implementation") and base.config._attn_implementation == "sdpa":
        base.set_attn_implementation(CPU_ATTENTION)


def compute_dtype(name: str, device: torch.device, hidden_size: int) -> torch.dtype:
    """learn.dtype: bf16 autocast on CUDA, and on CPUs with native bf16 matmuls (AVX-512 BF16, AMX)
    once the model's matmuls are large enough to pay for the casts; fp32 elsewhere. Measured on a
    2-core AVX-512 BF16 CPU (bench_learner_speed.py): SmolLM2-135M (hidden 576) 2.5x faster in bf16,
    the builtin tiny model (hidden 128) 0.64x; on an AVX2-only CPU bf16 is emulated, and slower."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.bfloat16 if native and hidden_size >= CPU_BF16_MIN_HIDDEN else torch.float32


def silence_tolerance(rows: int, reward: float) -> float:
    """The largest |advantage| GroupRelativeAdvantage can give a group of `rows` turns whose rewards
    all equal +-`reward`, from float rounding alone (eps = 2.2e-16, float64):
    mu = sum(w r) / sum(w) sums `rows` terms twice, each sum off by at most (rows - 1) eps/2
    relative, the products and the division by eps/2 more: |mu - R| <= rows * eps * |R|. r - mu is
    then exact (Sterbenz: r and mu within a factor 2), and the divisor is sd + Z_EPS >= Z_EPS for
    scale "group" and "batch" (1 for "none"), so |A| <= rows * eps * |R| / Z_EPS. Twice that, for
    margin: three attempts all scoring 0.1 give -1.39e-9, the tolerance is 1.3e-8; a group whose
    rewards differ has |A| of order 1 (z-scored) or of its reward gap (scale "none": gaps below
    ~1e-7 x rows x |R| count as none)."""
    return 2.0 * rows * sys.float_info.epsilon * reward / Z_EPS


def drop_silent_groups(table: pa.Table, drop: bool = True) -> tuple[pa.Table, dict]:
    """The batch without the groups ((group_id, pid)) whose every advantage is 0 (to within the
    float error of equal rewards: silence_tolerance): when
    nothing but the advantage weighs a row (`drop`) they carry no signal, and mini-batches full of
    them would make AdamW step on its momentum alone. With `drop` False (an entropy bonus or a KL
    penalty gives such rows a gradient) they stay beside groups that have signal; a batch with none at all is dropped
    whole all the same: its update would be the KL term's alone, which AdamW scales to a full step
    (at saturation, every group won, that step pulled a solved policy back towards the base:
    1.00 -> 0.25 in one round, tests/test_learning.py). Returns the table and learner_steps
    metrics: the share of silent groups and the rows dropped."""
    keys = [f"{g}\x00{p}" for g, p in zip(table.column("group_id").to_pylist(), table.column("pid").to_pylist())]
    rewards = table.column("step_reward").to_pylist() if "step_reward" in table.column_names else [1.0] * len(keys)
    scale: dict[str, float] = {}  # the group's rows x its largest |reward| (what entered the sampling transforms)
    rows: dict[str, int] = {}
    for k, r in zip(keys, rewards):
        rows[k] = rows.get(k, 0) + 1
        scale[k] = max(scale.get(k, 0.0), abs(r) if r is not None and math.isfinite(r) else 0.0)
    signal: dict[str, bool] = {}
    for k, a in zip(keys, table.column("advantage").to_pylist()):
        signal[k] = signal.get(k, False) or (a is not None and abs(a) > silence_tolerance(rows[k], scale[k]))
    keep_silent = not drop and any(signal.values())
    keep = pa.array([signal[k] or keep_silent for k in keys], pa.bool_())
    out = table.filter(keep) if len(keys) else table
    silent = sum(1 for v in signal.values() if not v)
    return out, dict(zero_std_group_frac=silent / len(signal) if signal else None,
                     rows_dropped=table.num_rows - out.num_rows)


def _mean(batch: pa.Table, name: str) -> Optional[float]:
    if name not in batch.column_names or batch.num_rows == 0:
        return None
    vals = [v for v in batch.column(name).to_pylist() if v is not None]
    return sum(vals) / len(vals) if vals else None
