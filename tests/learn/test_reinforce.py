"""REINFORCE loss and gradients on tiny tensors equal a hand computation; prompt and padding add nothing;
the learner's token ids are exactly the engine's."""
from __future__ import annotations

import math

import pytest
import torch

from unstable_dask.learn.algorithms.reinforce import Config as ReinforceConfig
from unstable_dask.learn.algorithms.reinforce import update
from unstable_dask.learn.tokens import tokenize

from helpers.learner_batch import ADV, COMPLETIONS, CPU, PROMPTS, TOL, Bigram, V, as_batch, batch, hand, models


@pytest.mark.parametrize("normalization", ["constant", "seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("mini", [1, 2, 3])
def test_loss_and_grads_equal_hand_computation(normalization, mini):
    model = Bigram()
    w0 = model.W.detach().clone()
    args = ReinforceConfig(mini_batch_size=mini, grad_clip=1e9, normalization=normalization, max_generation_len=4)
    m = update(models(model, lr=1.0), as_batch(batch()), args, CPU)
    loss, grad = hand(w0, normalization)
    assert m["loss"] == pytest.approx(loss, abs=1e-6)
    torch.testing.assert_close(model.W.grad, grad, **TOL)
    torch.testing.assert_close(model.W.detach(), w0 - grad, **TOL)  # one SGD step, lr 1


def test_log_probs_are_those_of_the_sampling_distribution():
    """At temperature T the gradient is that of log softmax(W / T): REINFORCE on what was sampled."""
    model = Bigram()
    w0 = model.W.detach().clone()
    update(models(model), as_batch(batch(), temperature=0.5),
           ReinforceConfig(mini_batch_size=3, grad_clip=1e9, max_generation_len=4), CPU)
    loss, grad = hand(w0 / 0.5, "constant")
    torch.testing.assert_close(model.W.grad, grad / 0.5, **TOL)  # chain rule through W / T


def test_a_token_outside_the_nucleus_adds_no_gradient_and_no_nan():
    """At T = 0.7, top_p = 0.95 three completion tokens fall outside W's nucleus (probability 0
    under the sampling distribution): they add nothing; the others get the gradient of the
    renormalised nucleus, (1/T) (onehot - pi_b) on the nucleus and 0 off it."""
    from unstable_dask.inference.sampling import sampling_logprobs
    model = Bigram()
    w0 = model.W.detach().clone()
    m = update(models(model), as_batch(batch(), temperature=0.7, top_p=0.95),
               ReinforceConfig(mini_batch_size=2, grad_clip=1e9, max_generation_len=4), CPU)
    want, outside = torch.zeros_like(w0), 0
    for i, (p, (_, comp)) in enumerate(zip(PROMPTS, COMPLETIONS)):
        seq = p + comp
        for t in range(len(p), len(seq)):
            prev, tok = seq[t - 1], seq[t]
            pb = sampling_logprobs(w0[prev], 0.7, 0.95).exp().double()
            if pb[tok] == 0:
                outside += 1
                continue
            onehot = torch.zeros(V, dtype=torch.float64)
            onehot[tok] = 1
            want[prev] += -ADV[i].item() / 3 / 4 / 0.7 * (onehot - pb) * (pb > 0)
    assert outside == 3 and math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
    torch.testing.assert_close(model.W.grad, want, **TOL)


def test_prompt_and_padding_contribute_nothing():
    """Changing pad ids, or what the prompt says about its own tokens, leaves loss and grads unchanged."""
    def run(tokens):
        model = Bigram()
        m = update(models(model), as_batch(tokens), ReinforceConfig(mini_batch_size=3, grad_clip=1e9, max_generation_len=4),
                   CPU)
        return m["loss"], model.W.grad.clone()

    l0, g0 = run(batch(pad=0))
    l1, g1 = run(batch(pad=3))  # other pad ids
    assert l0 == l1 and torch.equal(g0, g1)
    # Rows of W used only to predict prompt tokens or padding get exactly zero gradient:
    # W[x_t] is used at t = every position; only positions predicting a completion token count.
    used = {seq_prev for (p, comp), pr in zip(COMPLETIONS, PROMPTS)
            for seq_prev in (pr + comp)[len(pr) - 1:-1]}
    for row in range(V):
        if row not in used:
            assert torch.count_nonzero(g0[row]) == 0


def test_grad_clip_bounds_the_update():
    model = Bigram()
    m = update(models(model, lr=1.0), as_batch(batch(), ADV * 100),
               ReinforceConfig(mini_batch_size=3, grad_clip=0.2, max_generation_len=4), CPU)
    assert m["grad_norm"] > 0.2
    assert model.W.grad.norm().item() == pytest.approx(0.2, rel=1e-6)


def test_tokenize_trains_on_the_engine_s_ids_and_masks_prompt_and_padding():
    """Prompt ids are encode_prompts' (the engines' function) with the row's budget; completion ids
    are taken as stored, EOS included only when the engine generated it; nothing is re-encoded."""
    from transformers import AutoTokenizer

    from unstable_dask.errors import JobError
    from unstable_dask.inference.engine import encode_prompts
    from unstable_dask.inference.weights import resolve_model
    from unstable_dask.learn.tokens import prompt_ids
    tok = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny"))
    prompts = ["<|im_start|>user\nPick a number<|im_end|>\n<|im_start|>assistant\n", "hi there, a longer prompt"]
    full = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    fed = [len(full[0]), 3]  # the engine fed the second prompt left-truncated to a budget of 3
    ids = prompt_ids(tok, prompts, fed, ["a", "b"])
    assert ids == [full[0], full[1][-3:]] == [encode_prompts(tok, prompts[:1], 10**6)[0], encode_prompts(tok, prompts[1:], 3)[0]]
    # Ids a decode -> re-encode round trip need not give back, and the EOS the engine sampled.
    completions = [[tok.convert_tokens_to_ids("I"), 17, 17, tok.eos_token_id], [5, 6, 7, 8, 9, 10]]
    t = tokenize(ids, completions, None, tok.pad_token_id)
    n_p = len(full[0])
    assert t.input_ids[0, :n_p + 4].tolist() == full[0] + completions[0]
    assert t.loss_mask[0, :n_p].sum() == 0 and t.loss_mask[0].sum() == 4 and int(t.last_prompt[0]) == n_p - 1
    assert t.input_ids[1, :9].tolist() == full[1][-3:] + completions[1] and t.attention_mask[1].sum() == 9
    assert t.loss_mask[1, 9:].sum() == 0 and t.attention_mask[0, n_p + 4:].sum() == 0
    cut = tokenize(ids, completions, 8, tok.pad_token_id)
    assert cut.attention_mask.sum(-1).max() <= 8 and cut.truncated.tolist() == [True, True]
    assert cut.loss_mask[1].sum() == 6 and cut.input_ids[1, :8].tolist() == full[1][-2:] + completions[1]
    n = len(full[1])
    with pytest.raises(JobError, match=f"turn 0 of game g: the prompt encodes to {n} tokens but the engine fed {n + 1}"):
        prompt_ids(tok, prompts[1:], [n + 1], ["turn 0 of game g"])
