"""Records: what the rollout keeps of each FP4 rounding outcome (docs/design.md, "Records").

A record holds, per token row of one site, the low `b` bits of every element's code packed densely (exactly b bits
per element, element i at bit offset i*b, LSB first, so b = 4 is the nibble packing of `pack_fp4`), the block
scale bytes, and for per-token nvfp4 the FP32 token scale.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from trace_core.formats import FP4Format, get_format
from trace_core.quant import Quantized
from trace_core.sites import Site


def check_bits(bits: int) -> int:
    """Return `bits` if it is an int in 1..4, else raise ValueError."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 4:
        raise ValueError(f"record bits must be an integer in 1..4, got {bits!r}")
    return bits


def low_bits_mask(bits: int) -> int:
    return (1 << check_bits(bits)) - 1


def packed_len(n: int, bits: int) -> int:
    """Bytes needed for n elements at `bits` bits each."""
    return (n * check_bits(bits) + 7) // 8


def pack_low_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack `codes & (2^bits - 1)` of uint8 `[..., n]` densely into uint8 `[..., ceil(n * bits / 8)]`."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_low_bits expects uint8 codes, got {codes.dtype}")
    if codes.dim() == 0:
        raise ValueError("pack_low_bits needs at least one dimension")
    n = codes.shape[-1]
    low = (codes & low_bits_mask(bits)).to(torch.int32)
    # Bit stream: element i, bit j -> stream position i * bits + j; then 8 stream bits per byte, LSB first.
    bit_idx = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = ((low.unsqueeze(-1) >> bit_idx) & 1).reshape(*low.shape[:-1], n * bits)
    stream = torch.nn.functional.pad(stream, (0, packed_len(n, bits) * 8 - n * bits))
    weights = 1 << torch.arange(8, device=codes.device, dtype=torch.int32)
    return (stream.reshape(*stream.shape[:-1], packed_len(n, bits), 8) * weights).sum(dim=-1).to(torch.uint8)


