"""model.stop on the hf engine (builtin:tiny): a turn ends at the first token whose text completes a
stop string, each row of a batch on its own, and the lake gets exactly the tokens generated up to
it with their log-probs."""
import pytest
import torch

from unstable_dask.config import ModelConfig
from unstable_dask.inference.engine import encode_prompts, get_engine, prompt_budget

from helpers import logprob_check
from helpers.adapters import completion_logits, random_adapters, sample_prompts, stop_end
from helpers.hf_engine import GREEDY

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rows_of_a_batch_stop_independently_at_their_stop_string(engine, tmp_path_factory):
    """Greedy with a random adapter (the tiny model's own greedy text is one repeated newline): each
    row ends at the token that first completes a stop string, its tokens and log-probs a prefix of the
    unstopped run's; a row that never meets one runs to max_new_tokens as before."""
    [adapter] = random_adapters(engine.tokenizer.name_or_path, tmp_path_factory, n=1)
    tok = engine.tokenizer
    ps = sample_prompts(engine)
    free = engine.generate(ps, adapter=adapter)
    # stop strings the greedy rows reach at different points: one token's text from rows 1 and 2
    stop = [tok.decode(free[1].token_ids[6:7]), tok.decode(free[2].token_ids[1:2])]
    ends = [stop_end(tok, g.token_ids, stop) for g in free]
    assert ends[0] == GREEDY.max_new_tokens and len({ends[1], ends[2]}) == 2 and max(ends[1:]) < ends[0], \
        f"the adapter's greedy texts changed; pick other stop strings ({ends})"

    stopped = get_engine(GREEDY.model_copy(update={"stop": stop})).generate(ps, adapter=adapter)
    for g, f, n in zip(stopped, free, ends):
        assert g.token_ids == f.token_ids[:n] and g.completion_tokens == n == len(g.logprobs)
        assert g.logprobs == pytest.approx(f.logprobs[:n], abs=1e-4)
        assert g.text == tok.decode(g.token_ids, skip_special_tokens=True)
        assert g.truncated == (n == GREEDY.max_new_tokens)
    assert stopped[0].token_ids == free[0].token_ids  # no stop string: unchanged
    # the stop string is in the text, and it was not one token before
    for g in stopped[1:]:
        assert any(s in g.text for s in stop)
        assert not any(s in tok.decode(g.token_ids[:-1], skip_special_tokens=True) for s in stop)


def test_sampled_stops_record_the_log_probs_of_the_tokens_kept(engine):
    """Sampling, rows stopping at different steps while others go on: every row's log-probs line up
    with its kept tokens (a plain forward pass over prompt + token_ids reproduces them, as the learner
    computes them), and no row carries a token past its stop."""
    cfg = GREEDY.model_copy(update={"temperature": 1.0, "max_new_tokens": 24, "stop": ["a"]})
    tok = engine.tokenizer
    ps = sample_prompts(engine) * 4
    gens = get_engine(cfg).generate(ps, seed=3)
    lengths = [g.completion_tokens for g in gens]
    assert len(set(lengths)) >= 3 and min(lengths) < max(lengths)  # rows stopped independently
    for g in gens:
        assert len(g.token_ids) == g.completion_tokens == len(g.logprobs)
        assert stop_end(tok, g.token_ids, ["a"]) == len(g.token_ids)  # nothing kept after the stop
        assert not g.truncated if "a" in g.text else g.truncated or g.token_ids[-1] in engine.hf.eos_ids
    ids = encode_prompts(tok, ps, prompt_budget(cfg))
    logits, targets, _ = completion_logits(tok.name_or_path, ids, gens)
    logprob_check.check(logits, targets, torch.tensor([x for g in gens for x in g.logprobs]), 1.0, 1.0)


def test_an_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="empty stop string"):
        ModelConfig(stop=["]", ""])
