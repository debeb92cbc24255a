"""Overrides that shrink a recipe to a run the default suite can afford: ~0.3 MB of real text, a
512-token vocabulary, a 2-layer model trained for a few steps in fp32."""


def mini_overrides(max_steps: int = 12, warmup_steps: int = 2, every: int = 6) -> list[str]:
    """Dotted overrides for the spine (corpus -> pretrain); `every` sets eval and checkpoint cadence."""
    return [
        "corpus.max_bytes_per_source=120000",
        "tokenizer.vocab_size=512",
        "model.dim=64",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.max_seq_len=64",
        "train.seq_len=64",
        "train.micro_batch_size=4",
        "train.global_batch_tokens=512",
        f"train.max_steps={max_steps}",
        f"train.warmup_steps={warmup_steps}",
        f"train.eval_every={every}",
        "train.eval_batches=2",
        f"train.ckpt_every={every}",
        "train.precision=fp32",
    ]
