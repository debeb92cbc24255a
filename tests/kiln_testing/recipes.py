"""Overrides that shrink a recipe to a run the default suite can afford: ~0.3 MB of real text, a
512-token vocabulary, a 2-layer model trained for a few steps in fp32."""

from pathlib import Path

from kiln import pipeline


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


def pretrain_only_recipe(tmp_path: Path, tiny_pack_factory) -> tuple[Path, Path]:
    """(recipe file, its pretrain folder) of a run whose only stage is pretraining, on a tiny pack
    made in place: 8 fp32 steps of a 2-layer model, a checkpoint every 2, validation at the end."""
    tiny_pack_factory(tmp_path / "run" / "pack")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f"""
[run]
name = "run"
out_dir = "{tmp_path}"
stages = ["pretrain"]
[model]
dim = 32
n_layers = 2
n_heads = 4
max_seq_len = 16
[train]
seq_len = 16
micro_batch_size = 2
global_batch_tokens = 64
max_steps = 8
warmup_steps = 2
precision = "fp32"
compile = false
eval_every = 100
ckpt_every = 2
keep_last = 10
peak_flops = 1e12
""")
    return recipe, tmp_path / "run" / "pretrain"


def record_stages(monkeypatch, check_inputs: bool = False) -> list[str]:
    """Replace kiln.pipeline's stage bodies with recorders, so only the pipeline's own logic runs: each
    writes output.txt and appends its name to the returned list. check_inputs: each first asserts that
    the folders of the stages it reads (pipeline._inputs_of) hold their output beside its own."""
    calls = []

    def make(stage):
        def run(recipe, out, **kwargs):
            if check_inputs:
                for upstream in pipeline._inputs_of(recipe, stage):
                    assert (out.parent / upstream / "output.txt").read_text() == upstream
            calls.append(stage)
            (out / "output.txt").write_text(stage)
            return {"stage": stage}

        return run

    monkeypatch.setattr(pipeline, "STAGE_RUNNERS", {s: make(s) for s in pipeline.STAGE_RUNNERS})
    return calls
