"""Generated TileLang kernel: block-sparse tile lists (flash-attn-4 format) from a bitmap.

``block_sparse_lists(bitmap, packed_tiles, transpose=...)`` writes, in one launch on the
bitmap's device, the four tensors of ``compilemask.blocksparse.BlockSparseLists`` (partial and
full column tiles per row, compacted) bit for bit as the torch reference
``compilemask.blocksparse.lists_from_bitmap`` does on the counts and the first ``cnt`` entries of
every row. ``tilelang_source`` is the program text, ``block_sparse_kernel`` the compiled kernel
(once per plan and target in this process).

Design
------
Grid ``(ceil(R / RPB), B)``: a block owns ``RPB`` list rows, ``TPR`` threads per row. A row's
column tiles are visited in chunks of ``CHUNK = 16 * TPR * WPT`` tiles, each thread owning
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

Targets: as in ``compilemask.codegen.preprocess``, one generator, two threading skeletons. On
CUDA each stage runs once per thread, ``T.sync_threads()`` between stages; on TileLang's C
target (CPU, for CI) each stage is a serial loop over the threads, every value passed between
stages lives in shared memory, so both texts run the same stage bodies.

Several kinds in one launch (``multi_plan`` / ``block_sparse_multi``; a CUDA preprocess writes
a descriptor's forward and both backward kinds this way): grid x is cut into one range of blocks
per kind, each running the stages above with its own constants; the outputs are one flat buffer
(``MultiPlan`` layout) that ``compilemask.blocksparse.PackedLists`` views per kind. One launch
and one allocation instead of three each: the preprocess is bound by host time, not the device.

The shape (R, C, transpose) is static (the bitmap shapes change only with the sequence lengths;
a new shape compiles once per process, a few seconds); the batch size is dynamic.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from compilemask.blocksparse import BlockSparseLists
from compilemask.cache import CompileCache
from compilemask.descriptor import (
    TILE_BITS,
    TILE_FULL,
    TILE_PARTIAL,
    TILE_STATE_MASK,
    TILES_PER_WORD,
)

__all__ = ["BlockSparsePlan", "plan", "tilelang_source", "block_sparse_kernel",
           "block_sparse_lists", "compile_count", "MultiPlan", "multi_plan", "multi_source",
           "multi_kernel", "block_sparse_multi"]

_CUDA_TARGET = {"kind": "cuda", "arch": "sm_90a"}
# Thread layout (bench/blocksparse.py; docs/decisions/preprocess.md): one word per thread and
# up to 64 threads per row (chunks of 1024 tiles) beat 32 threads of 2 words; the transposed
# read prefers 8 rows per block of 32 threads: fewer blocks load each bitmap column.
_THREADS = 256  # per block: RPB rows of TPR threads
_MAX_TPR = 64  # threads per list row
_MAX_TPR_TRANSPOSED = 32
_WPT = 1  # words per thread per chunk
_SMEM_BUDGET = 40 * 1024  # bytes of shared memory per block (under the 48 KiB default)


@dataclass(frozen=True)
class BlockSparsePlan:
    """Static shape and thread layout of one generated kernel."""

    rows: int  # R: list rows
    cols: int  # C: column tiles per list row
    transpose: bool  # rows are the bitmap's packed tiles (read by columns)
    tpr: int  # threads per list row (power of 2)
    wpt: int  # 16-tile words per thread per chunk
    rpb: int  # list rows per block (divides 16 when transposed)
    fill: bool = False  # write 0 past each row's count

    @property
    def bitmap_rows(self) -> int:
        return self.cols if self.transpose else self.rows

    @property
    def bitmap_words(self) -> int:
        return -(-(self.rows if self.transpose else self.cols) // TILES_PER_WORD)

    @property
    def row_words(self) -> int:  # 16-tile words of one list row
        return -(-self.cols // TILES_PER_WORD)

    @property
    def chunk_words(self) -> int:
        return self.tpr * self.wpt

    @property
    def chunk(self) -> int:  # column tiles per chunk
        return TILES_PER_WORD * self.chunk_words

    @property
    def chunks(self) -> int:
        return -(-self.cols // self.chunk)

    @property
    def threads(self) -> int:
        return self.tpr * self.rpb

    @property
    def scan_steps(self) -> int:
        return self.tpr.bit_length() - 1

    @property
    def smem_bytes(self) -> int:
        col = self.chunk + self.chunk // TILES_PER_WORD if self.transpose else 0
        lists = 2 * self.rpb * (self.chunk + self.chunk // 32)
        return 4 * (lists + self.rpb * self.chunk_words + 2 * self.threads + 2 * self.rpb + col)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def plan(rows: int, cols: int, transpose: bool = False, fill: bool = False, *,
         threads: int | None = None, max_tpr: int | None = None,
         wpt: int | None = None) -> BlockSparsePlan:
    """The kernel for ``rows`` list rows of ``cols`` column tiles: ``TPR`` threads per row (up to
    64, 32 when transposed; fewer for short rows), ``WPT`` words each per chunk, rows per block
    to fill ``threads``, shrunk to fit the shared-memory budget."""
    if rows < 1 or cols < 1:
        raise ValueError(f"need at least one row and one column tile, got {rows} x {cols}")
    row_words = -(-cols // TILES_PER_WORD)
    wpt = wpt or _WPT
    max_tpr = max_tpr or (_MAX_TPR_TRANSPOSED if transpose else _MAX_TPR)
    tpr = min(max_tpr, _pow2_at_least(-(-row_words // wpt)))
    rpb = max(1, min(16, (threads or _THREADS) // tpr, _pow2_at_least(rows)))
    pl = BlockSparsePlan(rows, cols, transpose, tpr, wpt, rpb, fill)
    if pl.chunk >= 1 << 15:
        raise ValueError(f"chunk of {pl.chunk} tiles: a chunk's counts must fit in 15 bits")
    while pl.smem_bytes > _SMEM_BUDGET and pl.rpb > 1:
        pl = BlockSparsePlan(rows, cols, transpose, tpr, wpt, pl.rpb // 2, fill)
    if pl.smem_bytes > _SMEM_BUDGET:
        raise ValueError(f"block-sparse plan {pl} needs {pl.smem_bytes} bytes of shared memory")
    return pl


# --------------------------------------------------------------------------------------------
# source generation
# --------------------------------------------------------------------------------------------


def _check_target(target: str) -> str:
    if target not in ("cuda", "c"):
        raise ValueError(f"target must be 'cuda' or 'c', got {target!r}")
    return target


def tilelang_source(pl: BlockSparsePlan, target: str = "cuda") -> str:
    """The generated TileLang program (module text defining ``block_sparse``) for ``pl``."""
    return _Emitter(pl, _check_target(target)).source()


# names that differ between the parts of a multi-part kernel (renamed there, ``_k`` appended);
# the let-bound locals too: TileLang's builder takes a second binding of a name (in another part,
# where it may fold to a constant) for an assignment to the first
_PART_NAMES = ("R", "C", "NR", "W", "ROW_WORDS", "TPR", "WPT", "RPB", "THREADS", "CHUNK_WORDS",
               "CHUNK", "CHUNKS", "PSTRIDE", "LAST_MASK", "bx", "bitmap", "lr", "lane", "row", "v",
               "m")
_NAME_RE = re.compile(r"\b(" + "|".join(_PART_NAMES) + r")\b")
_OUTPUTS = ("mask_cnt", "mask_idx", "full_cnt", "full_idx")


class _Emitter:
    """The text of one list kind: its constants and stages (module docstring). Alone, it writes
    the outputs as four tensors; as part ``k`` of a multi-part kernel (``part=k``) its names get
    a ``_k`` suffix, its outputs are ranges of one flat buffer and, with fewer threads than the
    kernel, every stage is guarded by ``tx < THREADS``."""

    def __init__(self, pl: BlockSparsePlan, target: str, lines: list[str] | None = None,
                 part: int | None = None, bitmap: str = "bitmap", guard: bool = False):
        self.pl = pl
        self.target = target
        self.cuda = target == "cuda"
        self.lines: list[str] = [] if lines is None else lines
        self.names = {} if part is None else {n: f"{n}_{part}" for n in _PART_NAMES}
        if part is not None:
            self.names["bitmap"] = bitmap
        self.part = part
        self.guard = guard and self.cuda

    def w(self, indent: int, text: str = ""):
        if text and self.names:
            text = _NAME_RE.sub(lambda m: self.names[m.group(1)], text)
        self.lines.append(("    " * indent + text) if text else "")

    def out(self, name: str, row: str, col: str | None = None) -> str:
        """An output element: tensor ``name`` at ``[b, 0, row(, col)]``."""
        if self.part is None:
            return f"{name}[b, 0, {row}]" if col is None else f"{name}[b, 0, {row}, {col}]"
        off = f"B * {name.upper()}_OFF_{self.part}"  # the kind's four outputs, [B, 1, R(, C)]
        if col is None:
            return f"lists[{off} + b * R + {row}]"
        return f"lists[{off} + (b * R + {row}) * C + {col}]"

    # a stage: CUDA runs the body once per thread then syncs; C loops it over the threads
    def stage(self, ind: int, comment: str, body):
        self.w(ind, f"# {comment}")
        if self.cuda:
            if self.guard:
                self.w(ind, "if tx < THREADS:")
                body(ind + 1)
            else:
                body(ind)
            self.w(ind, "T.sync_threads()")
        else:
            self.w(ind, "for tx in T.serial(THREADS):")
            body(ind + 1)

    def row_of_thread(self, ind: int):
        self.w(ind, "lr = tx // TPR  # list row within the block")
        self.w(ind, "lane = tx % TPR")
        self.w(ind, "row = bx * RPB + lr")

    def constants(self):
        pl, w = self.pl, self.w
        w(0, f"R, C = {pl.rows}, {pl.cols}  # list rows, column tiles per row")
        w(0, f"NR, W = {pl.bitmap_rows}, {pl.bitmap_words}  # bitmap rows, words per bitmap row")
        w(0, f"ROW_WORDS = {pl.row_words}  # 16-tile words per list row")
        w(0, f"TPR, WPT, RPB = {pl.tpr}, {pl.wpt}, {pl.rpb}  # threads per row, words per thread "
             "per chunk, rows per block")
        w(0, "THREADS = TPR * RPB")
        w(0, "CHUNK_WORDS = TPR * WPT")
        w(0, "CHUNK = 16 * CHUNK_WORDS  # column tiles per chunk")
        w(0, f"CHUNKS = {pl.chunks}")
        w(0, "PSTRIDE = CHUNK + CHUNK // 32  # a row's chunk list in shared memory (see stage 3)")
        last = pl.cols % TILES_PER_WORD
        if last and not pl.transpose:
            w(0, f"LAST_MASK = {(1 << 2 * last) - 1}  # the tiles of the last word (the rest "
                 "pads)")

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

    def source(self) -> str:
        pl, w = self.pl, self.w
        how = ("by columns of the bitmap (rows: its packed tiles)" if pl.transpose
               else "along the rows of the bitmap")
        w(0, "# TileLang block-sparse lists (flash-attn-4 format) from a Tile-State Bitmap, "
             "generated by")
        w(0, f"# compilemask.codegen. Target: {self.target}. {pl.rows} list rows of {pl.cols} "
             f"column tiles, read {how}.")
        w(0, f"# One launch: grid (ceil(R / RPB), B), {pl.threads} threads"
             + (" per block." if self.cuda else " (serial loops on the C target)."))
        _describe(w)
        w(0, "import tilelang.language as T")
        w(0)
        self.constants()
        w(0, f"FIVES = {_FIVES}  # 0x55555555: bit 0 of every 2-bit tile state")
        w(0)
        w(0, 'B = T.dynamic("B")  # batch size')
        w(0)
        w(0)
        w(0, "@T.prim_func")
        w(0, "def block_sparse(")
        w(1, 'bitmap: T.Tensor((B, NR, W), "int32"),  # in: 2-bit tile states, 16 per word')
        w(1, 'mask_cnt: T.Tensor((B, 1, R), "int32"),  # out: partial tiles per row')
        w(1, 'mask_idx: T.Tensor((B, 1, R, C), "int32"),  # out: their columns, ascending')
        w(1, 'full_cnt: T.Tensor((B, 1, R), "int32"),  # out: full tiles per row')
        w(1, 'full_idx: T.Tensor((B, 1, R, C), "int32"),  # out: their columns, ascending')
        w(0, "):")
        threads = ", threads=THREADS" if self.cuda else ""
        w(1, f"with T.Kernel(T.ceildiv(R, RPB), B{threads}) as (bx, b):")
        if self.cuda:
            w(2, "tx = T.get_thread_binding()")
        _declare(w, 2, self.shared_sizes())
        self.body(2)
        return "\n".join(self.lines) + "\n"

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
            if pl.cols % TILES_PER_WORD:
                w(d + 1, "if ch * CHUNK_WORDS + v == ROW_WORDS - 1:")
                w(d + 2, "word = T.bitwise_and(word, T.uint32(LAST_MASK))")
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


def _describe(w):
    w(0, "# Block (bx, b) owns list rows [RPB*bx, RPB*bx + RPB) of sequence b, TPR threads "
         "per row; a row's")
    w(0, "# tiles are visited in chunks of CHUNK tiles, WPT 16-tile words per thread: count, "
         "prefix-sum the")
    w(0, "# counts over the row's threads, scatter the column indices to shared lists, copy "
         "them out coalesced.")


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


@dataclass(frozen=True)
class MultiPlan:
    """Several list kinds in one launch: ``parts[k]`` is a plan and the index of the bitmap it
    reads. The outputs are one flat int32 buffer: per part, its ``mask_cnt [B, 1, R]``,
    ``mask_idx [B, 1, R, C]``, ``full_cnt``, ``full_idx`` in that order, part after part."""

    parts: tuple[tuple[BlockSparsePlan, int], ...]
    num_bitmaps: int  # every one read by some part

    @property
    def threads(self) -> int:
        return max(pl.threads for pl, _ in self.parts)

    @property
    def blocks(self) -> tuple[int, ...]:  # blocks of each part along grid x
        return tuple(-(-pl.rows // pl.rpb) for pl, _ in self.parts)

    def offsets(self) -> list[tuple[int, int, int, int]]:
        """Per part, the start of each output per sequence (multiply by B)."""
        out, at = [], 0
        for pl, _ in self.parts:
            r, rc = pl.rows, pl.rows * pl.cols
            out.append((at, at + r, at + r + rc, at + 2 * r + rc))
            at += 2 * (r + rc)
        return out

    @functools.cached_property
    def per_sequence(self) -> int:  # output entries per sequence
        return sum(2 * pl.rows * (pl.cols + 1) for pl, _ in self.parts)


def multi_plan(parts, num_bitmaps: int) -> MultiPlan:
    """``parts``: (rows, cols, transpose, bitmap index) per list kind."""
    plans = tuple((_default_plan(r, c, t, False), i) for r, c, t, i in parts)
    if not plans or {i for _, i in plans} != set(range(num_bitmaps)):
        raise ValueError(f"parts must read bitmaps 0..{num_bitmaps - 1}, each, got {parts}")
    return MultiPlan(plans, num_bitmaps)


def multi_source(mp: MultiPlan, target: str = "cuda") -> str:
    """The generated TileLang program (``block_sparse_multi``) writing every part of ``mp``."""
    target = _check_target(target)
    cuda = target == "cuda"
    lines: list[str] = []
    parts = [_Emitter(pl, target, lines, part=k, bitmap=f"bitmap{i}",
                      guard=pl.threads < mp.threads) for k, (pl, i) in enumerate(mp.parts)]
    w0 = _Emitter(mp.parts[0][0], target, lines).w  # no renaming
    w0(0, "# TileLang block-sparse lists (flash-attn-4 format) of several passes in one launch, "
          "generated by")
    w0(0, f"# compilemask.codegen. Target: {target}. Grid x is cut into one range of blocks per "
          "part (list kind);")
    w0(0, "# a block runs its part's stages with that part's constants (suffix _k). Per part:")
    _describe(w0)
    w0(0, "import tilelang.language as T")
    w0(0)
    for k, (em, (pl, i)) in enumerate(zip(parts, mp.parts)):
        how = "by columns" if pl.transpose else "by rows"
        w0(0, f"# part {k}: {pl.rows} list rows of {pl.cols} column tiles, bitmap{i} read {how}")
        em.constants()
    for k, offs in enumerate(mp.offsets()):
        for name, off in zip(_OUTPUTS, offs):
            w0(0, f"{name.upper()}_OFF_{k} = {off}")
    w0(0, f"FIVES = {_FIVES}  # 0x55555555: bit 0 of every 2-bit tile state")
    w0(0)
    w0(0, 'B = T.dynamic("B")  # batch size')
    w0(0, 'N = T.dynamic("N")  # entries of the flat output (B times the per-sequence total)')
    w0(0)
    w0(0)
    w0(0, "@T.prim_func")
    w0(0, "def block_sparse_multi(")
    for i in range(mp.num_bitmaps):
        nr, words = next((pl.bitmap_rows, pl.bitmap_words) for pl, j in mp.parts if j == i)
        w0(1, f'bitmap{i}: T.Tensor((B, {nr}, {words}), "int32"),  # in: 2-bit tile states')
    w0(1, 'lists: T.Tensor((N,), "int32"),  # out: every part\'s four outputs (MultiPlan)')
    w0(0, "):")
    threads = f", threads={mp.threads}" if cuda else ""
    w0(1, f"with T.Kernel({sum(mp.blocks)}, B{threads}) as (gx, b):")
    if cuda:
        w0(2, "tx = T.get_thread_binding()")
    sizes: dict[str, int] = {}
    for em in parts:
        for name, n in em.shared_sizes().items():
            sizes[name] = max(sizes.get(name, 0), n)
    _declare(w0, 2, sizes)
    first, ind = 0, 2 if len(parts) == 1 else 3
    for k, em in enumerate(parts):
        if len(parts) > 1:  # the part of block gx: a range of grid x per part
            w0(2, "else:" if k == len(parts) - 1
               else f"{'if' if k == 0 else 'elif'} gx < {first + mp.blocks[k]}:")
        em.w(ind, f"bx = gx - {first}  # part {k}")
        em.body(ind)
        first += mp.blocks[k]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# compile (cached)
# --------------------------------------------------------------------------------------------

# (plan, target) -> compiled kernel; TileLang compiles run one at a time (see preprocess.py)
_KERNELS = CompileCache("block_sparse", serial=True)


def compile_count() -> int:
    """How many block-sparse kernels this process has compiled (tests: no recompile)."""
    return _KERNELS.builds


def _load_prim_func(source: str, tag: str):
    from compilemask.codegen.preprocess import _load_prim_func as load

    return load(source, f"blocksparse_{tag}", "block_sparse")


def block_sparse_kernel(pl: BlockSparsePlan, target: str):
    """The compiled kernel for (plan, target); compiled once per process."""
    key = (pl, _check_target(target))

    def build():
        import tilelang

        func = _load_prim_func(tilelang_source(pl, target), target)
        return tilelang.compile(func, target=_CUDA_TARGET if target == "cuda" else "c")

    return _KERNELS.get(key, build)


# --------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------


def block_sparse_lists(bitmap: torch.Tensor, packed_tiles: int, transpose: bool = False, *,
                       fill: bool = False) -> BlockSparseLists:
    """Block-sparse lists from a Tile-State Bitmap in one TileLang launch on its device (CUDA
    target for a CUDA tensor, the C target on CPU); the arguments are those of
    ``compilemask.blocksparse.lists_from_bitmap``. Entries past a row's count are left as they
    were allocated unless ``fill`` (then 0, as the torch reference). No host sync."""
    if bitmap.dim() != 3 or bitmap.dtype != torch.int32:
        raise ValueError(f"bitmap must be int32 [B, rows, words], got {bitmap.dtype} "
                         f"{tuple(bitmap.shape)}")
    _, N, W = bitmap.shape
    if packed_tiles < 1 or W != -(-packed_tiles // TILES_PER_WORD):
        raise ValueError(f"packed_tiles={packed_tiles} needs {-(-packed_tiles // 16)} words per "
                         f"row, the bitmap has {W}")
    rows, cols = (packed_tiles, N) if transpose else (N, packed_tiles)
    return _launch(bitmap, _default_plan(rows, cols, transpose, fill))


@functools.lru_cache(maxsize=256)
def _default_plan(rows: int, cols: int, transpose: bool, fill: bool) -> BlockSparsePlan:
    return plan(rows, cols, transpose, fill)  # once per shape: this runs in every preprocess


def _launch(bitmap: torch.Tensor, pl: BlockSparsePlan) -> BlockSparseLists:
    """Allocate the lists and run the kernel of ``pl`` on the bitmap's device."""
    dev = bitmap.device
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"block_sparse_lists: unsupported device {dev}")
    B, R, C = bitmap.shape[0], pl.rows, pl.cols
    # one allocation, four contiguous views: this runs in every preprocess, host time counts
    buf = torch.empty(2 * B * R * (C + 1), dtype=torch.int32, device=dev)
    n, m = B * R, B * R * C
    out = BlockSparseLists(buf[:n].view(B, 1, R), buf[n:n + m].view(B, 1, R, C),
                           buf[n + m:2 * n + m].view(B, 1, R), buf[2 * n + m:].view(B, 1, R, C))
    _launcher(pl, dev.type)(bitmap if bitmap.is_contiguous() else bitmap.contiguous(), *out)
    return out


