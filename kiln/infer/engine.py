"""The inference engine, Kiln's one generator (the sample stage, `kiln generate`, eval, serving and
post-training rollouts all decode through it): a preallocated KV cache, batched prefill then
decode, sampling (kiln.infer.sampling, under kiln.infer.config.SamplingParams), stop rules and
streaming text that never splits a character.

Batches of prompts of different lengths are laid out with per-row lengths rather than left padding:
every row starts at cache slot 0 and position 0, so a prompt gets the same positions and the same
keys whether it runs alone or in a batch, and a row can be dropped from or added to the batch
without moving the others (KVCache.keep, KVCache.extend). Prefill right-pads the prompts to the
longest one; the padded slots of a shorter row are past its length, are never attended to, and are
overwritten by the row's next tokens. See docs/inference.md for the sampling parameters and which
log-probabilities are returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from kiln.errors import ConfigError
from kiln.infer.config import SamplingParams
from kiln.infer.kv_cache import KVCache, encoder_decoder
from kiln.infer.sampling import sample_next_tokens
from kiln.infer.seq2seq import prefill_seq2seq
from kiln.infer.static_decode import CompiledDecoder, cache_length


@dataclass
class StreamToken:
    """One generated token. text is what the token completes: "" while a character's bytes are still
    incomplete or while the text might be the start of a stop string; the last token of a request
    carries finish_reason and whatever text was held back."""

    id: int
    text: str
    logprob: float
    temperature_logprob: float
    sampling_logprob: float
    finish_reason: str | None = None
    stop: int | str | None = None


@dataclass
class Completion:
    """ids include a stop token that ended the request (RL trains on it) and the token that completed
    a stop string; text (with a tokenizer) leaves out the stop token, and ends before a stop string."""

    ids: list[int]
    text: str | None
    finish_reason: str  # "stop" | "length"
    logprobs: list[float] = field(default_factory=list)
    temperature_logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    stop: int | str | None = None  # the stop token id or stop string that matched
    prompt_tokens: int = 0


class WithoutSpecialTokens:
    """A tokenizer view whose decode leaves special tokens (<|user|>, <|endoftext|>, ...) out of the
    text, as transformers' decode(..., skip_special_tokens=True) and vLLM's default do. Give it to
    Engine or TextStream where generated text is compared with theirs (lm-eval's HF backend)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        hf = getattr(tokenizer, "hf", None)  # Kiln's Tokenizer wraps a `tokenizers.Tokenizer`
        self._decode = (
            (lambda ids: hf.decode(list(ids), skip_special_tokens=True)) if hf is not None else tokenizer.decode
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        return self._decode(ids)


class TextStream:
    """Text of a growing list of token ids, given out in pieces that never end inside a character.

    A byte-level tokenizer splits a multi-byte UTF-8 character across tokens; decoding a token alone
    then gives U+FFFD. The ids after the last complete piece are decoded together with the token
    before them (so decoders that strip a leading space treat them as a continuation), and the new
    text is released only once it no longer ends in U+FFFD. With stop strings, text that could be
    the start of one is held back until it is known not to be."""

    def __init__(self, tokenizer, stop_strings: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""  # all complete text so far (cut before a stop string once one matched)
        self.released = 0  # characters of self.text already given out
        self.stopped: str | None = None  # the stop string that matched; nothing is added after it

    def push(self, token: int) -> tuple[str, str | None]:
        """Add a token; returns (new text, the stop string that matched or None)."""
        if self.stopped is not None:
            return "", None
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        now = self.tokenizer.decode(self.ids[self.prefix :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return "", None
        self.prefix, self.read = self.read, len(self.ids)
        return self._add(now[len(before) :], final=False)

    def finish(self) -> str:
        """The rest of the text at the end of the request (an incomplete character decodes to U+FFFD)."""
        if self.stopped is not None:
            return ""
        if self.read < len(self.ids):
            before = self.tokenizer.decode(self.ids[self.prefix : self.read])
            rest = self.tokenizer.decode(self.ids[self.prefix :])[len(before) :]
            self.prefix = self.read = len(self.ids)
            return self._add(rest, final=True)[0]
        return self._add("", final=True)[0]

    def _add(self, piece: str, final: bool) -> tuple[str, str | None]:
        start = max(0, len(self.text) - max((len(s) for s in self.stop_strings), default=0) + 1)
        self.text += piece
        matched, cut = None, len(self.text)
        for stop in self.stop_strings:
            at = self.text.find(stop, start)
            if 0 <= at < cut:
                matched, cut = stop, at
        self.text = self.text[:cut]
        self.stopped = self.stopped or matched
        end = len(self.text)
        if matched is None and not final:
            # Hold back the longest tail that some stop string starts with.
            for size in range(min(end - self.released, max((len(s) for s in self.stop_strings), default=0)), 0, -1):
                if any(s.startswith(self.text[end - size :]) for s in self.stop_strings):
                    end -= size
                    break
        out, self.released = self.text[self.released : end], end
        return out, matched


class Engine:
    """Generation from a kiln Transformer (or T5: kiln.infer.seq2seq) with a KV cache. tokenizer (anything with encode/decode)
    is needed for text, stop strings and string prompts.

    compile_decode=True decodes with a static-shape step compiled by torch.compile
    (kiln.infer.static_decode): the first request of each (batch, cache length bucket) pays the
    compile (seconds to a minute on a CPU), later ones run the compiled graph. Greedy and seeded
    tokens are the eager engine's (tests/infer/test_static_decode.py)."""

    def __init__(self, model, tokenizer=None, compile_decode: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.decoder = CompiledDecoder(model) if compile_decode else None

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        seed: int | Sequence[int] | None = None,
    ) -> list[Completion]:
        """One Completion per prompt, in order. Rows stop independently (stop token, stop string,
        max_new_tokens, or the model's max_seq_len); a finished row leaves the batch. seed: an int
        seeds row i with seed + i, a list gives each row its own; each row draws from its own
        generator, so a row's tokens do not depend on the other rows in the batch."""
        params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty)
        prompts = [self._encode(p) for p in prompts]
        outs = [Completion([], None, "length", prompt_tokens=len(p)) for p in prompts]
        for row, token in self._run(prompts, max_new_tokens, params, stop_token_ids, stop_strings, seed):
            out = outs[row]
            out.ids.append(token.id)
            out.logprobs.append(token.logprob)
            out.temperature_logprobs.append(token.temperature_logprob)
            out.sampling_logprobs.append(token.sampling_logprob)
            if self.tokenizer is not None:
                out.text = (out.text or "") + token.text
            if token.finish_reason is not None:
                out.finish_reason, out.stop = token.finish_reason, token.stop
        return outs

    def stream(
        self,
        prompt: Sequence[int] | str,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        seed: int | None = None,
    ) -> Iterator[StreamToken]:
        """The tokens of one request as they are generated; the same tokens generate([prompt]) gives
        with the same seed, and their texts join to its text."""
        params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty)
        for _, token in self._run([self._encode(prompt)], max_new_tokens, params, stop_token_ids, stop_strings, seed):
            yield token

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("prompts", "text prompts need a tokenizer (Engine(model, tokenizer))")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def _generators(self, seed, batch: int, device) -> list[torch.Generator]:
        if seed is None:
            # Drawn from torch's global generator, so torch.manual_seed still makes a run repeatable.
            seeds = torch.randint(0, 2**62, (batch,)).tolist()
        elif isinstance(seed, int):
            seeds = [seed + row for row in range(batch)]
        else:
            seeds = [int(s) for s in seed]
            if len(seeds) != batch:
                raise ConfigError("seed", f"got {len(seeds)} seeds for {batch} prompts")
        return [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def _check(self, prompts, max_new_tokens, stop_strings) -> None:
        max_seq_len, vocab = self.model.cfg.max_seq_len, self.model.cfg.vocab_size
        if not prompts:
            raise ConfigError("prompts", "no prompts given")
        if max_new_tokens <= 0:
            raise ConfigError("max_new_tokens", f"must be positive, got {max_new_tokens}")
        if stop_strings and self.tokenizer is None:
            raise ConfigError("stop_strings", "stop strings need a tokenizer (Engine(model, tokenizer))")
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ConfigError("prompts", f"prompt {i} is empty; give at least one token (e.g. the eot id)")
            if len(prompt) >= max_seq_len:
                raise ConfigError(
                    "prompts",
                    f"prompt {i} has {len(prompt)} tokens; the model's max_seq_len "
                    f"{max_seq_len} leaves no room to generate",
                )
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ConfigError("prompts", f"prompt {i} has token ids outside 0..{vocab - 1}")

    def _prefill(self, prompts, max_new_tokens, params: SamplingParams):
        """The prompts right-padded into one forward over a new cache: (cache with each row's true
        length, the logits [B, vocab] after each prompt's last token, and the [B, vocab] mask of the
        tokens each prompt holds when the repetition penalty needs it, else None)."""
        model = self.model
        device = next(model.parameters()).device
        if encoder_decoder(model):
            param, cfg = next(model.parameters()), model.cfg

            def make_cache(n_layers: int, batch: int, max_len: int) -> KVCache:
                return KVCache(n_layers, batch, cfg.n_heads, max_len, cfg.head_dim, param.dtype, param.device)

            cache, logits, tokens = prefill_seq2seq(model, prompts, max_new_tokens, make_cache)
        else:
            cache, logits, tokens = self._prefill_decoder(prompts, max_new_tokens, static=self.decoder is not None)
        seen = None
        if params.repetition_penalty != 1.0:  # over the decoder's tokens (the prompt's, for a decoder-only model)
            seen = torch.zeros(len(prompts), logits.shape[-1], dtype=torch.bool, device=device)
            seen.scatter_(1, tokens, True)
            if not encoder_decoder(model):
                seen[:, 0] = torch.tensor([0 in p for p in prompts], device=device)  # 0 was the padding id
        return cache, logits, seen

    def _prefill_decoder(self, prompts, max_new_tokens, static: bool = False):
        model = self.model
        device = next(model.parameters()).device
        lengths = [len(p) for p in prompts]
        batch, longest = len(prompts), max(lengths)
        # A row's last token is sampled but never fed back, so it needs no slot.
        slots = min(model.cfg.max_seq_len, longest + max_new_tokens - 1)
        if static:  # a few cache lengths, so that requests of different lengths share compiled graphs
            slots = cache_length(slots, model.cfg.max_seq_len)
        cache = KVCache.for_model(model, batch, slots)
        tokens = torch.zeros(batch, longest, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = torch.tensor(prompt, device=device)
        logits = model(tokens, kv_cache=cache)
        cache.set_lengths(lengths)
        logits = logits[torch.arange(batch, device=device), torch.tensor(lengths, device=device) - 1].float()
        return cache, logits, tokens

    @torch.inference_mode()
    def _run(self, prompts, max_new_tokens, params: SamplingParams, stop_token_ids, stop_strings, seed):
        """Yields (prompt index, StreamToken) for each token of each row, step by step."""
        params.validate()
        self._check(prompts, max_new_tokens, stop_strings)
        model = self.model
        was_training = model.training
        model.eval()
        try:
            device = next(model.parameters()).device
            batch = len(prompts)
            # What counts against max_seq_len: the decoder's own tokens (its start token) for an
            # encoder-decoder, whose prompt is the encoder's; else the prompt itself.
            lengths = [1] * batch if encoder_decoder(model) else [len(p) for p in prompts]
            cache, logits, seen = self._prefill(prompts, max_new_tokens, params)
            static = self.decoder.start(cache) if self.decoder is not None else None
            rows = list(range(batch))  # the prompt index of each cache row (None: finished, static decode)
            generators = self._generators(seed, batch, device)
            texts = [
                TextStream(self.tokenizer, stop_strings) if self.tokenizer is not None else None for _ in range(batch)
            ]
            stop_ids = {int(t) for t in stop_token_ids}
            generated = [0] * batch
            while True:
                new, logprob, temp_logprob, sample_logprob = sample_next_tokens(logits, params, seen, generators)
                keep = []
                for r, row in enumerate(rows):
                    if row is None:
                        continue
                    token, text = new[r], texts[r]
                    generated[row] += 1
                    piece, finish, stop = "", None, None
                    if token in stop_ids:
                        finish, stop = "stop", token
                    elif text is not None:
                        piece, stop = text.push(token)
                        finish = "stop" if stop is not None else None
                    if finish is None and (
                        generated[row] == max_new_tokens or lengths[row] + generated[row] >= model.cfg.max_seq_len
                    ):
                        finish = "length"
                    if finish is not None and text is not None:
                        piece += text.finish()
                    if finish is None:
                        keep.append(r)
                    yield row, StreamToken(token, piece, logprob[r], temp_logprob[r], sample_logprob[r], finish, stop)
                if not keep:
                    return
                next_ids = torch.tensor(new, device=device)
                if seen is not None:
                    seen[torch.arange(len(rows), device=device), next_ids] = True
                if static is not None:
                    # Finished rows stay in the batch, so the step keeps its shapes; their tokens are dropped.
                    rows = [row if r in keep else None for r, row in enumerate(rows)]
                    logits = static.step(next_ids[:, None])
                    continue
                if len(keep) < len(rows):
                    cache.keep(keep)
                    index = torch.tensor(keep, device=device)
                    next_ids = next_ids[index]
                    seen = seen[index] if seen is not None else None
                    rows = [rows[r] for r in keep]
                    generators = [generators[r] for r in keep]
                    texts = [texts[r] for r in keep]
                forward = model.decode if encoder_decoder(model) else model
                logits = forward(next_ids[:, None], kv_cache=cache)[:, -1].float()
        finally:
            model.train(was_training)