def unpack_low_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_low_bits`: uint8 `[..., ceil(n * bits / 8)]` -> low code bits uint8 `[..., n]`."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_low_bits expects uint8 bytes, got {packed.dtype}")
    if packed.dim() == 0 or packed.shape[-1] != packed_len(n, bits):
        raise ValueError(
            f"packed record shape {tuple(packed.shape)} does not hold {n} elements at {bits} bits "
            f"(expected last dimension {packed_len(n, bits)})"
        )
    bit_idx = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((packed.to(torch.int32).unsqueeze(-1) >> bit_idx) & 1).reshape(*packed.shape[:-1], packed.shape[-1] * 8)
    stream = stream[..., : n * bits].reshape(*packed.shape[:-1], n, bits)
    weights = 1 << torch.arange(bits, device=packed.device, dtype=torch.int32)
    return (stream * weights).sum(dim=-1).to(torch.uint8)


@dataclass(frozen=True)
class Record:
    """The rollout's record of one site for a batch of token rows.

    Attributes:
        fmt: format the rollout quantized with.
        bits: low code bits kept per element (4 = full information, sign included).
        n: elements per row.
        low_bits: uint8 `[..., packed_len(n, bits)]`.
        scales: uint8 `[..., n // block]` raw scale bytes.
        global_scale: FP32 `S_enc` (0-d or `[..., 1]`) for nvfp4, None for E8M0 formats.
    """

    fmt: FP4Format
    bits: int
    n: int
    low_bits: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if self.n % self.fmt.block:
            raise ValueError(f"record width {self.n} is not a multiple of the {self.fmt.name} block {self.fmt.block}")
        rows = tuple(self.scales.shape[:-1])
        if self.scales.dtype != torch.uint8 or self.scales.shape[-1:] != (self.n // self.fmt.block,):
            raise ValueError(
                f"record scales must be uint8 [..., {self.n // self.fmt.block}], got {self.scales.dtype} "
                f"{tuple(self.scales.shape)}"
            )
        if tuple(self.low_bits.shape) != rows + (packed_len(self.n, self.bits),):
            raise ValueError(
                f"record low_bits shape {tuple(self.low_bits.shape)} does not match rows {rows} with "
                f"{self.n} elements at {self.bits} bits"
            )
        if (self.global_scale is None) == self.fmt.has_global_scale:
            raise ValueError(f"{self.fmt.name} record global_scale presence is wrong: {self.global_scale!r}")

    @classmethod
    def from_quantized(cls, q: Quantized, bits: int) -> Record:
        """Keep the low `bits` code bits of a rollout-side quantization."""
        return cls(
            fmt=q.fmt,
            bits=check_bits(bits),
            n=q.codes.shape[-1],
            low_bits=pack_low_bits(q.codes, bits),
            scales=q.scales,
            global_scale=q.global_scale,
        )

    @property
    def shape(self) -> torch.Size:
        return torch.Size(tuple(self.scales.shape[:-1]) + (self.n,))

    def code_bits(self) -> torch.Tensor:
        """Unpacked low code bits, uint8 `[..., n]`."""
        return unpack_low_bits(self.low_bits, self.bits, self.n)


def _latter_half(layers: tuple[int, ...]) -> tuple[int, ...]:
    return layers[len(layers) // 2 :]


@dataclass(frozen=True)
class RecordSpec:
    """Which sites are captured and how many code bits each keeps.

    `moe_layers` are layer ids of MoE blocks (site `moe_in`); `attn_layers` are layer ids of softmax-attention
    layers (sites `k` and `v`). `RecordSpec.default` keeps b = 1 on the latter half of each, the paper's default.
    """

    bits: int = 1
    moe_layers: tuple[int, ...] = ()
    attn_layers: tuple[int, ...] = ()
    moe_format: str = "nvfp4"
    kv_format: str = "kv_fp4"
    per_token_scale: bool = True

    def __post_init__(self) -> None:
        check_bits(self.bits)
        get_format(self.moe_format), get_format(self.kv_format)
        for name in ("moe_layers", "attn_layers"):
            layers = getattr(self, name)
            if len(set(layers)) != len(layers) or any(not isinstance(i, int) or i < 0 for i in layers):
                raise ValueError(f"RecordSpec.{name} must be distinct non-negative layer ids, got {layers}")

    @classmethod
    def default(cls, moe_layers: tuple[int, ...], attn_layers: tuple[int, ...], bits: int = 1) -> RecordSpec:
        """b = `bits` on the latter half of the given MoE and attention layers."""
        return cls(bits=bits, moe_layers=_latter_half(tuple(moe_layers)), attn_layers=_latter_half(tuple(attn_layers)))

    def sites(self) -> list[Site]:
        """All captured sites as (layer, kind)."""
        return [(i, "moe_in") for i in self.moe_layers] + [(i, k) for i in self.attn_layers for k in ("k", "v")]


@dataclass(frozen=True)
class ModelShape:
    """The dimensions record sizes depend on."""

    hidden: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class RecordBytes:
    """Record bytes per token, split by site kind."""

    moe_in: float
    kv: float
    per_site: dict[Site, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.moe_in + self.kv


def site_bytes(width: int, bits: int, block: int, token_scale: bool) -> float:
    """Bytes per token of one site: width * (b + 8 / block) / 8, plus 4 for an FP32 token scale."""
    return width * (bits + 8 / block) / 8 + (4 if token_scale else 0)


def bytes_per_token(shape: ModelShape, spec: RecordSpec) -> RecordBytes:
    """Record bytes one token produces under `spec` (docs/design.md, "Records")."""
    moe_fmt, kv_fmt = get_format(spec.moe_format), get_format(spec.kv_format)
    token_scale = spec.per_token_scale and moe_fmt.has_global_scale
    per_site: dict[Site, float] = {}
    for layer, kind in spec.sites():
        if kind == "moe_in":
            per_site[(layer, kind)] = site_bytes(shape.hidden, spec.bits, moe_fmt.block, token_scale)
        else:
            per_site[(layer, kind)] = site_bytes(shape.num_kv_heads * shape.head_dim, spec.bits, kv_fmt.block, False)
    moe = sum(v for (_, k), v in per_site.items() if k == "moe_in")
    return RecordBytes(moe_in=moe, kv=sum(per_site.values()) - moe, per_site=per_site)


def token_digest(tokens: torch.Tensor | Sequence[int]) -> str:
    """Digest of a trajectory's token ids (prompt + response, as int64 little-endian): BLAKE2b-128, hex."""
    ids = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else tokens
    return hashlib.blake2b(np.asarray(ids, dtype="<i8").tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Binding:
    """What produced one trajectory's records; stored with them in the shard header and checked by the trainer.

    Attributes:
        step: RL step (record-store step directory). policy_version: the policy the rollout sampled with.
        trajectory: trajectory id in the step. attempt: id of the rollout attempt (a retry gets a new one).
        tokens: `token_digest` of the trajectory's token ids (prompt + response).
    """

    step: int
    policy_version: int
    trajectory: str
    attempt: str
    tokens: str

    def __post_init__(self) -> None:
        for name in ("step", "policy_version"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"binding {name} must be a non-negative int, got {v!r}")
        for name in ("trajectory", "attempt", "tokens"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"binding {name} must be a str, got {getattr(self, name)!r}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict) -> Binding:
        return cls(**value)

    def mismatches(self, expected: Binding) -> dict[str, tuple]:
        """Field -> (stored, expected) for every field that differs from `expected`."""
        mine, want = asdict(self), asdict(expected)
        return {k: (mine[k], want[k]) for k in mine if mine[k] != want[k]}
