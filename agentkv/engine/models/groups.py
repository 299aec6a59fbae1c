"""A model's KV cache as layer groups, after vLLM v1's KV cache specs: what each group caches per token
(or per sequence), and which blocks it needs to serve a prefix hit."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from agentkv.engine.models.dtypes import DTYPE_BYTES, KV_DTYPES, check_dtype
from agentkv.errors import UserError


class GroupKind(StrEnum):
    """How a group caches: vLLM's FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec,
    MLAAttentionSpec, MambaSpec (a constant state per sequence)."""

    FULL = "full_attention"
    SLIDING = "sliding_window"
    CHUNKED = "chunked_local"
    MLA = "mla"
    STATE = "state"


ATTENTION_KINDS = (GroupKind.FULL, GroupKind.SLIDING, GroupKind.CHUNKED, GroupKind.MLA)


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers that cache the same thing the same way: per-token entries (attention kinds) or a per-sequence
    state (STATE). Sizes are per layer; `layers` says how many layers (and which) the group covers."""

    kind: GroupKind
    layers: tuple[int, ...]
    kv_heads: int = 1  # heads cached per entry: split over TP ranks, replicated when fewer than ranks
    head_dim: int = 0  # elements per head
    vectors: int = 2  # vectors per head per entry: 2 (K and V), 1 (an MLA latent, an indexer key)
    window: int = 0  # SLIDING: the window in tokens; CHUNKED: the chunk size; STATE: see `is_window_state`
    compress: int = 1  # tokens per cached entry (DeepSeek-V4's compressed caches keep one per 4 or 128)
    fp8_entry_bytes: int = (
        0  # vLLM's fp8 layout of one entry when it is not `dims x 1 byte` (scales, bf16 RoPE)
    )
    fixed_entry_bytes: int = 0  # one entry's bytes whatever the KV dtype (indexer keys: fp8 plus a scale)
    state_bytes: int = 0  # STATE: bytes per layer per sequence at tp=1
    state_heads: int = 1  # STATE: heads the state splits over under TP (1: replicated)
    page_tokens: int = 0  # vLLM's block size for this group when not the engine's (V4: 64, 8, 4)
    label: str = ""

    def __post_init__(self) -> None:
        if not self.layers or min(self.layers) < 0:
            raise UserError(f"layer group '{self.name}': needs layers (indices from 0), got {self.layers!r}")
        if self.kind is GroupKind.STATE:
            if self.state_bytes <= 0:
                raise UserError(f"layer group '{self.name}': a state group needs state_bytes > 0")
            return
        if self.kv_heads < 1 or self.head_dim < 1 or self.vectors not in (1, 2) or self.compress < 1:
            raise UserError(f"layer group '{self.name}': heads, head_dim and compress must be positive")
        if self.kind in (GroupKind.SLIDING, GroupKind.CHUNKED) and self.window < 1:
            raise UserError(f"layer group '{self.name}': a {self.kind} group needs a window (tokens)")

    @property
    def name(self) -> str:
        """The label, or the kind (with its window) when there is none."""
        if self.label:
            return self.label
        return f"{self.kind} {self.window}" if self.window else str(self.kind)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def is_state(self) -> bool:
        return self.kind is GroupKind.STATE

    @property
    def is_mamba_state(self) -> bool:
        """A state saved at block boundaries (linear attention, SSM: vLLM's MambaSpec), not a window."""
        return self.is_state and not self.window

    @property
    def is_window_state(self) -> bool:
        """A state vLLM keeps as its last `window` tokens in a sliding-window group (DeepSeek-V4's
        compressor buffers, `SlidingWindowMLASpec`): cached and hit by the window rule, not saved at
        block boundaries as a Mamba state is."""
        return self.is_state and self.window > 0

    def entry_bytes(self, dtype: str = "bf16", tp: int = 1) -> float:
        """Bytes of one cached entry of one layer on one TP rank (0 for a state group)."""
        check_dtype(dtype, KV_DTYPES)
        if self.is_state:
            return 0.0
        if self.fixed_entry_bytes:
            return float(self.fixed_entry_bytes)
        if dtype == "fp8" and self.fp8_entry_bytes:
            return float(self.fp8_entry_bytes)
        heads = max(1, self.kv_heads // tp)
        return self.vectors * heads * self.head_dim * DTYPE_BYTES[dtype]

    def token_bytes(self, dtype: str = "bf16", tp: int = 1) -> float:
        """Bytes one more token adds to one layer (an entry over the tokens it stands for)."""
        return self.entry_bytes(dtype, tp) / self.compress

    def bytes_per_token(self, dtype: str = "bf16", tp: int = 1) -> float:
        """Bytes one token takes in the whole group, as if every layer kept every token (full context)."""
        return self.token_bytes(dtype, tp) * self.num_layers

    def head_token_bytes(self, dtype: str = "bf16") -> float:
        """One token's bytes for one KV head of one layer (what one decode program streams)."""
        return self.entry_bytes(dtype, self.kv_heads) / self.compress

    def state_bytes_per_seq(self, tp: int = 1) -> float:
        """The group's constant state for one sequence on one rank, all its layers (0 for attention kinds)."""
        if not self.is_state:
            return 0.0
        per_layer = self.state_bytes / self.state_heads * max(1, self.state_heads // tp)
        return per_layer * self.num_layers

    def resident_tokens(self, context: int) -> int:
        """Tokens of a `context`-token sequence the group must keep: all of them, the window, or the chunk."""
        if self.is_state:
            return 0
        if self.kind in (GroupKind.SLIDING, GroupKind.CHUNKED):
            return min(context, self.window)
        return context

    def sequence_bytes(self, context: int, dtype: str = "bf16", tp: int = 1) -> float:
        """What one sequence of `context` tokens holds in this group on one rank: entries or state."""
        if self.is_state:
            return self.state_bytes_per_seq(tp)
        entries = self.resident_tokens(context) // self.compress
        return entries * self.entry_bytes(dtype, tp) * self.num_layers

    def prefix_blocks(self, cut: int, block_size: int) -> range:
        """Blocks (numbered from 0) this group must still hold to resume a sequence after its first `cut`
        tokens: every block (full attention, MLA), those covering the last window - 1 tokens (sliding
        window, as vLLM's SlidingWindowManager), the current chunk's (chunked local), none for a state
        group, whose state is saved at the cut instead."""
        if cut < 0 or block_size < 1:
            raise ValueError("cut must be >= 0 and block_size >= 1")
        end = -(-cut // block_size)
        if self.is_mamba_state:
            return range(0)
        if self.kind is GroupKind.SLIDING or self.is_state:
            lo = max(0, cut - (self.window - 1))
        elif self.kind is GroupKind.CHUNKED:
            lo = cut // self.window * self.window
        else:
            lo = 0
        return range(min(lo // block_size, end), end)

    @property
    def prefix_rule(self) -> str:
        """The prefix-cache rule in words."""
        return {
            GroupKind.FULL: "every block before the cut",
            GroupKind.MLA: "every block before the cut",
            GroupKind.SLIDING: f"the blocks covering the last {self.window} tokens before the cut",
            GroupKind.CHUNKED: f"the blocks of the current {self.window}-token chunk",
            GroupKind.STATE: (
                f"a state kept as its last {self.window} tokens, the window's blocks before the cut"
                if self.window
                else "a constant state saved at the cut"
            ),
        }[self.kind]
