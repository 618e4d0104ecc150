"""The backend interface: ``plan`` once per forward on the host, ``run`` per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ardiff_modules.plan import ForwardLayout


class AttentionPlan(ABC):
    """Device-ready indices for one forward, shared by every layer."""

    @abstractmethod
    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
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

        Returns
        -------
        ``[num_streams * seq_len, num_heads, head_dim]``.
        """


class AttentionBackend(ABC):
    """Turns a :class:`ForwardLayout` into an :class:`AttentionPlan`."""

    name: str = "abstract"

    @abstractmethod
    def check_supported(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
        """Raise :class:`~ardiff_modules.errors.BackendUnavailableError` if this backend cannot run."""

    @abstractmethod
    def plan(
        self, layout: ForwardLayout, device: torch.device, previous: AttentionPlan | None
    ) -> AttentionPlan:
        """Build the plan for one forward (host work; ``previous`` may be reused for its buffers)."""
