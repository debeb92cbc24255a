"""MetricsLogger: the JSONL log and each optional backend, read back with the backend's own reader."""

import json
import math
import struct
import sys

import pytest
from kiln_testing.train import tiny_train_config

from kiln.errors import ConfigError
from kiln.train.metrics import MetricsLogger, flatten_config, mlflow_key, scalars, truncate_metrics

CONFIG = {"train": {"lr": 3e-4, "max_steps": 3, "loggers": ["tensorboard"]}, "model": {"dim": 64}}
TRAIN = [
    {
        "kind": "train",
        "step": 1,
        "loss": 4.0,
        "lr": 1e-4,
        "grad_norm": 2.0,
        "grad_norm/attn": 1.5,
        "sys/cpu_percent": 12.5,
        "note": "text is not a metric",
        "flag": True,
        "bad": math.nan,
    },
    {
        "kind": "train",
        "step": 2,
        "loss": 3.5,
        "lr": 2e-4,
        "grad_norm": 1.0,
        "grad_norm/attn": 0.5,
        "sys/cpu_percent": 20.0,
    },
]
VAL = {"kind": "val", "step": 2, "val_loss": 3.75, "val_bpb": 1.25, "tokens_seen": 4096}
SPIKES = [
    {"kind": "event", "step": 2, "type": "spike", "loss": 9.0, "mean": 3.6},
    {"kind": "event", "step": 3, "type": "spike", "loss": 8.0, "mean": 3.5},
]


def write_run(out, loggers, **kwargs):
    logger = MetricsLogger(out, loggers=loggers, run_name="demo", config=CONFIG, **kwargs)
    for record in [*TRAIN, VAL, *SPIKES]:
        logger.log(record)
    logger.close()


def test_scalars_keeps_finite_numbers_grouped_by_kind():
    assert scalars(TRAIN[0]) == {
        "train/loss": 4.0,
        "train/lr": 1e-4,
        "train/grad_norm": 2.0,
        "train/grad_norm/attn": 1.5,
        "sys/cpu_percent": 12.5,
    }
    assert scalars(VAL) == {"val/val_loss": 3.75, "val/val_bpb": 1.25, "val/tokens_seen": 4096.0}
    assert scalars({"step": 1, "loss": 2.0}) == {"train/loss": 2.0}  # no kind: a training record


def test_flatten_config_and_mlflow_keys():
    assert flatten_config(CONFIG) == {
        "train.lr": 3e-4,
        "train.max_steps": 3,
        "train.loggers": ["tensorboard"],
        "model.dim": 64,
    }
    assert mlflow_key("train/grad_norm/attn") == "train.grad_norm.attn"
    assert mlflow_key("sys/gpu_mem_mb") == "sys.gpu_mem_mb"
    assert mlflow_key("eval/acc@1 (%)") == "eval.acc_1 ___"
    assert mlflow_key("/x/../y/") == "x....y"


def test_mlflow_keys_pass_mlflows_own_name_checks():
    pytest.importorskip("mlflow")
    from mlflow.utils.validation import _validate_metric_name, _validate_param_name

    for key in ("train/grad_norm/attn", "eval/acc@1 (%)", "/x/../y/", "../../etc/passwd", "a//b", "é/ü", "."):
        _validate_metric_name(mlflow_key(key))
        _validate_param_name(mlflow_key(key))


def test_jsonl_is_written_through_and_keeps_every_field(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log(TRAIN[1])
    # Readable before close: a crash right after log() keeps the record.
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == TRAIN[1]
    logger.log(SPIKES[0])
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [TRAIN[1], SPIKES[0]]
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "mlruns").exists()


def test_truncate_metrics_drops_later_steps_and_cut_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    truncate_metrics(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_unknown_logger_names_the_key_and_the_known_ones(tmp_path):
    with pytest.raises(ConfigError) as err:
        MetricsLogger(tmp_path, loggers=["tensorbored"])
    assert err.value.key == "train.loggers"
    assert "'tensorbored'" in err.value.message
    for name in ("tensorboard", "wandb", "mlflow"):
        assert name in err.value.message


@pytest.mark.parametrize(
    "name, modules, extra",
    [
        ("wandb", ["wandb"], "wandb"),
        ("mlflow", ["mlflow", "mlflow.entities", "mlflow.tracking"], "mlflow"),
        ("tensorboard", ["torch.utils.tensorboard"], "tensorboard"),
    ],
)
def test_missing_backend_package_says_what_to_install(tmp_path, monkeypatch, name, modules, extra):
    for module in modules:  # None in sys.modules makes `import module` raise ImportError, even if loaded
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ConfigError) as err:
        MetricsLogger(tmp_path, loggers=[name])
    assert err.value.key == "train.loggers"
    assert f"kiln[{extra}]" in err.value.message


def test_tensorboard_records_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_run(tmp_path, ["tensorboard"])
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()

    def series(tag):
        return [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)]

    assert series("train/loss") == [(1, 4.0), (2, 3.5)]
    assert series("train/grad_norm") == [(1, 2.0), (2, 1.0)]
    assert series("train/grad_norm/attn") == [(1, 1.5), (2, 0.5)]
    assert series("sys/cpu_percent") == [(1, 12.5), (2, 20.0)]
    assert series("val/val_bpb") == [(2, 1.25)]
    assert series("event/spike") == [(2, 1.0), (3, 2.0)]  # a running count per event type
    tags = acc.Tags()["scalars"]
    assert not any(t.endswith(("/note", "/flag", "/bad")) for t in tags)
    events = acc.Tensors("events/text_summary")
    assert [e.step for e in events] == [2, 3]
    assert json.loads(events[0].tensor_proto.string_val[0]) == {k: v for k, v in SPIKES[0].items() if k != "kind"}
    config = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"lr": 0.0003' in config


