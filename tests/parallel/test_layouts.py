"""Every parallel layout trains like one process: same per-step losses, same final weights.

Each case launches tests/parallel/layout_worker.py under torchrun with gloo on CPU (4 processes on
2 cores is slow but exact enough) and compares with a single-process fit of the same recipe. In
fp32 the only differences are the order of floating-point sums across ranks.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.model import ModelConfig
from kiln.model.weights import load_weights
from kiln.train.config import TrainConfig
from kiln.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("layout_worker.py")
MODEL = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=64)
TRAIN = dict(
    seq_len=16,
    micro_batch_size=2,
    global_batch_tokens=128,
    max_steps=4,
    lr=1e-2,
    warmup_steps=1,
    precision="fp32",
    log_every=1,
    eval_every=2,
    eval_batches=2,
    ckpt_every=2,
    peak_flops=1e12,
)
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4
# Adam divides each gradient by its own running RMS, so an element whose gradient is ~1e-8 moves by
# up to lr whatever its sign noise: reduction-order differences show up as ~1e-5 weight changes.
# A real error (a missing or doubled reduction, a wrong shard) moves weights by ~lr = 1e-2.
WEIGHT_ATOL = 1e-4


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tiny_pack_factory):
    return tiny_pack_factory(tmp_path_factory.mktemp("pack"))


def launch(
    pack, out, nproc: int, parallel: dict, model=None, train=None, resume="none", timeout=600, kill=None, max_restarts=0
):
    spec = {
        "parallel": parallel,
        "model": {**MODEL, **(model or {})},
        "train": {**TRAIN, **(train or {})},
        "resume": resume,
        "kill_rank_after_step": kill,
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        str(WORKER),
        str(pack),
        str(out),
        json.dumps(spec),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((Path(out) / f"summary-{nproc}.json").read_text())


def losses(out, key: str = "loss", kind: str = "train") -> list[float]:
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in records if r["kind"] == kind]


def single_process(pack, out, dp: int = 1, model=None, train=None):
    """The reference: one process whose micro-batch is the dp ranks' micro-batches together."""
    train = {**TRAIN, **(train or {})}
    train["micro_batch_size"] *= dp
    Trainer(ModelConfig(**{**MODEL, **(model or {})}), TrainConfig(**train), pack, out, resume="none").fit()
    val = [losses(out, key, "val") for key in ("val_loss", "val_sequences")]
    return losses(out), losses(out, "grad_norm"), load_weights(out / "checkpoints")[1], val


@pytest.fixture(scope="module")
def reference(pack, tmp_path_factory):
    cache = {}

    def get(dp: int):
        if dp not in cache:
            cache[dp] = single_process(pack, tmp_path_factory.mktemp(f"single-dp{dp}"), dp)
        return cache[dp]

    return get


def assert_same_training(out, expected):
    ref_losses, ref_grad_norms, ref_weights, (ref_val_losses, ref_val_sequences) = expected
    assert losses(out) == pytest.approx(ref_losses, rel=LOSS_RTOL)
    # eval_batches whole global batches: the layout and the single process evaluate the same sample.
    assert losses(out, "val_sequences", "val") == ref_val_sequences
    assert losses(out, "val_loss", "val") == pytest.approx(ref_val_losses, rel=LOSS_RTOL)
    # Adam hides a wrongly scaled gradient; the clipped norm does not.
    assert losses(out, "grad_norm") == pytest.approx(ref_grad_norms, rel=GRAD_NORM_RTOL)
    weights = load_weights(Path(out) / "checkpoints")[1]
    assert weights.keys() == ref_weights.keys()
    for name, tensor in ref_weights.items():
        torch.testing.assert_close(
            weights[name], tensor, rtol=0, atol=WEIGHT_ATOL, msg=lambda m, name=name: f"{name}: {m}"
        )


