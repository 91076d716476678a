"""What every algorithm sees of a batch: the exact token ids the engine generated, the loss mask,
and log-probs under the distribution those tokens were drawn from. Shared by the algorithm files.

Token ids: prompt ids come from `engines.encode_prompts`, the function the engines feed the model
with, keeping the last `prompt_tokens` ids (the row's count of tokens fed: the same left
truncation the engine made, whatever the round's max_model_len); completion ids are the turn's
`completion_token_ids` as the engine generated them, EOS included when one was generated. Nothing
is decoded and re-encoded, so the learner trains on exactly what was sampled.

Log-probs: `sampling.sampling_logprobs(logits, temperature, top_p)` with the settings of the
row's round, at completion positions only (the vocabulary-sized softmax is never taken over the
prompt). A completion token outside the current policy's top-p nucleus has probability 0 under
the sampling distribution; its log-prob is floored at LOGP_FLOOR = -100 instead of -inf (zero
gradient; exp(-100) is below float32's smallest normal number, so a ratio against it is ~0), so
no loss turns into inf or NaN and metrics such as logp_mean stay on a readable scale. On-policy
this does not happen (the token was drawn from that nucleus); after an optimizer step a token
near the nucleus boundary can drop out.

torch is imported inside the functions: algorithm files import this module and `load_job` reads
their specs without loading torch.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from unstable_dask.play.prompts import action_end

if TYPE_CHECKING:
    import torch

LOGP_FLOOR = -100.0


@dataclass
class Tokens:
    input_ids: "torch.Tensor"  # [B, T] right-padded
    attention_mask: "torch.Tensor"  # [B, T] 1 on real tokens
    loss_mask: "torch.Tensor"  # [B, T] 1 on completion tokens
    last_prompt: "torch.Tensor"  # [B] index of each sample's last prompt token (A2C reads V there)
    truncated: "torch.Tensor"  # [B] bool: cut by max_train_len


def prompt_ids(tokenizer: Any, prompts: Sequence[str], prompt_tokens: Sequence[int],
               where: Sequence[str]) -> list[list[int]]:
    """The ids the engine fed for each prompt: encode_prompts with each row's own budget.

    A prompt that encodes to fewer ids than the engine fed was not made by this tokenizer.
    """
    from unstable_dask.errors import JobError
    from unstable_dask.inference.engine import encode_prompts
    out: list[Optional[list[int]]] = [None] * len(prompts)
    by_budget: dict[int, list[int]] = defaultdict(list)
    for i, n in enumerate(prompt_tokens):
        by_budget[int(n)].append(i)
    for budget, rows in by_budget.items():
        for i, ids in zip(rows, encode_prompts(tokenizer, [prompts[i] for i in rows], budget)):
            if len(ids) != budget:
                raise JobError(f"{where[i]}: the prompt encodes to {len(ids)} tokens but the engine fed {budget}; "
                               f"the learner's tokenizer ({tokenizer.name_or_path}) is not the one that played")
            out[i] = ids
    return out  # type: ignore[return-value]


def tokenize(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
             max_train_len: Optional[int], pad_id: int) -> Tokens:
    """Prompt ++ completion ids per sample, right-padded; the loss mask falls on the completion.

    A sample longer than max_train_len loses prompt tokens from the left first (the completion is
    what carries gradient), then completion tokens from the right.
    """
    import torch
    rows, masks, last, cut = [], [], [], []
    for p_ids, c_ids in zip(prompts, completions):
        p_ids, c_ids = list(p_ids), list(c_ids)
        over = 0 if max_train_len is None else len(p_ids) + len(c_ids) - max_train_len
        if over > 0:
            drop_p = min(over, max(len(p_ids) - 1, 0))  # keep >= 1 prompt token to condition on
            p_ids = p_ids[drop_p:]
            c_ids = c_ids[: max(len(c_ids) - (over - drop_p), 0)]
        rows.append(p_ids + c_ids)
        masks.append([0] * len(p_ids) + [1] * len(c_ids))
        last.append(len(p_ids) - 1)
        cut.append(over > 0)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    lm = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        att[i, : len(r)] = 1
        lm[i, : len(r)] = torch.tensor(m)
    return Tokens(ids, att, lm, torch.tensor(last), torch.tensor(cut))


def through_action(tokenizer: Any, completions: Sequence[Sequence[int]],
                   logprobs: Optional[Sequence[Optional[Sequence[float]]]] = None,
                   prefixes: Optional[Sequence[str]] = None,
                   env_ids: Optional[Sequence[str]] = None) -> tuple[list[list[int]], list[Optional[list[float]]]]:
    """Each completion cut right after the token that completes its move (learn.mask_after_action),
    with its engine log-probs cut alike (a list that does not match its completion, unusable before
    the cut, becomes None). A completion with no move (an invalid one) keeps every token. `prefixes`:
    each row's answer prefix, the start of its move written in the prompt (prompts.ANSWER_PREFIX);
    `env_ids`: each row's env, whose own rule finds its move (None: the first `[...]`).

    The move is found in the decoded text (prompts.action_end: the closing `}` of the box the
    round took, else the first move by the env's rule), and the kept tokens are the shortest prefix whose own
    decoding reaches it, so a move split over tokens ("[", "4", "].") keeps them all, the one that
    closes it whole. Later tokens are cut from the row, not only from the loss mask: the model is causal,
    so they change no kept token's log-prob, and they then count in no normaliser, metric, or
    max_train_len cut. Nothing is re-encoded: the kept ids are the engine's.
    """
    def text(ids: Sequence[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    cut_ids: list[list[int]] = []
    cut_lps: list[Optional[list[float]]] = []
    for i, ids in enumerate(completions):
        ids = list(ids)
        full = text(ids)
        prefix = prefixes[i] if prefixes is not None else ""
        end = action_end(full, env_ids[i] if env_ids is not None else None, prefix)
        keep = len(ids)
        if end is not None and end > 0:
            lo, hi = 1, len(ids)  # the shortest prefix whose text starts with the move's text
            while lo < hi:
                mid = (lo + hi) // 2
                if text(ids[:mid]).startswith(full[:end]):
                    hi = mid
                else:
                    lo = mid + 1
            keep = hi
        lp = None if logprobs is None else logprobs[i]
        cut_ids.append(ids[:keep])
        cut_lps.append(list(lp)[:keep] if lp is not None and len(lp) == len(ids) else None)
    return cut_ids, cut_lps


def completion_logprobs(logits: "torch.Tensor", input_ids: "torch.Tensor", loss_mask: "torch.Tensor",
                        temperature: Sequence[float], top_p: Sequence[float]) -> "torch.Tensor":
    """log pi(x_t | x_<t) of each completion token under its row's sampling distribution, [B, T-1]
    float32, aligned with `logits` (position t scores token t+1); 0 off the completion."""
    import torch

    from unstable_dask.inference import sampling
    completion = loss_mask[:, 1:].bool()
    out = torch.zeros(completion.shape, dtype=torch.float32, device=logits.device)
    settings = list(zip(temperature, top_p))
    for t, p in sorted(set(settings)):  # rows of one round share settings: usually one pass
        rows = torch.tensor([s == (t, p) for s in settings], device=logits.device)
        out = out + sampling.masked_token_logprobs(logits, input_ids, completion & rows.unsqueeze(-1), t, p)
    return out.clamp(min=LOGP_FLOOR)


def behaviour_logprobs(tokens: Tokens,
                       logprobs: Sequence[Optional[Sequence[float]]]) -> tuple["torch.Tensor", "torch.Tensor"]:
    """The engine's log-probs laid out like completion_logprobs' output ([B, T-1]) and a [B] mask of
    samples whose stored log-probs describe what we train on: one per completion token, and the
    sample not cut by max_train_len (a cut prompt changes what the tokens are conditioned on)."""
    import torch
    mask = tokens.loss_mask[:, 1:].bool()
    old = torch.zeros(mask.shape, dtype=torch.float32)
    ok = torch.zeros(mask.shape[0], dtype=torch.bool)
    for i, lp in enumerate(logprobs):
        if lp is not None and len(lp) == int(mask[i].sum()) and not bool(tokens.truncated[i]):
            old[i, mask[i]] = torch.tensor(lp, dtype=torch.float32)
            ok[i] = True
    return old, ok


def micro_batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def clip_and_step(optimizer: "torch.optim.Optimizer", grad_clip: float) -> float:
    """Clip the accumulated gradient's norm, take the optimizer step; returns the norm before clipping."""
    import torch
    params = [p for g in optimizer.param_groups for p in g["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    return float(norm)


def rendered_ids(tokenizer: Any, prompts: Sequence[str], targets: Sequence[str], budget: int,
                 stop: Sequence[str] = ()) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, completion ids) of rendered text no engine generated (SFT targets), tokenized as
    the engine would have: the prompt by `engines.encode_prompts` with the engine's prompt budget,
    the target by its own encoding (what the engine emits is a completion after the prompt ids, never
    re-tokenized with them), then EOS, which ends a generation that stops by itself, unless the
    target ends in a string of `stop` (model.stop: the engine stops there, keeping that text)."""
    from unstable_dask.inference.engine import encode_prompts
    eos = tokenizer.eos_token_id
    ends = [t.endswith(tuple(stop)) if stop else False for t in targets]
    if eos is None and not all(ends):
        raise ValueError(f"tokenizer {tokenizer.name_or_path} has no EOS token to end a target with")
    encoded = tokenizer(list(targets), add_special_tokens=False, verbose=False)["input_ids"]
    completions = [list(ids) + ([] if end else [eos]) for ids, end in zip(encoded, ends)]
    return encode_prompts(tokenizer, list(prompts), budget), completions
