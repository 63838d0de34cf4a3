"""Generated TileLang kernel: block-sparse tile lists (flash-attn-4 format) from the bitmaps.

``block_sparse_multi(bitmaps, mp, dims)`` writes, in one launch on the bitmaps' device, the lists
of several kinds (``compiler.blocksparse.BlockSparseLists`` each: partial and full column
tiles per row, compacted) into one flat buffer, bit for bit as the torch reference
``compiler.blocksparse.lists_from_bitmap`` does on the counts and the first ``cnt`` entries of
every row; ``block_sparse_lists`` is the one-kind case. ``multi_source`` is the program text,
``multi_kernel`` the compiled kernel.

Shapes are run-time values: the batch size, every kind's rows and columns (``R_k``, ``C_k``, int32
arguments) and the bitmaps' shapes. A program depends only on its kinds' structure (which bitmap,
read by rows or by columns) and the launch shape (:class:`ListsConfig`), so one compiled program
serves every sequence length and every mask with the same tilings.

Design
------
Grid ``(sum_k ceil(R_k / RPB_k), B)``: grid x is cut into one range of blocks per kind; a block
owns ``RPB`` list rows of its kind, ``TPR`` threads per row. A row's column tiles are visited in
chunks of ``CHUNK = 16 * TPR * WPT`` tiles (``ceil(C / CHUNK)`` chunks), each thread owning
``WPT`` consecutive 16-tile words of the chunk. Per chunk:

1. words: each thread reads its words (the bitmap row as it is; transposed, it assembles each
   16-tile word from 16 bitmap words of the block's column, staged in shared memory first) and
   counts its partial and full tiles (sums of bit fields: the C target has no popcount);
2. scan: a prefix sum of the per-thread counts over the row's threads (Hillis-Steele, both
   counts in one int32: ``partial + (full << 16)``, a chunk has < 2^15 tiles) gives every thread
   where its tiles go;
3. scatter: each thread writes its tiles' column indices at those places of the row's two
   compacted chunk lists in shared memory (skewed by one slot per 32 entries: a row of full
   tiles would otherwise put every thread of a warp on the same bank);
4. copy: the row's threads copy the chunk lists to global memory, consecutive threads to
   consecutive entries (coalesced; the scattered writes of step 3 would not be), after the
   entries of the earlier chunks.

Then the counts (and, with ``fill``, zeros past them). Output entries past a row's count are not
written unless ``fill``: the kernels never read them, and it saves the stores.

Targets: as in ``compilemask.codegen.preprocess``, one generator, two threading skeletons
(``codegen.tilelang_build.ProgramEmitter``): on CUDA each stage runs once per thread,
``T.sync_threads()`` between stages; on TileLang's C target (CPU, for CI) each stage is a serial
loop over the threads, every value passed between stages lives in shared memory.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from compilemask.compiler.blocksparse import BlockSparseLists, PackedLists, list_pass
from compilemask.contract.cache import CompileCache
from compilemask.contract.descriptor import (
    DEFAULT_BWD_TILES,
    DEFAULT_FWD_TILES,
    TILE_BITS,
    TILE_FULL,
    TILE_PARTIAL,
    TILE_STATE_MASK,
    TILES_PER_WORD,
)
from compilemask.contract.lru import LRU

from .tilelang_build import (
    Program,
    ProgramEmitter,
    check_target,
    compile_program,
    raw_launch,
)

__all__ = ["ListsConfig", "DEFAULT_LISTS_CONFIG", "BlockSparsePlan", "plan", "MultiPlan",
           "multi_plan", "multi_source", "multi_kernel", "block_sparse_multi",
           "block_sparse_lists", "packed_lists", "list_programs", "tilelang_source",
           "compile_count"]


@dataclass(frozen=True)
class ListsConfig:
    """Launch shape of the list programs (``bench/blocksparse.py`` measures the choices, recorded
    in ``docs/decisions/preprocess.md``): ``tpr`` threads per list row (``tpr_transposed`` for
    the read by columns), ``wpt`` 16-tile words per thread per chunk, ``threads`` per block, and
    the shared-memory budget that bounds the rows per block."""

    threads: int = 256
    tpr: int = 16
    tpr_transposed: int = 16
    wpt: int = 1
    smem_budget: int = 40 * 1024


DEFAULT_LISTS_CONFIG = ListsConfig()


@dataclass(frozen=True)
class BlockSparsePlan:
    """Static thread layout of one list kind (its rows and columns are run-time values)."""

    transpose: bool  # rows are the bitmap's packed tiles (read by columns)
    tpr: int  # threads per list row (power of 2)
    wpt: int  # 16-tile words per thread per chunk
    rpb: int  # list rows per block (divides 16 when transposed)
    fill: bool = False  # write 0 past each row's count

    @property
    def chunk_words(self) -> int:
        return self.tpr * self.wpt

    @property
    def chunk(self) -> int:  # column tiles per chunk
        return TILES_PER_WORD * self.chunk_words

    @property
    def threads(self) -> int:
        return self.tpr * self.rpb

    @property
    def scan_steps(self) -> int:
        return self.tpr.bit_length() - 1

    def chunks(self, cols: int) -> int:
        return -(-cols // self.chunk)

    @property
    def smem_bytes(self) -> int:
        col = self.chunk + self.chunk // TILES_PER_WORD if self.transpose else 0
        lists = 2 * self.rpb * (self.chunk + self.chunk // 32)
        return 4 * (lists + self.rpb * self.chunk_words + 2 * self.threads + 2 * self.rpb + col)


def plan(transpose: bool = False, fill: bool = False,
         config: ListsConfig = DEFAULT_LISTS_CONFIG) -> BlockSparsePlan:
    """The thread layout of one kind: ``TPR`` threads per row, ``WPT`` words each per chunk, rows
    per block to fill ``config.threads`` (at most 16), shrunk to fit the shared-memory budget."""
    tpr = config.tpr_transposed if transpose else config.tpr
    if tpr < 1 or tpr & (tpr - 1) or config.wpt < 1:
        raise ValueError(f"{config}: threads per row must be a power of 2, words per thread >= 1")
    rpb = max(1, min(16, config.threads // tpr))
    pl = BlockSparsePlan(transpose, tpr, config.wpt, rpb, fill)
    if pl.chunk >= 1 << 15:
        raise ValueError(f"chunk of {pl.chunk} tiles: a chunk's counts must fit in 15 bits")
    while pl.smem_bytes > config.smem_budget and pl.rpb > 1:
        pl = BlockSparsePlan(transpose, tpr, config.wpt, pl.rpb // 2, fill)
    if pl.smem_bytes > config.smem_budget:
        raise ValueError(f"block-sparse plan {pl} needs {pl.smem_bytes} bytes of shared memory")
    return pl


@dataclass(frozen=True)
class MultiPlan:
    """Several list kinds in one launch: ``parts[k]`` is a plan and the index of the bitmap it
    reads. The output is one flat int32 buffer: per part, its ``mask_cnt [B, 1, R]``,
    ``mask_idx [B, 1, R, C]``, ``full_cnt``, ``full_idx`` in that order, part after part."""

    parts: tuple[tuple[BlockSparsePlan, int], ...]
    num_bitmaps: int  # every one read by some part

    @property
    def threads(self) -> int:
        return max(pl.threads for pl, _ in self.parts)

    def blocks(self, dims) -> tuple[int, ...]:
        """Blocks of each part along grid x, for ``dims`` = (rows, cols) per part."""
        return tuple(-(-r // pl.rpb) for (pl, _), (r, _c) in zip(self.parts, dims))

    @staticmethod
    def offsets(dims) -> list[tuple[int, int, int, int]]:
        """Per part, the start of each output per sequence (multiply by B)."""
        out, at = [], 0
        for r, c in dims:
            rc = r * c
            out.append((at, at + r, at + r + rc, at + 2 * r + rc))
            at += 2 * (r + rc)
        return out

    @staticmethod
    def per_sequence(dims) -> int:  # output entries per sequence
        return sum(2 * r * (c + 1) for r, c in dims)


def multi_plan(parts, num_bitmaps: int, config: ListsConfig = DEFAULT_LISTS_CONFIG,
               fill: bool = False) -> MultiPlan:
    """``parts``: (transpose, bitmap index) per list kind."""
    plans = tuple((plan(t, fill, config), i) for t, i in parts)
    if not plans or {i for _, i in plans} != set(range(num_bitmaps)):
        raise ValueError(f"parts must read bitmaps 0..{num_bitmaps - 1}, each, got {parts}")
    return MultiPlan(plans, num_bitmaps)


# --------------------------------------------------------------------------------------------
# source generation
# --------------------------------------------------------------------------------------------

# names that differ between the parts of a program (``_k`` appended); the let-bound locals too:
# TileLang's builder takes a second binding of a name (in another part) for an assignment to
# the first
_PART_NAMES = ("R", "C", "ROW_WORDS", "TPR", "WPT", "RPB", "THREADS", "CHUNK_WORDS", "CHUNK",
               "CHUNKS", "PSTRIDE", "LAST_MASK", "bx", "lr", "lane", "row", "v", "m")
_NAME_RE = re.compile(r"\b(" + "|".join(_PART_NAMES + ("NR", "bitmap")) + r")\b")
_OUTPUTS = ("mask_cnt", "mask_idx", "full_cnt", "full_idx")


class _PartEmitter(ProgramEmitter):
    """The text of one list kind, part ``part`` of a program: its names get a ``_k`` suffix (the
    bitmap's, that of the bitmap it reads), its outputs are ranges of one flat buffer and, with
    fewer threads than the kernel, every stage is guarded by ``tx < THREADS``."""

    def __init__(self, pl: BlockSparsePlan, target: str, lines: list[str], part: int,
                 bitmap: int, guard: bool):
        super().__init__(target, lines)
        self.pl = pl
        self.part = part
        self.names = {n: f"{n}_{part}" for n in _PART_NAMES}
        self.names.update(NR=f"NR{bitmap}", bitmap=f"bitmap{bitmap}")
        self.guard = "tx < THREADS" if guard else None

    def rename(self, text: str) -> str:
        code, hash_, comment = text.partition("#")  # comments keep the plain names
        return _NAME_RE.sub(lambda m: self.names[m.group(1)], code) + hash_ + comment

    def out(self, name: str, row: str, col: str | None = None) -> str:
        """An output element: ``name`` of this kind at ``[b, 0, row(, col)]``."""
        off = f"B * {name.upper()}_OFF_{self.part}"  # the kind's four outputs, [B, 1, R(, C)]
        if col is None:
            return f"lists[{off} + b * R + {row}]"
        return f"lists[{off} + (b * R + {row}) * C + {col}]"

    def stage(self, ind: int, comment: str, body, sync: bool = True, guard=None):
        super().stage(ind, comment, body, sync, self.guard)

    def row_of_thread(self, ind: int):
        self.w(ind, "lr = tx // TPR  # list row within the block")
        self.w(ind, "lane = tx % TPR")
        self.w(ind, "row = bx * RPB + lr")

    def constants(self):
        pl, w = self.pl, self.w
        w(0, f"TPR, WPT, RPB = {pl.tpr}, {pl.wpt}, {pl.rpb}  # threads per row, words per thread "
             "per chunk, rows per block")
        w(0, "THREADS = TPR * RPB")
        w(0, "CHUNK_WORDS = TPR * WPT")
        w(0, "CHUNK = 16 * CHUNK_WORDS  # column tiles per chunk")
        w(0, "PSTRIDE = CHUNK + CHUNK // 32  # a row's chunk list in shared memory (see stage 3)")

    def shapes(self, ind: int):
        """The run-time quantities of the kind, from its rows ``R`` and columns ``C``."""
        w = self.w
        w(ind, "ROW_WORDS = T.ceildiv(C, 16)  # 16-tile words of one list row")
        w(ind, "CHUNKS = T.ceildiv(C, CHUNK)")
        if not self.pl.transpose:
            w(ind, "# the tiles of a row's last word (the rest pads)")
            w(ind, 'LAST_MASK = T.if_then_else(C % 16 == 0, T.uint32(4294967295), T.shift_left('
                   'T.uint32(1), T.Cast("uint32", 2 * (C % 16))) - T.uint32(1))')

    def shared_sizes(self) -> dict[str, int]:
        """Entries of each flat shared buffer this kind uses."""
        pl = self.pl
        sizes = {"words": pl.rpb * pl.chunk_words, "scan": 2 * pl.threads,
                 "part": pl.rpb * (pl.chunk + pl.chunk // 32),
                 "full": pl.rpb * (pl.chunk + pl.chunk // 32), "base": 2 * pl.rpb}
        if pl.transpose:
            sizes["col"] = pl.chunk + pl.chunk // 16
        return sizes

    def body(self, ind: int):
        """The stages, in a block whose ``bx``, ``b``, ``tx`` (CUDA), shared buffers and locals
        are in scope."""
        pl, d = self.pl, ind + 1
        self.stage(ind, "stage 0: no entries yet", self._stage_clear)
        self.w(ind, "for ch in T.serial(CHUNKS):")
        if pl.transpose:
            self.stage(d, "stage 1a: the block's bitmap column over the chunk", self._stage_col)
        self.stage(d, "stage 1: the thread's words, its partial and full tile counts",
                   self._stage_words)
        for s in range(pl.scan_steps):
            self.stage(d, f"stage 2.{s}: prefix sums over the row's threads, stride {1 << s}",
                       lambda i, s=s: self._stage_scan(i, s))
        self.stage(d, "stage 3: column indices to the chunk lists, from the thread's place on",
                   self._stage_scatter)
        self.stage(d, "stage 4: chunk lists to the output after the earlier chunks' entries "
                      "(coalesced)", self._stage_copy)
        self.stage(d, "stage 5: the chunk's entries count as earlier ones for the next",
                   self._stage_advance)
        self.stage(ind, "stage 6: counts" + (", zeros past them" if pl.fill else ""),
                   self._stage_counts)
        if self.cuda:
            self.lines.pop()  # no barrier after the last stage

    @property
    def _final(self) -> int:  # the scan buffer that holds the inclusive sums
        return self.pl.scan_steps % 2

    def _stage_clear(self, ind):
        self.w(ind, "for q in T.serial(T.ceildiv(2 * RPB, THREADS)):")
        self.w(ind + 1, "if q * THREADS + tx < 2 * RPB:")
        self.w(ind + 2, "base[q * THREADS + tx] = 0")

    def _stage_col(self, ind):
        w = self.w
        w(ind, "for q in T.serial(T.ceildiv(CHUNK, THREADS)):")
        w(ind + 1, "m = q * THREADS + tx")
        w(ind + 1, "if m < CHUNK:")
        w(ind + 2, "if ch * CHUNK + m < NR:")
        w(ind + 3, 'col[m + m // 16] = T.Cast("uint32", bitmap[b, ch * CHUNK + m, '
                   "(bx * RPB) // 16])")
        w(ind + 2, "else:")
        w(ind + 3, "col[m + m // 16] = T.uint32(0)")

    def _stage_words(self, ind):
        pl, w = self.pl, self.w
        self.row_of_thread(ind)
        w(ind, "acc = 0")
        w(ind, "for k in T.unroll(WPT):")
        d = ind + 1
        w(d, "v = lane * WPT + k  # word within the chunk")
        w(d, "word = T.uint32(0)")
        w(d, "if T.And(row < R, ch * CHUNK_WORDS + v < ROW_WORDS):")
        if pl.transpose:
            w(d + 1, "# tile t of the word: list column 16 v + t, bits 2 (row % 16) of its "
                     "bitmap word")
            w(d + 1, "for t in T.unroll(16):")
            w(d + 2, "word = word | T.shift_left(T.bitwise_and(T.shift_right(col[17 * v + t], "
                     f'T.Cast("uint32", {TILE_BITS} * (row % 16))), T.uint32({TILE_STATE_MASK})), '
                     f'T.uint32({TILE_BITS} * t))')
        else:
            w(d + 1, 'word = T.Cast("uint32", bitmap[b, row, ch * CHUNK_WORDS + v])')
            w(d + 1, "if ch * CHUNK_WORDS + v == ROW_WORDS - 1:")
            w(d + 2, "word = T.bitwise_and(word, LAST_MASK)")
        w(d, "words[lr * CHUNK_WORDS + v] = word")
        w(d, "# partial: both bits of the state set; full: the visible bit alone")
        w(d, "bits = T.bitwise_and(T.bitwise_and(word, T.shift_right(word, T.uint32(1))), "
             "T.uint32(FIVES))")
        self._popcount(d, "bits", "acc = acc + {}")
        w(d, "bits = T.bitwise_and(T.bitwise_and(word, T.bitwise_not(T.shift_right(word, "
             "T.uint32(1)))), T.uint32(FIVES))")
        self._popcount(d, "bits", "acc = acc + T.shift_left({}, 16)")
        w(ind, "scan[tx] = acc")

    def _popcount(self, ind, var, assign):
        """``assign`` with the number of set bits of ``var`` (set at even positions only), by
        sums of bit fields: TileLang's C target has no popcount."""
        w = self.w
        w(ind, f"{var} = T.bitwise_and({var}, T.uint32(0x33333333)) + T.bitwise_and("
               f"T.shift_right({var}, T.uint32(2)), T.uint32(0x33333333))")
        w(ind, f"{var} = T.bitwise_and({var} + T.shift_right({var}, T.uint32(4)), "
               "T.uint32(0x0F0F0F0F))")
        w(ind, f"{var} = {var} + T.shift_right({var}, T.uint32(8))")
        w(ind, f"{var} = {var} + T.shift_right({var}, T.uint32(16))")
        w(ind, assign.format(f'T.Cast("int32", T.bitwise_and({var}, T.uint32(63)))'))

    def _stage_scan(self, ind, s):
        src, dst, stride = s % 2, 1 - s % 2, 1 << s
        w = self.w
        w(ind, f"if tx % TPR >= {stride}:")
        w(ind + 1, f"scan[{dst} * THREADS + tx] = scan[{src} * THREADS + tx] + "
                   f"scan[{src} * THREADS + tx - {stride}]")
        w(ind, "else:")
        w(ind + 1, f"scan[{dst} * THREADS + tx] = scan[{src} * THREADS + tx]")

    def _stage_scatter(self, ind):
        w = self.w
        self.row_of_thread(ind)
        w(ind, "if row < R:")
        d = ind + 1
        w(d, "# the counts of the row's threads before this one; entry j of a chunk list is kept")
        w(d, "# at j + j // 32, so that the threads of a row of full tiles, which write entries")
        w(d, "# 16 * WPT apart, hit different banks")
        w(d, f"acc = T.if_then_else(lane > 0, scan[{self._final} * THREADS + T.max(tx - 1, "
             "0)], 0)")
        w(d, "op = T.bitwise_and(acc, 65535)")
        w(d, "of = T.shift_right(acc, 16)")
        w(d, "for k in T.unroll(WPT):")
        w(d + 1, "word = words[lr * CHUNK_WORDS + lane * WPT + k]")
        w(d + 1, "for t in T.unroll(16):")
        e = d + 2
        state = (f"T.bitwise_and(T.shift_right(word, T.uint32({TILE_BITS} * t)), "
                 f"T.uint32({TILE_STATE_MASK}))")
        w(e, f"if {state} == T.uint32({TILE_PARTIAL}):")
        w(e + 1, "part[lr * PSTRIDE + op + op // 32] = ch * CHUNK + (lane * WPT + k) * 16 + t")
        w(e + 1, "op = op + 1")
        w(e, f"if {state} == T.uint32({TILE_FULL}):")
        w(e + 1, "full[lr * PSTRIDE + of + of // 32] = ch * CHUNK + (lane * WPT + k) * 16 + t")
        w(e + 1, "of = of + 1")

    def _stage_copy(self, ind):
        w = self.w
        self.row_of_thread(ind)
        w(ind, "if row < R:")
        d = ind + 1
        w(d, f"acc = scan[{self._final} * THREADS + lr * TPR + TPR - 1]  # the row's chunk "
             "totals")
        w(d, "for q in T.serial(CHUNK // TPR):")
        for half, cnt, base, src in (("mask_idx", "T.bitwise_and(acc, 65535)", "base[lr]", "part"),
                                     ("full_idx", "T.shift_right(acc, 16)", "base[RPB + lr]",
                                      "full")):
            w(d + 1, f"if q * TPR + lane < {cnt}:")
            w(d + 2, f"{self.out(half, 'row', base + ' + q * TPR + lane')} = "
                     f"{src}[lr * PSTRIDE + q * TPR + lane + (q * TPR + lane) // 32]")

    def _stage_advance(self, ind):
        w = self.w
        w(ind, "if tx % TPR == 0:")
        w(ind + 1, f"acc = scan[{self._final} * THREADS + tx + TPR - 1]")
        w(ind + 1, "base[tx // TPR] = base[tx // TPR] + T.bitwise_and(acc, 65535)")
        w(ind + 1, "base[RPB + tx // TPR] = base[RPB + tx // TPR] + T.shift_right(acc, 16)")

    def _stage_counts(self, ind):
        w = self.w
        self.row_of_thread(ind)
        w(ind, "if row < R:")
        d = ind + 1
        w(d, "if lane == 0:")
        w(d + 1, f"{self.out('mask_cnt', 'row')} = base[lr]")
        w(d + 1, f"{self.out('full_cnt', 'row')} = base[RPB + lr]")
        if self.pl.fill:
            w(d, "for q in T.serial(T.ceildiv(C, TPR)):")
            w(d + 1, "if q * TPR + lane < C:")
            w(d + 2, "if q * TPR + lane >= base[lr]:")
            w(d + 3, f"{self.out('mask_idx', 'row', 'q * TPR + lane')} = 0")
            w(d + 2, "if q * TPR + lane >= base[RPB + lr]:")
            w(d + 3, f"{self.out('full_idx', 'row', 'q * TPR + lane')} = 0")


_FIVES = 1431655765
_SHARED = {"words": ("uint32", "the chunk's words of each row, row-major"),
           "scan": ("int32", "per thread partial + (full << 16) tiles, then prefix sums "
                    "(ping-pong halves)"),
           "part": ("int32", "the chunk's partial columns of each row (PSTRIDE apart; entry j "
                    "at j + j // 32: see stage 3)"),
           "full": ("int32", "the chunk's full columns of each row"),
           "base": ("int32", "entries of the earlier chunks, per row: partial then full"),
           "col": ("uint32", "the block's bitmap column over the chunk (its rows share a word "
                   "index), a pad word per 16 so that threads 16 words apart read different "
                   "banks")}


def _declare(w, ind: int, sizes: dict[str, int]):
    """Flat shared buffers (one declaration serves every part of a multi-part kernel), then the
    locals. Static shared memory: the C target takes one dynamic shared allocation at most."""
    for name, n in sizes.items():
        dtype, comment = _SHARED[name]
        w(ind, f"# {comment}")
        w(ind, f'{name} = T.alloc_shared(({n},), "{dtype}", scope="shared")')
    w(ind, 'word = T.alloc_var("uint32")')
    w(ind, 'bits = T.alloc_var("uint32")')
    w(ind, 'acc = T.alloc_var("int32")')
    w(ind, 'op = T.alloc_var("int32")  # next slot of the partial / full chunk list')
    w(ind, 'of = T.alloc_var("int32")')



def multi_source(mp: MultiPlan, target: str = "cuda") -> str:
    """The generated TileLang program (``block_sparse_multi``) writing every part of ``mp``."""
    target = check_target(target)
    cuda = target == "cuda"
    lines: list[str] = []
    parts = [_PartEmitter(pl, target, lines, k, i, guard=pl.threads < mp.threads)
             for k, (pl, i) in enumerate(mp.parts)]
    w0 = ProgramEmitter(target, lines).w  # no renaming
    w0(0, "# TileLang block-sparse lists (flash-attn-4 format) of one or more kinds in one "
          "launch, generated by")
    w0(0, f"# compilemask.codegen. Target: {target}. Grid x is cut into one range of blocks per "
          "part (list kind);")
    w0(0, "# a block runs its part's stages with that part's constants (suffix _k). Rows R_k "
          "and columns C_k")
    w0(0, "# of every part, the batch and the bitmaps' shapes are run-time values. Per part:")
    w0(0, "# block (bx, b) owns list rows [RPB*bx, RPB*bx + RPB) of sequence b, TPR threads per "
          "row; a row's")
    w0(0, "# tiles are visited in chunks of CHUNK tiles, WPT 16-tile words per thread: count, "
          "prefix-sum the")
    w0(0, "# counts over the row's threads, scatter the column indices to shared lists, copy "
          "them out coalesced.")
    w0(0, "import tilelang.language as T")
    w0(0)
    for k, (em, (pl, i)) in enumerate(zip(parts, mp.parts)):
        how = "by columns" if pl.transpose else "by rows"
        w0(0, f"# part {k}: bitmap{i} read {how}")
        em.constants()
    w0(0, f"FIVES = {_FIVES}  # 0x55555555: bit 0 of every 2-bit tile state")
    w0(0)
    w0(0, 'B = T.dynamic("B")  # batch size')
    for i in range(mp.num_bitmaps):
        w0(0, f'NR{i}, W{i} = T.dynamic("NR{i}"), T.dynamic("W{i}")  # bitmap{i}: rows, words '
              "per row")
    w0(0, 'N = T.dynamic("N")  # entries of the flat output (B times the per-sequence total)')
    w0(0)
    w0(0)
    w0(0, "@T.prim_func")
    w0(0, "def block_sparse_multi(")
    for i in range(mp.num_bitmaps):
        w0(1, f'bitmap{i}: T.Tensor((B, NR{i}, W{i}), "int32"),  # in: 2-bit tile states')
    w0(1, 'lists: T.Tensor((N,), "int32"),  # out: every part\'s four outputs (MultiPlan)')
    for k in range(len(parts)):
        w0(1, f"R_{k}: T.int32,  # part {k}: list rows")
        w0(1, f"C_{k}: T.int32,  # part {k}: column tiles per row")
    w0(0, "):")
    at = "0"
    for k, em in enumerate(parts):
        em.shapes(1)
        w0(1, f"BLOCKS_{k} = T.ceildiv(R_{k}, RPB_{k})")
        for name, off in zip(_OUTPUTS, ("0", "R", "R + R * C", "2 * R + R * C")):
            em.w(1, f"{name.upper()}_OFF_{k} = {at} + {off}")
        at = f"MASK_CNT_OFF_{k} + 2 * (R + R * C)"
        at = em.rename(at)
    grid = " + ".join(f"BLOCKS_{k}" for k in range(len(parts)))
    threads = f", threads={mp.threads}" if cuda else ""
    w0(1, f"with T.Kernel({grid}, B{threads}) as (gx, b):")
    if cuda:
        w0(2, "tx = T.get_thread_binding()")
    sizes: dict[str, int] = {}
    for em in parts:
        for name, n in em.shared_sizes().items():
            sizes[name] = max(sizes.get(name, 0), n)
    _declare(w0, 2, sizes)
    first, ind = "0", 2 if len(parts) == 1 else 3
    for k, em in enumerate(parts):
        if len(parts) > 1:  # the part of block gx: a range of grid x per part
            w0(2, "else:" if k == len(parts) - 1
               else f"{'if' if k == 0 else 'elif'} gx < {first} + BLOCKS_{k}:")
        em.w(ind, f"bx = gx - ({first})  # part {k}")
        em.body(ind)
        first = f"BLOCKS_{k}" if k == 0 else f"{first} + BLOCKS_{k}"
    return "\n".join(lines) + "\n"


def tilelang_source(pl: BlockSparsePlan, target: str = "cuda") -> str:
    """The program of one list kind (a one-part :func:`multi_source`)."""
    return multi_source(MultiPlan(((pl, 0),), 1), target)


# --------------------------------------------------------------------------------------------
# compile (cached: in process here, across processes by TileLang's disk cache)
# --------------------------------------------------------------------------------------------

# (plan, target) -> compiled kernel; TileLang compiles run one at a time
_KERNELS = CompileCache("block_sparse", serial=True)


def compile_count() -> int:
    """How many block-sparse programs this process has compiled (tests: no recompile)."""
    return _KERNELS.builds


def multi_kernel(mp: MultiPlan, target: str):
    """The compiled program for (plan, target); compiled once per process."""
    key = (mp, check_target(target))

    def build():
        return compile_program(multi_source(mp, target), f"blocksparse_multi_{target}",
                               "block_sparse_multi", target, "a tile-list program")

    return _KERNELS.get(key, build)


_LAUNCHERS = LRU(256)  # (plan, device) -> entry point


def _launcher(mp: MultiPlan, device_type: str):
    """The compiled program's entry point (CUDA: without TileLang's per-call wrapper)."""
    key = (mp, device_type)
    fn = _LAUNCHERS.get(key)
    if fn is None:
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"block-sparse lists: unsupported device {device_type}")
        kern = multi_kernel(mp, "cuda" if device_type == "cuda" else "c")
        fn = _LAUNCHERS[key] = raw_launch(kern) if device_type == "cuda" else kern
    return fn


