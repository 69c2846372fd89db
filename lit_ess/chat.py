"""How a prompt becomes the model's input: text, or a conversation in the model's chat template.

A prompt is text ("37+85=") or a conversation: a list of `{"role", "content"}` messages, the
conversational format of TRL and verl datasets, with or without a system message. `ChatFormat` says
how either is rendered (lit_ess.envs.tokens.encode_prompt does it):

    text, template on (default)   [system_prompt], user: text      -> chat template + generation prompt
    chat, template on             [system_prompt], the messages    -> chat template + generation prompt
    text, template off            bos + text
    chat, template off            refused (a conversation has no plain-text form)

A tokenizer without a chat template renders text prompts as bos + text, as if the template were off,
and refuses chat prompts, a system prompt and template kwargs, naming the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Prompt = str | list[dict[str, str]]          # text, or {"role", "content"} messages

# apply_chat_template arguments lit-ess sets itself: a prompt ends with the generation prompt
RESERVED_KWARGS = ("conversation", "messages", "add_generation_prompt", "continue_final_message", "tokenize",
                   "return_dict", "return_tensors", "tools", "documents", "chat_template", "padding",
                   "truncation", "max_length", "return_assistant_tokens_mask")


@dataclass(frozen=True)
class ChatFormat:
    """How prompts are rendered for the model (`data.chat`).

    Args:
        use_template: render prompts with the tokenizer's chat template and its generation prompt
            (a text prompt becomes one user message), when the tokenizer has one. false: text prompts
            are encoded as plain text (bos + text), as for a base model, and chat prompts are refused.
        system_prompt: a system message put first in every prompt that has none. A chat prompt whose first
            message is a system message keeps its own: the row's data wins, and setup warns once with the
            number of such rows. A non-empty string, or None (default) = no system message added. Needs the
            chat template.
        chat_template_kwargs: extra keyword arguments for `tokenizer.apply_chat_template`, which passes them
            to the template, e.g. {enable_thinking: false} for Qwen3. Default {} = none. Keys are names
            (strings) other than the arguments lit-ess sets itself (add_generation_prompt, tokenize, tools,
            ...). Needs the chat template.
    """
    use_template: bool = True
    system_prompt: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.use_template, bool):
            raise ValueError(f"chat.use_template must be true or false, got {self.use_template!r}")
        if self.system_prompt is not None and (not isinstance(self.system_prompt, str) or not self.system_prompt.strip()):
            raise ValueError(f"chat.system_prompt must be a non-empty string or null, got {self.system_prompt!r}")
        kwargs = self.chat_template_kwargs
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
            raise ValueError(f"chat.chat_template_kwargs must be a mapping of names to values, got {kwargs!r}")
        if taken := sorted(set(kwargs) & set(RESERVED_KWARGS)):
            raise ValueError(f"chat.chat_template_kwargs: {taken} are set by lit-ess (a prompt ends with the "
                             f"generation prompt); leave them out")
        if not self.use_template and (knob := self.needs_template()):
            raise ValueError(f"chat.{knob} needs the chat template, but chat.use_template is false: drop {knob}, "
                             f"or write the instruction into the text prompts (e.g. HFPrompts.template)")

    def needs_template(self) -> str | None:
        """The knob that only a chat template can apply, if one is set."""
        return ("system_prompt" if self.system_prompt is not None
                else "chat_template_kwargs" if self.chat_template_kwargs else None)

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The conversation a prompt is rendered from: a text prompt as one user message, the system
        prompt first where the prompt has no system message."""
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt is not None and not has_system(msgs):
            msgs = [{"role": "system", "content": self.system_prompt}, *msgs]
        return msgs


def check_format(chat) -> None:
    """A data module's `chat` must be a ChatFormat (jsonargparse builds one from a mapping; Python callers
    pass one)."""
    if not isinstance(chat, ChatFormat):
        raise ValueError(f"chat must be a lit_ess.chat.ChatFormat (use_template, system_prompt, chat_template_kwargs), "
                         f"got {chat!r}")


def has_system(prompt: Prompt) -> bool:
    """Whether a chat prompt starts with a system message."""
    return isinstance(prompt, list) and bool(prompt) and prompt[0].get("role") == "system"


def message_problem(prompt: list, field: str = "prompt") -> str | None:
    """What is wrong with a list given as a chat prompt (the column `field`), in words (messages counted
    from 1), or None."""
    if not prompt:
        return f"{field} is an empty list"
    for i, m in enumerate(prompt, 1):
        if not isinstance(m, dict):
            return f"{field} is a list but message {i} is a {type(m).__name__}, not a {{'role', 'content'}} object"
        for key in ("role", "content"):
            if m.get(key) is None:
                return f"{field} is a list but message {i} has no {key!r}"
            if not isinstance(m[key], str):
                return (f"{field} is a list but message {i}'s {key!r} is a {type(m[key]).__name__}, not text"
                        + (" (content parts are not supported)" if key == "content" and isinstance(m[key], list) else ""))
        if not m["role"].strip():
            return f"{field} is a list but message {i}'s 'role' is empty"
    if not any(m["content"].strip() for m in prompt):
        return f"{field} is a list whose messages are all empty"
    return None


def prompt_text(prompt: Prompt) -> str:
    """A prompt as the completions table shows it: text as it is, a conversation as '[role] content' lines."""
    return prompt if isinstance(prompt, str) else "\n".join(f"[{m['role']}] {m['content']}" for m in prompt)
