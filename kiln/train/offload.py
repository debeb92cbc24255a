"""AdamW whose moments live in files on local disk (NVMe offload, as in DeepSpeed ZeRO-Infinity).

The trainable parameters are cut into chunks: runs of consecutive parameters of one optimizer
parameter group (a parameter larger than a chunk is cut into flat slices), each holding at most
`chunk_bytes` of optimizer state. Each chunk's two moments are one raw file in a private temporary
folder: [exp_avg of every slice][exp_avg_sq of every slice], in the parameters' dtype, native byte
order. A step streams the chunks through two buffers: while chunk k is updated, one I/O thread
reads chunk k+1 and writes chunk k-1 back, so at most two chunks of state are in memory at once.

The update of a chunk is torch's own functional AdamW (`torch.optim.adamw.adamw`) on flat views of
the chunk's parameters and gradients. AdamW is elementwise, so updating a tensor slice by slice
computes the same bits as updating it whole: the result equals `torch.optim.AdamW` bit for bit
(tests/train/test_offload.py). Step counts (one scalar per slice) stay in memory.

`state_dict()` returns what `torch.optim.AdamW.state_dict()` returns (same keys, shapes, dtypes), so
checkpoints of offloaded and in-memory runs are interchangeable; building it materialises the whole
state for the duration of a checkpoint save. The swap files hold no state a checkpoint lacks: a
killed run resumes from its last checkpoint, and its stale swap folder (`kiln-optim-*`) can be
deleted.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.optim.adamw import adamw

DEFAULT_CHUNK_MB = 64


@dataclass
class _Slice:
    """Elements [start, stop) of a parameter flattened, with its own step count."""

    param: torch.Tensor
    index: int  # position of the parameter across all groups (the key of state_dict()["state"])
    start: int
    stop: int
    step: torch.Tensor = field(default_factory=lambda: torch.tensor(0.0, dtype=torch.float32))

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view(-1)[self.start : self.stop]


@dataclass
class _Chunk:
    group: int
    dtype: torch.dtype
    slices: list[_Slice]
    path: Path
    written: bool = False  # the file exists (before a chunk's first update its moments are zeros)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slices)

    @property
    def nbytes(self) -> int:
        return 2 * self.numel * self.dtype.itemsize


def plan_chunks(param_groups: list[dict], chunk_bytes: int, folder: Path) -> list[_Chunk]:
    """Cut the groups' parameters into chunks of at most chunk_bytes of state (two moments)."""
    chunks: list[_Chunk] = []
    index = 0
    for g, group in enumerate(param_groups):
        current: _Chunk | None = None
        for p in group["params"]:
            per_element = 2 * p.dtype.itemsize
            capacity = max(chunk_bytes // per_element, 1)
            start = 0
            while start < p.numel():
                if current is None or current.dtype != p.dtype or current.numel >= capacity:
                    current = _Chunk(g, p.dtype, [], folder / f"chunk-{len(chunks):05d}.bin")
                    chunks.append(current)
                stop = min(p.numel(), start + capacity - current.numel)
                current.slices.append(_Slice(p, index, start, stop))
                start = stop
            index += 1
    return chunks


def _remove(pool: ThreadPoolExecutor, folder: Path) -> None:
    pool.shutdown(wait=True)
    shutil.rmtree(folder, ignore_errors=True)


class NVMeAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW with its moments in files under `swap_dir` (a private folder is made
    inside it and removed by close(), at garbage collection, or at interpreter exit)."""

    def __init__(
        self,
        params,
        swap_dir,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        chunk_bytes: int = DEFAULT_CHUNK_MB << 20,
        foreach: bool | None = None,
    ):
        # The hyperparameters torch.optim.AdamW keeps in each group, so state_dict()["param_groups"]
        # is the in-memory optimizer's and either can load the other's checkpoints.
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=False,
            foreach=foreach,
            capturable=False,
            differentiable=False,
            fused=None,
            decoupled_weight_decay=True,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if not p.is_floating_point() or not p.is_contiguous():
                    raise ValueError(f"NVMeAdamW: parameters must be contiguous real floats, got {p.dtype}")
        Path(swap_dir).mkdir(parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(prefix="kiln-optim-", dir=swap_dir))
        self.chunks = plan_chunks(self.param_groups, chunk_bytes, self.folder)
        # One thread does all file I/O in submission order: a chunk's write-back is queued before
        # the read that reuses its buffer, so the order alone keeps the two from overlapping.
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-nvme")
        self._cleanup = weakref.finalize(self, _remove, self._io, self.folder)
        largest = max(c.nbytes for c in self.chunks)
        self._buffers = [torch.empty(largest, dtype=torch.uint8) for _ in range(2)]

    # ---- file I/O (on the I/O thread) ------------------------------------------------------------

    def _moments(self, chunk: _Chunk, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = buffer[: chunk.nbytes].view(chunk.dtype)
        return flat[: chunk.numel], flat[chunk.numel :]

    def _read(self, chunk: _Chunk, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        view = buffer[: chunk.nbytes]
        if not chunk.written:
            view.zero_()
        else:
            with open(chunk.path, "rb") as f:
                got = f.readinto(memoryview(view.numpy()))
            if got != chunk.nbytes:
                raise OSError(f"{chunk.path}: read {got} of {chunk.nbytes} bytes of optimizer state")
        return self._moments(chunk, buffer)

    def _write(self, chunk: _Chunk, buffer: torch.Tensor) -> None:
        try:
            with open(chunk.path, "wb") as f:
                f.write(memoryview(buffer[: chunk.nbytes].numpy()))
        except OSError as err:
            # A full disk fails in write(), whose error names no file: name the swap file, so the
            # CLI's one line (kiln.files.os_error_line) says where.
            err.filename = err.filename or str(chunk.path)
            raise
        chunk.written = True

    # ---- the step --------------------------------------------------------------------------------

    def _update(self, chunk: _Chunk, exp_avgs: torch.Tensor, exp_avg_sqs: torch.Tensor) -> None:
        group = self.param_groups[chunk.group]
        params, grads, avgs, sqs, steps = [], [], [], [], []
        offset = 0
        for s in chunk.slices:
            if s.param.grad is not None:
                # The moments go to the parameter's device for the update and come back after.
                avgs.append(exp_avgs[offset : offset + s.numel].to(s.param.device))
                sqs.append(exp_avg_sqs[offset : offset + s.numel].to(s.param.device))
                params.append(s.of(s.param))
                grads.append(s.of(s.param.grad.contiguous()))
                steps.append(s.step)
            offset += s.numel
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            avgs,
            sqs,
            [],
            steps,
            foreach=group["foreach"],
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        offset, k = 0, 0
        for s in chunk.slices:
            if s.param.grad is not None:
                if avgs[k].device.type != "cpu":
                    exp_avgs[offset : offset + s.numel].copy_(avgs[k])
                    exp_avg_sqs[offset : offset + s.numel].copy_(sqs[k])
                k += 1
            offset += s.numel

    @torch.no_grad()
    def step(self, closure=None):
        loss = torch.enable_grad()(closure)() if closure is not None else None
        todo = [c for c in self.chunks if any(s.param.grad is not None for s in c.slices)]
        reads = {}

        def prefetch(k: int) -> None:
            if k < len(todo):
                reads[k] = self._io.submit(self._read, todo[k], self._buffers[k % 2])

        prefetch(0)
        prefetch(1)
        writes = []
        for k, chunk in enumerate(todo):
            exp_avgs, exp_avg_sqs = reads.pop(k).result()
            self._update(chunk, exp_avgs, exp_avg_sqs)
            writes.append(self._io.submit(self._write, chunk, self._buffers[k % 2]))
            prefetch(k + 2)
        for w in writes:
            w.result()
        return loss

    # ---- state dict: torch.optim.AdamW's ---------------------------------------------------------

    def state_dict(self) -> dict:
        state: dict[int, dict] = {}
        buffer = self._buffers[0]
        for chunk in self.chunks:
            exp_avgs, exp_avg_sqs = self._io.submit(self._read, chunk, buffer).result()
            offset = 0
            for s in chunk.slices:
                if s.step.item() > 0:
                    entry = state.setdefault(
                        s.index,
                        {
                            "step": s.step.clone(),
                            "exp_avg": torch.zeros_like(s.param, device="cpu"),
                            "exp_avg_sq": torch.zeros_like(s.param, device="cpu"),
                        },
                    )
                    s.of(entry["exp_avg"]).copy_(exp_avgs[offset : offset + s.numel])
                    s.of(entry["exp_avg_sq"]).copy_(exp_avg_sqs[offset : offset + s.numel])
                offset += s.numel
        groups, start = [], 0
        for group in self.param_groups:
            groups.append(
                {
                    **{k: v for k, v in group.items() if k != "params"},
                    "params": list(range(start, start + len(group["params"]))),
                }
            )
            start += len(group["params"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("loaded state dict's parameter groups do not match the optimizer's")
        position = {i: n for n, i in enumerate(i for g in saved_groups for i in g["params"])}
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            group["betas"] = tuple(group["betas"])
        state = {position[i]: s for i, s in state_dict["state"].items()}
        buffer = self._buffers[0]
        for chunk in self.chunks:
            exp_avgs, exp_avg_sqs = self._moments(chunk, buffer)
            offset = 0
            for s in chunk.slices:
                saved = state.get(s.index)
                if saved is None:
                    s.step = torch.tensor(0.0, dtype=torch.float32)
                    exp_avgs[offset : offset + s.numel].zero_()
                    exp_avg_sqs[offset : offset + s.numel].zero_()
                else:
                    s.step = torch.tensor(float(saved["step"]), dtype=torch.float32)
                    exp_avgs[offset : offset + s.numel].copy_(s.of(saved["exp_avg"].contiguous()))
                    exp_avg_sqs[offset : offset + s.numel].copy_(s.of(saved["exp_avg_sq"].contiguous()))
                offset += s.numel
            self._io.submit(self._write, chunk, buffer).result()

    def resident_state_bytes(self) -> int:
        """Bytes of moment buffers this optimizer holds in memory (two chunks' worth)."""
        return sum(b.numel() for b in self._buffers)

    def close(self) -> None:
        """Remove the swap folder (only the one this optimizer made)."""
        self._cleanup()