# --------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------


def block_sparse_multi(bitmaps, mp: MultiPlan, dims, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """Run ``mp`` on ``bitmaps`` (int32 ``[B, rows, words]`` each, on one device) for ``dims``
    (list rows, column tiles) per part: the flat output buffer (``MultiPlan`` layout;
    ``compiler.blocksparse.PackedLists`` views it), allocated unless ``out`` (a contiguous
    int32 tensor of that size) is given. One launch, no host sync."""
    dims = tuple((int(r), int(c)) for r, c in dims)
    if len(dims) != len(mp.parts) or any(r < 1 or c < 1 for r, c in dims):
        raise ValueError(f"need (rows >= 1, cols >= 1) for each of {len(mp.parts)} parts, "
                         f"got {dims}")
    dev, B = bitmaps[0].device, bitmaps[0].shape[0]
    n = B * mp.per_sequence(dims)
    if n >= 1 << 31:
        raise ValueError(f"block-sparse lists of {n} entries: int32 offsets overflow")
    if out is None:
        buf = torch.empty(n, dtype=torch.int32, device=dev)
    elif out.numel() != n or out.dtype != torch.int32 or not out.is_contiguous():
        raise ValueError(f"out must be {n} contiguous int32 entries, got {out.dtype} "
                         f"{tuple(out.shape)}")
    else:
        buf = out
    args = [t if t.is_contiguous() else t.contiguous() for t in bitmaps]
    _launcher(mp, dev.type)(*args, buf, *(x for rc in dims for x in rc))
    return buf


@functools.lru_cache(maxsize=8)
def _one_kind(transpose: bool, fill: bool) -> MultiPlan:
    return MultiPlan(((plan(transpose, fill), 0),), 1)


def block_sparse_lists(bitmap: torch.Tensor, packed_tiles: int, transpose: bool = False, *,
                       fill: bool = False):
    """Block-sparse lists of one kind from a Tile-State Bitmap in one TileLang launch on its
    device (CUDA target for a CUDA tensor, the C target on CPU); the arguments are those of
    ``compiler.blocksparse.lists_from_bitmap``. Entries past a row's count are left as they
    were allocated unless ``fill`` (then 0, as the torch reference). No host sync."""
    if bitmap.dim() != 3 or bitmap.dtype != torch.int32:
        raise ValueError(f"bitmap must be int32 [B, rows, words], got {bitmap.dtype} "
                         f"{tuple(bitmap.shape)}")
    B, N, W = bitmap.shape
    if packed_tiles < 1 or W != -(-packed_tiles // TILES_PER_WORD):
        raise ValueError(f"packed_tiles={packed_tiles} needs {-(-packed_tiles // 16)} words per "
                         f"row, the bitmap has {W}")
    rows, cols = (packed_tiles, N) if transpose else (N, packed_tiles)
    buf = block_sparse_multi((bitmap,), _one_kind(transpose, fill), ((rows, cols),))
    n, m = B * rows, B * rows * cols
    return BlockSparseLists(buf[:n].view(B, 1, rows), buf[n:n + m].view(B, 1, rows, cols),
                            buf[n + m:2 * n + m].view(B, 1, rows),
                            buf[2 * n + m:].view(B, 1, rows, cols))


def _list_groups(kinds, fwd_tiles, bwd_tiles, seqlen_q: int, seqlen_k: int,
                 config: ListsConfig):
    """``kinds`` grouped into one program per read (by rows, by columns): per group, its
    ``MultiPlan``, the bitmaps it reads, and (kind, rows, cols) per part. Two programs of one
    read each compile in about half the time of one program of both, and in parallel
    (``tilelang_build.prebuild``)."""
    passes = [(k, *list_pass(k, fwd_tiles, bwd_tiles, seqlen_q, seqlen_k)) for k in kinds]
    groups = []
    for transpose in dict.fromkeys(t for *_, t in passes):
        part = [p for p in passes if p[4] == transpose]
        reads = tuple(dict.fromkeys(which for _, which, *_ in part))
        mp = _multi_for(tuple((reads.index(which), transpose) for _, which, *_ in part),
                        len(reads), config)
        groups.append((mp, reads, tuple((k, r, c) for k, _, r, c, _ in part)))
    return groups


def list_programs(kinds=("fwd", "bwd64", "bwd128"), fwd_tiles=None, bwd_tiles=None,
                  target: str = "cuda", config: ListsConfig = DEFAULT_LISTS_CONFIG):
    """The programs :func:`packed_lists` runs for ``kinds`` (the same at every length), as
    ``tilelang_build.Program`` values for ``prebuild``."""
    fwd_tiles, bwd_tiles = fwd_tiles or DEFAULT_FWD_TILES, bwd_tiles or DEFAULT_BWD_TILES
    S = max(fwd_tiles.tile_m, fwd_tiles.tile_n, bwd_tiles.tile_m, bwd_tiles.tile_n)
    return [Program(multi_source(mp, target), f"blocksparse_multi_{target}",
                    "block_sparse_multi", target, "a tile-list program")
            for mp, _, _ in _list_groups(kinds, fwd_tiles, bwd_tiles, S, S, config)]


def packed_lists(fwd_bitmap: torch.Tensor, bwd_bitmap: torch.Tensor, fwd_tiles, bwd_tiles,
                 seqlen_q: int, seqlen_k: int, kinds=("fwd", "bwd64", "bwd128"),
                 config: ListsConfig = DEFAULT_LISTS_CONFIG) -> PackedLists:
    """``kinds`` of a descriptor's lists in one buffer on the bitmaps' device, one launch per
    read (by rows, by columns). The programs are the same for every length (their shapes are
    run-time arguments): compiled once per (kinds, config, target)."""
    B, dev = fwd_bitmap.shape[0], fwd_bitmap.device
    bitmaps = {"fwd": fwd_bitmap, "bwd": bwd_bitmap}
    groups = _list_groups(kinds, fwd_tiles, bwd_tiles, seqlen_q, seqlen_k, config)
    sizes = [mp.per_sequence(tuple((r, c) for _, r, c in parts)) for mp, _, parts in groups]
    if B * sum(sizes) >= 1 << 31:
        raise ValueError(f"block-sparse lists of {B * sum(sizes)} entries: int32 offsets "
                         "overflow")
    buf = torch.empty(B * sum(sizes), dtype=torch.int32, device=dev)
    layout, base = {}, 0
    for (mp, reads, parts), size in zip(groups, sizes):
        dims = tuple((r, c) for _, r, c in parts)
        block_sparse_multi(tuple(bitmaps[w] for w in reads), mp, dims,
                           out=buf[B * base:B * (base + size)])
        for (kind, r, c), offs in zip(parts, mp.offsets(dims)):
            layout[kind] = (tuple(base + o for o in offs), r, c)
        base += size
    return PackedLists(buf, B, {k: layout[k] for k in kinds})


@functools.lru_cache(maxsize=64)
def _multi_for(parts: tuple[tuple[int, bool], ...], num_bitmaps: int,
               config: ListsConfig) -> MultiPlan:
    return multi_plan([(t, i) for i, t in parts], num_bitmaps, config)
