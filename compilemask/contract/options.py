"""KernelOptions: the build variants of the ``cute`` engine's kernels.

``cm.attention(..., backend="cute", options=KernelOptions(bwd_meta="async"))`` picks variants per
call; a field left None takes :func:`default_options`'s value for that call (its device, K and
shape). The other engines (native, fa4, reference) have no such variants and ignore them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

from compilemask.contract.descriptor import TILES_PER_WORD, bitmap_words

__all__ = ["KernelOptions", "default_options", "device_arch", "bitmap_fits_smem",
           "BITMAP_SMEM_WORDS", "GpuRefusalWarning"]


class GpuRefusalWarning(UserWarning):
    """The reference (CPU) engine ran a score_mod that the GPU engines' converter refuses
    (``compilemask.dsl.score_mod``): the same call on a GPU would raise. Said once per function,
    with the converter's reason and the user's line; silenced with
    ``warnings.filterwarnings("ignore", category=cm.GpuRefusalWarning)``."""

# the sm90 backward's shared-memory copy of a bitmap row, TILES_PER_WORD q tiles per word (1 KB:
# q tiles up to 4096, i.e. Sq <= 262144 at tile_m = 64)
BITMAP_SMEM_WORDS = 256

# FA4's own softcap divides every score (div.rn.f32); the generated score_mod multiplies by 1/c:
# 1.27x / 1.22x faster train steps at 8K / 32K (docs/decisions/engine.md)
DEFAULT_SOFTCAP = "score_mod"
# a score_mod's float(kv_idx - q_idx) by bits rather than I2F (docs/decisions/engine.md)
DEFAULT_SCORE_INDEX = "bits"

_CHOICES = {
    "bwd_arch": (80, 90),
    "bwd_dq": ("atomic", "red2"),
    "fwd_mask": ("compare", "bits"),
    "bwd_meta": ("regs", "async"),
    "bwd_bitmap": ("smem", "global"),
    "mask_mod": ("rules", "intervals", "predicate", "rows", "columns"),
    "softcap": ("fa4", "score_mod"),
    "score_index": ("cvt", "bits"),
}


@dataclass(frozen=True)
class KernelOptions:
    """Variants of the CuTe kernels; None: :func:`default_options`'s choice.

    * ``bwd_arch``: 90, the wgmma backward (sm_90 only), or 80, the mma.sync one (sm80+).
    * ``bwd_dq``: the mma.sync backward's dQ adds, ``"atomic"`` (one float32 atomic per element)
      or ``"red2"`` (one ``red.global.add.v2.f32`` per column pair, sm_90); the wgmma backward
      always adds whole tiles by bulk reduce.
    * ``fwd_mask``: how the forward tests partial tiles, ``"compare"`` (the K interval compares
      per score) or ``"bits"`` (the intervals once per row, then one bit per score).
    * ``bwd_meta``: how the wgmma backward brings the next q tile's row metadata, ``"regs"``
      (registers held across the item) or ``"async"`` (per-thread cp.async into shared memory).
    * ``bwd_bitmap``: where the wgmma backward's scans read the bitmap row, ``"smem"`` (a
      shared-memory copy, when the row fits: up to 4096 q tiles) or ``"global"``.
    * ``mask_mod``: the ``fa4`` engine's partial-tile test, ``"rules"`` (the rules as index
      arithmetic), ``"intervals"`` (the Interval Table), ``"predicate"`` (every region a
      fallback predicate), ``"rows"`` (the forward's Interval Table read a row at a time,
      the backward the default) or ``"columns"`` (the head-dim-128 backward's tiles masked by
      the descriptor's column view, ``PipelineConfig(column_view=True)``; the forward the
      default); None: ``codegen.cute_mask_mod.mask_mod_variant`` chooses (and a backward
      reads the column view where the descriptor carries it).
    * ``softcap``: a score_mod recognized as ``c * tanh(score / c)`` runs as the generated
      score_mod (``"score_mod"``: a multiply by ``1/c``, as Flex-FA4 runs it) or FA4's own
      ``softcap`` (``"fa4"``: an IEEE division per score); None: :data:`DEFAULT_SOFTCAP`.
    * ``score_index``: how a generated score_mod turns a linear index expression
      (``kv_idx - q_idx``) into a float, ``"cvt"`` (I2F, a quarter-rate conversion) or
      ``"bits"`` (an add into the mantissa of 1.5 * 2**23 and a subtraction, exact below 2**22;
      used where every length is below 2**20);
      None: :data:`DEFAULT_SCORE_INDEX`.
    """

    bwd_arch: Optional[int] = None
    bwd_dq: Optional[str] = None
    fwd_mask: Optional[str] = None
    bwd_meta: Optional[str] = None
    bwd_bitmap: Optional[str] = None
    mask_mod: Optional[str] = None
    softcap: Optional[str] = None
    score_index: Optional[str] = None

    def __post_init__(self):
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise ValueError(f"KernelOptions.{name} must be one of "
                                 f"{', '.join(map(repr, choices))} (or None), got {value!r}")

    def resolve(self, arch: int, num_intervals: int, num_q_tiles: int = 0) -> "KernelOptions":
        """Every field set: these options, the defaults for the rest."""
        unset = {f.name: getattr(default_options(arch, num_intervals, num_q_tiles), f.name)
                 for f in fields(self) if getattr(self, f.name) is None}
        return replace(self, **unset)

    def to_str(self) -> str:
        """``"name=value,..."`` of the fields set ("" when none are): how the options cross the
        ``compilemask::attention_*`` custom ops, whose arguments are tensors and scalars."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                        if getattr(self, f.name) is not None)

    @classmethod
    def from_str(cls, text: str) -> "KernelOptions":
        """The inverse of :meth:`to_str`."""
        kw = {}
        for item in filter(None, text.split(",")):
            name, _, value = item.partition("=")
            if name not in _CHOICES:
                raise ValueError(f"KernelOptions has no field {name!r}")
            kw[name] = int(value) if name == "bwd_arch" else value
        return cls(**kw)

    def __str__(self) -> str:
        return self.to_str() or "defaults"

    def describe(self, arch: int) -> str:
        """Every field on a device of SM version ``arch``: the value set, else the default
        (both of its values where it depends on K or the length), e.g. for a table's header."""
        short, many = default_options(arch, 1), default_options(arch, 3, 1 << 20)
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "mask_mod":
                value = "per mask"
            elif value is None:
                a, b = getattr(short, f.name), getattr(many, f.name)
                what = {"bwd_meta": "K > 2",
                        "bwd_bitmap": f"> {TILES_PER_WORD * BITMAP_SMEM_WORDS} q tiles"}
                value = a if a == b else f"{a} ({b} for {what[f.name]})"
            parts.append(f"{f.name}={value}")
        return ", ".join(parts)


