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

from trace_core.numerics.formats import FP4Format, get_format
from trace_core.numerics.quant import Quantized
from trace_core.numerics.recipe import DEFAULT_RECIPE, PrecisionRecipe, Scale, get_recipe
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


_COMPRESS = {  # per b: the word mask of each byte's two codes' low b bits, then (shift, mask) steps
    1: (0x11111111, ((3, 0x03030303), (6, 0x000F000F), (12, 0x000000FF))),
    2: (0x33333333, ((2, 0x0F0F0F0F), (4, 0x00FF00FF), (8, 0x0000FFFF))),
}


def pack_low_bits_of_fp4(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack_low_bits(unpack_fp4(packed), bits)` without unpacking: the low `bits` of the codes in packed FP4 bytes
    uint8 `[..., m]` (two codes a byte, the first in the low nibble), as uint8 `[..., ceil(2 * m * bits / 8)]`.

    For b = 1 and 2 and m a multiple of 4, each 32-bit word of 8 codes is compressed in place by three shift / OR
    / mask steps into the 8 b stream bits `pack_low_bits` gives them (little-endian bytes, as on CPUs and GPUs);
    b = 4 is the input itself; b = 3 and other widths take the reference path. The record writer runs this on
    every K/V site of every finished request."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"pack_low_bits_of_fp4 expects uint8 bytes, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("pack_low_bits_of_fp4 needs at least one dimension")
    check_bits(bits)
    if bits == 4:
        return packed.contiguous()
    m = packed.shape[-1]
    if bits == 3 or m % 4:
        from trace_core.numerics.e2m1 import unpack_fp4

        return pack_low_bits(unpack_fp4(packed), bits)
    if packed.numel() == 0:
        return packed.new_empty(*packed.shape[:-1], m * bits // 4)
    mask, steps = _COMPRESS[bits]
    t = packed.contiguous().view(torch.int32) & mask  # bit 31 clear: the right shifts bring in zeros
    for shift, keep in steps:
        t = (t | (t >> shift)) & keep
    out = t.to(torch.uint8) if bits == 1 else t.to(torch.int16).view(torch.uint8)
    return out.reshape(*packed.shape[:-1], m * bits // 4)


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


def recipe_layout(recipe: str | PrecisionRecipe) -> dict[str, object]:
    """The record layout a recipe implies: `moe_format` / `kv_format` (None where the recipe records no such site)
    and `per_token_scale` (an FP32 token scale next to the MoE-input block scales)."""
    r = get_recipe(recipe)
    return {
        "moe_format": recorded_format(r, "moe_in"),
        "kv_format": recorded_format(r, "k"),
        "per_token_scale": r.moe_in.scale is Scale.PER_TOKEN,
    }


def recorded_format(recipe: str | PrecisionRecipe, kind: str) -> str | None:
    """Name of the format `recipe` records site kind `kind` (moe_in, k, v) in; None when it records no such site."""
    role = get_recipe(recipe).role(kind)
    return role.fmt.name if role.recorded else None


LAYER_PRESETS = ("all", "latter-half")
"""The layer presets of a capture policy: every layer (the project's default) or the latter half (the paper's)."""


@dataclass(frozen=True)
class CapturePolicy:
    """What the rollout records, in the one vocabulary the RL config (`record_bits`, `record_all_layers`) and the
    server flags (`--trace-record-bits`, `--trace-layers`) both parse into: `bits` low code bits at every layer
    (`"all"`), at the latter half of each kind's layers (`"latter-half"`), or at the layer ids given."""

    bits: int = 1
    layers: str | tuple[int, ...] = "all"

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if isinstance(self.layers, str):
            if self.layers not in LAYER_PRESETS:
                raise ValueError(f"capture layers {self.layers!r} is not one of {LAYER_PRESETS} or a tuple of ids")
        elif len(set(self.layers)) != len(self.layers) or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.layers
        ):
            raise ValueError(f"capture layers must be distinct non-negative layer ids, got {self.layers}")

    def select(self, layers: Sequence[int]) -> tuple[int, ...]:
        """The layers of `layers` (one site kind's layer ids of a model, ascending) that this policy captures."""
        layers = tuple(layers)
        if self.layers == "all":
            return layers
        if self.layers == "latter-half":
            return layers[len(layers) // 2 :]
        return tuple(i for i in layers if i in self.layers)

    def spec(self, moe_layers: Sequence[int], attn_layers: Sequence[int], recipe: str | None = None) -> RecordSpec:
        """The record spec of this policy on a model with these MoE and attention layers, of the site kinds
        `recipe` records."""
        return RecordSpec.of_recipe(recipe, self.select(moe_layers), self.select(attn_layers), self.bits)


@dataclass(frozen=True)
class RecordSpec:
    """Which sites are captured and how many code bits each keeps.

    `moe_layers` are layer ids of MoE blocks (site `moe_in`); `attn_layers` are layer ids of softmax-attention
    layers (sites `k` and `v`). `RecordSpec.default` keeps b = 1 at every given layer, the policy docs/results.md
    measured best (the paper's default, b = 1 on the latter half, is `RecordSpec.latter_half`).
    `recipe` names the precision recipe (`trace_core.numerics.recipe`) whose rollout writes the records; the record
    layout (`moe_format`, `kv_format`, `per_token_scale`) is derived from it (`layout_recipe`), never stored, so it
    cannot disagree with it. Without a recipe the spec describes today's layout (that of `DEFAULT_RECIPE`: nvfp4 /
    kv_fp4 / per-token) and names no recipe.
    """

    bits: int = 1
    moe_layers: tuple[int, ...] = ()
    attn_layers: tuple[int, ...] = ()
    recipe: str | None = None

    def __post_init__(self) -> None:
        check_bits(self.bits)
        layout = self.layout_recipe  # an unknown recipe name is refused here
        for name, kind in (("moe_layers", "moe_in"), ("attn_layers", "k")):
            layers = getattr(self, name)
            if len(set(layers)) != len(layers) or any(not isinstance(i, int) or i < 0 for i in layers):
                raise ValueError(f"RecordSpec.{name} must be distinct non-negative layer ids, got {layers}")
            if layers and not layout.recorded(kind):
                raise ValueError(
                    f"recipe {self.recipe!r} does not record {kind} (rounded to nearest on both sides); "
                    f"RecordSpec.{name} must be empty, got {layers}"
                )

    @property
    def layout_recipe(self) -> PrecisionRecipe:
        """The recipe the record layout follows: the spec's, else `DEFAULT_RECIPE`."""
        return get_recipe(self.recipe if self.recipe is not None else DEFAULT_RECIPE)

    @property
    def moe_format(self) -> str | None:
        """Format name of the `moe_in` records (None when the recipe records no MoE input)."""
        return recorded_format(self.layout_recipe, "moe_in")

    @property
    def kv_format(self) -> str | None:
        """Format name of the `k` / `v` records (None when the recipe records no K / V)."""
        return recorded_format(self.layout_recipe, "k")

    @property
    def per_token_scale(self) -> bool:
        """Whether the MoE-input records carry an FP32 token scale next to their block scales."""
        return self.layout_recipe.moe_in.scale is Scale.PER_TOKEN

    @classmethod
    def default(
        cls, moe_layers: tuple[int, ...], attn_layers: tuple[int, ...], bits: int = 1, recipe: str | None = None
    ) -> RecordSpec:
        """The project's default: b = `bits` at every given MoE and attention layer, of the site kinds `recipe`
        records. On our models it leaves 2-14x less train-rollout mismatch than the latter half for twice its record
        bytes (docs/results.md, "Choosing the default capture policy")."""
        return CapturePolicy(bits, "all").spec(moe_layers, attn_layers, recipe)

    @classmethod
    def latter_half(
        cls, moe_layers: tuple[int, ...], attn_layers: tuple[int, ...], bits: int = 1, recipe: str | None = None
    ) -> RecordSpec:
        """The paper's default: b = `bits` on the latter half of the given MoE and attention layers (half the
        bytes of `default`), of the site kinds `recipe` records."""
        return CapturePolicy(bits, "latter-half").spec(moe_layers, attn_layers, recipe)

    @classmethod
    def of_recipe(
        cls, recipe: str | None, moe_layers: tuple[int, ...], attn_layers: tuple[int, ...], bits: int
    ) -> RecordSpec:
        """The sites of the given layers that `recipe` records (None: today's layout, no recipe named)."""
        layout = recipe_layout(recipe if recipe is not None else DEFAULT_RECIPE)
        return cls(
            bits=bits,
            moe_layers=tuple(moe_layers) if layout["moe_format"] else (),
            attn_layers=tuple(attn_layers) if layout["kv_format"] else (),
            recipe=recipe,
        )

    def resolve_recipe(self, recipe: str | PrecisionRecipe | None = None) -> PrecisionRecipe:
        """The recipe an engine or trainer runs with this spec: `recipe` if given, else the spec's, else the
        default; checked against the spec (`check_recipe`)."""
        resolved = get_recipe(recipe if recipe is not None else self.recipe or DEFAULT_RECIPE)
        self.check_recipe(resolved)
        return resolved

    def check_recipe(self, recipe: str | PrecisionRecipe) -> None:
        """Raise ValueError unless this spec names no other recipe and its record layout is the one `recipe`
        writes (engines and trainer call it with their own recipe)."""
        recipe = get_recipe(recipe)
        if self.recipe is not None and self.recipe != recipe.name:
            raise ValueError(f"record spec of recipe {self.recipe!r} used under precision recipe {recipe.name!r}")
        want = recipe_layout(recipe)
        moe_differs = self.moe_layers and (
            self.moe_format != want["moe_format"]
            or recipe.moe_in.fmt.has_global_scale
            and self.per_token_scale != want["per_token_scale"]
        )
        if moe_differs or self.attn_layers and self.kv_format != want["kv_format"]:
            raise ValueError(
                f"record spec layout (moe_in {self.moe_format}, per-token {self.per_token_scale}, k/v "
                f"{self.kv_format}) is not what recipe {recipe.name} records (moe_in {want['moe_format']}, per-token "
                f"{want['per_token_scale']}, k/v {want['kv_format']}); build the spec with recipe={recipe.name!r}"
            )

    def site_format(self, kind: str) -> FP4Format:
        """The format of this spec's records of site kind `kind` (ValueError when its recipe records none)."""
        name = self.moe_format if kind == "moe_in" else self.kv_format
        if name is None:
            raise ValueError(f"record spec of recipe {self.recipe!r} records no {kind} sites")
        return get_format(name)

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
    per_site: dict[Site, float] = {}
    for layer, kind in spec.sites():
        fmt = spec.site_format(kind)
        if kind == "moe_in":
            token_scale = spec.per_token_scale and fmt.has_global_scale
            per_site[(layer, kind)] = site_bytes(shape.hidden, spec.bits, fmt.block, token_scale)
        else:  # an nvfp4 K/V row carries its static S_enc (the record's global scale per row)
            width = shape.num_kv_heads * shape.head_dim
            per_site[(layer, kind)] = site_bytes(width, spec.bits, fmt.block, fmt.has_global_scale)
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
        tokens: `token_digest` of the trajectory's token ids (prompt + response). recipe: the precision recipe
        the rollout ran (`trace_core.numerics.recipe`), so a trainer under another recipe refuses the records.
    """

    step: int
    policy_version: int
    trajectory: str
    attempt: str
    tokens: str
    recipe: str = DEFAULT_RECIPE

    def __post_init__(self) -> None:
        for name in ("step", "policy_version"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"binding {name} must be a non-negative int, got {v!r}")
        for name in ("trajectory", "attempt", "tokens"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"binding {name} must be a str, got {getattr(self, name)!r}")
        get_recipe(self.recipe)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict) -> Binding:
        return cls(**value)

    def mismatches(self, expected: Binding) -> dict[str, tuple]:
        """Field -> (stored, expected) for every field that differs from `expected`."""
        mine, want = asdict(self), asdict(expected)
        return {k: (mine[k], want[k]) for k in mine if mine[k] != want[k]}