def read_wandb_records(path):
    """The protobuf records of a .wandb file: W&B's LevelDB-style log (7-byte file header, then
    32 KiB blocks of chunks, each with a crc32/length/type header), decoded with wandb's own schema."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # too little room for a chunk header: the writer padded to the next block
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out = tmp_path / "run"
    write_run(out, ["wandb"])
    files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    records = read_wandb_records(files[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == "demo"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["train"]["lr"] == 3e-4 and config["model"] == {"dim": 64}
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            history[row["_step"]] = row
    assert history[1]["train/loss"] == 4.0 and history[1]["train/grad_norm/attn"] == 1.5
    assert history[1]["sys/cpu_percent"] == 12.5 and "train/note" not in history[1]
    # One W&B step holds everything logged at it: the train row, the validation and the event.
    assert history[2]["train/loss"] == 3.5 and history[2]["val/val_bpb"] == 1.25
    assert history[2]["event/spike"] == 1 and json.loads(history[2]["event/text"])["loss"] == 9.0
    assert history[3]["event/spike"] == 2
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finished cleanly


def test_mlflow_file_store_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    write_run(tmp_path, ["mlflow"])
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    runs = client.search_runs([client.get_experiment_by_name("kiln").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == "demo" and run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "0.0003" and run.data.params["model.dim"] == "64"
    assert json.loads(run.data.params["train.loggers"]) == ["tensorboard"]

    def series(key):
        return [
            (m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        ]

    # "grad_norm" and "grad_norm/attn" both kept: "/" would make one a file and the other a folder.
    assert series("train.grad_norm") == [(1, 2.0), (2, 1.0)]
    assert series("train.grad_norm.attn") == [(1, 1.5), (2, 0.5)]
    assert series("sys.cpu_percent") == [(1, 12.5), (2, 20.0)]
    assert series("val.val_loss") == [(2, 3.75)]
    assert series("event.spike") == [(2, 1.0), (3, 2.0)]
    assert not any(key.endswith(("note", "flag", "bad")) for key in run.data.metrics)
    events = client.download_artifacts(run.info.run_id, "events.jsonl", str(tmp_path / "dl"))
    assert [json.loads(line)["step"] for line in open(events)] == [2, 3]


def test_all_backends_at_once_and_jsonl_unchanged(tmp_path, monkeypatch):
    for module in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(module)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    write_run(tmp_path, ["tensorboard", "wandb", "mlflow"])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(TRAIN) + 1 + len(SPIKES)
    assert json.loads(lines[-1]) == SPIKES[-1]
    assert (tmp_path / "tensorboard").is_dir() and (tmp_path / "mlruns").is_dir()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_tensorboard_after_resume_shows_the_resumed_run_not_the_lost_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, loggers=["tensorboard"])
    for step in (1, 2, 3):
        logger.log({"kind": "train", "step": step, "loss": 10.0 + step})
        if step != 2:
            logger.log({"kind": "event", "step": step, "type": "spike"})
    logger.close()
    truncate_metrics(tmp_path / "metrics.jsonl", 1)  # what the trainer does when resuming from step 1
    logger = MetricsLogger(tmp_path, loggers=["tensorboard"])
    for step in (2, 3):
        logger.log({"kind": "train", "step": step, "loss": float(step)})
    logger.log({"kind": "event", "step": 3, "type": "spike"})
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 11.0), (2, 2.0), (3, 3.0)]
    # The lost attempt's spike at step 3 is gone; the count goes on from the kept one at step 1.
    assert [(e.step, e.value) for e in acc.Scalars("event/spike")] == [(1, 1.0), (3, 2.0)]


def test_a_training_run_reaches_every_backend(tmp_path, monkeypatch, tiny_pack_factory):
    """The Trainer's real records (per-group grad norms, sys/ metrics, validation) through all three."""
    for module in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(module)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from kiln.model import ModelConfig
    from kiln.train import Trainer

    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    pack = tiny_pack_factory(tmp_path / "pack")
    cfg = tiny_train_config(
        max_steps=4, warmup_steps=1, log_every=2, eval_batches=1, loggers=["tensorboard", "wandb", "mlflow"]
    )
    out = tmp_path / "run" / "pretrain"
    Trainer(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32), cfg, pack, out).fit()
    train = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "train"
    ]
    assert [r["step"] for r in train] == [2, 4]
    numeric = sorted(k for k in train[-1] if k not in ("kind", "step") and not isinstance(train[-1][k], bool))
    assert "grad_norm/attn" in numeric and "sys/rss_mb" in numeric

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tb_tags = set(acc.Tags()["scalars"])
    assert {k if k.startswith("sys/") else f"train/{k}" for k in numeric} <= tb_tags
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx([r["loss"] for r in train])
    assert "val/val_loss" in tb_tags

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    run = client.search_runs([client.get_experiment_by_name("kiln").experiment_id])[0]
    assert run.info.run_name == "run/pretrain" and run.data.params["train.max_steps"] == "4"
    assert set(run.data.metrics) >= {mlflow_key(k if k.startswith("sys/") else f"train/{k}") for k in numeric}
    history = client.get_metric_history(run.info.run_id, "train.grad_norm.attn")
    assert sorted((m.step, m.value) for m in history) == [
        (r["step"], pytest.approx(r["grad_norm/attn"])) for r in train
    ]

    (wandb_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    rows = [
        {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
        for r in read_wandb_records(wandb_file)
        if r.WhichOneof("record_type") == "history"
    ]
    assert [row["train/loss"] for row in rows if "train/loss" in row] == pytest.approx([r["loss"] for r in train])