CASES = {
    # name: (processes, [parallel] table, data-parallel degree)
    "fsdp": (2, {"dp_shard": 2}, 2),
    "tp_sp": (2, {"tp": 2, "dp_shard": 1}, 1),
    "ddp": (2, {"dp_replicate": 2, "dp_shard": 1}, 2),
    # CPU offload is refused on the CPU (the weights are there already); its wrapping and one-rank
    # training are checked in tests/parallel/test_layout_options.py.
    "fsdp_zero2": (2, {"dp_shard": 2, "reshard_after_forward": False}, 2),
    "hsdp": (4, {"dp_replicate": 2, "dp_shard": 2}, 4),
    "fsdp_tp": (4, {"dp_shard": 2, "tp": 2}, 2),
    "cp_ring": (2, {"cp": 2, "dp_shard": 1}, 1),
    "fsdp_cp_allgather": (4, {"dp_shard": 2, "cp": 2, "cp_backend": "allgather"}, 2),
    "tp_cp": (4, {"tp": 2, "cp": 2, "dp_shard": 1}, 1),
    "pp_gpipe": (2, {"pp": 2, "dp_shard": 1, "pp_schedule": "gpipe", "pp_microbatches": 2}, 1),
    "pp_1f1b": (2, {"pp": 2, "dp_shard": 1, "pp_schedule": "1f1b", "pp_microbatches": 2}, 1),
    "pp_interleaved": (
        2,
        {"pp": 2, "dp_shard": 1, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 2, "pp_microbatches": 2},
        1,
    ),
    "pp_fsdp": (4, {"pp": 2, "dp_shard": 2, "pp_microbatches": 2}, 2),
    "pp_tp": (4, {"pp": 2, "tp": 2, "dp_shard": 1, "pp_microbatches": 2}, 1),
    "pp_fsdp_tp": (8, {"pp": 2, "dp_shard": 2, "tp": 2, "pp_microbatches": 2}, 2),
}
FAST = {"fsdp", "tp_sp", "cp_ring", "pp_1f1b"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in CASES])
def test_layout_matches_single_process(case, pack, reference, tmp_path):
    nproc, parallel, dp = CASES[case]
    launch(pack, tmp_path, nproc, parallel)
    assert_same_training(tmp_path, reference(dp))


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize("case", ["fsdp", "tp_sp", "cp_ring", "pp_1f1b"])
def test_selective_checkpointing_matches_single_process(case, pack, reference, tmp_path):
    # Selective checkpointing under each parallelism (its policy keeps TP's reduce-scatters, CP's
    # attention runs again in backward, each pipeline stage checkpoints its own blocks) trains like
    # the single process without checkpointing.
    nproc, parallel, dp = CASES[case]
    launch(pack, tmp_path, nproc, parallel, train={"activation_checkpointing": "selective"})
    assert_same_training(tmp_path, reference(dp))


@pytest.mark.parametrize("case", ["fsdp", "pp_1f1b"])
def test_whole_split_validation_under_a_layout(case, pack, tmp_path):
    """The default validation, every window once, on ranks that must all run the same forwards: the
    last partial global batch is shared evenly (under a pipeline, in whole microbatches)."""
    nproc, parallel, dp = CASES[case]
    launch(pack, tmp_path, nproc, parallel, train={"eval_batches": 0})
    windows = (len(np.fromfile(Path(pack) / "val" / "synthetic-00000.bin", dtype="<u2")) - 1) // TRAIN["seq_len"]
    global_batch = TRAIN["micro_batch_size"] * dp
    per_rank_multiple = parallel.get("pp_microbatches", 1)
    tail = windows % global_batch // dp // per_rank_multiple * per_rank_multiple * dp
    expected = windows - windows % global_batch + tail
    assert expected < windows  # this pack leaves a tail that the ranks cannot all share
    assert losses(tmp_path, "val_sequences", "val") == [expected, expected]
    assert losses(tmp_path, "val_tokens", "val") == [expected * TRAIN["seq_len"]] * 2


