"""The per-batch pipeline: metadata -> generated programs -> Execution Descriptor and tile lists.

One place owns every step a batch takes before attention:

1. metadata: validated and converted (``CompiledMask.normalize_meta``); the run bounds of
   compared ids derived on the metadata's device (``compilemask.compiler.segments``);
2. the Interval Table and both Tile-State Bitmaps: the generated TileLang program (CUDA, or its
   C target on CPU) or the generated torch reference;
3. what the engines read besides: a native segments mask's ``cu_seqlens``
   (``compiler.native.segments``), and for every other mask on CUDA flash-attn-4's tile lists
   of every kind, written by one generated program into one buffer (``desc.lists``); asked
   for (``PipelineConfig(column_view=True)``), each key's query rows (``desc.columns``, one
   generated program on CUDA: ``codegen.column_table``).

Every generated program takes the batch size, the lengths and the tile counts at run time, so a
program compiles once per (mask, tilings, target, :class:`PipelineConfig`) and never again for a
new sequence length; TileLang keeps the builds on disk for the next process.

:func:`on_device` gives a descriptor made elsewhere (a mask without params preprocesses on the
CPU by default) its copy on the device attention runs on, made once and kept with it.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch

from compilemask.codegen.blocksparse import (
    DEFAULT_LISTS_CONFIG,
    ListsConfig,
    list_programs,
    packed_lists,
)
from compilemask.codegen.column_table import column_table_program, tilelang_column_table
from compilemask.codegen.cute_mask_mod import metadata_matters
from compilemask.codegen.preprocess import (
    DEFAULT_PREPROCESS_CONFIG,
    PreprocessConfig,
    launch_outputs,
    launcher,
    preprocess_program,
    tilelang_preprocess,
)
from compilemask.codegen.tilelang_build import prebuild
from compilemask.compiler.columns import column_table
from compilemask.compiler.native import segments
from compilemask.compiler.segments import derive_run_arrays
from compilemask.compiler.sizes import check_descriptor_fits
from compilemask.compiler.tiles import bitmaps, visibility_only_slots
from compilemask.contract.descriptor import (
    DEFAULT_BWD_TILES,
    DEFAULT_FWD_TILES,
    ExecutionDescriptor,
    TileConfig,
    descriptor_shapes,
    make_descriptor,
    pack_table,
    with_fields,
)
from compilemask.contract.env import configure_compile_caches
from compilemask.contract.lru import LRU, LRUSet
from compilemask.pipeline.padding import key_range, padded_tables

__all__ = ["PipelineConfig", "DEFAULT_CONFIG", "DEFAULT_COLUMN_VIEW", "LIST_KINDS_FA4",
           "first_use", "first_use_programs", "preprocess", "torch_tables", "assemble",
           "finish", "with_lists", "with_columns", "with_fields", "padded", "on_device",
           "Preprocessor", "has_tilelang"]

# the list kinds flash-attn-4's kernels read: forward, head-dim-128 backward (64x128 tiles) and
# head-dim-64 backward (on the forward's 128x128 tiles)
LIST_KINDS_FA4 = ("fwd", "bwd64", "bwd128")


@dataclass(frozen=True)
class PipelineConfig:
    """The tilings and the generated programs' launch shapes: one object that tests and
    benchmarks pass, and part of every compiled program's key. ``column_view``: also write
    each key's query rows (``ExecutionDescriptor.columns``, ``compilemask.compiler.columns``), which
    FA4's head-dim-128 backward then masks its partial tiles with: True writes it (and raises
    where the mask or the shape has none), False never, None (the default) where
    :data:`DEFAULT_COLUMN_VIEW` says so and the batch can use it (a CUDA descriptor of square
    attention for the block-sparse engine, of a mask with a view)."""

    fwd_tiles: TileConfig = DEFAULT_FWD_TILES
    bwd_tiles: TileConfig = DEFAULT_BWD_TILES
    preprocess: PreprocessConfig = field(default=DEFAULT_PREPROCESS_CONFIG)
    lists: ListsConfig = field(default=DEFAULT_LISTS_CONFIG)
    column_view: bool | None = None

    def __post_init__(self):
        if self.column_view not in (None, True, False):
            raise TypeError(f"PipelineConfig: column_view must be None, True or False, got "
                            f"{self.column_view!r}")

    @property
    def fa4_tiles(self) -> bool:
        """Whether FA4's lists exist for these tilings (forward 128x128, backward 64x128)."""
        return (self.fwd_tiles, self.bwd_tiles) == (DEFAULT_FWD_TILES, DEFAULT_BWD_TILES)


