"""Prompt templates and \\boxed{} extraction, as UnstableBaselines defines them."""
import time

import pytest

from unstable_dask.templates import extract_action, render_prompt


@pytest.mark.parametrize("completion, action, ok", [
    ("I will play \\boxed{3}", "[3]", True),
    ("\\boxed{[col 2]}", "[col 2]", True),  # already bracketed: sent as is
    ("first \\boxed{1} then \\boxed{ 4 }", "[4]", True),  # the last box wins, stripped
    ("\\boxed{\\frac{1}{2}}", "[\\frac{1}{2}]", True),  # nested braces (UB's regex cuts at the first '}')
    ("\\boxed{a{b}c} and \\boxed{x", "[a{b}c]", True),  # an unclosed box after a closed one
    ("no answer here", "no answer here", False),  # whole completion goes to the env
    ("\\boxed{}", "\\boxed{}", False),  # empty answer is not an answer
    ("\\boxed{   }", "\\boxed{   }", False),
    ("\\boxed{5", "\\boxed{5", False),  # unclosed
    ("", "", False),
])
def test_extract_action(completion, action, ok):
    assert extract_action(completion) == (action, ok)


def test_extract_is_linear_on_hostile_text():
    hostile = ["\\boxed{" * 30_000, "}" * 100_000, "x" * 100_000, "\u202e\u0000\x1b[31m" * 10_000,
               "{" * 50_000 + "\\boxed{1}"]
    t = time.perf_counter()
    out = [extract_action(h) for h in hostile]
    assert time.perf_counter() - t < 5  # quadratic scanning would take minutes
    assert out[-1] == ("[1]", True)


def test_qwen3_zs_template_is_exact():
    assert render_prompt("qwen3-zs", "OBS") == (
        "<|im_start|>user\nYou are playing a two-player zero-sum game. Make valid actions to win.\n"
        "Observation: OBS\nPlease reason step by step, and put your final answer within \\boxed{}."
        "<|im_end|>\n<|im_start|>assistant\n")


def test_reasoning_template_opens_think_and_chat_uses_tokenizer():
    assert render_prompt("qwen3-reasoning", "o").endswith("<|im_start|>assistant\n<think>")
    assert render_prompt("llama-instruct-zs", "o").startswith("<|begin_of_text|>")
    seen = []
    out = render_prompt("chat", "OBS", chat_prompt=lambda text: seen.append(text) or f"<chat>{text}</chat>")
    assert out.startswith("<chat>") and "Observation: OBS" in seen[0]
