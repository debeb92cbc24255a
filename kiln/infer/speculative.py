"""Speculative decoding (Leviathan et al. 2023, Chen et al. 2023): a small draft model proposes k tokens
one by one, the target model scores all of them in one forward pass over its KV cache, and a rejection
rule keeps a prefix of the proposals plus one token of the target's own, so that every token emitted
is distributed exactly as the target alone would sample it.

Acceptance, for proposal d_i drawn from the draft's distribution q_i, with p_i the target's at the same
position (both after temperature, top-k, top-p and min-p):
- keep d_i with probability min(1, p_i(d_i) / q_i(d_i)), and go on to d_{i+1};
- at the first rejection emit a token drawn from the residual max(0, p_i - q_i), normalised, and stop;
- when all k are kept, emit a bonus token from p_{k+1}, which the same target pass computed.
Summing over the two ways to emit x gives min(q(x), p(x)) + max(0, p(x) - q(x)) = p(x). Greedy decoding
is the special case where p and q are one-hot: a proposal is kept when it is the target's argmax, and the
first mismatch is replaced by that argmax, so the output equals the target's greedy output.

Batches keep the engine's per-row layout: rows accept different numbers of tokens, so after a step each
row's cache length is set to what it accepted (KVCache.set_lengths) and the rejected tail is simply
overwritten later. Draft proposals are not free: a step costs k draft forwards and one target forward
over k + 1 tokens, so it pays when the draft is much cheaper than the target and agrees with it often.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kiln.errors import ConfigError
from kiln.infer.config import SamplingParams
from kiln.infer.engine import Completion, Engine, TextStream
from kiln.infer.kv_cache import KVCache
from kiln.infer.sampling import sampling_logits


@dataclass
class SpeculativeStats:
    """Counts of the last generate call: proposals made and kept, forward passes of each model."""

    proposed: int = 0
    accepted: int = 0
    target_calls: int = 0  # prefill included
    draft_calls: int = 0  # prefill included
    tokens: int = 0  # tokens emitted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from: fp32 softmax of the filtered, tempered logits."""
    return sampling_logits(logits.float(), params).softmax(dim=-1)


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    return torch.cat([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(generators)])


