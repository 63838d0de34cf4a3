"""``python -m compilemask explain|show|warmup FILE.py[:NAME] ...``: inspect a MaskSpec from a
file, or compile what it needs ahead of time.

    python -m compilemask explain masks.py:hstu [--meta k=v,...] [--row I] [--seqlen S] [--code]
    python -m compilemask show masks.py:hstu --seqlen 4096 [--seqlen-k N] \\
        --meta ctx_end=1024,hist_end=3000,seq_end=4000,group_size=256 --out mask.png
    python -m compilemask warmup masks.py:hstu --seqlens 8192,32768 [--head-dims 64,128] \\
        [--heads 32 --kv-heads 8] [--no-backward]

``NAME`` is a MaskSpec defined at the top level of ``FILE.py``, or a function of no arguments
returning one. Without ``:NAME`` the file's ``SPEC`` is used, or its only MaskSpec. Metadata
values on the command line are Python ints (one sequence, batch size 1); per-row array params
cannot be given on the command line.

Errors in what was asked (a missing file or name, a name that is not a MaskSpec, unknown or
missing metadata, bad ``--meta`` syntax, a rule the compiler rejects, an ``--out`` image format
matplotlib does not write) print one line on stderr and return 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import uuid

from compilemask.api.viz import image_format, visualize
from compilemask.api.warmup import warmup
from compilemask.dsl import MaskSpec
from compilemask.pipeline.compiled import check_device, compile_mask
from compilemask.pipeline.render import descriptor_to_string

__all__ = ["run", "load_spec", "parse_meta", "CliError"]


class CliError(Exception):
    """A user error: reported as one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage and exit; we want one line
        raise CliError(message)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def load_spec(target: str):
    """``FILE.py[:NAME]`` -> the MaskSpec (raises CliError with a one-line reason)."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or os.sep in name or name.endswith(".py"):
        path, name = target, ""
    if not path.endswith(".py"):
        raise CliError(f"expected FILE.py:NAME, got {target!r}")
    if not os.path.isfile(path):
        raise CliError(f"no such file: {path}")
    mod_name = f"_compilemask_cli_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise CliError(f"cannot load {path} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look modules up by name
    here = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, here)  # as when running the file: its sibling modules import
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise CliError(f"error while running {path}: {type(e).__name__}: {e}") from e
    finally:
        sys.modules.pop(mod_name, None)
        if sys.path and sys.path[0] == here:
            del sys.path[0]
    found = {k: v for k, v in vars(module).items()
             if isinstance(v, MaskSpec) and not k.startswith("_")}
    if not name:
        if "SPEC" in found:
            name = "SPEC"
        elif len(found) == 1:
            name = next(iter(found))
        else:
            have = ", ".join(sorted(found)) or "none"
            raise CliError(f"{path}: say which MaskSpec with FILE.py:NAME (MaskSpecs there: "
                           f"{have})")
    if not hasattr(module, name):
        have = ", ".join(sorted(found)) or "none"
        raise CliError(f"{path} has no name {name!r} (MaskSpecs there: {have})")
    obj = getattr(module, name)
    if isinstance(obj, MaskSpec):
        return obj
    if callable(obj) and _takes_no_args(obj):
        try:
            res = obj()
        except Exception as e:
            raise CliError(f"{path}:{name}() raised {type(e).__name__}: {e}") from e
        if isinstance(res, MaskSpec):
            return res
        raise CliError(f"{path}:{name}() returned an object of type {type(res).__name__}, "
                       f"not a MaskSpec")
    raise CliError(f"{path}:{name} is not a MaskSpec (nor a function of no arguments "
                   f"returning one): it is of type {type(obj).__name__}")


def _takes_no_args(fn) -> bool:
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in sig.parameters.values())


def parse_meta(text: str | None) -> dict:
    """``"a=1,b=2"`` -> ``{"a": 1, "b": 2}`` (ints only)."""
    out: dict = {}
    if text is None or not text.strip():
        return out
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, eq, val = item.partition("=")
        key, val = key.strip(), val.strip()
        if not eq or not key.isidentifier():
            raise CliError(f"bad --meta item {item!r}: expected name=int[,name=int...]")
        if key in out:
            raise CliError(f"--meta gives {key!r} twice")
        try:
            out[key] = int(val, 0)
        except ValueError:
            raise CliError(f"bad --meta value {item!r}: {val!r} is not an int") from None
    return out


def _check_meta(mask, meta: dict, need_all: bool) -> None:
    params = list(mask.spec.params)
    unknown = [k for k in meta if k not in params]
    if unknown:
        raise CliError(f"mask {mask.name!r} has no param(s) {', '.join(unknown)} "
                       f"(declared: {', '.join(params) or 'none'})")
    arrays = [k for k in meta if k in mask.array_params or k in mask.table_params]
    if arrays:
        raise CliError(f"param(s) {', '.join(arrays)} of mask {mask.name!r} are per-row arrays "
                       f"or tables; the command line takes scalar params only")
    if need_all:
        if mask.array_params or mask.table_params:
            raise CliError(f"mask {mask.name!r} needs per-row array or table param(s) "
                           f"{', '.join(mask.array_params + mask.table_params)}, which the "
                           f"command line cannot give;"
                           f" call compilemask.visualize from Python")
        missing = [p for p in params if p not in meta]
        if missing:
            raise CliError(f"mask {mask.name!r} needs --meta for {', '.join(missing)} "
                           f"(e.g. --meta {','.join(f'{p}=...' for p in missing)})")


def _tiles(text: str):
    m, sep, n = text.lower().partition("x")
    try:
        tm, tn = int(m), int(n) if sep else int(m)
    except ValueError:
        raise CliError(f"bad --tiles {text!r}: expected MxN, e.g. 128x128") from None
    return tm, tn


_SHOW_HELP = ("Print the tile grid of sequence 0, one character per tile ('#' full, '~' partial, "
              "'.' empty; grids wider than --max-chars: one per block of tiles, '#' all full, "
              "'.' all empty, '~' mixed), then draw the mask to --out.")


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"bad {what} {text!r}: expected ints separated by commas") from None
    if not vals or min(vals) < 1:
        raise CliError(f"{what} needs positive ints, got {text!r}")
    return vals


def _warmup_parser() -> _Parser:
    p = _Parser(prog="python -m compilemask warmup", add_help=True,
                description="Compile the mask's preprocess, tile-list and attention programs "
                            "for these lengths and head dims, into the cache folder "
                            "(COMPILEMASK_CACHE_DIR): later processes load them.")
    p.add_argument("target", metavar="FILE.py:NAME")
    p.add_argument("--seqlens", required=True, help="lengths, e.g. 4096,32768")
    p.add_argument("--head-dims", default="128", help="head dims (default 128)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--no-backward", action="store_true", help="forward kernels only")
    p.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    return p


def _warmup(args) -> int:
    try:  # before compiling: a machine without CUDA is told in one line
        check_device(args.device, "--device")
    except ValueError as e:
        raise CliError(str(e)) from None
    mask = _compile(load_spec(args.target))
    took = warmup(mask, _ints(args.seqlens, "--seqlens"), _ints(args.head_dims, "--head-dims"),
                  args.heads, args.kv_heads, backward=not args.no_backward, device=args.device,
                  verbose=True)
    print(f"warmed up {mask.name!r}: {len(took)} step(s), {sum(took.values()):.1f} s")
    return 0


def _parser(cmd: str) -> _Parser:
    if cmd == "warmup":
        return _warmup_parser()
    p = _Parser(prog=f"python -m compilemask {cmd}", add_help=True,
                description=_SHOW_HELP if cmd == "show" else None)
    p.add_argument("target", metavar="FILE.py:NAME")
    p.add_argument("--meta", default=None, help="scalar metadata: name=int,name=int,...")
    p.add_argument("--seqlen", type=int, default=None, help="query length (and key length)")
    p.add_argument("--seqlen-k", type=int, default=None, help="key length (default: --seqlen)")
    if cmd == "explain":
        p.add_argument("--row", type=int, default=None, help="print this row's intervals")
        p.add_argument("--code", dest="code", action="store_true", default=False,
                       help="append the generated TileLang, CuTe and torch code")
        p.add_argument("--no-code", dest="code", action="store_false",
                       help="omit the generated code (the default)")
    else:
        p.add_argument("--out", default="mask.png",
                       help="image to write, its format by the extension: .png (default "
                            "mask.png) or any other matplotlib writes (.svg, .pdf, .jpg, ...)")
        p.add_argument("--tiles", default=None, help="forward tiles MxN (default 128x128)")
        p.add_argument("--backward", action="store_true", help="draw the backward tiling")
        p.add_argument("--max-chars", type=int, default=128,
                       help="widest tile grid printed one character per tile; larger grids "
                            "print blocks of tiles (0: no limit; default 128)")
    return p


def _compile(spec):
    try:
        return compile_mask(spec)
    except (ValueError, TypeError, NotImplementedError, SyntaxError) as e:
        raise CliError(f"cannot compile {spec.name!r}: {type(e).__name__}: {e}") from e


def _explain(args) -> int:
    spec = load_spec(args.target)
    mask = _compile(spec)
    meta = parse_meta(args.meta)
    want_row = args.row is not None
    _check_meta(mask, meta, need_all=want_row)
    if want_row and args.seqlen is None:
        raise CliError("--row needs --seqlen")
    kw = {}
    if want_row:
        if not 0 <= args.row < args.seqlen:
            raise CliError(f"--row {args.row} is outside [0, seqlen={args.seqlen})")
        kw = dict(seqlen_q=args.seqlen, seqlen_k=args.seqlen_k or args.seqlen)
    try:
        text = mask.explain(meta=meta if want_row else None, row=args.row,
                            show_code=args.code, **kw)
    except ValueError as e:
        raise CliError(str(e)) from e
    print(text)
    return 0


def _show(args) -> int:
    spec = load_spec(args.target)
    mask = _compile(spec)
    meta = parse_meta(args.meta)
    _check_meta(mask, meta, need_all=True)
    if args.seqlen is None:
        raise CliError("show needs --seqlen")
    sq = args.seqlen
    sk = args.seqlen_k or sq
    for nm, v in (("--seqlen", sq), ("--seqlen-k", sk)):
        if v < 1:
            raise CliError(f"{nm} must be positive, got {v}")
    try:  # a bad extension is reported before any work, not after the text grid
        image_format(args.out)
    except ImportError:
        pass  # no matplotlib: the text grid still prints, then visualize says what is missing
    except ValueError as e:
        raise CliError(str(e)) from e
    kw = {}
    if args.tiles:
        kw["fwd_tiles"] = _tiles(args.tiles)
    try:
        desc = mask.preprocess(meta, seqlen_q=sq, seqlen_k=sk, check=True, **kw)
    except (ValueError, TypeError) as e:
        raise CliError(f"preprocess: {e}") from e
    # no legend here: the header line stays fixed for scripts that read it (--help has it)
    print(descriptor_to_string(desc, batch=0, backward=args.backward,
                               max_size=args.max_chars if args.max_chars > 0 else None,
                               legend=False))
    try:
        path = visualize(desc, batch=0, path=args.out, backward=args.backward)
    except ImportError as e:
        raise CliError(str(e)) from e
    except (OSError, ValueError, RuntimeError) as e:  # e.g. .pgf needs a LaTeX installation
        raise CliError(f"cannot write {args.out}: {e}") from e
    print(f"wrote {path}")
    return 0


def run(cmd: str, argv) -> int:
    """Run ``explain``, ``show`` or ``warmup`` with the given arguments; returns the exit
    code."""
    try:
        if cmd not in ("explain", "show", "warmup"):
            raise CliError(f"unknown command {cmd!r} (explain, show, warmup)")
        args = _parser(cmd).parse_args(list(argv))
        return {"explain": _explain, "show": _show, "warmup": _warmup}[cmd](args)
    except CliError as e:
        print(f"compilemask {cmd}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
