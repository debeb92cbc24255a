"""Metrics: a JSONL log mirrored to optional backends (TensorBoard, Weights & Biases, MLflow),
peak-FLOPs detection, MFU, peak memory."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import numbers
import os
import re
import resource
import sys
import time
import warnings
from pathlib import Path

import torch

from kiln.errors import ConfigError
from kiln.files import reporting, write_text_atomic

# Dense (non-sparse) bf16 tensor-core peaks from the vendors' data sheets, FLOP/s per device.
# Matched by substring of torch.cuda.get_device_name(), most specific first.
CUDA_BF16_PEAKS = [
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("B100", 1.75e15),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("A10G", 70e12),
    ("A6000", 155e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("4090", 165e12),
    ("3090", 71e12),
    ("V100", 125e12),
    ("T4", 65e12),
    ("MI300X", 1.307e15),
    ("MI250X", 383e12),
]

LOGGERS_KEY = "train.loggers"


def scalars(record: dict) -> dict[str, float]:
    """The record's finite numbers as "<kind>/<key>" (train/loss, train/grad_norm/attn, val/val_bpb);
    system metrics keep their own "sys/" group whatever record carries them. Booleans, strings and
    nested values are not metrics and are left to the JSONL."""
    kind = record.get("kind", "train")
    out = {}
    for key, value in record.items():
        if key in ("step", "kind") or isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        if math.isfinite(value):
            out[key if key.startswith("sys/") else f"{kind}/{key}"] = float(value)
    return out


def flatten_config(config, prefix: str = "") -> dict[str, object]:
    """{"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}; dataclasses are read as dicts; lists stay whole."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, dict):
        return {prefix: config} if prefix else {}
    out: dict[str, object] = {}
    for key, value in config.items():
        out.update(flatten_config(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _jsonable(config) -> dict:
    """A plain JSON copy of the config (paths and other objects as strings) for the backends."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    return json.loads(json.dumps(config or {}, default=str))


def _missing(name: str, package: str, extra: str) -> ConfigError:
    return ConfigError(LOGGERS_KEY, f"the {name!r} logger needs the {package} package: pip install 'kiln[{extra}]'")


def _history(path: Path) -> tuple[int | None, dict[str, int]]:
    """From an existing metrics.jsonl (which a resumed trainer has already cut back to its
    checkpoint): one past its last step (None for a fresh run), and its events counted by type."""
    last, events = None, {}
    if path.is_file():
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                step = record.get("step") if isinstance(record, dict) else None
                if isinstance(step, int) and not isinstance(step, bool):
                    last = step if last is None else max(last, step)
                if isinstance(record, dict) and record.get("kind") == "event":
                    kind = str(record.get("type", "event"))
                    events[kind] = events.get(kind, 0) + 1
    return (None if last is None else last + 1), events


class TensorBoardBackend:
    """Event files under <out>/tensorboard; view with `tensorboard --logdir <out>/tensorboard`."""

    def __init__(self, out_dir: Path, run_name: str | None, config: dict | None, resume_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's wrapper raises ImportError when the tensorboard package is absent
            raise _missing("tensorboard", "tensorboard", "tensorboard") from None
        # On resume, TensorBoard hides what the interrupted attempt logged past the checkpoint, so
        # its curves read like the truncated JSONL instead of doubling back.
        self.writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resume_step)
        if config:
            # Four-space indent: a Markdown code block, which the text dashboard shows verbatim.
            text = json.dumps(_jsonable(config), indent=2)
            self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        # Written through at once, like the JSONL, so a crash loses no logged step.
        self.writer.flush()

    def event(self, step: int, text: str) -> None:
        self.writer.add_text("events", text, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """An offline W&B run under <out>/wandb/offline-run-*; upload later with `wandb sync`."""

    live = 0  # open runs in this process; the last one to close stops wandb's service process

    def __init__(self, out_dir: Path, run_name: str | None, config: dict | None):
        # Offline means nothing leaves the machine, crash reports to W&B's Sentry included (read
        # when wandb is imported; a value the user set wins).
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        try:
            import wandb
        except ImportError:
            raise _missing("wandb", "wandb", "wandb") from None
        out_dir.mkdir(parents=True, exist_ok=True)
        # console="off": Kiln's own output is not mirrored into the run; x_disable_stats: the
        # records already carry Kiln's sys/ metrics, so wandb's sampling process is not needed.
        settings = wandb.Settings(mode="offline", console="off", x_disable_stats=True, silent=True)
        self.wandb = wandb
        self.run = wandb.init(
            dir=str(out_dir),
            project=os.environ.get("WANDB_PROJECT", "kiln"),
            name=run_name,
            config=_jsonable(config),
            settings=settings,
            reinit="create_new",
        )
        WandbBackend.live += 1

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def event(self, step: int, text: str) -> None:
        self.run.log({"event/text": text}, step=step)

    def close(self) -> None:
        self.run.finish()
        WandbBackend.live -= 1
        if WandbBackend.live == 0:
            # finish() returns before wandb's service process has written the run file; stopping
            # the service waits for it, so after close() the run folder is complete on disk.
            self.wandb.teardown()


def mlflow_key(key: str) -> str:
    """A metric or param name MLflow's file store accepts.

    "/" becomes ".": the file store keeps each metric in a file at the key's path, so "grad_norm"
    (a file) and "grad_norm/attn" (a file inside a folder of the same name) cannot both exist.
    Other characters outside MLflow's set (letters, digits, _ - . space :) become "_".
    """
    return re.sub(r"[^\w\-. :]", "_", key.replace("/", ".")).strip(" .") or "_"


class MlflowBackend:
    """One MLflow run in a local file store at <out>/mlruns; view with `mlflow ui --backend-store-uri`."""

    PARAM_BATCH = 100  # MLflow's limit on params per log_batch call
    PARAM_CHARS = 6000  # and on one param value's length

    def __init__(self, out_dir: Path, run_name: str | None, config: dict | None):
        # MLflow 3 keeps the file store but refuses it unless opted in; it is the store that needs
        # no server or database, which is what a training run's own folder wants.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # A local store should not report usage to MLflow's telemetry service; a user's value wins.
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("mlflow", "mlflow-skinny (or mlflow)", "mlflow") from None
        self.Metric = Metric
        self.client = MlflowClient(tracking_uri=(out_dir / "mlruns").absolute().as_uri())
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "kiln")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [
            Param(
                mlflow_key(k),
                json.dumps(v, default=str)[: self.PARAM_CHARS] if not isinstance(v, str) else v[: self.PARAM_CHARS],
            )
            for k, v in flatten_config(_jsonable(config)).items()
        ]
        for start in range(0, len(params), self.PARAM_BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + self.PARAM_BATCH])
        self.events: list[str] = []

    def log(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.Metric(mlflow_key(k), v, now, step) for k, v in values.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def event(self, step: int, text: str) -> None:
        # Run-level artifact rewritten whole: events are rare, and the file always reads complete.
        self.events.append(text)
        self.client.log_text(self.run_id, "\n".join(self.events) + "\n", "events.jsonl")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


BACKENDS = {"tensorboard": TensorBoardBackend, "wandb": WandbBackend, "mlflow": MlflowBackend}


class MetricsLogger:
    """Appends one JSON object per record to `<out_dir>/metrics.jsonl`, flushed immediately
    so a crashed run keeps everything logged before the crash, and mirrors each record's numbers
    to the backends named in `loggers` ("tensorboard", "wandb", "mlflow")."""

    def __init__(self, out_dir, loggers=(), run_name: str | None = None, config: dict | None = None):
        if isinstance(loggers, str):
            loggers = [loggers]
        names = list(dict.fromkeys(loggers))  # a name given twice gets one backend
        for name in names:
            if name not in BACKENDS:
                raise ConfigError(
                    LOGGERS_KEY,
                    f"unknown logger {name!r}; known: {', '.join(BACKENDS)} (metrics.jsonl is always written)",
                )
        out_dir = Path(out_dir)
        self.path = out_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        run_name = run_name or out_dir.absolute().name
        # A resumed run continues the event counts, and TensorBoard's curves, from the log it keeps.
        resume_step, self._event_counts = _history(self.path) if names else (None, {})
        self.backends = []
        try:
            for name in names:
                extra = {"resume_step": resume_step} if name == "tensorboard" else {}
                self.backends.append(BACKENDS[name](out_dir, run_name, config, **extra))
        except BaseException:
            self._close_backends()
            raise
        # Unbuffered: each record reaches the file at once, and a write the disk refuses leaves
        # nothing buffered to retry.
        self._file = open(self.path, "ab", buffering=0)
        self._step = 0

    def log(self, record: dict) -> None:
        self._append((json.dumps(record) + "\n").encode())
        if not self.backends:
            return
        step = record.get("step")
        step = self._step if not isinstance(step, int) or isinstance(step, bool) else step
        self._step = step
        values = scalars(record)
        text = None
        if record.get("kind") == "event":
            kind = str(record.get("type", "event"))
            # A running count per event type: one line per type that steps up at each event.
            self._event_counts[kind] = self._event_counts.get(kind, 0) + 1
            values = {f"event/{kind}": float(self._event_counts[kind])}
            text = json.dumps({k: v for k, v in record.items() if k != "kind"}, default=str)
        for backend in self.backends:
            if values:
                backend.log(step, values)
            if text is not None:
                backend.event(step, text)

    def _append(self, data: bytes) -> None:
        """Append one record; a write the disk refuses is cut back to the record before, so the log
        never ends in half a line, and raised as an OSError naming the log."""
        fd = self._file.fileno()
        end = os.fstat(fd).st_size
        with reporting(self.path):
            try:
                view = memoryview(data)
                while view:
                    view = view[self._file.write(view) :]
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, end)
                raise

    def _close_backends(self) -> None:
        for backend in self.backends:
            try:
                backend.close()
            except Exception as err:  # noqa: BLE001 - one backend failing to close must not lose the others
                warnings.warn(f"closing the {type(backend).__name__} metrics backend failed: {err}", stacklevel=3)
        self.backends = []

    def close(self) -> None:
        self._file.close()
        self._close_backends()


def truncate_metrics(path, last_step: int) -> None:
    """Drop records after `last_step` (and any line cut short by a crash), so a resumed run's
    log reads like the log of an uninterrupted run."""
    path = Path(path)
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and (
            record.get("step", 0) <= last_step or (record.get("kind") == "event" and record.get("type") == "watchdog")
        ):
            kept.append(line)
    write_text_atomic(path, "".join(line + "\n" for line in kept))


def measure_cpu_peak_flops(dtype: torch.dtype, seconds: float = 0.3, n: int = 1024) -> float:
    """Best FLOP/s of a square matmul in this process, as the CPU's practical peak.

    Measured rather than taken from a table because a CPU's usable peak depends on its vector
    units (AVX-512, AMX), its thread count and host contention (VMs vary ~2x). The best of
    repeated short runs estimates the uncontended peak.
    """
    # A private generator: measuring must not advance the global RNG that seeds the model.
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(dtype)
    b = torch.randn(n, n, generator=generator).to(dtype)
    torch.matmul(a, b)  # warm-up: oneDNN picks and JITs its kernel on the first call
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.matmul(a, b)
        elapsed = time.perf_counter() - start
        best = max(best, 2 * n**3 / elapsed)
    return best


def detect_peak_flops(device: torch.device, dtype: torch.dtype, override: float = 0.0) -> float:
    """Peak FLOP/s of one device for `dtype` compute; `override` (> 0) wins."""
    if override > 0:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in CUDA_BF16_PEAKS:
            if key in name:
                # fp32 without TF32 runs on CUDA cores at a small fraction of the tensor-core peak;
                # fp16 tensor-core peaks equal bf16 on these parts.
                return peak if dtype in (torch.bfloat16, torch.float16) else peak / 16
        warnings.warn(
            f"unknown GPU {name!r}: MFU is reported against a measured matmul peak; "
            f"set train.peak_flops for the data-sheet value",
            stacklevel=2,
        )
        a = torch.ones(4096, 4096, device=device, dtype=dtype)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize(device)
        return 10 * 2 * 4096**3 / (time.perf_counter() - start)
    return measure_cpu_peak_flops(dtype)


def peak_memory_mb(device: torch.device) -> float:
    """Peak accelerator memory allocated by torch, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def model_flops_utilization(
    flops_per_token: float, tokens_per_s: float, peak_flops: float, world_size: int = 1
) -> float:
    """MFU: model FLOPs actually done per second over what the devices could do at peak."""
    if peak_flops <= 0:
        return 0.0
    return flops_per_token * tokens_per_s / (peak_flops * world_size)
