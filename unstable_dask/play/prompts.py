"""Prompt templates and `\\boxed{}` action extraction.

A template turns an observation into the exact text fed to the model; that text is stored in
`turns.prompt` and is what the learner trains on.

The names UnstableBaselines uses (`default`, `qwen3-zs`, `qwen3-sp`, `qwen3-reasoning`,
`gemma3-zs`, `llama-instruct-zs`) give its text byte for byte (`unstable/utils/templates.py` of
unstable-rl 0.2.2), so a model trained with either project sees the same prompts. Variants of
ours live under their own names:

  plain-zs            the qwen3-zs wording with no chat markup (for base models without a format)
  qwen3-zs-think      qwen3-zs (the game's own wording) with the assistant turn opened by <think>;
                      UB's qwen3-reasoning asks a generic "Question:" instead
  llama3-instruct-zs  Llama 3's own chat format: the user turn closes with <|eot_id|> and no
                      newline, and the assistant header is followed by "\\n\\n" as in its chat template
  chat                the tokenizer's own chat template around the plain-zs text
  plain-move-only     the plain-zs wording, asking for the move alone instead of reasoning and a box:
                      the env reads the first `[...]` of the text, so the answer is the move (pair it
                      with `model.stop = ["]"]` to end each turn there)
  chat-move-only      the tokenizer's own chat template around the plain-move-only text
  chat-move-prefill   chat-move-only with the answer begun in the prompt: the assistant turn opens
                      with "[", so the model writes the rest of the move ("4]"), and the env reads
                      "[" + the completion (ANSWER_PREFIX)
"""
from __future__ import annotations

import re
from typing import Callable, Optional

_ZS = "You are playing a two-player zero-sum game. Make valid actions to win."
_SP = "You are playing a single-player game. Make valid actions to solve it completely."
ASK = "Please reason step by step, and put your final answer within \\boxed{}."
# No example move: one would be a move of one game only, and a bias toward it in others.
ASK_MOVE = "Answer with your move only: one of your available moves, with its square brackets, and nothing else."
# A move in square brackets, as observations list them ("[3]", "[col 2]", "[check]") and as the
# env reads the first of a completion without a \\boxed{} (TextArena's envs search their own rule).
BRACKETED_MOVE = re.compile(r"\[[^\[\]\n]{1,40}\]")
# The rule of the envs whose step reads its own move pattern (TextArena's env.py, the first match),
# keyed by env_id prefix; any other env: BRACKETED_MOVE. "[Player 0] [4]" is move 4 to TicTacToe.
ENV_MOVE_RULES = {"TicTacToe-": re.compile(r"\[\s*(\d+)\s*\]"),
                  "KuhnPoker-": re.compile(r"\[(Check|Bet|Fold|Call)\]", re.IGNORECASE)}


def _plain(obs: str) -> str:
    return f"{_ZS}\nObservation: {obs}\n{ASK}"


def _plain_move(obs: str) -> str:
    return f"{_ZS}\nObservation: {obs}\n{ASK_MOVE}"


def _qwen3(system: str, obs: str, think: bool = False) -> str:
    return (f"<|im_start|>user\n{system}\nObservation: {obs}\n{ASK}<|im_end|>\n"
            f"<|im_start|>assistant\n" + ("<think>" if think else ""))


def _llama(obs: str, user_end: str, assistant_end: str) -> str:
    return (f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{_ZS}<|eot_id|>"
            f"<|start_header_id|>user<|end_header_id|>\n\nCurrent Observation: {obs}\n{ASK}<|eot_id|>{user_end}"
            f"<|start_header_id|>assistant<|end_header_id|>{assistant_end}")


TEMPLATE_FNS: dict[str, Callable[[str], str]] = {
    # UnstableBaselines 0.2.2, byte for byte (tests/test_templates.py pins every one).
    "default": lambda obs: (
        "You are playing a two-player zero-sum game. Make valid moves to win. You should first reason about "
        f"your next move, and then submit the move enclosed by \\boxed{{}}.\nObservation: {obs}\n"),
    "qwen3-zs": lambda obs: _qwen3(_ZS, obs),
    "qwen3-sp": lambda obs: _qwen3(_SP, obs),
    "qwen3-reasoning": lambda obs: (f"<|im_start|>user\n{ASK}\nQuestion: {obs}<|im_end|>\n"
                                    f"<|im_start|>assistant\n<think>"),
    "gemma3-zs": lambda obs: (f"<bos><start_of_turn>user\n{_ZS}\nObservation: {obs}\n{ASK}<end_of_turn>\n"
                              f"<start_of_turn>model\n"),
    "llama-instruct-zs": lambda obs: _llama(obs, "\n", ""),
    # Ours.
    "plain-zs": _plain,
    "qwen3-zs-think": lambda obs: _qwen3(_ZS, obs, think=True),
    "llama3-instruct-zs": lambda obs: _llama(obs, "", "\n\n"),
    "plain-move-only": _plain_move,
}
# Templates whose text the tokenizer's own chat template wraps (the engine's chat_prompt).
CHAT_TEMPLATE_FNS: dict[str, Callable[[str], str]] = {"chat": _plain, "chat-move-only": _plain_move,
                                                      "chat-move-prefill": _plain_move}
