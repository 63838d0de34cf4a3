"""Generated TileLang preprocess: batch metadata -> Execution Descriptor in one kernel launch.

``tilelang_source(mask, target)`` emits the program text, ``tilelang_kernel`` compiles it (once
per spec key, tile sizes, target and K; cached in process, and on disk by TileLang's own kernel
cache), ``tilelang_preprocess`` runs it (``CompiledMask.preprocess(backend="tilelang")``).

Design (one launch, no atomics to global memory, nothing pre-zeroed)
------------------------------------------------------------------
Grid ``(ceil(Sq / ROWS), chunks, B)``. ``ROWS = max(tile_m_fwd, 16 * tile_m_bwd)`` (1024 for
the default 128x128 / 64x128 tilings), so a block owns whole output words of *both* bitmaps:
over its chunk of ``CHUNK`` n-tiles, the forward words of its ``ROWS / tile_m_fwd`` forward
m-tiles, and, for every backward n-tile of the chunk, the ``ROWS / (16 * tile_m_bwd)`` backward
words that pack its ``ROWS / tile_m_bwd`` backward m-tiles. ``chunks = ceil(max(n-tiles fwd,
n-tiles bwd) / CHUNK)`` (one chunk up to Sk = 32K with the default tilings; the blocks of the
other chunks recompute the rows' intervals and run in parallel). Every output element is written
exactly once (the Interval Table by the chunk-0 blocks).

When the tilings nest (same ``tile_n``, forward ``tile_m`` a multiple of the backward one, as
the defaults 128x128 / 64x128 do) only the backward counters are kept: a forward tile is the
union of ``SUB`` backward tiles, so its visible and covered row counts are their sums. That halves
the shared-memory atomics of stage 1 and the shared memory, which buys a 256-tile chunk: at 32K
one block per 1024 rows, as at 16K, instead of two that each recompute the rows (measured in
``docs/decisions/preprocess.md``).

Stages of a block (``T.sync_threads()`` between them on CUDA):

0. clear the shared counters.
1. rows: each row evaluates the region guards (first that holds wins) and the K interval
   endpoints in int64, clips them to ``[0, Sk)`` (empty slot: ``(0, 0)``) and writes its Interval
   Table row, ``row_region`` and its metadata copies (chunk 0 only). It then adds its tile
   ranges to per-m-tile difference arrays in shared memory: the n-tiles its intervals *overlap*
   (visible counts), and the n-tiles the union of its intervals *covers* (coverage counts; the
   components of the union come from sorting the K slots by start, a K-element bubble sort in
   registers, and one sweep that merges a slot into the current component when it starts at or
   before the component's end). Rows of fallback regions add no coverage (their tiles are never
   full). The 32 lanes of a warp own 32 consecutive rows (the linear row map), so their
   Interval Table rows are written as one contiguous span. The other map ("interleaved": lanes
   own rows of different backward m-tiles, so their shared-memory atomics go to different
   counters) was measured slower (``docs/decisions/preprocess.md``): the atomics are not what
   bounds stage 1, the scattered global writes cost more.
2. scan: prefix sums of the difference arrays (sums of 16-tile words, then per word: the
   words before it, then its tiles).
3. pack: tile ``t`` of m-tile ``m`` is visible iff its visible count > 0, and masked iff it is
   visible and its coverage count < the number of rows of ``m`` below Sq (``10`` never
   occurs). 16 states per int32 word; forward words run along n, backward words along m.

This is O(rows * K^2 + tiles) per block instead of the O(rows * tiles * K^2) of testing every
(row, tile) pair, and bit-identical to the reference: a tile is covered by a row iff it lies in
one component of the row's interval union (``compiler.tiles`` finds the same components by a
reach iteration; both merge slots that overlap or touch).

Targets
-------
One generator, two texts that differ only in the threading skeleton: on CUDA each stage runs
once per thread (``tx = T.get_thread_binding()``, ``T.sync_threads()`` between stages, shared
memory atomics in stage 1); on TileLang's C target (CPU, used by CI) each stage is a serial loop
``for tx in T.serial(THREADS)`` over the same body, with plain increments. The stage bodies, and
so the endpoint code and the tile algorithm, are the same lines.

Seqlens and batch size are dynamic (``T.dynamic``): new lengths and metadata never recompile.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp
import torch

from compilemask.contract.cache import CompileCache
from compilemask.contract.descriptor import (
    DEFAULT_BWD_TILES,
    DEFAULT_FWD_TILES,
    TILE_BITS,
    TILE_EMPTY,
    TILE_FULL,
    TILE_PARTIAL,
    TILES_PER_WORD,
    TileConfig,
    descriptor_shapes,
)
from compilemask.contract.lru import LRU

from .tilelang_build import (
    Program,
    ProgramEmitter,
    check_target,
    compile_program,
    raw_launch,
)
from .tl_printer import TileLangPrinter

__all__ = ["PreprocessConfig", "DEFAULT_PREPROCESS_CONFIG", "tilelang_source",
           "tilelang_kernel", "tilelang_preprocess", "launcher", "compile_count",
           "PreprocessPlan", "plan"]


@dataclass(frozen=True)
class PreprocessConfig:
    """Launch shape and variants of the preprocess program (``bench/preprocess.py`` sweeps them;
    ``docs/decisions/preprocess.md`` records the choices): ``threads`` per block; ``row_map``
    of stage 1, "linear" or "interleaved" (slower, see the module docstring); Interval Table rows
    as 16-byte (K even) or 8-byte ``vector_stores`` instead of 2K scalar ones (faster for large
    K, never slower; the C target checks it bit for bit in CI); the shared-memory budget of the
    counters (under the 48 KiB default)."""

    threads: int = 512
    row_map: str = "linear"
    vector_stores: bool = True
    smem_budget: int = 40 * 1024

    def __post_init__(self):
        if self.row_map not in ("linear", "interleaved"):
            raise ValueError(f"row_map must be 'linear' or 'interleaved', got {self.row_map!r}")


DEFAULT_PREPROCESS_CONFIG = PreprocessConfig()


# a tile's state from its counts: partial if some row does not cover it, else full; empty if
# no row sees it (the generated `T.if_then_else(cov < rows_in, partial, full), empty` tail)
_STATES = f"{TILE_PARTIAL}, {TILE_FULL}), {TILE_EMPTY}"


@dataclass(frozen=True)
class PreprocessPlan:
    """Static shape of one generated program."""

    K: int
    fwd: TileConfig
    bwd: TileConfig
    rows: int  # rows per block
    threads: int
    chunk: int  # n-tiles per chunk (multiple of 16)
    interleaved: bool = False  # row map of stage 1 (see the module docstring)
    vector_stores: bool = True  # Interval Table rows in vector stores

    @property
    def vector_width(self) -> int:  # ints per vector store: rows are 8K bytes apart
        return 4 if self.K % 2 == 0 else 2

    @property
    def m_fwd(self) -> int:  # forward m-tiles per block
        return self.rows // self.fwd.tile_m

    @property
    def m_bwd(self) -> int:  # backward m-tiles per block
        return self.rows // self.bwd.tile_m

    @property
    def words_bwd(self) -> int:  # backward words (along m) per block and n-tile
        return self.m_bwd // TILES_PER_WORD

    @property
    def nested(self) -> bool:
        """Forward tiles are unions of backward tiles (same tile_n, tile_m a multiple): the
        forward counts are then sums of backward counts, and only those are kept."""
        return _nested(self.fwd, self.bwd)

    @property
    def sub(self) -> int:  # backward m-tiles per forward m-tile (nested tilings)
        return self.fwd.tile_m // self.bwd.tile_m

    @property
    def counters(self) -> int:  # rows of the shared count array
        return (0 if self.nested else 2 * self.m_fwd) + 2 * self.m_bwd

    @property
    def chunk_words(self) -> int:
        return self.chunk // TILES_PER_WORD


def _nested(fwd: TileConfig, bwd: TileConfig) -> bool:
    return fwd.tile_n == bwd.tile_n and fwd.tile_m % bwd.tile_m == 0


def plan(K: int, fwd: TileConfig, bwd: TileConfig,
         config: PreprocessConfig = DEFAULT_PREPROCESS_CONFIG) -> PreprocessPlan:
    rows = max(fwd.tile_m, TILES_PER_WORD * bwd.tile_m)
    threads = min(config.threads, rows)
    counters = (0 if _nested(fwd, bwd) else 2 * (rows // fwd.tile_m)) + 2 * (rows // bwd.tile_m)
    chunk = TILES_PER_WORD
    while chunk < 512 and counters * (2 * chunk) * 4 * (1 + 1 / TILES_PER_WORD) \
            <= config.smem_budget:
        chunk *= 2
    m_bwd = rows // bwd.tile_m
    interleaved = (config.row_map == "interleaved" and threads % m_bwd == 0
                   and bwd.tile_m % (threads // m_bwd) == 0)
    return PreprocessPlan(K, fwd, bwd, rows, threads, chunk, interleaved, config.vector_stores)


# --------------------------------------------------------------------------------------------
# source generation
# --------------------------------------------------------------------------------------------

# every name the generated module binds (a param's buffer must not shadow one)
_RESERVED = frozenset("""
T K TM_FWD TN_FWD TM_BWD TN_BWD ROWS THREADS M_FWD M_BWD WORDS_BWD CHUNK CHUNK_WORDS VIS_FWD
COV_FWD VIS_BWD COV_BWD COUNTERS B Sq NM_FWD W_FWD NN_BWD W_BWD add_range preprocess intervals
SUB vis cov u row_out row_region fwd_bitmap bwd_bitmap params row_params seqlen_k nn_fwd chunks bx
c b tx count lo hi
start end i sq sk region ss ee cs ce tmp EMPTY acc word q e rr r row k j s n a v t mf m_tile gw
rows_in x n_tile mb a z counter lo_tile hi_tile row_pos key_end seqlen kend
""".split())


def tilelang_source(mask, target: str = "cuda", fwd_tiles: TileConfig | None = None,
                    bwd_tiles: TileConfig | None = None,
                    config: PreprocessConfig = DEFAULT_PREPROCESS_CONFIG,
                    meta_dtype: str = "int64", rows: bool = False) -> str:
    """The generated TileLang program (module text defining ``preprocess``) for ``mask``;
    ``meta_dtype`` is the metadata's integer type (int32 values are widened on load);
    ``rows``: the rows are given positions of a longer sequence (``row_pos``, ``key_end``,
    ``seqlen`` inputs; the arrays are read at the rows: ``tilelang_preprocess(..., rows=)``)."""
    check_target(target)
    fwd = fwd_tiles or DEFAULT_FWD_TILES
    bwd = bwd_tiles or DEFAULT_BWD_TILES
    _check_meta_dtype(meta_dtype)
    return _Emitter(mask, plan(mask.num_intervals, fwd, bwd, config), target,
                    meta_dtype, rows).source()


def _check_meta_dtype(meta_dtype: str) -> str:
    if meta_dtype not in ("int64", "int32"):
        raise ValueError(f"meta_dtype must be 'int64' or 'int32', got {meta_dtype!r}")
    return meta_dtype


class _Emitter(ProgramEmitter):
    def __init__(self, mask, pl: PreprocessPlan, target: str, meta_dtype: str = "int64",
                 rows: bool = False):
        super().__init__(target)
        self.mask = mask
        self.pl = pl
        # rows: row r of sequence b is position row_pos[b, r] of a `seqlen`-token sequence
        # (the rows of a served or context-parallel descriptor), its keys clipped at key_end[b]
        self.rows = rows
        self.meta_dtype = meta_dtype
        # metadata buffers are named after their params, unless that clashes with a name of
        # the program (then ``<name>_param``)
        self.buf = {}
        for p in (*mask.scalar_params, *mask.array_params):
            name = p
            while name in _RESERVED or name in self.buf.values():
                name = f"{name}_param"
            self.buf[p] = name
        names = {"i": "i", "seqlen_q": "sq", "seqlen_k": "sk"}
        for p in mask.scalar_params:
            names[p] = self._load(f"{self.buf[p]}[b]")
        arrays = {a: self._load(f"{self.buf[a]}[b, row]") for a in mask.array_params}
        self.pr = TileLangPrinter(names, arrays)

    def _load(self, ref: str) -> str:
        # endpoints are evaluated in int64 whatever the metadata's type
        return ref if self.meta_dtype == "int64" else f'T.Cast("int64", {ref})'

    def bump(self, ind: int, ref: str, delta: str):
        if self.cuda:
            self.w(ind, f"T.atomic_add({ref}, {delta})")
        else:
            self.w(ind, f"{ref} = {ref} + {delta}")

    def source(self) -> str:
        m, pl = self.mask, self.pl
        K = pl.K
        fb = [r.index for r in m.fallback_regions]
        w = self.w
        w(0, f"# TileLang preprocess for mask {m.name!r} (canonical hash {m.key}), generated by "
             "compilemask.codegen.")
        w(0, f"# Target: {self.target}. K = {K} interval slots; forward tiles "
             f"{pl.fwd.tile_m}x{pl.fwd.tile_n}, backward tiles {pl.bwd.tile_m}x{pl.bwd.tile_n}.")
        w(0, "# Regions (first guard that holds wins; its slots, clipped to [0, seqlen_k)):")
        for r in m.regions:
            tag = "  [fallback: tiles never full]" if r.fallback else ""
            w(0, f"#   {r.index} {r.name}: when {r.guard}{tag}")
            for k, iv in enumerate(r.intervals):
                cond = "" if iv.cond is sp.true else f"  if {iv.cond}"
                w(0, f"#       slot {k}: [{iv.lower}, {iv.upper}){cond}")
        w(0, f"# One launch: grid (ceil(Sq / ROWS), n-tile chunks, B), {pl.threads} threads"
             + (" per block." if self.cuda else " (serial loops on the C target)."))
        w(0, "# Block (bx, c, b) owns rows [ROWS*bx, ROWS*bx + ROWS) of sequence b and the n-tiles "
             "of chunk c:")
        w(0, "# the Interval Table rows (chunk 0), the forward bitmap words of its M_FWD forward "
             "m-tiles over")
        w(0, "# the chunk and, for every backward n-tile of the chunk, the WORDS_BWD backward "
             "words packing")
        w(0, "# its M_BWD backward m-tiles: each output word is written once, nothing is "
             "pre-zeroed.")
        w(0, "import tilelang.language as T")
        w(0)
        w(0, f"K = {K}  # interval slots")
        w(0, f"TM_FWD, TN_FWD = {pl.fwd.tile_m}, {pl.fwd.tile_n}  # forward tiling")
        w(0, f"TM_BWD, TN_BWD = {pl.bwd.tile_m}, {pl.bwd.tile_n}  # backward tiling")
        w(0, f"ROWS = {pl.rows}  # rows per block")
        w(0, f"THREADS = {pl.threads}")
        w(0, f"M_FWD, M_BWD = {pl.m_fwd}, {pl.m_bwd}  # forward / backward m-tiles per block")
        w(0, f"WORDS_BWD = {pl.words_bwd}  # backward words per n-tile per block")
        w(0, f"CHUNK = {pl.chunk}  # n-tiles per pass over the shared counters")
        w(0, f"CHUNK_WORDS = CHUNK // {TILES_PER_WORD}")
        w(0, "EMPTY = 2147483647  # sort key of an empty slot (sorts last)")
        if pl.nested:
            w(0, "# shared counter rows: visible / covered per backward m-tile; a forward tile is")
            w(0, "# the union of SUB backward tiles, so its counts are their sums")
            w(0, "SUB = TM_FWD // TM_BWD")
            w(0, "VIS_BWD, COV_BWD = 0, M_BWD")
            w(0, "COUNTERS = 2 * M_BWD")
        else:
            w(0, "# shared counter rows: visible / covered, forward then backward m-tiles")
            w(0, "VIS_FWD, COV_FWD = 0, M_FWD")
            w(0, "VIS_BWD, COV_BWD = 2 * M_FWD, 2 * M_FWD + M_BWD")
            w(0, "COUNTERS = 2 * M_FWD + 2 * M_BWD")
        w(0)
        w(0, 'B = T.dynamic("B")  # batch size')
        w(0, 'Sq = T.dynamic("Sq")  # query rows')
        w(0, 'NM_FWD = T.dynamic("NM_FWD")  # forward m-tiles = ceil(Sq / TM_FWD)')
        w(0, 'W_FWD = T.dynamic("W_FWD")  # forward words per m-tile = ceil(n-tiles / 16)')
        w(0, 'NN_BWD = T.dynamic("NN_BWD")  # backward n-tiles = ceil(seqlen_k / TN_BWD)')
        w(0, 'W_BWD = T.dynamic("W_BWD")  # backward words per n-tile = ceil(m-tiles / 16)')
        w(0)
        self._range_macro()
        w(0)
        w(0)
        w(0, "@T.prim_func")
        w(0, "def preprocess(")
        for p in m.scalar_params:
            w(1, f'{self.buf[p]}: T.Tensor((B,), "{self.meta_dtype}"),  '
                 f'# scalar param {p!r}, per sequence')
        for a in m.array_params:
            w(1, f'{self.buf[a]}: T.Tensor((B, Sq), "{self.meta_dtype}"),  '
                 f'# per-row array {a!r}')
        w(1, 'intervals: T.Tensor((B, Sq, K, 2), "int32"),  # out: Interval Table (start, len)')
        w(1, 'row_region: T.Tensor((B, Sq), "int32"),  # out: region of each row, -1: none')
        w(1, 'fwd_bitmap: T.Tensor((B, NM_FWD, W_FWD), "int32"),  # out: [b, m_block, n words]')
        w(1, 'bwd_bitmap: T.Tensor((B, NN_BWD, W_BWD), "int32"),  # out: [b, n_block, m words]')
        if m.scalar_params:
            w(1, f'params: T.Tensor((B, {len(m.scalar_params)}), "int32"),  # out: scalar params')
        if m.array_params:
            w(1, f'row_params: T.Tensor((B, Sq, {len(m.array_params)}), "int32"),  '
                 '# out: per-row arrays')
        if self.rows:
            w(1, 'row_pos: T.Tensor((B, Sq), "int64"),  # position of each row in its sequence')
            w(1, 'key_end: T.Tensor((B,), "int32"),  # keys at or past it are not shown')
        w(1, "seqlen_k: T.int32,")
        if self.rows:
            w(1, "seqlen: T.int32,  # the sequence's length: seqlen_q and seqlen_k of the rules")
        w(0, "):")
        threads = ", threads=THREADS" if self.cuda else ""
        w(1, "nn_fwd = T.ceildiv(seqlen_k, TN_FWD)  # forward n-tiles")
        w(1, "chunks = T.ceildiv(T.max(nn_fwd, NN_BWD), CHUNK)  # chunks of n-tiles")
        w(1, "# block (bx, c, b): rows [ROWS*bx, ROWS*bx + ROWS) of sequence b, n-tiles of chunk c")
        w(1, f"with T.Kernel(T.ceildiv(Sq, ROWS), chunks, B{threads}) as (bx, c, b):")
        ind = 2
        if self.cuda:
            w(ind, "tx = T.get_thread_binding()")
        w(ind, "# per counter row: CHUNK tile counts (difference array, then prefix sums), then")
        w(ind, "# CHUNK_WORDS sums of 16-tile words (one shared buffer)")
        w(ind, "# (+1: an odd row stride puts the same tile of different counter rows in different")
        w(ind, "# banks)")
        w(ind, 'count = T.alloc_shared((COUNTERS, CHUNK + CHUNK_WORDS + 1), "int32")')
        w(ind, 'lo = T.alloc_local((K,), "int64")  # slot endpoints before the clip')
        w(ind, 'hi = T.alloc_local((K,), "int64")')
        w(ind, 'start = T.alloc_local((K,), "int32")  # clipped slots: [start, end)')
        w(ind, 'end = T.alloc_local((K,), "int32")')
        if self.pl.vector_stores:
            w(ind, 'row_out = T.alloc_local((2 * K,), "int32")  # the Interval Table row')
        w(ind, 'i = T.alloc_var("int64")  # the row, for the endpoint expressions')
        w(ind, 'sq = T.alloc_var("int64")')
        w(ind, 'sk = T.alloc_var("int64")')
        if self.rows:
            w(ind, 'kend = T.alloc_var("int64")  # where the row\'s keys end')
        w(ind, 'region = T.alloc_var("int32")')
        w(ind, 'ss = T.alloc_local((K,), "int32")  # slots sorted by start, for the coverage')
        w(ind, 'ee = T.alloc_local((K,), "int32")')
        w(ind, 'cs = T.alloc_var("int32")  # the current component of the union: [cs, ce)')
        w(ind, 'ce = T.alloc_var("int32")')
        w(ind, 'tmp = T.alloc_var("int32")')
        w(ind, 'acc = T.alloc_var("int32")')
        w(ind, 'word = T.alloc_var("uint32")')
        if pl.nested:
            w(ind, 'vis = T.alloc_var("int32")  # forward counts: sums over SUB backward tiles')
            w(ind, 'cov = T.alloc_var("int32")')
        self.stage(ind, "stage 0: clear the counters", self._stage_clear)
        self.stage(ind, "stage 1 (per row): guards, interval endpoints, table row; add tile "
                        "ranges to the counters", lambda d: self._stage_rows(d, fb))
        self.stage(ind, "stage 2a: sum of each 16-tile word of the difference arrays",
                   self._stage_word_sums)
        self.stage(ind, "stage 2b: prefix sums (words before, then within the word): counts "
                        "per tile", self._stage_scan)
        self.stage(ind, "stage 3: tile states -> bitmap words (2 bits per tile, 16 per word)",
                   self._stage_pack, sync=False)
        return "\n".join(self.lines) + "\n"

    def _range_macro(self):
        w = self.w
        w(0, "@T.macro")
        w(0, "def add_range(count, counter, lo_tile, hi_tile, c):")
        w(1, '"""Count +1 on tiles [lo_tile, hi_tile) of counter row `counter` in chunk `c` '
             '(difference array)."""')
        w(1, "a = T.max(lo_tile, c * CHUNK) - c * CHUNK")
        w(1, "z = T.min(hi_tile, c * CHUNK + CHUNK) - c * CHUNK")
        w(1, "if a < z:")
        self.bump(2, "count[counter, a]", "1")
        w(2, "if z < CHUNK:")
        self.bump(3, "count[counter, z]", "-1")

    def _stage_clear(self, ind):
        w = self.w
        w(ind, "for q in T.serial(T.ceildiv(COUNTERS * CHUNK, THREADS)):")
        w(ind + 1, "e = q * THREADS + tx")
        w(ind + 1, "if e < COUNTERS * CHUNK:")
        w(ind + 2, "count[e // CHUNK, e % CHUNK] = 0")

    def _stage_rows(self, ind, fb):
        m, pr, w = self.mask, self.pr, self.w
        w(ind, "for rr in T.serial(ROWS // THREADS):")
        ind += 1
        if self.pl.interleaved:
            w(ind, "# row within the block, interleaved: lane tx owns rows of backward m-tile "
                   "tx % M_BWD")
            w(ind, "r = (tx % M_BWD) * TM_BWD + tx // M_BWD + (THREADS // M_BWD) * rr")
        else:
            w(ind, "r = rr * THREADS + tx  # row within the block")
        w(ind, "row = bx * ROWS + r")
        w(ind, "if row < Sq:")
        ind += 1
        if self.rows:
            w(ind, "i = row_pos[b, row]")
            w(ind, "sq = T.Cast(\"int64\", seqlen)")
            w(ind, "sk = T.Cast(\"int64\", seqlen)")
            w(ind, "kend = T.Cast(\"int64\", T.min(seqlen_k, key_end[b]))")
        else:
            w(ind, "i = T.Cast(\"int64\", row)")
            w(ind, "sq = T.Cast(\"int64\", Sq)")
            w(ind, "sk = T.Cast(\"int64\", seqlen_k)")
        w(ind, "region = -1")
        w(ind, "for k in T.unroll(K):")
        w(ind + 1, "lo[k] = 0")
        w(ind + 1, "hi[k] = 0")
        rind = ind
        if self.rows:  # a position outside the sequence is padding: no region, empty slots
            w(ind, "if T.And(i >= 0, i < sq):")
            rind = ind + 1
        for r in m.regions:
            tag = " (fallback: slots over-approximate)" if r.fallback else ""
            w(rind, f"# region {r.index} {r.name!r}: rows where {r.guard}{tag}")
            g = pr(r.guard)
            cond = "region < 0" if g == "True" else f"T.And(region < 0, {g})"
            w(rind, f"if {cond}:")
            w(rind + 1, f"region = {r.index}")
            for k, iv in enumerate(r.intervals):
                w(rind + 1, f"# slot {k}: [{iv.lower}, {iv.upper})"
                  + ("" if iv.cond is sp.true else f" if {iv.cond}"))
                d = rind + 1
                if iv.cond is not sp.true:
                    w(d, f"if {pr(iv.cond)}:")
                    d += 1
                w(d, f"lo[{k}] = {pr(iv.lower)}")
                w(d, f"hi[{k}] = {pr(iv.upper)}")
        clip = "kend" if self.rows else "sk"
        w(ind, "# clip to the keys that exist; an empty slot is (0, 0)")
        w(ind, "for k in T.unroll(K):")
        w(ind + 1, f"s = T.min(T.max(lo[k], 0), {clip})")
        w(ind + 1, f"n = T.max(T.min(T.max(hi[k], 0), {clip}) - s, 0)")
        w(ind + 1, "start[k] = T.Cast(\"int32\", T.if_then_else(n > 0, s, 0))")
        w(ind + 1, "end[k] = start[k] + T.Cast(\"int32\", n)")
        w(ind, "if c == 0:")
        w(ind + 1, "# Interval Table row, row_region, metadata copies")
        if self.pl.vector_stores:
            vec = self.pl.vector_width
            w(ind + 1, "for k in T.unroll(K):")
            w(ind + 2, "row_out[2 * k] = start[k]")
            w(ind + 2, "row_out[2 * k + 1] = end[k] - start[k]")
            w(ind + 1, f"# the row's 2K ints in {vec}-int vector stores (rows are {4 * vec}-byte "
                       "aligned)")
            w(ind + 1, f"for v in T.unroll(K * 2 // {vec}):")
            w(ind + 2, f"for x in T.vectorized({vec}):")
            w(ind + 3, f"intervals[b, row, ({vec} * v + x) // 2, ({vec} * v + x) % 2] = "
                       f"row_out[{vec} * v + x]")
        else:
            w(ind + 1, "for k in T.unroll(K):")
            w(ind + 2, "intervals[b, row, k, 0] = start[k]")
            w(ind + 2, "intervals[b, row, k, 1] = end[k] - start[k]")
        w(ind + 1, "row_region[b, row] = region")
        for n, a in enumerate(m.array_params):
            w(ind + 1, f"row_params[b, row, {n}] = T.Cast(\"int32\", {self.buf[a]}[b, row])")
        if m.scalar_params:
            w(ind + 1, "if row == 0:")
            for n, p in enumerate(m.scalar_params):
                w(ind + 2, f"params[b, {n}] = T.Cast(\"int32\", {self.buf[p]}[b])")
        w(ind, "# visible: the n-tiles each nonempty slot overlaps")
        w(ind, "for k in T.unroll(K):")
        w(ind + 1, "if end[k] > start[k]:")
        if not self.pl.nested:
            w(ind + 2, "add_range(count, VIS_FWD + r // TM_FWD, start[k] // TN_FWD, "
                       "(end[k] - 1) // TN_FWD + 1, c)")
        w(ind + 2, "add_range(count, VIS_BWD + r // TM_BWD, start[k] // TN_BWD, "
                   "(end[k] - 1) // TN_BWD + 1, c)")
        w(ind, "# covered: the n-tiles inside one component of the union of the slots")
        d = ind
        # a full tile runs with no interval test and no predicate: only exact slots cover; a
        # fallback region's over-approximating slots add visibility only
        none = [x for x in fb if not any(iv.exact for iv in m.regions[x].intervals)]
        mixed = [m.regions[x] for x in fb
                 if x not in none and not all(iv.exact for iv in m.regions[x].intervals)]
        if none:
            cond = self._fold("T.And", [f"region != {x}" for x in none])
            w(ind, "# fallback rows add no coverage: their tiles are never full")
            w(ind, f"if {cond}:")
            d += 1
        w(d, "# sort the slots by start (empty slots last), then sweep: a slot that starts at or")
        w(d, "# before the end of the current component extends it, else closes it")
        if mixed:
            w(d, "# (over-approximating slots of fallback regions count as empty here)")
        keep = "end[k] > start[k]"
        for r in mixed:
            covers = self._fold("T.And", [f"k != {k}" for k, iv in enumerate(r.intervals)
                                          if not iv.exact])
            keep = f"T.And({keep}, T.Or(region != {r.index}, {covers}))"
        w(d, "for k in T.unroll(K):")
        w(d + 1, f"ss[k] = T.if_then_else({keep}, start[k], EMPTY)")
        w(d + 1, f"ee[k] = T.if_then_else({keep}, end[k], EMPTY)")
        if self.pl.K > 1:
            self.sort_by_first(d, "K", "ss", "ee")
        self.sweep_runs(d, "K", self.pl.K, "ss", "ee", self._cover)

    def _cover(self, ind):
        """Coverage counts for the component [cs, ce): its inner n-tiles (to the last tile when
        it reaches seqlen_k)."""
        if not self.pl.nested:
            self.w(ind, "add_range(count, COV_FWD + r // TM_FWD, (cs + TN_FWD - 1) // TN_FWD, "
                        "T.if_then_else(ce >= seqlen_k, nn_fwd, ce // TN_FWD), c)")
        self.w(ind, "add_range(count, COV_BWD + r // TM_BWD, (cs + TN_BWD - 1) // TN_BWD, "
                    "T.if_then_else(ce >= seqlen_k, NN_BWD, ce // TN_BWD), c)")

    @staticmethod
    def _fold(op: str, terms: list[str]) -> str:
        """``terms`` joined by a two-operand ``T.And`` / ``T.Or``: ``op(op(a, b), c)``."""
        out = terms[0]
        for t in terms[1:]:
            out = f"{op}({out}, {t})"
        return out

    def _stage_word_sums(self, ind):
        w = self.w
        w(ind, "for q in T.serial(T.ceildiv(COUNTERS * CHUNK_WORDS, THREADS)):")
        w(ind + 1, "e = q * THREADS + tx")
        w(ind + 1, "if e < COUNTERS * CHUNK_WORDS:")
        w(ind + 2, "acc = 0")
        w(ind + 2, f"for t in T.serial({TILES_PER_WORD}):")
        w(ind + 3, f"acc = acc + count[e // CHUNK_WORDS, (e % CHUNK_WORDS) * {TILES_PER_WORD} + t]")
        w(ind + 2, "count[e // CHUNK_WORDS, CHUNK + e % CHUNK_WORDS] = acc")

    def _stage_scan(self, ind):
        w = self.w
        w(ind, "for q in T.serial(T.ceildiv(COUNTERS * CHUNK_WORDS, THREADS)):")
        w(ind + 1, "e = q * THREADS + tx")
        w(ind + 1, "if e < COUNTERS * CHUNK_WORDS:")
        w(ind + 2, "acc = 0")
        w(ind + 2, "for v in T.serial(e % CHUNK_WORDS):")
        w(ind + 3, "acc = acc + count[e // CHUNK_WORDS, CHUNK + v]")
        w(ind + 2, f"for t in T.serial({TILES_PER_WORD}):")
        w(ind + 3, f"acc = acc + count[e // CHUNK_WORDS, (e % CHUNK_WORDS) * {TILES_PER_WORD} + t]")
        w(ind + 3, f"count[e // CHUNK_WORDS, (e % CHUNK_WORDS) * {TILES_PER_WORD} + t] = acc")

    def _stage_pack(self, ind):
        w = self.w
        w(ind, "# forward: word (m-tile mf, word v of the chunk) packs 16 n-tiles")
        w(ind, "for q in T.serial(T.ceildiv(M_FWD * CHUNK_WORDS, THREADS)):")
        w(ind + 1, "e = q * THREADS + tx")
        w(ind + 1, "mf = e // CHUNK_WORDS")
        w(ind + 1, "m_tile = bx * M_FWD + mf")
        w(ind + 1, "gw = c * CHUNK_WORDS + e % CHUNK_WORDS")
        w(ind + 1, "if T.And(e < M_FWD * CHUNK_WORDS, T.And(m_tile < NM_FWD, gw < W_FWD)):")
        d = ind + 2
        w(d, "rows_in = T.min(T.max(Sq - m_tile * TM_FWD, 0), TM_FWD)  # rows below Sq")
        w(d, "word = T.uint32(0)")
        w(d, f"for t in T.serial({TILES_PER_WORD}):")
        w(d + 1, f"x = (e % CHUNK_WORDS) * {TILES_PER_WORD} + t")
        w(d + 1, f"if gw * {TILES_PER_WORD} + t < nn_fwd:")
        if self.pl.nested:
            w(d + 2, "vis = 0")
            w(d + 2, "cov = 0")
            w(d + 2, "for u in T.unroll(SUB):")
            w(d + 3, "vis = vis + count[VIS_BWD + mf * SUB + u, x]")
            w(d + 3, "cov = cov + count[COV_BWD + mf * SUB + u, x]")
            vis, cov = "vis", "cov"
        else:
            vis, cov = "count[VIS_FWD + mf, x]", "count[COV_FWD + mf, x]"
        w(d + 2, "word = word | T.shift_left(T.Cast(\"uint32\", "
                 f"T.if_then_else({vis} > 0, "
                 f"T.if_then_else({cov} < rows_in, {_STATES})), "
                 f"T.Cast(\"uint32\", {TILE_BITS} * t))")
        w(d, "fwd_bitmap[b, m_tile, gw] = T.Cast(\"int32\", word)")
        w(ind, "# backward: word (n-tile x of the chunk, word v of the block) packs 16 m-tiles")
        w(ind, "for q in T.serial(T.ceildiv(CHUNK * WORDS_BWD, THREADS)):")
        w(ind + 1, "e = q * THREADS + tx")
        w(ind + 1, "x = e // WORDS_BWD")
        w(ind + 1, "n_tile = c * CHUNK + x")
        w(ind + 1, "gw = bx * WORDS_BWD + e % WORDS_BWD")
        w(ind + 1, "if T.And(e < CHUNK * WORDS_BWD, T.And(n_tile < NN_BWD, gw < W_BWD)):")
        d = ind + 2
        w(d, "word = T.uint32(0)")
        w(d, f"for t in T.serial({TILES_PER_WORD}):")
        w(d + 1, f"mb = (e % WORDS_BWD) * {TILES_PER_WORD} + t")
        w(d + 1, "rows_in = T.min(T.max(Sq - (bx * M_BWD + mb) * TM_BWD, 0), TM_BWD)")
        w(d + 1, "word = word | T.shift_left(T.Cast(\"uint32\", "
                 "T.if_then_else(count[VIS_BWD + mb, x] > 0, "
                 f"T.if_then_else(count[COV_BWD + mb, x] < rows_in, {_STATES})), "
                 f"T.Cast(\"uint32\", {TILE_BITS} * t))")
        w(d, "bwd_bitmap[b, n_tile, gw] = T.Cast(\"int32\", word)")


