"""Log-sum-exp values whose base is part of their type, and the merge of partial attention states.

A query row's attention over a key set K with scaled scores ``s_j`` has the partial state
    o_K = Σ_{j∈K} e^{s_j} v_j / Σ_{j∈K} e^{s_j}          and its log-sum-exp
    natural   l_K  = ln Σ_{j∈K} e^{s_j}                   (every op of ``mla_fa3.ops``, FA3, merge_state_v2)
    base 2    l2_K = log2 Σ_{j∈K} 2^{s_j·log2 e} = l_K / ln 2   (kernels computing in exp2)
Two states over disjoint key sets A, B merge into the state over A ∪ B:
    l = ln(e^{l_A} + e^{l_B}),    o = o_A·e^{l_A − l} + o_B·e^{l_B − l}
This holds for natural logs only: feeding ``l2`` as if it were ``l`` weights the states by
``e^{l2_A − l2_B} = (e^{l_A − l_B})^{1/ln 2}`` — a wrong answer with no error. So an LSE never travels
as a bare tensor here: :class:`NaturalLSE` and :class:`Base2LSE` wrap it, :func:`merge_states` accepts
only ``NaturalLSE`` (anything else raises ``TypeError``), and a base-2 value must be converted
explicitly with :meth:`Base2LSE.to_natural` (``· ln 2``, ``ops.lse_base2_to_natural``).

A row whose key set is empty has ``l = -inf`` (output 0) and is the identity of the merge.
Layout: ``[T, H]`` float32 for outputs ``[T, H, d]`` (the ops' varlen layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from mla_fa3 import ops

__all__ = ["NaturalLSE", "Base2LSE", "merge_states"]


def _check_value(value: object, cls_name: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"value must be a torch.Tensor for {cls_name}, got {type(value).__name__}")
    if value.dtype != torch.float32:
        raise TypeError(f"value must be float32 for {cls_name}, got {value.dtype}")


@dataclass(frozen=True)
class NaturalLSE:
    """An LSE in natural log: ``ln Σ exp(s)``. The only kind :func:`merge_states` accepts."""

    value: torch.Tensor  # [T, H] float32, device of the output it belongs to

    def __post_init__(self) -> None:
        _check_value(self.value, "NaturalLSE")

    def to_base2(self) -> "Base2LSE":
        return Base2LSE(ops.lse_natural_to_base2(self.value))


@dataclass(frozen=True)
class Base2LSE:
    """An LSE in base 2: ``log2 Σ 2^(s·log2 e)``. Convert with :meth:`to_natural` before merging."""

    value: torch.Tensor  # [T, H] float32, device of the output it belongs to

    def __post_init__(self) -> None:
        _check_value(self.value, "Base2LSE")

    def to_natural(self) -> NaturalLSE:
        """The same LSE in natural log: ``value · ln 2``."""
        return NaturalLSE(ops.lse_base2_to_natural(self.value))


def _natural(lse: object, name: str) -> torch.Tensor:
    if isinstance(lse, NaturalLSE):
        return lse.value
    if isinstance(lse, Base2LSE):
        raise TypeError(f"{name} is a Base2LSE: merging needs natural logs; convert it explicitly "
                        f"with {name}.to_natural() (multiplies by ln 2)")
    raise TypeError(f"{name} must be a NaturalLSE (wrap a natural-log tensor as NaturalLSE(t), a "
                    f"base-2 one as Base2LSE(t).to_natural()), got {type(lse).__name__}")


def merge_states(o_a: torch.Tensor, lse_a: NaturalLSE, o_b: torch.Tensor, lse_b: NaturalLSE, *,
                 impl: Optional[Union[ops.Impl, str]] = None) -> Tuple[torch.Tensor, NaturalLSE]:
    """Merge two partial attention states over disjoint key sets: ``(o, lse)`` over their union.

    o_a, o_b ``[T, H, d]`` (same dtype); lse_a, lse_b :class:`NaturalLSE` ``[T, H]``. Runs
    ``ops.merge_state`` (merge_state_v2 on FA3 devices, torch otherwise; ``impl`` overrides).
    """
    a, b = _natural(lse_a, "lse_a"), _natural(lse_b, "lse_b")
    o, lse = ops.merge_state(o_a, a, o_b, b, impl=impl)
    return o, NaturalLSE(lse)