TEMPLATE_NAMES = (*TEMPLATE_FNS, *CHAT_TEMPLATE_FNS)
# The start of the answer, written at the end of the prompt (the assistant turn opened with it): a
# small base model asked for "[4]" wrote no move in 82-92% of its turns (SmolLM2-135M, TicTacToe,
# temperature 0.7-1.0); after "[" it only has to name the move. The env reads prefix + completion.
ANSWER_PREFIX: dict[str, str] = {"chat-move-prefill": "["}


def render_prompt(template: str, obs: str, chat_prompt: Optional[Callable[[str], str]] = None) -> str:
    """The exact prompt text for an observation. `chat` and `chat-move-only` use the tokenizer's own
    chat template."""
    if template in CHAT_TEMPLATE_FNS:
        if chat_prompt is None:
            raise ValueError(f"template {template!r} needs the engine's chat_prompt")
        return chat_prompt(CHAT_TEMPLATE_FNS[template](obs)) + ANSWER_PREFIX.get(template, "")
    return TEMPLATE_FNS[template](obs)


def answer_text(template: str, completion: str) -> str:
    """The answer a completion gives under `template`: the prompt's answer prefix, then the completion."""
    return ANSWER_PREFIX.get(template, "") + completion


def prompt_answer_prefix(prompt: str) -> str:
    """The answer prefix a rendered prompt ends with ("" for the templates that write none)."""
    return next((p for p in ANSWER_PREFIX.values() if prompt.endswith(p)), "")


# The templates that ask for the move alone; every other one asks for it in \boxed{}.
MOVE_ONLY_TEMPLATES = ("plain-move-only", "chat-move-only", "chat-move-prefill")
# Qwen3's empty thinking block: the templates that open the answer with <think> get it closed first.
_NO_THOUGHT = "\n\n</think>\n\n"


def render_action(template: str, action: str) -> str:
    """The completion that answers with `action` the way `template` asks (an SFT target): the move
    itself (`[4]`; `4]` after a prefill template's `[`) for the move-only templates, else `\\boxed{4}`, after Qwen3's empty thinking block
    where the prompt ends in `<think>`. `extract_action` gives the action back (the move-only
    templates' env reads the first `[...]`)."""
    if template in MOVE_ONLY_TEMPLATES:
        prefix = ANSWER_PREFIX.get(template, "")
        return action[len(prefix):] if action.startswith(prefix) else action
    inner = action[1:-1] if action.startswith("[") and action.endswith("]") and action.count("[") == 1 \
        and action.count("]") == 1 else action  # `[4]` -> 4; extract_action adds the brackets back
    think = template in TEMPLATE_FNS and TEMPLATE_FNS[template]("").endswith("<think>")
    return (_NO_THOUGHT if think else "") + f"{_BOXED}{inner}}}"


_BOXED = "\\boxed{"


def _last_boxed(text: str) -> Optional[tuple[int, int]]:
    """(start, end) of the content of the last-starting *closed* \\boxed{...}, nested braces
    included: the content is text[start:end], its closing `}` at `end`.

    One pass with a stack of open braces, so a 100k-character completion full of unclosed
    `\\boxed{` stays linear.

    UnstableBaselines takes the last match of the regex `\\\\boxed\\{(.*?)\\}`. Where that regex is
    right (one line, no braces inside the box) both give the same content. Where it is not, ours
    differs on purpose:
      - nested braces: UB cuts at the first `}` (`\\boxed{\\frac{1}{2}}` -> `\\frac{1`);
      - a box spanning lines: UB's `.` stops at a newline, so it finds no box at all;
      - an unclosed box before a closed one (`\\boxed{x \\boxed{y}`): UB's match starts at the
        first `\\boxed{` (`x \\boxed{y`), ours is the closed one (`y`).
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
                best_start, best = start, (start, i)
        i += 1
    return best


def extract_action(completion: str) -> tuple[str, bool]:
    """(action sent to the env, format_ok), as UnstableBaselines defines them.

    The last closed `\\boxed{X}` with non-empty X gives `[X]` (X as is when it already holds a
    `[`), and format_ok=True. Otherwise (no box, or the last box is empty) the whole completion
    goes to the env, format_ok=False.
    """
    box = _last_boxed(completion)
    if box is not None:
        content = completion[box[0]:box[1]].strip()
        if content:
            return (content if "[" in content else f"[{content}]"), True
    return completion, False


def move_rule(env_id: Optional[str]) -> re.Pattern[str]:
    """The pattern `env_id`'s step reads a move with (first match): ENV_MOVE_RULES, else BRACKETED_MOVE."""
    return next((rule for prefix, rule in ENV_MOVE_RULES.items() if (env_id or "").startswith(prefix)),
                BRACKETED_MOVE)


def action_end(completion: str, env_id: Optional[str] = None, prefix: str = "") -> Optional[int]:
    """Where the move ends in a completion: the index just past the text it is read from. That is
    the closing `}` of the box extract_action takes (the last closed, non-empty \\boxed{}); without
    one the env gets the whole text and reads its first move by its own rule (move_rule(env_id): the
    answer of the move-only templates). `prefix`: the answer prefix the prompt wrote (answer_text);
    the index stays in the completion's own text. None: neither, no move in it (an invalid move)."""
    text = prefix + completion
    box = _last_boxed(text)
    if box is not None and text[box[0]:box[1]].strip():
        return box[1] + 1 - len(prefix)
    match = move_rule(env_id).search(text)
    return None if match is None else match.end() - len(prefix)
