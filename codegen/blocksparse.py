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

The shape (R, C, transpose) is static (the bitmap shapes change only with the sequence lengths;
a new shape compiles once per process, a few seconds); the batch size is dynamic.
"""

from __future__ import annotations

import functools
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
           "block_sparse_lists", "compile_count"]

_CUDA_TARGET = {"kind": "cuda", "arch": "sm_90a"}
TPW = TILES_PER_WORD  # short, for the generated sources' index arithmetic
# Thread layout, from a sweep on the H200 at 128K tokens (1024 x 1024 and 1024 x 2048 tiles,
# bench/blocksparse.py): one word per thread and up to 64 threads per row (chunks of 1024 tiles)
# beat 32 threads of 2 words (fwd 6.4 -> 5.1 us, bwd 9.0 -> 6.9 us on random states); the
# transposed read prefers 8 rows per block of 32 threads (8.8 -> 6.9 us): fewer blocks load each
# bitmap column.
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


class _Emitter:
    def __init__(self, pl: BlockSparsePlan, target: str):
        self.pl = pl
        self.target = target
        self.cuda = target == "cuda"
        self.lines: list[str] = []

    def w(self, indent: int, text: str = ""):
        self.lines.append(("    " * indent + text) if text else "")

    # a stage: CUDA runs the body once per thread then syncs; C loops it over the threads
    def stage(self, ind: int, comment: str, body):
        self.w(ind, f"# {comment}")
        if self.cuda:
            body(ind)
            self.w(ind, "T.sync_threads()")
        else:
            self.w(ind, "for tx in T.serial(THREADS):")
            body(ind + 1)

    def row_of_thread(self, ind: int):
        self.w(ind, "lr = tx // TPR  # list row within the block")
        self.w(ind, "lane = tx % TPR")
        self.w(ind, "row = bx * RPB + lr")

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
        w(0, "# Block (bx, b) owns list rows [RPB*bx, RPB*bx + RPB) of sequence b, TPR threads "
             "per row; a row's")
        w(0, "# tiles are visited in chunks of CHUNK tiles, WPT 16-tile words per thread: count, "
             "prefix-sum the")
        w(0, "# counts over the row's threads, scatter the column indices to shared lists, copy "
             "them out coalesced.")
        w(0, "import tilelang.language as T")
        w(0)
        w(0, f"R, C = {pl.rows}, {pl.cols}  # list rows, column tiles per row")
        w(0, f"NR, W = {pl.bitmap_rows}, {pl.bitmap_words}  # bitmap rows, words per bitmap row")
        w(0, f"ROW_WORDS = {pl.row_words}  # 16-tile words per list row")
        w(0, f"TPR, WPT, RPB = {pl.tpr}, {pl.wpt}, {pl.rpb}  # threads per row, words per thread "
             "per chunk, rows per block")
        w(0, "THREADS = TPR * RPB")
        w(0, "CHUNK_WORDS = TPR * WPT")
        w(0, f"CHUNK = {TILES_PER_WORD} * CHUNK_WORDS  # column tiles per chunk")
        w(0, f"CHUNKS = {pl.chunks}")
        w(0, "FIVES = 1431655765  # 0x55555555: bit 0 of every 2-bit tile state")
        last = pl.cols % TILES_PER_WORD
        if last and not pl.transpose:
            w(0, f"LAST_MASK = {(1 << TILE_BITS * last) - 1}  # the tiles of the last word (the "
                 "rest pads)")
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
        ind = 2
        if self.cuda:
            w(ind, "tx = T.get_thread_binding()")
        # static shared buffers: the C target takes one dynamic shared allocation at most
        shared = [("words", "(RPB, CHUNK_WORDS)", "uint32", "the chunk's words of each row"),
                  ("scan", "(2, THREADS)", "int32", "per thread partial + (full << 16) tiles, "
                   "then prefix sums (ping-pong)"),
                  ("part", "(RPB, CHUNK + CHUNK // 32)", "int32", "the chunk's partial "
                   "columns of each row (entry j at j + j // 32: see stage 3)"),
                  ("full", "(RPB, CHUNK + CHUNK // 32)", "int32", "the chunk's full columns of "
                   "each row"),
                  ("base", "(2, RPB)", "int32", "entries of the earlier chunks, per row")]
        if pl.transpose:
            shared.append(("col", f"(CHUNK + CHUNK // {TPW},)", "uint32", "the block's bitmap "
                           "column over the chunk (its rows share a word index), a pad word per "
                           "16 so that threads 16 words apart read different banks"))
        for name, shape, dtype, comment in shared:
            w(ind, f"# {comment}")
            w(ind, f'{name} = T.alloc_shared({shape}, "{dtype}", scope="shared")')
        w(ind, 'word = T.alloc_var("uint32")')
        w(ind, 'bits = T.alloc_var("uint32")')
        w(ind, 'acc = T.alloc_var("int32")')
        w(ind, 'op = T.alloc_var("int32")  # next slot of the partial / full chunk list')
        w(ind, 'of = T.alloc_var("int32")')
        self.stage(ind, "stage 0: no entries yet", self._stage_clear)
        w(ind, "for ch in T.serial(CHUNKS):")
        d = ind + 1
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
        return "\n".join(self.lines) + "\n"

    @property
    def _final(self) -> int:  # the scan buffer that holds the inclusive sums
        return self.pl.scan_steps % 2

    def _stage_clear(self, ind):
        self.w(ind, "for q in T.serial(T.ceildiv(2 * RPB, THREADS)):")
        self.w(ind + 1, "if q * THREADS + tx < 2 * RPB:")
        self.w(ind + 2, "base[(q * THREADS + tx) // RPB, (q * THREADS + tx) % RPB] = 0")

    def _stage_col(self, ind):
        w = self.w
        w(ind, "for q in T.serial(T.ceildiv(CHUNK, THREADS)):")
        w(ind + 1, "m = q * THREADS + tx")
        w(ind + 1, "if m < CHUNK:")
        w(ind + 2, "if ch * CHUNK + m < NR:")
        w(ind + 3, f'col[m + m // {TPW}] = T.Cast("uint32", bitmap[b, ch * CHUNK + m, '
                   f"(bx * RPB) // {TPW}])")
        w(ind + 2, "else:")
        w(ind + 3, f"col[m + m // {TPW}] = T.uint32(0)")

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
            w(d + 1, f"for t in T.unroll({TPW}):")
            w(d + 2, "word = word | T.shift_left(T.bitwise_and(T.shift_right("
                     f'col[{TPW + 1} * v + t], T.Cast("uint32", {TILE_BITS} * (row % {TPW}))), '
                     f"T.uint32({TILE_STATE_MASK})), T.uint32({TILE_BITS} * t))")
        else:
            w(d + 1, 'word = T.Cast("uint32", bitmap[b, row, ch * CHUNK_WORDS + v])')
            if pl.cols % TILES_PER_WORD:
                w(d + 1, "if ch * CHUNK_WORDS + v == ROW_WORDS - 1:")
                w(d + 2, "word = T.bitwise_and(word, T.uint32(LAST_MASK))")
        w(d, "words[lr, v] = word")
        w(d, "# partial: both bits of the state set; full: the visible bit alone")
        w(d, "bits = T.bitwise_and(T.bitwise_and(word, T.shift_right(word, T.uint32(1))), "
             "T.uint32(FIVES))")
        self._popcount(d, "bits", "acc = acc + {}")
        w(d, "bits = T.bitwise_and(T.bitwise_and(word, T.bitwise_not(T.shift_right(word, "
             "T.uint32(1)))), T.uint32(FIVES))")
        self._popcount(d, "bits", "acc = acc + T.shift_left({}, 16)")
        w(ind, "scan[0, tx] = acc")

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
        w(ind + 1, f"scan[{dst}, tx] = scan[{src}, tx] + scan[{src}, tx - {stride}]")
        w(ind, "else:")
        w(ind + 1, f"scan[{dst}, tx] = scan[{src}, tx]")

    def _stage_scatter(self, ind):
        w = self.w
        self.row_of_thread(ind)
        w(ind, "if row < R:")
        d = ind + 1
        w(d, "# the counts of the row's threads before this one; entry j of a chunk list is kept")
        w(d, "# at j + j // 32, so that the threads of a row of full tiles, which write entries")
        w(d, "# 16 * WPT apart, hit different banks")
        w(d, f"acc = T.if_then_else(lane > 0, scan[{self._final}, T.max(tx - 1, 0)], 0)")
        w(d, "op = T.bitwise_and(acc, 65535)")
        w(d, "of = T.shift_right(acc, 16)")
        w(d, "for k in T.unroll(WPT):")
        w(d + 1, "word = words[lr, lane * WPT + k]")
        w(d + 1, f"for t in T.unroll({TPW}):")
        e = d + 2
        state = (f"T.bitwise_and(T.shift_right(word, T.uint32({TILE_BITS} * t)), "
                 f"T.uint32({TILE_STATE_MASK}))")
        w(e, f"if {state} == T.uint32({TILE_PARTIAL}):")
        w(e + 1, f"part[lr, op + op // 32] = ch * CHUNK + (lane * WPT + k) * {TPW} + t")
        w(e + 1, "op = op + 1")
        w(e, f"if {state} == T.uint32({TILE_FULL}):")
        w(e + 1, f"full[lr, of + of // 32] = ch * CHUNK + (lane * WPT + k) * {TPW} + t")
        w(e + 1, "of = of + 1")

    def _stage_copy(self, ind):
        w = self.w
        self.row_of_thread(ind)
        w(ind, "if row < R:")
        d = ind + 1
        w(d, f"acc = scan[{self._final}, lr * TPR + TPR - 1]  # the row's chunk totals")
        w(d, "for q in T.serial(CHUNK // TPR):")
        w(d + 1, "if q * TPR + lane < T.bitwise_and(acc, 65535):")
        w(d + 2, "mask_idx[b, 0, row, base[0, lr] + q * TPR + lane] = part[lr, q * TPR + lane "
                 "+ (q * TPR + lane) // 32]")
        w(d + 1, "if q * TPR + lane < T.shift_right(acc, 16):")
        w(d + 2, "full_idx[b, 0, row, base[1, lr] + q * TPR + lane] = full[lr, q * TPR + lane "
                 "+ (q * TPR + lane) // 32]")

    def _stage_advance(self, ind):
        w = self.w
        w(ind, "if tx % TPR == 0:")
        w(ind + 1, f"acc = scan[{self._final}, tx + TPR - 1]")
        w(ind + 1, "base[0, tx // TPR] = base[0, tx // TPR] + T.bitwise_and(acc, 65535)")
        w(ind + 1, "base[1, tx // TPR] = base[1, tx // TPR] + T.shift_right(acc, 16)")

    def _stage_counts(self, ind):
        w = self.w
        self.row_of_thread(ind)
        w(ind, "if row < R:")
        d = ind + 1
        w(d, "if lane == 0:")
        w(d + 1, "mask_cnt[b, 0, row] = base[0, lr]")
        w(d + 1, "full_cnt[b, 0, row] = base[1, lr]")
        if self.pl.fill:
            w(d, "for q in T.serial(T.ceildiv(C, TPR)):")
            w(d + 1, "if q * TPR + lane < C:")
            w(d + 2, "if q * TPR + lane >= base[0, lr]:")
            w(d + 3, "mask_idx[b, 0, row, q * TPR + lane] = 0")
            w(d + 2, "if q * TPR + lane >= base[1, lr]:")
            w(d + 3, "full_idx[b, 0, row, q * TPR + lane] = 0")


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
