"""The learner's model state: base model + LoRA policy (+ A2C critic), optimizers, save/load.

A checkpoint directory is a standard peft adapter (adapter_config.json + adapter_model.safetensors,
loadable by PeftModel.from_pretrained and vLLM's LoRARequest) plus what resuming exactly needs:
optimizer.pt (AdamW state), trainer_state.json, and for A2C critic/ (its adapter, value_head.pt,
critic_optimizer.pt). Precision: fp32 on CPU, bf16 base weights on CUDA (LoRA weights stay fp32).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import pyarrow as pa
import torch

from . import a2c, grpo, reinforce
from .config import Job


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


def _backbone(cls, path: str, job: Job, device: torch.device):
    model = cls.from_pretrained(path, dtype=model_dtype(job, device)).to(device)
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
        from peft import PeftModel, get_peft_model
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

        from .models import resolve_model
        self.job, self.cfg, self.device = job, job.learn, device
        path = resolve_model(job.model.base)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id
        torch.manual_seed(job.run.seed)  # LoRA init (A ~ kaiming, B = 0) and the value head
        base = _backbone(AutoModelForCausalLM, path, job, device)
        if parent_adapter:
            self.policy = PeftModel.from_pretrained(base, parent_adapter, is_trainable=True)
        else:
            self.policy = get_peft_model(base, lora_config(job, "CAUSAL_LM"))
        self.optimizer = _adamw(self.policy.parameters(), self.cfg.lr, job)
        self.updates = 0
        if parent_adapter and (Path(parent_adapter) / "optimizer.pt").is_file():
            self.optimizer.load_state_dict(torch.load(Path(parent_adapter) / "optimizer.pt", map_location=device))
            state = Path(parent_adapter) / "trainer_state.json"
            self.updates = json.loads(state.read_text())["updates"] if state.is_file() else 0
        self.critic = self.critic_optimizer = None
        if self.cfg.algorithm == "a2c":
            body = _backbone(AutoModel, path, job, device)
            cdir = Path(parent_adapter) / "critic" if parent_adapter else None
            if cdir is not None and (cdir / "adapter_config.json").is_file():
                body = PeftModel.from_pretrained(body, str(cdir), is_trainable=True)
            else:
                body = get_peft_model(body, lora_config(job, "FEATURE_EXTRACTION"))
            self.critic = a2c.Critic(body, base.config.hidden_size).to(device)
            if cdir is not None and (cdir / "value_head.pt").is_file():
                self.critic.head.load_state_dict(torch.load(cdir / "value_head.pt", map_location=device))
            self.critic_optimizer = _adamw(self.critic.parameters(), self.cfg.critic_lr, job)
            if cdir is not None and (cdir / "critic_optimizer.pt").is_file():
                self.critic_optimizer.load_state_dict(torch.load(cdir / "critic_optimizer.pt", map_location=device))

    def _args(self, cls, **extra):
        c = self.cfg
        return cls(mini_batch_size=c.mini_batch_size, grad_clip=c.grad_clip, normalization=c.normalization,
                   max_generation_len=c.max_generation_len or self.job.model.max_new_tokens,
                   max_train_len=c.max_train_len, pad_id=self.pad_id, **extra)

    def tokenize(self, batch: pa.Table) -> reinforce.Tokens:
        col = batch.column
        truncated = [bool(t) for t in col("truncated").to_pylist()]
        # A completion that ended by itself ended on EOS: train on the EOS too, so stopping is learned.
        return reinforce.tokenize(self.tokenizer, col("prompt").to_pylist(), col("completion").to_pylist(),
                                  [not t for t in truncated], self.cfg.max_train_len, self.pad_id)

    def step(self, batch: pa.Table) -> dict:
        """One update on a batch from the lake query; returns the learner_steps metrics."""
        t0 = time.perf_counter()
        tokens = self.tokenize(batch)
        adv = torch.tensor(batch.column("advantage").to_pylist(), dtype=torch.float64)
        c = self.cfg
        if c.algorithm == "reinforce":
            m = reinforce.update(self.policy, self.optimizer, tokens, adv, self._args(reinforce.ReinforceArgs), self.device)
        elif c.algorithm == "grpo":
            old, ok = grpo.behaviour_logprobs(tokens, batch.column("logprobs").to_pylist())
            args = self._args(grpo.GRPOArgs, clip_ratio=c.clip_ratio, kl_coef=c.kl_coef)
            m = grpo.update(self.policy, self.optimizer, tokens, adv, old, ok, args, self.device)
        else:
            seats = list(zip(batch.column("round").to_pylist(), batch.column("game_id").to_pylist(),
                             batch.column("pid").to_pylist()))
            args = self._args(a2c.A2CArgs, gamma=c.gamma, gae_lambda=c.gae_lambda, critic_grad_clip=c.grad_clip)
            m = a2c.update(self.policy, self.critic, self.optimizer, self.critic_optimizer, tokens, seats,
                           batch.column("turn").to_pylist(), batch.column("final_reward").to_pylist(),
                           batch.column("step_reward").to_pylist(), args, self.device)
            m["critic_lr"] = c.critic_lr
        self.updates += 1
        lengths = tokens.attention_mask.sum(-1).float()
        adv_all = torch.tensor(batch.column("advantage").to_pylist(), dtype=torch.float64)
        elapsed = time.perf_counter() - t0
        m.setdefault("advantage_mean", adv_all.mean().item())
        m.update(lr=self.optimizer.param_groups[0]["lr"], samples=batch.num_rows, tokens=int(lengths.sum()),
                 train_tokens=int(tokens.loss_mask.sum()), tokens_per_s=float(lengths.sum()) / max(elapsed, 1e-9),
                 step_time_s=elapsed, mean_train_len=lengths.mean().item(),
                 pct_truncated=100.0 * tokens.truncated.float().mean().item(),
                 reward_mean=_mean(batch, "env_reward"), step_reward_mean=_mean(batch, "step_reward"),
                 advantage_std=adv_all.std(unbiased=False).item())
        return m

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(str(directory))
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        if self.critic is not None:
            cdir = directory / "critic"
            self.critic.body.save_pretrained(str(cdir))
            torch.save(self.critic.head.state_dict(), cdir / "value_head.pt")
            torch.save(self.critic_optimizer.state_dict(), cdir / "critic_optimizer.pt")


def _mean(batch: pa.Table, name: str) -> Optional[float]:
    if name not in batch.column_names or batch.num_rows == 0:
        return None
    vals = [v for v in batch.column(name).to_pylist() if v is not None]
    return sum(vals) / len(vals) if vals else None