# --------------------------------------------------------------------------------------------
# compile (cached: in process here, across processes by TileLang's disk cache)
# --------------------------------------------------------------------------------------------

# TileLang compiles run one at a time (its compiler is not known to be thread-safe)
_KERNELS = CompileCache("tilelang_preprocess", serial=True)


def compile_count() -> int:
    """How many TileLang compiles this process has run (tests: no recompile across batches)."""
    return _KERNELS.builds


def tilelang_kernel(mask, fwd_tiles: TileConfig, bwd_tiles: TileConfig, target: str,
                    meta_dtype: str = "int64",
                    config: PreprocessConfig = DEFAULT_PREPROCESS_CONFIG, rows: bool = False):
    """The compiled program for (spec key, plan, target, metadata dtype, rows variant):
    compiled once per process, loaded from TileLang's disk cache in the next."""
    check_target(target)
    key = (mask.key, plan(mask.num_intervals, fwd_tiles, bwd_tiles, config), target,
           _check_meta_dtype(meta_dtype)) + (("rows",) if rows else ())

    def build():
        return compile_program(*preprocess_program(mask, fwd_tiles, bwd_tiles, target,
                                                   meta_dtype, config, rows))

    return _KERNELS.get(key, build)


def preprocess_program(mask, fwd_tiles: TileConfig, bwd_tiles: TileConfig, target: str,
                       meta_dtype: str = "int64",
                       config: PreprocessConfig = DEFAULT_PREPROCESS_CONFIG,
                       rows: bool = False) -> Program:
    """What :func:`tilelang_kernel` compiles, as a ``tilelang_build.Program`` (``prebuild``)."""
    src = tilelang_source(mask, target, fwd_tiles, bwd_tiles, config, meta_dtype, rows)
    what = "row-descriptor program" if rows else "preprocess program"
    return Program(src, f"{target}_{mask.key}{'_rows' if rows else ''}", "preprocess", target,
                   f"the {what} of mask {mask.name!r}")