_LAUNCHERS: dict = {}


def _launcher(pl: BlockSparsePlan, device_type: str):
    """The compiled kernel's raw entry point (CUDA: without TileLang's per-call wrapper)."""
    key = (pl, device_type)
    fn = _LAUNCHERS.get(key)
    if fn is None:
        kern = block_sparse_kernel(pl, "cuda" if device_type == "cuda" else "c")
        if device_type == "cuda":
            from compilemask.codegen.preprocess import _raw_launch

            fn = _raw_launch(kern)
        else:
            fn = kern
        _LAUNCHERS[key] = fn
    return fn


# --------------------------------------------------------------------------------------------
# several list kinds in one launch
# --------------------------------------------------------------------------------------------


def multi_kernel(mp: MultiPlan, target: str):
    """The compiled multi-part kernel for (plan, target); compiled once per process."""
    key = ("multi", mp, _check_target(target))

    def build():
        import tilelang

        from compilemask.codegen.preprocess import _load_prim_func as load

        func = load(multi_source(mp, target), f"blocksparse_multi_{target}", "block_sparse_multi")
        return tilelang.compile(func, target=_CUDA_TARGET if target == "cuda" else "c")

    return _KERNELS.get(key, build)


def block_sparse_multi(bitmaps, mp: MultiPlan) -> torch.Tensor:
    """Run ``mp`` on ``bitmaps`` (int32 ``[B, rows, words]`` each, on one device): the flat
    output buffer (``MultiPlan`` layout; ``PackedLists`` views it). One allocation, one launch,
    no host sync."""
    dev, B = bitmaps[0].device, bitmaps[0].shape[0]
    n = B * mp.per_sequence
    if n >= 1 << 31:
        raise ValueError(f"block-sparse lists of {n} entries: int32 offsets overflow")
    buf = torch.empty(n, dtype=torch.int32, device=dev)
    key = (mp, dev.type)
    fn = _LAUNCHERS.get(key)
    if fn is None:
        if dev.type not in ("cuda", "cpu"):
            raise ValueError(f"block_sparse_multi: unsupported device {dev}")
        kern = multi_kernel(mp, "cuda" if dev.type == "cuda" else "c")
        if dev.type == "cuda":
            from compilemask.codegen.preprocess import _raw_launch

            kern = _raw_launch(kern)
        fn = _LAUNCHERS[key] = kern
    fn(*bitmaps, buf)
    return buf
