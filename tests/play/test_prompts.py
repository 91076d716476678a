"""Prompt templates and \\boxed{} extraction, as UnstableBaselines defines them."""
import random
import re
import time

import pytest

from unstable_dask.play.prompts import TEMPLATE_NAMES as TEMPLATES
from unstable_dask.play.prompts import (
    action_end,
    answer_text,
    extract_action,
    prompt_answer_prefix,
    render_action,
    render_prompt,
)


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


@pytest.mark.parametrize("completion, move", [
    ("[4] and then some text", "[4]"),  # a move-only answer: the env reads the first [...]
    ("I play [col 2]. Or [col 3]", "I play [col 2]"),
    ("say [1] then \\boxed{3} done", "say [1] then \\boxed{3}"),  # the box the round reads, not the bracket
    ("\\boxed{1} and \\boxed{2}!", "\\boxed{1} and \\boxed{2}"),  # its last box
    ("\\boxed{ } but [2] x", "\\boxed{ } but [2]"),  # an empty box is no move: the env reads the text
    ("no move", None), ("[] [ 1", None), ("", None),
])
def test_action_end_is_where_the_move_the_env_gets_ends(completion, move):
    end = action_end(completion)
    assert (None if end is None else completion[:end]) == move


@pytest.mark.parametrize("completion, env_id, prefix, move", [
    ("[Player 0] [4] x", "TicTacToe-v0", "", "[Player 0] [4]"),  # TicTacToe's own rule: the first [digit]
    ("[Player 0] [4] x", "TicTacToe-v0-train", "", "[Player 0] [4]"),
    ("[Player 0] [4] x", "ConnectFour-v0", "", "[Player 0]"),  # another env: the first bracket
    ("[Player 0] [4] x", None, "", "[Player 0]"),
    ("I [think] I [bet] [Fold]", "KuhnPoker-v0", "", "I [think] I [bet]"),  # Kuhn's words, any case
    ("4] and [5]", "TicTacToe-v0", "[", "4]"),  # the prompt wrote "[": the index is the completion's own
    ("4] and [5]", "TicTacToe-v0", "", "4] and [5]"),
    ("\\boxed{4} [3]", "TicTacToe-v0", "[", "\\boxed{4}"),
])
def test_action_end_reads_the_move_by_the_envs_rule_after_the_prompts_prefix(completion, env_id, prefix, move):
    end = action_end(completion, env_id, prefix)
    assert completion[:end] == move


def test_extract_is_linear_on_hostile_text():
    hostile = ["\\boxed{" * 30_000, "}" * 100_000, "x" * 100_000, "\u202e\u0000\x1b[31m" * 10_000,
               "{" * 50_000 + "\\boxed{1}"]
    t = time.perf_counter()
    out = [extract_action(h) for h in hostile]
    assert time.perf_counter() - t < 5  # quadratic scanning would take minutes
    assert out[-1] == ("[1]", True)


# UnstableBaselines 0.2.2 (unstable/utils/templates.py), rendered for the observation "OBS", as literals:
# this test must fail if a single byte of a UB-named template changes.
UB_TEXT = {
    "default": "You are playing a two-player zero-sum game. Make valid moves to win. You should first reason about "
               "your next move, and then submit the move enclosed by \\boxed{}.\nObservation: OBS\n",
    "qwen3-zs": "<|im_start|>user\nYou are playing a two-player zero-sum game. Make valid actions to win.\n"
                "Observation: OBS\nPlease reason step by step, and put your final answer within \\boxed{}."
                "<|im_end|>\n<|im_start|>assistant\n",
    "qwen3-sp": "<|im_start|>user\nYou are playing a single-player game. Make valid actions to solve it completely.\n"
                "Observation: OBS\nPlease reason step by step, and put your final answer within \\boxed{}."
                "<|im_end|>\n<|im_start|>assistant\n",
    "qwen3-reasoning": "<|im_start|>user\nPlease reason step by step, and put your final answer within \\boxed{}.\n"
                       "Question: OBS<|im_end|>\n<|im_start|>assistant\n<think>",
    "gemma3-zs": "<bos><start_of_turn>user\nYou are playing a two-player zero-sum game. Make valid actions to win.\n"
                 "Observation: OBS\nPlease reason step by step, and put your final answer within \\boxed{}."
                 "<end_of_turn>\n<start_of_turn>model\n",
    "llama-instruct-zs": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are playing a two-player "
                         "zero-sum game. Make valid actions to win.<|eot_id|><|start_header_id|>user<|end_header_id|>"
                         "\n\nCurrent Observation: OBS\nPlease reason step by step, and put your final answer within "
                         "\\boxed{}.<|eot_id|>\n<|start_header_id|>assistant<|end_header_id|>",
}


@pytest.mark.parametrize("name", sorted(UB_TEXT))
def test_unstable_baselines_templates_are_byte_identical(name):
    assert render_prompt(name, "OBS") == UB_TEXT[name]
    # the observation goes in verbatim (braces, backslashes, newlines are not format syntax)
    obs = "a {b} {{c}} \\boxed{x}\n[1]"
    assert render_prompt(name, obs) == UB_TEXT[name].replace("OBS", obs)


