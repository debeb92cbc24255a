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

import json
from datetime import datetime
from typing import Sequence

from kiln.errors import DataError

ROLES = ("system", "user", "assistant")
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END = "<|end|>"
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
    """The control-token ids of Kiln's chat format in one tokenizer, looked up once."""

    def __init__(self, tokenizer):
        self.role = {role: tokenizer.token_id(token) for role, token in ROLE_TOKENS.items()}
        self.end = tokenizer.token_id(END)
        self.stop = tuple(dict.fromkeys((self.end, tokenizer.eot_id)))  # a reply ends its turn, or the text
        self.pad = tokenizer.token_id(PAD)


def own_template(tokenizer) -> str | None:
    """The tokenizer's own chat template (from its tokenizer_config.json), unless it is Kiln's
    format, which Kiln renders natively (same ids, and message text can never become a control token)."""
    template = getattr(tokenizer, "chat_template", None)
    return None if template is None or template in (CHAT_TEMPLATE, TRAINING_CHAT_TEMPLATE) else template


def has_kiln_chat_tokens(tokenizer) -> bool:
    return all(tokenizer.hf.token_to_id(t) is not None for t in (*ROLE_TOKENS.values(), END, PAD))


def chat_format(tokenizer) -> str | None:
    """ "template" (the tokenizer's own Jinja chat template), "kiln" (Kiln's role tokens) or None."""
    if own_template(tokenizer) is not None:
        return "template"
    return "kiln" if has_kiln_chat_tokens(tokenizer) else None


def no_chat_format(tokenizer, instead: str = "plain completions") -> DataError:
    return DataError(
        f"{tokenizer.path}: the tokenizer has no chat format (no chat_template in its tokenizer_config.json "
        f"and not Kiln's chat tokens <|system|>, <|user|>, <|assistant|>, <|end|>); use {instead}"
    )


def chat_template_text(tokenizer) -> str | None:
    """The Jinja template that renders this tokenizer's chat format (for /tokenizer_info and exports)."""
    kind = chat_format(tokenizer)
    return tokenizer.chat_template if kind == "template" else CHAT_TEMPLATE if kind == "kiln" else None


def chat_stop_ids(tokenizer) -> tuple[int, ...]:
    """The tokens that end a chat reply: Kiln's <|end|> and the end of text, or, with the
    tokenizer's own template, its eos (the token its template closes a turn with)."""
    kind = chat_format(tokenizer)
    if kind is None:
        raise no_chat_format(tokenizer)
    return ChatTokens(tokenizer).stop if kind == "kiln" else (tokenizer.eot_id,)


def render_template(tokenizer, messages: Sequence[dict], add_generation_prompt: bool) -> list[int]:
    """The ids of `messages` rendered with the tokenizer's own template, as transformers'
    apply_chat_template(tokenize=True) gives them: the template sees the messages, add_generation_prompt
    and the special tokens' texts (bos_token, eos_token, ...), and its text is encoded with special
    tokens parsed and none added. As there (and in vLLM), a special token's text typed in a message
    becomes that token."""
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError(
            f"{tokenizer.path}: rendering the tokenizer's chat_template needs the jinja2 package (pip install jinja2)"
        ) from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which chat templates do not expect.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        template = env.from_string(tokenizer.chat_template)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise DataError(f"{tokenizer.path}: chat_template line {err.lineno}: {err.message}") from None
    try:
        text = template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **{key: tokenizer.special[key] for key in tokenizer.special},
        )
    except jinja2.exceptions.TemplateError as err:
        raise DataError(f"bad conversation: the chat template refused it: {err}") from None
    return tokenizer.encode(text, parse_special=True)


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


def kiln_chat_tokens(tokenizer) -> ChatTokens:
    """ChatTokens for rendering and training in Kiln's own format; a tokenizer with its own template
    renders prompts with it, but Kiln's loss masks need Kiln's role tokens."""
    kind = chat_format(tokenizer)
    if kind == "template":
        raise DataError(
            f"{tokenizer.path}: training conversations (their loss mask) needs Kiln's chat tokens; this tokenizer "
            "has its own chat_template, which renders prompts (kiln serve, kiln eval --chat) but not training rows"
        )
    if kind is None:
        raise no_chat_format(tokenizer)
    return ChatTokens(tokenizer)


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
    tokens = kiln_chat_tokens(tokenizer)
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
    """(ids, loss mask) of one conversation in Kiln's format; messages are {"role", "content"} dicts."""
    validate_messages(messages)
    tokens = kiln_chat_tokens(tokenizer)
    contents = tokenizer.encode_batch([m["content"] for m in messages], parse_special=False)
    return _assemble(tokens, messages, contents, add_generation_prompt)


def render_prompt(tokenizer, messages: Sequence[dict]) -> list[int]:
    """The ids a model continues to produce the next assistant reply: Kiln's format, or the
    tokenizer's own chat template when it has one."""
    validate_messages(messages)
    if messages[-1]["role"] == "assistant":
        raise DataError(
            "bad prompt: the last message is the assistant's; a prompt ends with a user "
            "(or system) message and the reply is generated"
        )
    kind = chat_format(tokenizer)
    if kind == "template":
        return render_template(tokenizer, messages, add_generation_prompt=True)
    if kind is None:
        raise no_chat_format(tokenizer)
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
