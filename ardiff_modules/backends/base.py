"""The backend interface: ``plan`` once per forward on the host, ``run`` per layer."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ardiff_modules.errors import SpecError
from ardiff_modules.layout import ForwardLayout
from ardiff_modules.quant import KVQuantizer


@dataclass(frozen=True, eq=False)
class PlanRequest:
    """Everything a backend needs to plan one forward.

    Attributes
    ----------
    layout:
        Pages of every stream.
    device:
        The pool's device.
    dtype, kv_dtype:
        Compute dtype (queries, outputs) and the storage dtype of the paged K/V.
    num_qo_heads, num_kv_heads, head_dim:
        Attention geometry.
    token_mask:
        Optional user mask, bool ``[num_streams, seq_len, max_keys]`` in the key order of
        ``layout.to_dense()`` (history keys, then pending keys), ANDed with the visibility
        rule. Selects the masked path.
    static:
        Keep every device input in fixed buffers so a CUDA graph captured once can be
        replayed after re-planning (FlashInfer only).
    max_pages:
        With ``static``: the most pages any plan of this forward will list (sizes the buffers).
    quantizer:
        The pool's FP8 scales (``kv_dtype="float8_e4m3fn"``); ``None`` for the float formats.
    segment:
        Which key segment of the forward this plan covers: ``"main"``, or ``"sinks"`` for the sink
        segment of relative-position sinks (its plans keep their own kernel workspace).
    """

    layout: ForwardLayout
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    token_mask: torch.Tensor | None = None
    static: bool = False
    max_pages: int | None = None
    quantizer: KVQuantizer | None = None
    segment: str = "main"


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over two disjoint key sets, from each set's attention.

    ``out_*`` ``[tokens, heads, dim]``, ``lse_*`` float32 natural-log ``[tokens, heads]`` (``-inf``:
    no key in that set, whose ``out`` is then ignored). Returns the merged output (``out_a``'s dtype)
    and LSE. Computed in float32.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    # NOTE: where, not a product: a key-less segment's output may be anything (0 * NaN = NaN).
    part_a = torch.where(weight_a > 0, out_a.float() * weight_a, 0.0)
    part_b = torch.where(weight_b > 0, out_b.float() * weight_b, 0.0)
    # contiguous like the ops' fake outputs (an input may be a strided view, e.g. the reference's one stream)
    return (part_a + part_b).to(out_a.dtype).contiguous(), lse


def fold_softmax_scale(q: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` ``[tokens, heads, head_dim]`` for a kernel that applies the default softmax scale
    ``head_dim ** -0.5``: ``q`` itself for that scale, else ``q * (scale * sqrt(head_dim))`` in ``q``'s dtype.

    The one place a custom scale is folded: eagerly inside a plan's ``attend``, and in a compiled graph
    before the FP8 query is quantized (:func:`ardiff_modules.ops.attend_in_graph`), so both round alike.
    """
    default = 1.0 / math.sqrt(q.shape[-1])
    if math.isclose(scale, default, rel_tol=1e-6):
        return q
    return q * (scale / default)