def test_our_variants_keep_their_own_names():
    assert render_prompt("plain-zs", "OBS") == (
        "You are playing a two-player zero-sum game. Make valid actions to win.\nObservation: OBS\n"
        "Please reason step by step, and put your final answer within \\boxed{}.")
    assert render_prompt("qwen3-zs-think", "OBS") == UB_TEXT["qwen3-zs"] + "<think>"
    assert render_prompt("llama3-instruct-zs", "OBS") == (
        UB_TEXT["llama-instruct-zs"].replace("<|eot_id|>\n<|start", "<|eot_id|><|start") + "\n\n")
    assert set(TEMPLATES) == set(UB_TEXT) | {"plain-zs", "qwen3-zs-think", "llama3-instruct-zs", "chat",
                                             "plain-move-only", "chat-move-only", "chat-move-prefill"}


def test_reasoning_template_opens_think_and_chat_uses_tokenizer():
    assert render_prompt("qwen3-reasoning", "o").endswith("<|im_start|>assistant\n<think>")
    seen = []
    out = render_prompt("chat", "OBS", chat_prompt=lambda text: seen.append(text) or f"<chat>{text}</chat>")
    assert out.startswith("<chat>") and seen == [render_prompt("plain-zs", "OBS")]


def test_move_only_templates_ask_for_the_move_alone():
    """plain-move-only: the plain-zs wording asking for the bare move, no reasoning, no box; the env reads
    the first [...] of the answer. chat-move-only wraps it in the tokenizer's chat template."""
    plain = render_prompt("plain-move-only", "OBS")
    assert plain == ("You are playing a two-player zero-sum game. Make valid actions to win.\nObservation: OBS\n"
                     "Answer with your move only: one of your available moves, with its square brackets, and nothing else.")
    assert "step by step" not in plain and "boxed" not in plain
    seen = []
    out = render_prompt("chat-move-only", "OBS", chat_prompt=lambda text: seen.append(text) or f"<chat>{text}</chat>")
    assert seen == [plain] and out == f"<chat>{plain}</chat>"
    with pytest.raises(ValueError, match="'chat-move-only' needs the engine's chat_prompt"):
        render_prompt("chat-move-only", "OBS")
    # a move-only answer is sent to the env as written (no box to extract)
    assert extract_action("[4]") == ("[4]", False)


def test_the_prefill_template_begins_the_move_and_the_env_reads_it_whole():
    """chat-move-prefill: chat-move-only's text with the assistant turn opened by "[": the model writes
    "4]", the env gets "[4]"; an SFT target is the rest of the move, and the learner finds its end."""
    out = render_prompt("chat-move-prefill", "OBS", chat_prompt=lambda text: f"<chat>{text}</chat>")
    assert out == render_prompt("chat-move-only", "OBS", chat_prompt=lambda text: f"<chat>{text}</chat>") + "["
    assert prompt_answer_prefix(out) == "[" and prompt_answer_prefix(out[:-1]) == ""
    assert extract_action(answer_text("chat-move-prefill", "4]")) == ("[4]", False)
    assert render_action("chat-move-prefill", "[4]") == "4]"
    for template in ("chat-move-only", "plain-move-only", "chat-move-prefill", "qwen3-zs"):
        target = render_action(template, "[7]")  # an SFT target gives the move back to the env
        assert extract_action(answer_text(template, target))[0] == "[7]"
    # a completion that is no move stays an invalid one: the env gets "[" + the text
    assert extract_action(answer_text("chat-move-prefill", "I think"))[0] == "[I think"
    assert answer_text("qwen3-zs", "x") == "x"


def test_a_job_may_name_the_move_only_templates(tmp_path):
    from unstable_dask.jobfile import load_job
    for name in ("chat-move-only", "plain-move-only", "chat-move-prefill"):
        path = tmp_path / f"{name}.toml"
        path.write_text(f'[model]\ntemplate = "{name}"\nstop = ["]"]\n')
        job = load_job(str(path))
        assert job.model.template == name and job.model.stop == ["]"]


def _ub_extract(completion: str) -> tuple[str, bool]:
    """UnstableBaselines' rule: the last match of its non-greedy regex, stripped; `[X]` unless X has a `[`."""
    matches = re.findall(r"\\boxed\{(.*?)\}", completion)
    last = matches[-1].strip() if matches else ""
    if not last:
        return completion, False
    return (last if "[" in last else f"[{last}]"), True


def test_extraction_agrees_with_unstable_baselines_where_its_regex_is_right():
    """One-line boxes without braces inside: the cases UB's regex reads correctly."""
    rng = random.Random(0)
    text = ["a", " ", "[", "]", "3", "\n", "x y", "\\box", "boxed", "\\", "}"]
    inner = ["a", " ", "[", "]", "3", "col 2", "\\", "  ", ""]
    for _ in range(3000):
        s = "".join("\\boxed{" + "".join(rng.choices(inner, k=rng.randint(0, 3))) + "}" if rng.random() < 0.4
                    else rng.choice(text) for _ in range(rng.randint(0, 6)))
        assert extract_action(s) == _ub_extract(s), repr(s)


@pytest.mark.parametrize("completion, ours, ub", [
    ("\\boxed{\\frac{1}{2}}", "[\\frac{1}{2}]", "[\\frac{1]"),  # nested braces: UB cuts at the first '}'
    ("\\boxed{\n[3]\n}", "[3]", "\\boxed{\n[3]\n}"),  # a box over lines: UB's '.' stops at a newline
    ("\\boxed{x \\boxed{y}", "[y]", "[x \\boxed{y]"),  # an unclosed box before a closed one
])
def test_extraction_differs_from_unstable_baselines_only_where_its_regex_is_wrong(completion, ours, ub):
    assert extract_action(completion)[0] == ours
    assert _ub_extract(completion)[0] == ub