DEFAULT_CONFIG = PipelineConfig()

# whether PipelineConfig(column_view=None) writes the column view: no, the H200 timed the
# backward it serves slower than the default's per-row test on 5 of 6 points (engine.md)
DEFAULT_COLUMN_VIEW = False


def _wants_columns(mask, config: PipelineConfig, device_type: str, native: bool,
                   square: bool) -> bool:
    if config.column_view is not None:
        return config.column_view
    return (DEFAULT_COLUMN_VIEW and device_type == "cuda" and not native and square
            and mask.column_view is not None)


@functools.cache
def has_tilelang() -> bool:
    configure_compile_caches()  # before TileLang's first import: it reads its cache folder then
    try:
        import tilelang  # noqa: F401
    except Exception:
        return False
    return True


_FIRST_USES = LRUSet(1024)  # (mask key, device, dtype, config) prebuilt; again: a disk lookup


def first_use_programs(mask, device_type: str, meta_dtype: str = "int64",
                       config: PipelineConfig = DEFAULT_CONFIG) -> list:
    """The TileLang programs a mask's batches run on ``device_type`` (``first_use``)."""
    target = "cuda" if device_type == "cuda" else "c"
    programs = [preprocess_program(mask, config.fwd_tiles, config.bwd_tiles, target,
                                   meta_dtype, config.preprocess)]
    if device_type == "cuda" and config.fa4_tiles and mask.native_pattern is None:
        programs += list_programs(LIST_KINDS_FA4, config.fwd_tiles, config.bwd_tiles, target,
                                  config.lists)
    if (device_type == "cuda"
            and _wants_columns(mask, config, device_type, mask.native_pattern is not None, True)
            and mask.column_view is not None):
        programs.append(column_table_program(mask, target))
    return programs


def first_use(mask, device_type: str, meta_dtype: str = "int64",
              config: PipelineConfig = DEFAULT_CONFIG) -> None:
    """Before a mask's first batch on ``device_type``: every TileLang program its batches run
    (its preprocess program and, on CUDA for a mask that is not native, the tile-list programs)
    compiles at once in worker processes where this machine has not built it yet, so the first
    step waits for the slowest compile, not their sum."""
    key = (mask.key, device_type, meta_dtype, config)
    if key in _FIRST_USES or torch.compiler.is_compiling():
        return
    _FIRST_USES.add(key)
    programs = first_use_programs(mask, device_type, meta_dtype, config)
    prebuild(programs)