_LAUNCHERS = LRU(256)  # (mask key, tilings, device, dtype, config) -> entry point


def launcher(mask, fwd_tiles: TileConfig, bwd_tiles: TileConfig, device_type: str,
             meta_dtype: str = "int64", config: PreprocessConfig = DEFAULT_PREPROCESS_CONFIG,
             rows: bool = False):
    """The compiled program's entry point for ``device_type`` ("cuda": the raw TVM-FFI function,
    without TileLang's per-call wrapper; "cpu": the C target)."""
    key = (mask.key, fwd_tiles, bwd_tiles, device_type, meta_dtype, config, rows)
    fn = _LAUNCHERS.get(key)
    if fn is None:
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"tilelang preprocess: unsupported device {device_type}")
        target = "cuda" if device_type == "cuda" else "c"
        kern = tilelang_kernel(mask, fwd_tiles, bwd_tiles, target, meta_dtype, config, rows)
        fn = _LAUNCHERS[key] = raw_launch(kern) if target == "cuda" else kern
    return fn


# --------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------


def tilelang_preprocess(mask, B, scal, arrs, seqlen_q, seqlen_k, fwd_tiles, bwd_tiles, *,
                        device, config: PreprocessConfig = DEFAULT_PREPROCESS_CONFIG,
                        rows: tuple | None = None) -> dict:
    """Run the generated program (CUDA for a CUDA device, the C target on CPU): the descriptor's
    tensors by field name. ``scal``: int64 ``[B, 1]`` per scalar param; ``arrs``: ``[B, Sq]``
    per array param (the derived run bounds included). No host sync.

    ``rows = (row_pos, key_end, seqlen)``: the rows variant, row ``r`` of sequence ``b`` being
    position ``row_pos[b, r]`` (int64 ``[B, Sq]``; outside ``[0, seqlen)``: padding) of a
    ``seqlen``-token sequence, its keys clipped at ``key_end[b]`` (int ``[B]``); ``arrs`` are
    then the arrays at the rows."""
    dev = torch.device(device)
    K = mask.num_intervals
    P, R = len(mask.scalar_params), len(mask.array_params)
    shapes = descriptor_shapes(B, seqlen_q, seqlen_k, K, P, R, fwd_tiles, bwd_tiles)
    out = {f: torch.empty(s, dtype=torch.int32, device=dev) for f, s in shapes.items()}
    args = [_as_i64(scal[p].reshape(B), dev) for p in mask.scalar_params]
    args += [_as_i64(arrs[a], dev) for a in mask.array_params]
    args += launch_outputs(out, P, R)
    if rows is not None:
        row_pos, key_end, seqlen = rows
        args += [_as_i64(row_pos, dev), key_end.to(device=dev, dtype=torch.int32).contiguous()]
    args.append(int(seqlen_k))
    if rows is not None:
        args.append(int(seqlen))
    launcher(mask, fwd_tiles, bwd_tiles, dev.type, "int64", config, rows=rows is not None)(*args)
    return out


def launch_outputs(out: dict, num_params: int, num_arrays: int) -> list:
    """The program's output arguments, in its signature's order."""
    args = [out["intervals"], out["row_region"], out["fwd_bitmap"], out["bwd_bitmap"]]
    if num_params:
        args.append(out["params"])
    if num_arrays:
        args.append(out["row_params"])
    return args


def _as_i64(t, dev):
    t = t.to(device=dev, dtype=torch.int64)
    return t if t.is_contiguous() else t.contiguous()
