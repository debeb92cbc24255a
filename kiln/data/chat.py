"""Kiln's chat format: conversations to token ids with a loss mask on the assistant's turns.

A conversation renders as the reserved role tokens around each message's text, with nothing added
between them (no newlines, no role names in text):

    <|system|>{system}<|end|><|user|>{user}<|end|><|assistant|>{reply}<|end|><|user|>...

The system message is optional and comes first. A generation prompt is the rendered history plus
`<|assistant|>`; the model's reply ends with `<|end|>` (generation also stops at `<|endoftext|>`).
The loss mask is 1 on the assistant's text and on the `<|end|>` that closes it, so the model
learns both what to answer and when to stop; role tokens and user/system text are 0.

Each message's text is tokenised on its own, with special-token parsing off: a literal "<|end|>"
typed by a user stays ordinary text and can never end a turn early. Because every message is
encoded separately between fixed control tokens, rendering is prefix-preserving (the ids of a
conversation start with the ids of any shorter history), so no merge across a turn boundary can
shift the mask, which is the check TRL has to make when it tokenises prompt and completion apart.

`CHAT_TEMPLATE` is the same format as a Jinja template for `tokenizer_config.json`, so
`transformers`' `apply_chat_template` (and servers built on it, such as vLLM) give exactly these
ids; `TRAINING_CHAT_TEMPLATE` adds `{% generation %}` markers so that
`return_assistant_tokens_mask=True` gives exactly this loss mask.
"""

from __future__ import annotations

from typing import Sequence

from kiln.errors import DataError

ROLES = ("system", "user", "assistant")
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END = "<|end|>"
STOP_TOKENS = (END, "<|endoftext|>")
PAD = "<|pad|>"

# Role tokens are spelled out per branch rather than built as '<|' + role + '|>', so a caller's
# role string can never produce a control token, and transformers' sanitize_control_tokens can
# tell template tokens from message text.
_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is not string -%}"
    "{{ raise_exception('message ' ~ loop.index0 ~ ': content must be a string') }}"
    "{%- elif message['role'] == 'system' -%}"
    "{%- if not loop.first -%}"
    "{{ raise_exception('message ' ~ loop.index0 ~ ': a system message may only come first') }}"
    "{%- endif -%}"
    "<|system|>{{ message['content'] }}<|end|>"
    "{%- elif message['role'] == 'user' -%}"
    "<|user|>{{ message['content'] }}<|end|>"
    "{%- elif message['role'] == 'assistant' -%}"
    "<|assistant|>@OPEN@{{ message['content'] }}<|end|>@CLOSE@"
    "{%- else -%}"
    "{{ raise_exception('message ' ~ loop.index0 ~ ': role must be system, user or assistant') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
CHAT_TEMPLATE: str = _TEMPLATE.replace("@OPEN@", "").replace("@CLOSE@", "")
TRAINING_CHAT_TEMPLATE: str = _TEMPLATE.replace("@OPEN@", "{% generation %}").replace("@CLOSE@", "{% endgeneration %}")


def message_problem(messages) -> tuple[str, str] | None:
    """(reason, explanation) for the first thing wrong with `messages`, or None when it renders.

    The reasons are the rejection codes the data readers count.
    """
    if not isinstance(messages, (list, tuple)):
        return "messages_not_list", f"messages must be a list, got {type(messages).__name__}"
    if not messages:
        return "empty_messages", "the conversation has no messages"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return "bad_message", f"message {i} is a {type(message).__name__}, not an object"
        role = message.get("role")
        if role not in ROLES:
            return "unknown_role", f"message {i}: role {role!r} is not one of {', '.join(ROLES)}"
        content = message.get("content")
        if not isinstance(content, str):
            return "content_not_string", f"message {i}: content must be a string, got {type(content).__name__}"
        if role == "system" and i != 0:
            return "misplaced_system", f"message {i}: a system message may only come first"
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from a "\ud800" JSON escape
            return "bad_utf8", f"message {i}: content is not valid Unicode (lone surrogate)"
    return None


def validate_messages(messages) -> None:
    problem = message_problem(messages)
    if problem is not None:
        raise DataError(f"bad conversation: {problem[1]}")


class ChatTokens:
    """The control-token ids of one tokenizer, looked up once."""

    def __init__(self, tokenizer):
        self.role = {role: tokenizer.token_id(token) for role, token in ROLE_TOKENS.items()}
        self.end = tokenizer.token_id(END)
        self.stop = tuple(tokenizer.token_id(token) for token in STOP_TOKENS)
        self.pad = tokenizer.token_id(PAD)


def _assemble(
    tokens: ChatTokens, messages: Sequence[dict], contents: list[list[int]], add_generation_prompt: bool
) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    mask: list[int] = []
    for message, content in zip(messages, contents):
        learn = 1 if message["role"] == "assistant" else 0
        ids.append(tokens.role[message["role"]])
        mask.append(0)
        ids += content
        ids.append(tokens.end)
        mask += [learn] * (len(content) + 1)
    if add_generation_prompt:
        ids.append(tokens.role["assistant"])
        mask.append(0)
    return ids, mask


def render_conversations(
    tokenizer,
    conversations: Sequence[Sequence[dict]],
    add_generation_prompt: bool = False,
) -> list[tuple[list[int], list[int]]]:
    """render_conversation for many conversations, all message texts encoded in one batched
    tokeniser call (which the Rust side may spread over threads)."""
    for k, messages in enumerate(conversations):
        problem = message_problem(messages)
        if problem is not None:
            raise DataError(f"conversation {k}: {problem[1]}")
    tokens = ChatTokens(tokenizer)
    texts = [m["content"] for messages in conversations for m in messages]
    encoded = tokenizer.encode_batch(texts, parse_special=False) if texts else []
    out, start = [], 0
    for messages in conversations:
        out.append(_assemble(tokens, messages, encoded[start : start + len(messages)], add_generation_prompt))
        start += len(messages)
    return out


def render_conversation(
    tokenizer,
    messages: Sequence[dict],
    add_generation_prompt: bool = False,
) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one conversation; messages are {"role", "content"} dicts."""
    validate_messages(messages)
    contents = tokenizer.encode_batch([m["content"] for m in messages], parse_special=False)
    return _assemble(ChatTokens(tokenizer), messages, contents, add_generation_prompt)


def render_prompt(tokenizer, messages: Sequence[dict]) -> list[int]:
    """The ids a model continues to produce the next assistant reply."""
    validate_messages(messages)
    if messages[-1]["role"] == "assistant":
        raise DataError(
            "bad prompt: the last message is the assistant's; a prompt ends with a user "
            "(or system) message and the reply is generated"
        )
    return render_conversation(tokenizer, messages, add_generation_prompt=True)[0]


def hf_tokenizer_config_extra(chat: bool = True) -> dict:
    """Keys to merge into an exported tokenizer_config.json.

    The template is always useful (a base model can still be prompted in the chat format). With
    chat=True (a post-trained model) `<|end|>` becomes the eos token, because that is where a reply
    stops; a pretrained-only model keeps `<|endoftext|>` as its eos.
    """
    extra = {"chat_template": CHAT_TEMPLATE, "pad_token": PAD}
    if chat:
        extra["eos_token"] = END
    return extra