def preprocess(mask, meta, seqlen_q: int, seqlen_k: int, *, batch_size=None, device=None,
               backend: str = "auto", check: bool = False, config: PipelineConfig = DEFAULT_CONFIG,
               max_segments: int | None = None, padding=None) -> ExecutionDescriptor:
    """Metadata of one batch -> Execution Descriptor with what its engines read (see the module
    docstring). ``backend``: "torch", "tilelang" or "auto" (TileLang on CUDA when available, the
    torch reference on CPU). ``padding``: a bool or 0/1 ``[B, seqlen_k]`` mask of the real
    tokens, one contiguous run per sequence: the descriptor of the mask within each sequence's
    real tokens (``compilemask.pipeline.padding``; the table clipped and the bitmaps made anew
    in torch ops on the device after the program, with no host synchronization)."""
    if backend not in ("auto", "torch", "tilelang"):
        raise ValueError(f"preprocess: backend must be auto, torch or tilelang, got {backend!r}")
    B, scal, arrs, dev = mask.normalize_meta(meta, seqlen_q, seqlen_k, batch_size, device,
                                             check_values=None if not check else True)
    check_descriptor_fits(mask, B, seqlen_q, seqlen_k, config.fwd_tiles, config.bwd_tiles,
                          dev.type)
    if mask.derived_arrays:
        arrs = {**arrs, **derive_run_arrays(mask.derived_arrays, arrs,
                                            check or dev.type == "cpu")}
    fwd, bwd = config.fwd_tiles, config.bwd_tiles
    reach = meta_reach(mask, meta, seqlen_q, seqlen_k)
    if backend == "tilelang" or (backend == "auto" and dev.type == "cuda" and has_tilelang()):
        first_use(mask, dev.type, "int64", config)
        out = tilelang_preprocess(mask, B, scal, arrs, seqlen_q, seqlen_k, fwd, bwd, device=dev,
                                  config=config.preprocess)
        out["row_params"] = with_tables(mask, arrs, out["row_params"])
        desc = make_descriptor(mask, seqlen_q, seqlen_k, fwd, bwd, **out, meta_max=reach)
    else:
        starts, lens, region = torch_tables(mask, B, scal, arrs, seqlen_q, seqlen_k, dev)
        always = visibility_only_slots(mask, region)
        fwd_bm, bwd_bm = bitmaps(starts, lens, always, fwd, bwd, seqlen_q, seqlen_k)
        desc = assemble(mask, B, scal, arrs, seqlen_q, seqlen_k, starts, lens, region, fwd,
                        fwd_bm, bwd, bwd_bm)
        desc = with_fields(desc, meta_max=reach)
    if padding is not None:
        lo, hi = key_range(padding, B, seqlen_k, device=dev)
        desc = padded_tables(desc, lo, hi)
    return finish(desc, config, max_segments)


def meta_reach(mask, meta, seqlen_q: int, seqlen_k: int) -> int:
    """``ExecutionDescriptor.meta_max`` of a batch: where metadata past the sequence may make
    the mask's int32 kernel arithmetic wrap (``metadata_matters``), the power of two at or
    above the largest value given on the host (ints, CPU tensors) if it passes the longest
    sequence; else 0. Powers of two, so a compiled loop sees few values; tensors on the GPU
    are not read (that would synchronize)."""
    if not meta or not metadata_matters(mask):
        return 0
    top = 0
    for p, v in meta.items():
        if p in mask.table_params:  # entries, not values
            continue
        if isinstance(v, torch.Tensor):
            if v.device.type == "cpu" and v.numel():
                top = max(top, int(v.max()))
        elif isinstance(v, int):
            top = max(top, v)
    return 0 if top <= max(seqlen_q, seqlen_k) else 1 << (top - 1).bit_length()


def torch_tables(mask, B, scal, arrs, seqlen_q, seqlen_k, dev):
    """The generated torch reference's Interval Table: (starts, lens, region) int64."""
    i = torch.arange(seqlen_q, device=dev, dtype=torch.int64).unsqueeze(0)
    args = [i, seqlen_q, seqlen_k] + [scal[p] for p in mask.scalar_params] + [
        arrs[a] for a in mask.array_params]
    return mask.torch_function("interval_table")(*args, batch_size=B)


def assemble(mask, B, scal, arrs, seqlen_q, seqlen_k, starts, lens, region, fwd_tiles, fwd,
             bwd_tiles, bwd) -> ExecutionDescriptor:
    """A descriptor from torch-computed tables and bitmaps (the reference producers)."""
    dev = starts.device
    intervals = torch.stack([starts, lens], dim=-1).to(torch.int32).contiguous()
    params = (torch.cat([scal[p].view(B, 1) for p in mask.scalar_params], dim=1)
              if mask.scalar_params else torch.zeros(B, 0, dtype=torch.int64, device=dev))
    row_params = (torch.stack([arrs[a] for a in mask.array_params], dim=-1)
                  if mask.array_params
                  else torch.zeros(B, seqlen_q, 0, dtype=torch.int64, device=dev))
    row_params = with_tables(mask, arrs, row_params.to(torch.int32))
    return make_descriptor(
        mask, seqlen_q, seqlen_k, fwd_tiles, bwd_tiles, intervals=intervals,
        row_region=region.to(torch.int32).contiguous(), fwd_bitmap=fwd, bwd_bitmap=bwd,
        params=params.to(torch.int32).contiguous(),
        row_params=row_params.to(torch.int32).contiguous())


