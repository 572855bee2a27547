"""Named pieces of the policy objective: one registry per kind, filled by the modules that define the pieces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """One registered function and the LossSpec settings it reads (the config checks those, and only those)."""

    name: str
    fn: Callable
    reads: tuple[str, ...]

    @property
    def doc(self) -> str:
        return (self.fn.__doc__ or "").strip().splitlines()[0]


class Registry(dict):
    """name -> Piece; `register` is the only way in, so a piece's name, function and settings sit together."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key  # the config key that chooses from it, for messages

    def register(self, name: str, reads: tuple[str, ...] = ()) -> Callable:
        def add(fn: Callable) -> Callable:
            if name in self:
                raise ValueError(f"{self.key}: {name!r} is registered twice")
            self[name] = Piece(name, fn, reads)
            return fn

        return add

    def choose(self, name: str) -> Piece:
        """The piece called `name`, or one line naming the key and the choices."""
        if name not in self:
            raise ValueError(f"{self.key}={name!r} is not allowed; choose one of: {', '.join(self)}")
        return self[name]


WEIGHTS = Registry("algo.weight")  # importance weight on the mismatch ratio rho = pi_prox / pi_behav (no gradient)
MASKS = Registry("algo.mask")  # rejection: which response tokens the loss keeps
CLIPS = Registry("algo.clip")  # the trust region's bounds on the policy ratio
OBJECTIVES = Registry("algo.objective")  # the per-token surrogate the weight multiplies
