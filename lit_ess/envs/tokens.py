"""Token ids of an episode's prompt and observations, without ever re-encoding the policy's tokens.

Plain tokenizer: the prompt is encoded as every prompt is (encode_prompt: bos + text), an observation
is its text encoded with no special tokens, appended after the turn's sampled ids.

Chat template: an observation's tokens are the template's delta for the new messages. With `history`
the conversation so far (ending with the policy's turn as an assistant message, its text decoded from
the sampled ids) the template renders

    before = render(history)                                   ... <assistant text> <eos> close
    after  = render(history + new, add_generation_prompt=True) ... <assistant text> <eos> close <new> <gen>

and the observation tokens are `close + after[len(before):]` (preceded by the eos when the turn did not
end with one: a turn cut by max_new_tokens or a stop string), where `close` are the template's tokens
after the eos that ends an assistant turn (ChatML's '\n'). The sampled ids stand where the template
would put the re-encoded assistant text, so the episode is the sampled ids plus the template's deltas.
A template that rewrites earlier turns when a message is added (e.g. one dropping earlier reasoning)
makes `before` no prefix of `after`: that is an error, since the conversation the model is trained on
would not be the one it is served later.
"""
from __future__ import annotations

from lit_ess.chat import ChatFormat, Prompt

from .base import EnvError, Message, Observation


def encode_prompt(tokenizer, prompt: Prompt, chat: ChatFormat = ChatFormat()) -> list[int]:
    """Token ids of a prompt (text, or chat messages), the same for the RL rollouts and the SFT warm start:
    the chat template (the conversation of `chat.messages` + the generation prompt) when the tokenizer has
    one and `chat.use_template`, else the plain text after a bos (lit_ess.chat)."""
    if getattr(tokenizer, "chat_template", None) and chat.use_template:
        return render_chat(tokenizer, chat.messages(prompt), generation=True, **chat.chat_template_kwargs)
    if not isinstance(prompt, str):
        raise ValueError(no_template(tokenizer, chat, "the prompts are chat messages"))
    if knob := chat.needs_template():
        raise ValueError(no_template(tokenizer, chat, f"data.chat.{knob} is set"))
    return encode_text(tokenizer, prompt)


def no_template(tokenizer, chat: ChatFormat, what: str) -> str:
    """One line: why `what` cannot be rendered without a chat template, naming the model, and the fix."""
    if not chat.use_template:
        return f"{what}, but data.chat.use_template is false: set it to true to render them with the chat template"
    return (f"{what}, but the model {tokenizer.name_or_path!r} has no chat template: use a chat model (e.g. an "
            f"-Instruct checkpoint) or set tokenizer.chat_template in its tokenizer_config.json, or give text prompts")


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of a plain-text prompt (no chat template): a bos, then the text."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
        ids = [tokenizer.bos_token_id] + ids
    return list(ids)


def render_chat(tokenizer, messages: list[Message], generation: bool, tools: list[dict] | None = None,
                **template_kwargs) -> list[int]:
    """Token ids of `messages` in the tokenizer's chat template (+ the generation prompt); `tools` the
    OpenAI tool schemas the template renders, if any; `template_kwargs` variables for the template
    (ChatFormat.chat_template_kwargs). A template that refuses them (its raise_exception, e.g. roles out
    of order) is a TemplateError of one line."""
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True, tools=tools,
                                            **template_kwargs)
    except Exception as e:
        roles = ", ".join(str(m.get("role")) for m in messages)
        raise TemplateError(f"the chat template refuses the messages of roles [{roles}]: {type(e).__name__}: "
                            f"{' '.join(str(e).split())}") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class TemplateError(EnvError):
    """The tokenizer (its chat template, or the lack of one) cannot give token-in-token-out observation
    tokens for what the environment answers."""


class EpisodeTokens:
    """Prompt and observation token ids for one tokenizer (a transformers tokenizer)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self.eos_id = tokenizer.eos_token_id

    def messages(self, obs: Observation, role: str) -> list[Message]:
        """An observation as chat messages (text becomes one message of `role`)."""
        return [{"role": role, "content": obs}] if isinstance(obs, str) else list(obs)

    def text(self, obs: Observation) -> str:
        """An observation as the completions table shows it."""
        return obs if isinstance(obs, str) else "".join(f"[{m['role']}] {m['content']}" for m in obs)

    def prompt(self, obs: Observation, role: str) -> list[int]:
        """The first observation's ids: the prompt, encoded as lit_ess encodes every prompt."""
        if isinstance(obs, str):
            return encode_prompt(self.tok, obs)
        if not self.chat:
            raise TemplateError("reset returned chat messages, but the tokenizer has no chat template: return text")
        return render_chat(self.tok, self.messages(obs, role), generation=True)

    def observation(self, history: list[Message], obs: Observation, role: str, turn_ids: list[int],
                    tools: list[dict] | None = None) -> list[int]:
        """Ids to append after the policy's turn `turn_ids` (the last message of `history`, for a chat model;
        `tools` the tool schemas its template renders)."""
        if not self.chat:
            if not isinstance(obs, str):
                raise TemplateError("answered with chat messages, but the tokenizer has no chat template: return text")
            return list(self.tok(obs, add_special_tokens=False)["input_ids"])
        before = render_chat(self.tok, history, generation=False, tools=tools)
        after = render_chat(self.tok, history + self.messages(obs, role), generation=True, tools=tools)
        if after[:len(before)] != before:
            raise TemplateError("the chat template rewrites earlier turns when a message is added (the conversation "
                                "rendered with the new message does not start with the one rendered without it): "
                                "token in, token out needs a template that only appends")
        ends = [i for i, t in enumerate(before) if t == self.eos_id]
        if not ends:
            raise TemplateError(f"the chat template does not end an assistant turn with the eos token "
                                f"{self.tok.eos_token!r}: the turn's end cannot be placed after the sampled ids")
        close = before[ends[-1] + 1:]
        eos = [] if turn_ids and turn_ids[-1] == self.eos_id else [self.eos_id]
        return eos + close + after[len(before):]
