"""A foreign checkpoint's tensors, handed out by name to an importer (kiln/hf.py, hf_bert.py, hf_t5.py).

A missing tensor is a named error, and every tensor the importer never took is refused at the end:
it would be a layer (a bias, an extra norm, a head) that the Kiln model silently drops."""

from __future__ import annotations

import torch

from kiln.errors import DataError


class TensorTaker:
    def __init__(self, tensors: dict[str, torch.Tensor], where: str):
        self.tensors, self.where, self.used = tensors, where, set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise DataError(f"{self.where}: missing tensor {name!r}")
        self.used.add(name)
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def take_copy(self, name: str, of: torch.Tensor, tied_to: str, why: str) -> None:
        """Accept a stored duplicate of a tied tensor (an older writer's habit), refusing one that differs."""
        if name in self.tensors:
            if not torch.equal(self.tensors[name], of):
                raise DataError(f"{self.where}: {name} differs from {tied_to}; {why}")
            self.used.add(name)

    def refuse_leftovers(self, model: str, ignorable=lambda name: False) -> None:
        extra = sorted(n for n in self.tensors if n not in self.used and not ignorable(n))
        if extra:
            raise DataError(
                f"{self.where}: tensors {model} has no place for: {', '.join(extra[:5])}"
                + (f" (+{len(extra) - 5} more)" if len(extra) > 5 else "")
            )