def accept_drafts(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: torch.Tensor, generators: Sequence[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule for one step of a batch.

    target_probs [B, k+1, V]: the target's distributions at the k proposals and after them; draft_probs
    [B, k, V]: the distributions the proposals drew from; drafts [B, k]. Returns (accepted [B], the
    count of leading proposals kept, and next [B], the token emitted after them: from the residual
    at the first rejection, or from target_probs[:, k] when all were kept)."""
    batch, k = drafts.shape
    p = target_probs[:, :k].gather(2, drafts[:, :, None])[..., 0]
    q = draft_probs.gather(2, drafts[:, :, None])[..., 0]
    u = torch.stack([torch.rand(k, generator=g, device=drafts.device) for g in generators])
    # u < p/q, written without the division; q > 0 because each proposal was drawn from q.
    keep = u * q < p
    accepted = keep.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(batch, device=drafts.device)
    at = accepted.clamp(max=k - 1)
    residual = (target_probs[rows, at] - draft_probs[rows, at]).clamp(min=0)
    # p == q leaves no residual, but then every proposal is kept (u < 1), so this row takes the bonus.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_probs[rows, at])
    final = torch.where((accepted == k)[:, None], target_probs[:, k], residual)
    return accepted, _draw(final / final.sum(-1, keepdim=True), generators)


class SpeculativeEngine:
    """Generation from `target` with proposals from `draft` (same vocabulary). Same interface and
    outputs as Engine.generate except repetition_penalty, which is not supported: its distribution
    would depend on which proposals are kept. stats holds the counts of the last call."""

    def __init__(self, target, draft, tokenizer=None, k: int = 4):
        if k < 1:
            raise ConfigError("k", f"the draft must propose at least 1 token per step, got {k}")
        if draft.cfg.vocab_size != target.cfg.vocab_size:
            raise ConfigError(
                "draft",
                f"draft vocab_size {draft.cfg.vocab_size} differs from the target's "
                f"{target.cfg.vocab_size}; both must share the tokenizer",
            )
        if draft.cfg.max_seq_len < target.cfg.max_seq_len:
            raise ConfigError(
                "draft",
                f"draft max_seq_len {draft.cfg.max_seq_len} is shorter than the target's {target.cfg.max_seq_len}",
            )
        self.target, self.draft, self.tokenizer, self.k = target, draft, tokenizer, k
        self._engine = Engine(target, tokenizer)  # prompt checks, encoding and seeding as the engine does them
        self.stats = SpeculativeStats()

    def generate(
        self,
        prompts,
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
        params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty)
        params.validate()
        if params.repetition_penalty != 1.0:
            # The acceptance test compares draft and target distributions position by position; a
            # penalty would change the target's at every drafted position by the tokens before it.
            raise ConfigError("repetition_penalty", "speculative decoding does not apply one; leave it at 1.0")
        prompts = [self._engine._encode(p) for p in prompts]
        self._engine._check(prompts, max_new_tokens, stop_strings)
        models = (self.target, self.draft)
        modes = [m.training for m in models]
        for m in models:
            m.eval()
        try:
            with torch.inference_mode():
                return self._run(prompts, max_new_tokens, params, stop_token_ids, stop_strings, seed)
        finally:
            for m, mode in zip(models, modes):
                m.train(mode)

    def _run(self, prompts, max_new_tokens, params, stop_token_ids, stop_strings, seed) -> list[Completion]:
        target = self.target
        device = next(target.parameters()).device
        batch, lengths = len(prompts), [len(p) for p in prompts]
        longest, max_seq_len = max(lengths), target.cfg.max_seq_len
        # Rows still running hold at most prompt + max_new_tokens - 1 tokens and add k + 1 more.
        max_len = min(max_seq_len, longest + max_new_tokens + self.k - 1)
        t_cache, d_cache, t_logits = self._prefill(prompts, max_len)
        self.stats = SpeculativeStats(target_calls=1, draft_calls=1)

        generators = self._engine._generators(seed, batch, device)
        outs = [Completion([], None, "length", prompt_tokens=n) for n in lengths]
        texts = [TextStream(self.tokenizer, stop_strings) if self.tokenizer is not None else None for _ in range(batch)]
        stop_ids = {int(t) for t in stop_token_ids}
        rows = list(range(batch))
        # The first token comes from the prefill's logits, as in Engine; then the invariant of the
        # loop holds: the target cache has every committed token but the last, the draft cache lags
        # by the tokens in `pending` (one, or two after a step that kept every proposal).
        first = self._pick(t_logits[:, 0], params, generators)
        keep = self._commit(
            outs,
            texts,
            rows,
            [[int(t)] for t in first],
            t_logits,
            params,
            stop_ids,
            lengths,
            max_new_tokens,
            max_seq_len,
        )
        pending = [[int(first[r])] for r in range(batch)]
        while keep:
            if len(keep) < len(rows):
                t_cache.keep(keep)
                d_cache.keep(keep)
                rows = [rows[r] for r in keep]
                generators = [generators[r] for r in keep]
                texts = [texts[r] for r in keep]
                pending = [pending[r] for r in keep]
            committed = [lengths[row] + len(outs[row].ids) for row in rows]
            k = max(1, min(self.k, max_len - max(committed)))
            drafts, d_probs = self._propose(d_cache, pending, k, params, generators, device)
            last_ids = torch.tensor([p[-1] for p in pending], device=device)
            chunk = torch.cat([last_ids[:, None], drafts], dim=1)
            t_logits = target(chunk, kv_cache=t_cache).float()  # [B, k + 1, V]
            self.stats.target_calls += 1
            self.stats.proposed += k * len(rows)
            if params.temperature == 0:
                best = t_logits.argmax(dim=-1)
                match = (drafts == best[:, :k]).long().cumprod(dim=1)
                accepted = match.sum(dim=1)
                nxt = best.gather(1, accepted[:, None])[:, 0]
            else:
                accepted, nxt = accept_drafts(_probs(t_logits, params), d_probs, drafts, generators)
            accepted_l, nxt_l, drafts_l = accepted.tolist(), nxt.tolist(), drafts.tolist()
            self.stats.accepted += sum(accepted_l)
            new = [drafts_l[r][:a] + [nxt_l[r]] for r, a in enumerate(accepted_l)]
            t_cache.set_lengths([c + a for c, a in zip(committed, accepted_l)])
            d_cache.set_lengths([c + min(a, k - 1) for c, a in zip(committed, accepted_l)])
            pending = [([drafts_l[r][k - 1]] if a == k else []) + [nxt_l[r]] for r, a in enumerate(accepted_l)]
            keep = self._commit(
                outs, texts, rows, new, t_logits, params, stop_ids, lengths, max_new_tokens, max_seq_len
            )
        return outs

    def _prefill(self, prompts, max_len: int):
        """Both models read the right-padded prompts into new caches of max_len slots: (target cache,
        draft cache, the target's logits [B, 1, vocab] after each prompt's last token)."""
        target, draft = self.target, self.draft
        device = next(target.parameters()).device
        batch, lengths = len(prompts), [len(p) for p in prompts]
        t_cache, d_cache = KVCache.for_model(target, batch, max_len), KVCache.for_model(draft, batch, max_len)
        tokens = torch.zeros(batch, max(lengths), dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = torch.tensor(prompt, device=device)
        last = torch.tensor(lengths, device=device) - 1
        t_logits = target(tokens, kv_cache=t_cache)[torch.arange(batch, device=device), last][:, None].float()
        t_cache.set_lengths(lengths)
        draft(tokens, kv_cache=d_cache)
        d_cache.set_lengths(lengths)
        return t_cache, d_cache, t_logits

    def _propose(self, cache: KVCache, pending, k, params, generators, device):
        """k proposals per row from the draft, and the distributions they were drawn from [B, k, V]."""
        width = max(len(p) for p in pending)
        feed = torch.zeros(len(pending), width, dtype=torch.long, device=device)
        for r, p in enumerate(pending):
            feed[r, : len(p)] = torch.tensor(p, device=device)
        start = cache.lengths
        logits = self.draft(feed, kv_cache=cache)
        cache.set_lengths([n + len(p) for n, p in zip(start, pending)])
        logits = logits[
            torch.arange(len(pending), device=device), torch.tensor([len(p) - 1 for p in pending], device=device)
        ].float()
        drafts, probs = [], []
        for i in range(k):
            if params.temperature == 0:
                token = logits.argmax(dim=-1)
            else:
                probs.append(_probs(logits, params))
                token = _draw(probs[-1], generators)
            drafts.append(token)
            if i < k - 1:
                logits = self.draft(token[:, None], kv_cache=cache)[:, -1].float()
        self.stats.draft_calls += k
        return torch.stack(drafts, dim=1), (torch.stack(probs, dim=1) if probs else None)

    def _pick(self, logits, params, generators) -> torch.Tensor:
        if params.temperature == 0:
            return logits.argmax(dim=-1)
        return _draw(_probs(logits, params), generators)

    def _commit(
        self, outs, texts, rows, new, t_logits, params, stop_ids, lengths, max_new_tokens, max_seq_len
    ) -> list[int]:
        """Append each row's new tokens (new[r][i] was scored by t_logits[r, i]) until the row ends;
        returns the positions in `rows` of the rows still running."""
        logprobs = t_logits.log_softmax(dim=-1)
        temp = logprobs if params.temperature == 0 else (t_logits / params.temperature).log_softmax(dim=-1)
        sampled = None if params.temperature == 0 else sampling_logits(t_logits, params).log_softmax(dim=-1)
        keep = []
        for r, row in enumerate(rows):
            out, text, finish = outs[row], texts[r], None
            for i, token in enumerate(new[r]):
                self.stats.tokens += 1
                out.ids.append(token)
                out.logprobs.append(float(logprobs[r, i, token]))
                out.temperature_logprobs.append(float(temp[r, i, token]))
                out.sampling_logprobs.append(0.0 if sampled is None else float(sampled[r, i, token]))
                stop = None
                if token in stop_ids:
                    finish, stop = "stop", token
                elif text is not None:
                    _, stop = text.push(token)
                    finish = "stop" if stop is not None else None
                if finish is None and (len(out.ids) == max_new_tokens or lengths[row] + len(out.ids) >= max_seq_len):
                    finish = "length"
                if finish is not None:
                    out.finish_reason, out.stop = finish, stop
                    break
            if text is not None:
                if finish is not None:
                    text.finish()  # releases what was held back as a possible stop string
                out.text = text.text
            if finish is None:
                keep.append(r)
        return keep