def bitmap_fits_smem(num_q_tiles: int) -> bool:
    """Whether a backward bitmap row of ``num_q_tiles`` q tiles fits the sm90 kernel's
    shared-memory copy."""
    return bitmap_words(num_q_tiles) <= BITMAP_SMEM_WORDS


def default_options(arch: int, num_intervals: int, num_q_tiles: int = 0) -> KernelOptions:
    """The variants a call runs unless told otherwise, all fields set.

    ``arch``: the SM version the kernels run on (90 for sm_90, 0 without a GPU); for the forward,
    the forward kernel's (90: wgmma, 80: mma.sync). ``num_intervals``: the descriptor's K;
    ``num_q_tiles``: the backward's q tiles per sequence. The choices and their measurements:
    ``docs/decisions/kernel-options.md``."""
    return KernelOptions(
        # the wgmma backward is sm_90 only (faster there than mma.sync)
        bwd_arch=90 if arch // 10 == 9 else 80,
        # red.global.add.v2.f32 needs sm_90 PTX
        bwd_dq="red2" if arch >= 90 else "atomic",
        # the bits are faster at every K on the wgmma forward; the mma.sync path keeps the
        # compares
        fwd_mask="bits" if arch >= 90 else "compare",
        # at large K the registers held across the item slow the backward, at K <= 2
        # cp.async is a wash
        bwd_meta="async" if num_intervals > 2 else "regs",
        bwd_bitmap="smem" if bitmap_fits_smem(num_q_tiles) else "global",
        softcap=DEFAULT_SOFTCAP,
        score_index=DEFAULT_SCORE_INDEX,
    )


def device_arch(device=None) -> int:
    """The SM version of a CUDA ``device`` (90 for sm_90), 0 for anything else."""
    if device is None or getattr(device, "type", None) != "cuda":
        return 0
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor
