"""`kiln serve` (the OpenAI-compatible server and chat page) and `kiln chat` (a terminal chat)."""

from __future__ import annotations

import argparse
import os
import sys

from kiln.checkpoint.format import resolve_checkpoint
from kiln.config import finite_float
from kiln.data.chat import chat_stop_ids, render_prompt
from kiln.errors import ConfigError
from kiln.infer.cli import add_compile_decode_arg, add_inference_args, load_for_inference
from kiln.infer.engine import Engine
from kiln.serve.prefix_cache import DEFAULT_MB
from kiln.serve.threads import on_passing_thread

# The post-training stages that train on conversations (kiln.recipe.POST_STAGES less rm, the reward
# model): a checkpoint under a run's folder of one of them has had chat training. kiln.recipe is a
# layer above the server; tests/serve/test_chat_cli.py checks the two lists agree.
CHAT_STAGES = ("sft", "dpo", "ppo", "grpo", "distill")

HELP = """commands:
  /help          this list
  /reset         clear the conversation (the system message stays)
  /system TEXT   set the system message (and clear the conversation); /system alone removes it
  /quit, /exit   leave (so does end of input, Ctrl-D)
a line starting with // sends the rest, starting with /, as a message"""


def chat_trained(checkpoint) -> bool:
    """Whether the checkpoint comes from a stage that trains on chat: its folder lies in a stage
    folder (run/<stage>/...) named in CHAT_STAGES."""
    folder = resolve_checkpoint(checkpoint).resolve()
    return any(part in CHAT_STAGES for part in folder.parts)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint folder, checkpoints root, or stage folder")
    p.add_argument("--tokenizer", help="tokenizer.json (default: found next to the checkpoint)")
    add_inference_args(p)
    add_compile_decode_arg(p)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible API, with a chat page at /")
    _model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model id clients send (default: the checkpoint path as given)")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require 'Authorization: Bearer KEY' (repeatable; also $KILN_API_KEY)",
    )
    p.add_argument("--max-batch", type=int, default=32, help="requests decoded together (continuous batching)")
    p.add_argument("--max-waiting", type=int, default=256, help="requests queued behind them before 429")
    p.add_argument("--max-tokens-limit", type=int, help="largest max_tokens a request may ask (default: context)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (413 above)")
    p.add_argument("--max-prefill-tokens", type=int, default=8192, help="padded prompt tokens prefilled at once")
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=0,
        help="prefill prompts longer than this in chunks of this many tokens between decode steps (0: off)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=finite_float,
        help=f"MiB of prompt-prefix keys/values kept for reuse (default {DEFAULT_MB:g}; 0: off)",
    )
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))

    p = subparsers.add_parser("chat", help="chat with a checkpoint in the terminal (history kept, chat template)")
    _model_args(p)
    p.add_argument("--system", help="system message that starts the conversation")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=finite_float, default=0.7, help="0 is greedy")
    p.add_argument("--top-p", type=finite_float, default=0.95)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, help="turn t samples with seed + t (default: random)")