def with_tables(mask, arrs, row_params: torch.Tensor) -> torch.Tensor:
    """``row_params`` with a table param's packed entries after the arrays (the descriptor's
    layout); as it is for a mask without one."""
    if not mask.table_params:
        return row_params
    words = [pack_table(arrs[t]) for t in mask.table_params]
    return torch.cat([row_params.to(torch.int32), *words], dim=-1)


def finish(desc: ExecutionDescriptor, config: PipelineConfig = DEFAULT_CONFIG,
           max_segments: int | None = None) -> ExecutionDescriptor:
    """What every producer adds after the tables and bitmaps: a segments-pattern mask's
    ``cu_seqlens``, the column view where ``config`` asks for it, and on CUDA, with FA4's
    tilings, the tile lists of a non-native mask (one launch; a compiled model then runs no
    kernel for them)."""
    pat = desc.mask.native_pattern
    if pat is not None and pat.kind == "segments" and desc.q_offset >= 0:
        desc = with_fields(desc, segments=segments(desc.mask, desc, max_segments))
    native = (pat is not None and desc.native_applies()
              and (pat.kind != "segments" or desc.segments is not None))
    if _wants_columns(desc.mask, config, desc.device.type, native, _square(desc)):
        desc = with_columns(desc)
    # where the native path cannot run this batch, the block-sparse engine reads the lists
    return desc if native else with_lists(desc, config)


def _square(desc: ExecutionDescriptor) -> bool:
    # the column view's shape: square self-attention, rows 0.. of the sequence
    return desc.seqlen_q == desc.seqlen_k and not desc.q_offset


def with_columns(desc: ExecutionDescriptor) -> ExecutionDescriptor:
    """``desc`` with its column view's table (``compilemask.compiler.columns``), from the metadata
    copies it carries; raises where the mask or the shape has none."""
    mask = desc.mask
    if mask.column_view is None:
        raise ValueError(f"column_view: mask {mask.name!r} has no column view "
                         f"({mask.column_view_reason})")
    if not _square(desc):
        raise ValueError(f"column_view: needs square attention from row 0 (seqlen_q "
                         f"{desc.seqlen_q}, seqlen_k {desc.seqlen_k}, q_offset {desc.q_offset})")
    if desc.device.type == "cuda" and has_tilelang():
        table = tilelang_column_table(mask, desc.params, desc.row_params, desc.seqlen_k)
    else:  # the torch reference (CI checks the program against it on TileLang's C target)
        table = column_table(mask, desc.params, desc.row_params, desc.seqlen_k)
    return with_fields(desc, columns=table.contiguous())


def with_lists(desc: ExecutionDescriptor, config: PipelineConfig = DEFAULT_CONFIG
               ) -> ExecutionDescriptor:
    """On CUDA, with FA4's tilings, ``desc`` with FA4's tile lists of every kind (one launch);
    elsewhere ``desc`` as it is (lists are then computed when asked for)."""
    if desc.device.type != "cuda" or not _config_of(desc, config).fa4_tiles:
        return desc
    lists = packed_lists(desc.fwd_bitmap, desc.bwd_bitmap, desc.fwd_tiles, desc.bwd_tiles,
                         desc.seqlen_q, desc.seqlen_k, LIST_KINDS_FA4, config.lists)
    return with_fields(desc, lists=lists)


