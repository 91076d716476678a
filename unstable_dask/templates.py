"""Prompt templates and `\\boxed{}` action extraction, as UnstableBaselines defines them.

A template turns an observation into the exact text fed to the model; that text is stored in
`turns.prompt` and is what the learner trains on.
"""
from __future__ import annotations

from typing import Callable, Optional

_ZS = "You are playing a two-player zero-sum game. Make valid actions to win."
_SP = "You are playing a single-player game. Make valid actions to solve it completely."
_ASK = "Please reason step by step, and put your final answer within \\boxed{}."


def _qwen3(system: str, obs: str, think: bool = False) -> str:
    return (f"<|im_start|>user\n{system}\nObservation: {obs}\n{_ASK}<|im_end|>\n"
            f"<|im_start|>assistant\n" + ("<think>" if think else ""))


TEMPLATE_FNS: dict[str, Callable[[str], str]] = {
    "default": lambda obs: f"{_ZS}\nObservation: {obs}\n{_ASK}",
    "qwen3-zs": lambda obs: _qwen3(_ZS, obs),
    "qwen3-sp": lambda obs: _qwen3(_SP, obs),
    "qwen3-reasoning": lambda obs: _qwen3(_ZS, obs, think=True),
    "gemma3-zs": lambda obs: (f"<bos><start_of_turn>user\n{_ZS}\nObservation: {obs}\n{_ASK}<end_of_turn>\n"
                              f"<start_of_turn>model\n"),
    "llama-instruct-zs": lambda obs: (
        f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{_ZS}<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\nCurrent Observation: {obs}\n{_ASK}<|eot_id|>"
        f"<|start_header_id|>assistant<|end_header_id|>\n\n"),
}


def render_prompt(template: str, obs: str, chat_prompt: Optional[Callable[[str], str]] = None) -> str:
    """The exact prompt text for an observation. `chat` uses the tokenizer's own chat template."""
    if template == "chat":
        if chat_prompt is None:
            raise ValueError("template 'chat' needs the engine's chat_prompt")
        return chat_prompt(f"{_ZS}\nObservation: {obs}\n{_ASK}")
    return TEMPLATE_FNS[template](obs)


_BOXED = "\\boxed{"


def _last_boxed(text: str) -> Optional[str]:
    """Content of the last-starting *closed* \\boxed{...}, nested braces included.

    One pass with a stack of open braces, so a 100k-character completion full of unclosed
    `\\boxed{` stays linear (UB's non-greedy regex also breaks on nested braces).
    """
    stack: list[int] = []  # content start of a boxed opener, or -1 for a plain "{"
    best_start, best = -1, None
    i, n = 0, len(text)
    while i < n:
        if text.startswith(_BOXED, i):
            i += len(_BOXED)
            stack.append(i)
            continue
        c = text[i]
        if c == "{":
            stack.append(-1)
        elif c == "}" and stack:
            start = stack.pop()
            if start > best_start:
                best_start, best = start, text[start:i]
        i += 1
    return best


def extract_action(completion: str) -> tuple[str, bool]:
    """(action sent to the env, format_ok).

    The last closed `\\boxed{X}` with non-empty X gives `[X]` (X as is when it already holds a
    `[`), and format_ok=True. Otherwise the whole completion goes to the env, format_ok=False.
    """
    content = _last_boxed(completion)
    if content is not None:
        content = content.strip()
        if content:
            return (content if "[" in content else f"[{content}]"), True
    return completion, False