def build_app(args: argparse.Namespace):
    """(the server's app, the line that announces it) for `kiln serve`'s parsed arguments."""
    from kiln.serve.app import create_app  # fastapi: the optional [serve] extra; `kiln chat` runs without it

    model, tokenizer = load_for_inference(args)
    trained = chat_trained(args.checkpoint)
    keys = list(args.api_key)
    if os.environ.get("KILN_API_KEY"):
        keys.append(os.environ["KILN_API_KEY"])
    name = args.served_model_name or args.checkpoint
    try:
        app = create_app(
            model,
            tokenizer,
            model_name=name,
            api_keys=keys,
            max_body_bytes=args.max_body_bytes,
            max_tokens_limit=args.max_tokens_limit,
            max_batch=args.max_batch,
            max_waiting=args.max_waiting,
            max_prefill_tokens=args.max_prefill_tokens,
            prefill_chunk_tokens=args.prefill_chunk_tokens,
            prefix_cache_mb=args.prefix_cache_mb,
            chat_trained=trained,
        )
    except ConfigError as err:  # what only the loaded model can refuse (dynamic RoPE and a prefix cache)
        raise ConfigError("--" + err.key.replace("_", "-"), err.message, "<command line>") from None
    banner = (
        f"kiln serve: {name} on http://{args.host}:{args.port} (chat page at /, API at /v1, docs at /docs"
        f"{', API key required' if keys else ''}; {next(model.parameters()).dtype}"
        f"{', weights ' + args.quant if args.quant else ''}{'' if trained else '; no chat training'})"
    )
    return app, banner


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    for key in ("max_batch", "max_tokens_limit", "max_body_bytes", "max_prefill_tokens"):
        value = getattr(args, key)
        if value is not None and value < 1:
            raise ConfigError("--" + key.replace("_", "-"), f"must be >= 1, got {value}", "<command line>")
    for key in ("max_waiting", "prefill_chunk_tokens"):
        if getattr(args, key) < 0:
            raise ConfigError("--" + key.replace("_", "-"), f"must be >= 0, got {getattr(args, key)}", "<command line>")
    if args.prefix_cache_mb is not None and args.prefix_cache_mb < 0:
        raise ConfigError(
            "--prefix-cache-mb", f"must be >= 0 (0 is off), got {args.prefix_cache_mb:g}", "<command line>"
        )
    if args.compile_decode:
        # The scheduler adds requests to and drops them from the running batch between steps
        # (KVCache.extend/keep), so its decode shapes change every few steps.
        raise ConfigError(
            "--compile-decode",
            "is not supported by kiln serve: continuous batching changes the batch between steps; "
            "it applies to kiln generate and kiln chat",
            "<command line>",
        )
    app, banner = on_passing_thread(build_app, args)
    print(banner, file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _fit(tokenizer, history: list[dict], want: int, max_seq_len: int, err) -> list[int] | None:
    """The prompt for history, dropping the oldest exchanges (never a system message or the last
    question) until the reply has room for `want` tokens; None if the last question alone is too long."""
    start = 1 if history and history[0]["role"] == "system" else 0
    while True:
        prompt = render_prompt(tokenizer, history)
        if max_seq_len - len(prompt) >= want or len(history) - start <= 1:
            break
        dropped = 2 if len(history) - start > 2 else 1
        del history[start : start + dropped]
        print("(the oldest exchange was dropped to fit the model's context)", file=err, flush=True)
    return prompt if len(prompt) < max_seq_len else None


def _command(text: str, start: list[dict], err) -> tuple[str, list[dict]]:
    """(what to do: "quit", "reset" or "none"; the conversation's new start) for a /command line.
    Confirmations and refusals go to err."""
    word, _, rest = text.strip().partition(" ")
    if word in ("/exit", "/quit"):
        return "quit", start
    if word == "/help":
        print(HELP, file=err, flush=True)
        return "none", start
    if word == "/reset":
        print("(conversation cleared" + (", system message kept)" if start else ")"), file=err, flush=True)
        return "reset", start
    if word == "/system":
        start = [{"role": "system", "content": rest.strip()}] if rest.strip() else []
        print("(system message " + ("set" if start else "removed") + "; conversation cleared)", file=err, flush=True)
        return "reset", start
    print(f"(unknown command {word}: /help lists the commands; // starts a message with /)", file=err, flush=True)
    return "none", start


def run_chat(args: argparse.Namespace, stdin=None, stdout=None, stderr=None) -> int:
    """Read a message per line; print the streamed reply. Lines starting with / are commands
    (/help lists them), never sent to the model. Without a terminal (input piped) only the replies
    go to stdout."""
    stdin, stdout, err = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", f"must be >= 1, got {args.max_new_tokens}", "<command line>")
    model, tokenizer = load_for_inference(args)
    try:
        engine = Engine(model, tokenizer, compile_decode=args.compile_decode)
    except ConfigError as err:  # a model the compiled step cannot serve
        raise ConfigError("--compile-decode", err.message, "<command line>") from None
    stop = chat_stop_ids(tokenizer)
    max_seq_len = model.cfg.max_seq_len
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    interactive = stdin.isatty()
    if interactive:
        print(f"kiln chat: {args.checkpoint} (/help lists the commands, /quit or Ctrl-D quits)", file=err)
    if not chat_trained(args.checkpoint):
        print("(this model has had no chat training: it continues text; `kiln sft` trains a chat model)", file=err)
    turn = 0
    while True:
        if interactive:
            stdout.write("you> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            break
        text = line.rstrip("\r\n")
        if text.startswith("//"):
            text = text[1:]
        elif text.startswith("/"):
            action, start = _command(text, start, err)
            if action == "quit":
                break
            if action == "reset":
                history = list(start)
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        prompt = _fit(tokenizer, history, min(args.max_new_tokens, max_seq_len // 4), max_seq_len, err)
        if prompt is None:
            history.pop()
            print(f"(message too long for the model's context of {max_seq_len} tokens)", file=err, flush=True)
            continue
        if interactive:
            stdout.write("kiln> ")
        reply = ""
        seed = None if args.seed is None else args.seed + turn
        try:
            for token in engine.stream(
                prompt,
                min(args.max_new_tokens, max_seq_len - len(prompt)),
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                stop_token_ids=stop,
                seed=seed,
            ):
                reply += token.text
                stdout.write(token.text)
                stdout.flush()
        except KeyboardInterrupt:  # stops this reply only; what was said so far stays in the history
            print("\n(interrupted)", file=err, flush=True)
        except ConfigError as error:
            raise ConfigError("--" + error.key.replace("_", "-"), error.message, "<command line>") from None
        stdout.write("\n")
        stdout.flush()
        history.append({"role": "assistant", "content": reply})
        turn += 1
    return 0


def run(args: argparse.Namespace) -> int:
    return run_serve(args) if args.verb == "serve" else run_chat(args)


def main(argv: list[str] | None = None) -> int:
    """`python -m kiln.serve.cli serve|chat ...`, the same verbs as `kiln serve|chat`."""
    parser = argparse.ArgumentParser(prog="kiln")
    add_parser(parser.add_subparsers(dest="verb", required=True))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