def padded(desc: ExecutionDescriptor, padding, config: PipelineConfig = DEFAULT_CONFIG, *,
           name: str = "padding") -> ExecutionDescriptor:
    """``desc`` (rows 0.. of the sequence, or its last rows: ``q_offset >= 0``) for a padded
    batch: ``padding`` a bool or 0/1 ``[B, seqlen_k]`` mask of the real tokens, one
    contiguous run per sequence (``compilemask.pipeline.padding``), and the lists on CUDA.
    ``name``: the argument's name in errors."""
    lo, hi = key_range(padding, desc.batch_size, desc.seqlen_k, device=desc.device, name=name)
    return with_lists(padded_tables(desc, lo, hi), config)


def _config_of(desc, config: PipelineConfig) -> PipelineConfig:
    if (desc.fwd_tiles, desc.bwd_tiles) == (config.fwd_tiles, config.bwd_tiles):
        return config
    return PipelineConfig(desc.fwd_tiles, desc.bwd_tiles, config.preprocess, config.lists,
                          config.column_view)


# ---- descriptors on the device that runs attention -------------------------------------------

_ON_DEVICE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def on_device(desc: ExecutionDescriptor, device) -> ExecutionDescriptor:
    """``desc`` on ``device``: itself when it is there, else its copy there, made once per
    (descriptor, device) with the device's own lists (as a preprocess there would write them)
    and kept while ``desc`` lives, so a layer loop copies nothing per call."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # one copy per physical device
        device = torch.device("cuda", torch.cuda.current_device())
    if desc.device == device:
        return desc
    per_desc = _ON_DEVICE.setdefault(desc, {})
    moved = per_desc.get(device)
    if moved is None:
        moved = desc.to(device)
        if desc.lists is None:  # as a preprocess there would write them
            moved = with_lists(moved)
        native = moved.native is not None and moved.native_applies()
        if moved.columns is None and _wants_columns(moved.mask, DEFAULT_CONFIG, device.type,
                                                    native, _square(moved)):
            moved = with_columns(moved)
        per_desc[device] = moved
    return moved


# ---- the bound fast path ---------------------------------------------------------------------


class Preprocessor:
    """Per-batch preprocess bound to a mask, batch size and device (``CompiledMask.preprocessor``).

    ``preprocess`` validates and converts its arguments on every call, which costs more host time
    than the kernels take on the device. A training loop calls it with the same kinds of
    metadata every step, so what does not depend on the metadata values is done once per length
    pair and kept: argument checks, the program lookup, the output shapes, TileLang's argument
    marshalling (the raw TVM-FFI function is called). A call then checks only what can change at
    no cost (the params present, each tensor's dtype, device, shape and layout) and launches.
    ``pre(meta)`` runs at the bound lengths, ``pre(meta, seqlen_q=S)`` at another: the programs
    take the lengths at run time, so a new length costs a shape computation, never a compile.
    int32 and int64 metadata are read as they are (one program per dtype). Metadata that does
    not match (ints for scalar params, mixed dtypes, another device or shape) takes the general
    path, which converts it or raises the usual error.

    Metadata values are not checked on the fast path (checking would synchronize a GPU stream):
    it is used only where ``preprocess`` would not check them either, i.e. on CUDA, unless
    ``check_values=False`` asks for it on CPU too."""

    def __init__(self, mask, seqlen_q: int, seqlen_k: int, batch_size: int, device,
                 config: PipelineConfig = DEFAULT_CONFIG, check_values: bool | None = None,
                 max_segments: int | None = None):
        self.mask, self.batch_size, self.config = mask, batch_size, config
        self.max_segments = max_segments
        self.fwd_tiles, self.bwd_tiles = config.fwd_tiles, config.bwd_tiles
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.fast = (dev.type == "cuda") if check_values is None else not check_values
        # a table's words are packed by the general path
        self.fast = self.fast and not mask.table_params
        self._launches = {}  # metadata dtype -> launch function
        self._shapes = LRU(64)  # (seqlen_q, seqlen_k) -> output shapes: a loop of new lengths
        self._keys = set(mask.spec.params)
        self._derived = mask.derived_arrays  # run bounds of compared ids, derived in torch
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self._shapes_for(seqlen_q, seqlen_k)
        if not mask.spec.params:
            self._launch_for(torch.int64)

    def _shapes_for(self, seqlen_q: int, seqlen_k: int):
        got = self._shapes.get((seqlen_q, seqlen_k))
        if got is None:
            mask, B = self.mask, self.batch_size
            # the general path validates the shape arguments (and raises its errors) once
            probe = {p: torch.zeros((B, seqlen_q) if p in mask.array_params else
                                    (B, seqlen_q, 1) if p in mask.table_params else (B,),
                                    dtype=torch.int64) for p in mask.spec.params}
            mask.normalize_meta(probe, seqlen_q, seqlen_k, B, self.device, check_values=False)
            check_descriptor_fits(mask, B, seqlen_q, seqlen_k, self.fwd_tiles, self.bwd_tiles,
                                  self.device.type)
            K, P, R = mask.num_intervals, len(mask.scalar_params), len(mask.array_params)
            shapes = descriptor_shapes(B, seqlen_q, seqlen_k, K, P, R, self.fwd_tiles,
                                       self.bwd_tiles)
            inputs = [(p, (B,)) for p in mask.scalar_params] + [
                (a, (B, seqlen_q)) for a in mask.array_params if a in self._keys]
            got = self._shapes[(seqlen_q, seqlen_k)] = (shapes, inputs)
        return got

    def _launch_for(self, dtype):
        launch = self._launches.get(dtype)
        if launch is None:
            first_use(self.mask, self.device.type,
                      "int64" if dtype is torch.int64 else "int32", self.config)
            launch = self._launches[dtype] = launcher(
                self.mask, self.fwd_tiles, self.bwd_tiles, self.device.type,
                "int64" if dtype is torch.int64 else "int32", self.config.preprocess)
        return launch

    def _matches(self, meta, inputs):
        """The metadata dtype when the fast path applies, else None."""
        # a dict subclass too: from_mask_mod's metadata computes its gathers again on a read
        if not isinstance(meta, dict) or meta.keys() != self._keys:
            return None
        dtype = torch.int64
        for n, (p, shape) in enumerate(inputs):
            v = meta[p]
            if n == 0 and type(v) is torch.Tensor:
                dtype = v.dtype
            if not (type(v) is torch.Tensor and v.dtype is dtype and v.device == self.device
                    and v.shape == shape and v.is_contiguous()):
                return None
        return dtype if dtype is torch.int64 or dtype is torch.int32 else None

    def __call__(self, meta=None, seqlen_q: int | None = None, seqlen_k: int | None = None):
        meta = {} if meta is None else meta
        if seqlen_q is None:
            sq, sk = self.seqlen_q, self.seqlen_k if seqlen_k is None else seqlen_k
        else:
            sq, sk = seqlen_q, seqlen_q if seqlen_k is None else seqlen_k
        shapes, inputs = self._shapes_for(sq, sk)
        dtype = self._matches(meta, inputs) if self.fast else None
        if dtype is None:
            return preprocess(self.mask, meta, sq, sk, batch_size=self.batch_size,
                              device=self.device, backend="tilelang", config=self.config,
                              max_segments=self.max_segments)
        i32, dev = torch.int32, self.device
        out = {f: torch.empty(s, dtype=i32, device=dev) for f, s in shapes.items()}
        args = [meta[p] for p, _ in inputs]
        if self._derived:  # the derived arrays follow the declared ones
            runs = derive_run_arrays(self._derived, meta, check=False)
            args += [runs[a] for a in self.mask.array_params if a not in self._keys]
        args += launch_outputs(out, len(self.mask.scalar_params), len(self.mask.array_params))
        args.append(sk)
        self._launch_for(dtype)(*args)
        reach = meta_reach(self.mask, meta, sq, sk) if dev.type == "cpu" else 0
        desc = make_descriptor(self.mask, sq, sk, self.fwd_tiles, self.bwd_tiles, **out,
                               meta_max=reach)
        return finish(desc, self.config, self.max_segments)