class AttentionPlan(ABC):
    """Device-ready indices for one forward, shared by every layer.

    Attributes
    ----------
    quantizer:
        The pool's FP8 scales, or ``None``.
    """

    quantizer: KVQuantizer | None = None

    def merge(
        self, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`merge_attention` of two key segments' results (a backend may run it as one kernel)."""
        return merge_attention(out_a, lse_a, out_b, lse_b)

    @property
    def uses_sink_query(self) -> bool:
        """Whether ``run`` / ``attend`` take the sink query ``q_sink`` (relative-position sinks)."""
        return False

    @property
    def takes_fp8_query(self) -> bool:
        """Whether this plan's kernel attends with an FP8 query (FA3 over an FP8 pool).

        If so, ``attend`` also takes a query the caller quantized already: ``q`` float8_e4m3fn
        ``[tokens, heads, head_dim]`` with ``q_scale=`` float32 ``[heads]`` (:func:`~ardiff_modules.quant.
        quantize_query` of the query, any custom softmax scale folded in first by :func:`fold_softmax_scale`;
        ``scale`` is then the default ``head_dim ** -0.5``). Without ``q_scale`` it quantizes the query itself.
        ``False`` (the default): the kernel attends the compute-dtype query (the reference backend, FA2 with a
        mask, float pools, the two-segment plans of relative sinks).
        """
        return False

    @property
    @abstractmethod
    def write_slots(self) -> torch.Tensor:
        """int64 ``[num_streams * seq_len]`` on the pool's device: the token slot (``page * page_size +
        offset``) of every current token, stream-major -- where a compiled graph writes K/V itself
        (see :func:`ardiff_modules.ops.kv_write_slots_op`). A fixed buffer in static plans."""

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        return_lse: bool = False,
        *,
        layer: int = 0,
        q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend over the pages alone: the current K/V are already in the pending pages.

        Same arguments and result as :meth:`run`, without ``k`` / ``v``; and ``q_scale``: float32 ``[heads]``
        when ``q`` is already the FP8 query (plans that :attr:`takes_fp8_query` only, the others refuse it
        through :func:`refuse_fp8_query`).
        """

    @abstractmethod
    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        return_lse: bool = False,
        *,
        layer: int = 0,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Write the current K/V into the pending pages, then attend.

        Parameters
        ----------
        q:
            ``[num_streams * seq_len, num_heads, head_dim]`` queries, stream-major.
        k, v:
            ``[num_streams * seq_len, num_kv_heads, head_dim]`` current keys / values.
        k_cache, v_cache:
            One layer's pages ``[num_pages, page_size, num_kv_heads, head_dim]``; mutated.
        scale:
            Softmax scale.
        return_lse:
            Also return each query's log-sum-exp over its visible keys.
        layer:
            The layer index (selects the FP8 scales of a quantized pool).

        Returns
        -------
        ``[num_streams * seq_len, num_heads, head_dim]``; with ``return_lse`` also the float32
        ``[num_streams * seq_len, num_heads]`` natural-log LSE of the scaled logits
        (``log sum_j exp(scale * q . k_j)``; ``-inf`` for a query that sees no key), what merging
        partial attentions (sequence parallelism) needs.
        """


def refuse_fp8_query(plan: AttentionPlan, q_scale: torch.Tensor | None) -> None:
    """:class:`SpecError` if ``q_scale`` is given to ``plan.attend`` of a plan that attends the compute-dtype
    query (``takes_fp8_query`` is ``False``): an FP8 query would be attended as if it were that query."""
    if q_scale is not None:
        raise SpecError(
            f"{type(plan).__name__}.attend: expected q_scale=None (this plan attends the compute-dtype query: "
            f"takes_fp8_query is False), got a {q_scale.dtype} tensor of shape {tuple(q_scale.shape)}"
        )


class AttentionBackend(ABC):
    """Turns a :class:`ForwardLayout` into an :class:`AttentionPlan`."""

    name: str = "abstract"
    #: Whether :meth:`plan` may update ``previous`` in place. If so, a ``plan()`` that raises leaves
    #: ``previous`` untrustworthy: the cache then ends the forward that used it and plans afresh.
    replans_in_place: bool = True

    @abstractmethod
    def check_supported(
        self, device: torch.device, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype | None = None
    ) -> None:
        """Raise :class:`~ardiff_modules.errors.BackendUnavailableError` if this backend cannot run.

        ``kv_dtype`` is the pool's storage dtype (``None``: the same as ``dtype``).
        """

    @abstractmethod
    def plan(self, request: PlanRequest, previous: AttentionPlan | None) -> AttentionPlan:
        """Build the plan for one forward (host work; ``previous`` may be reused for its buffers).

        A query that sees no key at all (only possible with a ``token_mask``) must output zeros.
        """