MOE = {"moe_every": 2, "n_experts": 4, "moe_top_k": 2}
MOE_CASES = {
    # Experts split over 2 ranks (all-to-all dispatch), the rest of the model FSDP-sharded. The
    # ep ranks pool their routing counts, so the load-balancing loss is the whole batch's.
    "ep": (2, {"dp_shard": 2, "ep": 2}, {}),
    # 4 ranks: experts over ep=2, then FSDP-sharded again over the other 2 data-parallel ranks.
    # Each ep group balances its own half of the batch, which is not the whole batch's loss (it
    # is a product of per-expert averages), so this comparison runs without it.
    "fsdp_ep": (4, {"dp_shard": 4, "ep": 2}, {"moe_aux_loss_weight": 0.0}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_expert_parallel_matches_single_process(case, pack, tmp_path):
    nproc, parallel, model = MOE_CASES[case]
    model = {**MOE, **model}
    launch(pack, tmp_path / "ep", nproc, parallel, model=model)
    assert_same_training(tmp_path / "ep", single_process(pack, tmp_path / "single", nproc, model=model))


def test_pipeline_moe_logs_and_trains_the_aux_losses(pack, tmp_path):
    """pp = 2 with an MoE layer in each stage trains and logs what one process does on the same
    micro-batches: cross-entropy plus every stage's load-balance and z-losses (the pipeline once
    logged the cross-entropy alone: 0.025 nats lower here, with two MoE layers). One process with half the micro-batch sees
    the same token groups as the pipeline's 2 microbatches, so even the non-additive balance loss
    is computed over the same tokens."""
    parallel = {"pp": 2, "dp_shard": 1, "pp_schedule": "1f1b", "pp_microbatches": 2}
    launch(pack, tmp_path / "pp", 2, parallel, model=MOE)
    # Twice the eval budget in batches of half the size: the same validation windows as the pipeline's.
    half = {"micro_batch_size": TRAIN["micro_batch_size"] // 2, "eval_batches": 2 * TRAIN["eval_batches"]}
    assert_same_training(tmp_path / "pp", single_process(pack, tmp_path / "single", model=MOE, train=half))


# Muon's Newton-Schulz in fp32: bf16 rounding would turn reduction-order noise into whole bf16 steps.
MUON = {"optimizer": "muon", "muon_ns_dtype": "float32"}
MUON_CASES = {"fsdp": False, "tp_sp": True, "pp_1f1b": True, "fsdp_tp": True}  # name: slow


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow if slow else ()) for c, slow in MUON_CASES.items()]
)
def test_muon_under_a_layout_matches_single_process(case, pack, tmp_path):
    """Muon orthogonalises each whole matrix; under FSDP and tensor parallelism its shards are
    gathered, orthogonalised on one rank and scattered back, so the layout trains like one process."""
    nproc, parallel, dp = CASES[case]
    launch(pack, tmp_path / "layout", nproc, parallel, train=MUON)
    assert_same_training(tmp_path / "layout", single_process(pack, tmp_path / "single", dp, train=MUON))


def test_muon_in_bf16_under_fsdp_trains_like_one_process(pack, tmp_path):
    """torch's default bf16 Newton-Schulz: the owner's bf16 result goes out in the gradient's dtype
    (a bf16 scatter beside fp32 receive buffers would not be one collective). bf16 rounding of
    reduction-order noise allows only a loose bound."""
    train = {"optimizer": "muon", "muon_ns_dtype": "bfloat16"}
    launch(pack, tmp_path / "layout", 2, {"dp_shard": 2}, train=train)
    expected = single_process(pack, tmp_path / "single", 2, train=train)
    assert losses(tmp_path / "layout") == pytest.approx(expected[0], rel=1e-3)


def test_muon_sharded_checkpoint_resumes_in_one_process(pack, tmp_path):
    """Muon's momentum and AdamW's moments, saved as shards by 2 FSDP ranks, continue in one plain
    process exactly as the 2-rank run continued."""
    train = {**MUON, "ckpt_every": 2, "keep_last": 3}
    full = tmp_path / "two"
    launch(pack, full, 2, {"dp_shard": 2}, train=train)
    assert (full / "checkpoints" / "step-00000002" / "sharded" / ".metadata").is_file()
    run = tmp_path / "resumed"
    shutil.copytree(full, run)
    _drop_checkpoints_after(run, 2)
    trainer_cfg = {**TRAIN, **train, "micro_batch_size": TRAIN["micro_batch_size"] * 2}
    Trainer(ModelConfig(**MODEL), TrainConfig(**trainer_cfg), pack, run, resume="auto").fit()
    assert losses(run) == pytest.approx(losses(full), rel=LOSS_RTOL)
    final, expected = load_weights(run / "checkpoints")[1], load_weights(full / "checkpoints")[1]
    for name, tensor in expected.items():
        torch.testing.assert_close(
            final[name], tensor, rtol=0, atol=WEIGHT_ATOL, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.slow
def test_a_single_file_adamw_checkpoint_is_refused_by_a_sharded_muon_run(pack, tmp_path):
    """Resuming a one-process AdamW checkpoint under FSDP with optimizer = "muon": refused by key,
    not loaded into the wrong optimizer."""
    Trainer(ModelConfig(**MODEL), TrainConfig(**{**TRAIN, "max_steps": 2}), pack, tmp_path, resume="none").fit()
    spec = {"parallel": {"dp_shard": 2}, "model": MODEL, "train": {**TRAIN, **MUON}, "resume": "auto"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(WORKER), str(pack), str(tmp_path), json.dumps(spec)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode != 0
    assert "ConfigError: optimizer: the checkpoint's optimizer state was not written by this optimizer" in result.stderr


def _drop_checkpoints_after(run, step: int) -> None:
    for folder in (Path(run) / "checkpoints").glob("step-*"):
        if int(folder.name[len("step-") :]) > step:
            shutil.rmtree(folder)


@pytest.mark.slow
def test_sharded_checkpoint_resumes_on_fewer_ranks(pack, tmp_path):
    """Saved by 4 ranks (FSDP x TP), resumed by 2 (FSDP) and by 1 plain process: the continued
    steps have the same losses and end at the same weights as the uninterrupted 4-rank run."""
    train = {"ckpt_every": 2, "keep_last": 3}
    full = tmp_path / "four"
    launch(pack, full, 4, {"dp_shard": 2, "tp": 2}, train=train)
    assert (full / "checkpoints" / "step-00000002" / "sharded" / ".metadata").is_file()
    for ranks, parallel in ((2, {"dp_shard": 2}), (1, None)):
        run = tmp_path / f"resumed-{ranks}"
        shutil.copytree(full, run)
        _drop_checkpoints_after(run, 2)
        if parallel is None:
            trainer_cfg = {**TRAIN, **train, "micro_batch_size": TRAIN["micro_batch_size"] * 2}
            Trainer(ModelConfig(**MODEL), TrainConfig(**trainer_cfg), pack, run, resume="auto").fit()
        else:
            launch(pack, run, ranks, parallel, train=train, resume="auto")
        assert losses(run) == pytest.approx(losses(full), rel=LOSS_RTOL)
        final, expected = load_weights(run / "checkpoints")[1], load_weights(full / "checkpoints")[1]
        for name, tensor in expected.items():
            torch.testing.assert_close(
                final[name], tensor, rtol=0, atol=WEIGHT_ATOL, msg=lambda m, name=name: f"{ranks} ranks, {name}: {m}"
            )


@pytest.mark.slow
def test_killed_rank_restarts_from_last_checkpoint(pack, tmp_path):
    """torchrun --max-restarts: rank 1 is SIGKILLed after its 4th step; the restarted job resumes from
    the step-2 checkpoint and ends with the uninterrupted run's losses and weights."""
    train = {"ckpt_every": 2}
    clean = tmp_path / "clean"
    launch(pack, clean, 2, {"dp_shard": 2}, train=train)
    faulty = tmp_path / "faulty"
    launch(pack, faulty, 2, {"dp_shard": 2}, train=train, resume="auto", kill=(1, 3), max_restarts=1)
    summary = json.loads((faulty / "summary-2.json").read_text())
    assert summary["resumed_from"].endswith("step-00000002")
    assert losses(faulty) == pytest.approx(losses(clean), rel=LOSS_RTOL)
    final, expected = load_weights(faulty / "checkpoints")[1], load_weights(clean / "checkpoints")[1]
    for name, tensor in expected.items():
        torch.testing.assert_close(final[name], tensor, rtol=0, atol=WEIGHT_ATOL)


@pytest.mark.slow
def test_sharded_checkpoint_converts_to_single_file_and_hf(pack, tmp_path):
    from kiln.cli import main
    from kiln.model import build_model

    transformers = pytest.importorskip("transformers")
    run = tmp_path / "run"
    # Saved with async_save: the shards are written in the background and published at the end.
    launch(pack, run, 2, {"dp_shard": 2, "async_checkpoint": True}, train={"max_steps": 2, "eval_every": 2})
    sharded = run / "checkpoints" / "step-00000002"
    assert (sharded / "sharded").is_dir() and not (sharded / "model.safetensors").exists()
    assert main(["export", "single", str(sharded), str(tmp_path / "single")]) == 0
    cfg, weights, _ = load_weights(tmp_path / "single")
    for name, tensor in load_weights(sharded)[1].items():
        assert torch.equal(weights[name], tensor)
    tokenizer = tmp_path / "tokenizer.json"
    _write_byte_tokenizer(tokenizer, cfg.vocab_size)
    assert main(["export", "hf", str(sharded), str(tmp_path / "hf"), "--tokenizer", str(tokenizer)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    model = build_model(cfg)
    model.load_state_dict(weights)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)


def _write_byte_tokenizer(path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models

    vocab = {"<|endoftext|>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>")).save(str(path))
