"""What every generated TileLang program shares: the text emitter's skeleton, loading the text as
a module (its file in the cache folder checked against the text, which is what runs:
``contract.cache``), compiling it (logged, one process at a time per program, cached on disk
by TileLang under the compilemask cache folder), compiling several first-use programs at once in
worker processes (:func:`prebuild`), and calling the compiled function without TileLang's
per-call wrapper."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from typing import NamedTuple

from compilemask.contract.cache import exec_verified, file_lock, verified_source_file, write_atomic
from compilemask.contract.env import cache_dir, configure_compile_caches, in_private_fallback
from compilemask.contract.log import log

__all__ = ["CUDA_TARGET", "check_target", "ProgramEmitter", "Program", "load_prim_func",
           "compile_program", "prebuild", "raw_launch"]

CUDA_TARGET = {"kind": "cuda", "arch": "sm_90a"}


def check_target(target: str) -> str:
    if target not in ("cuda", "c"):
        raise ValueError(f"target must be 'cuda' or 'c', got {target!r}")
    return target


class ProgramEmitter:
    """Lines of a generated program and its stages: on CUDA a stage's body runs once per thread
    (``T.sync_threads()`` after it); on TileLang's C target it is a serial loop over the threads,
    so both texts run the same stage bodies."""

    def __init__(self, target: str, lines: list[str] | None = None):
        self.target = check_target(target)
        self.cuda = target == "cuda"
        self.lines: list[str] = [] if lines is None else lines

    def rename(self, text: str) -> str:
        """Hook for emitters whose names depend on context (parts of one program)."""
        return text

    def w(self, indent: int, text: str = ""):
        self.lines.append(("    " * indent + self.rename(text)) if text else "")

    def sort_by_first(self, ind: int, n: str, keys: str, values: str):
        """Sort the ``n`` local pairs (``keys[k]``, ``values[k]``) by key: a bubble sort over
        registers (``n`` names a constant of the program; ``tmp`` a local int32 var)."""
        w = self.w
        w(ind, f"for a in T.unroll({n} - 1):")
        w(ind + 1, f"for j in T.unroll({n} - 1):")
        w(ind + 2, f"if T.And(j < {n} - 1 - a, {keys}[j] > {keys}[j + 1]):")
        for x in (keys, values):
            w(ind + 3, f"tmp = {x}[j]")
            w(ind + 3, f"{x}[j] = {x}[j + 1]")
            w(ind + 3, f"{x}[j + 1] = tmp")

    def sweep_runs(self, ind: int, n: str, count: int, starts: str, ends: str, close):
        """Sweep ``count`` (= the constant ``n``) pairs sorted by start into the runs of their
        union (a pair that starts at or before the current run's end extends it), calling
        ``close(indent)`` to emit the code for each nonempty run ``[cs, ce)``."""
        w = self.w
        w(ind, f"cs = {starts}[0]")
        w(ind, f"ce = {ends}[0]")
        if count > 1:
            w(ind, f"for k in T.unroll({n} - 1):")
            w(ind + 1, f"if {starts}[k + 1] <= ce:")
            w(ind + 2, f"ce = T.max(ce, {ends}[k + 1])")
            w(ind + 1, "else:")
            w(ind + 2, "if ce > cs:")
            close(ind + 3)
            w(ind + 2, f"cs = {starts}[k + 1]")
            w(ind + 2, f"ce = {ends}[k + 1]")
        w(ind, "if ce > cs:")
        close(ind + 1)

    def stage(self, ind: int, comment: str, body, sync: bool = True, guard: str | None = None):
        self.w(ind, f"# {comment}")
        if self.cuda:
            if guard:
                self.w(ind, f"if {guard}:")
                body(ind + 1)
            else:
                body(ind)
            if sync:
                self.w(ind, "T.sync_threads()")
        else:
            self.w(ind, "for tx in T.serial(THREADS):")
            body(ind + 1)


class Program(NamedTuple):
    """One generated program to compile: its text, a file tag, the prim_func's name, the target
    and what it is (for the log)."""

    source: str
    tag: str
    attr: str
    target: str
    what: str


def _source_path(source: str, tag: str) -> tuple[str, str]:
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    return os.path.join(cache_dir("tilelang"), f"{tag}_{digest}.py"), digest


def _built_marker(source: str, tag: str, target: str) -> str:
    """A file that says this machine's TileLang disk cache holds the build of (text, target)."""
    return f"{_source_path(source, tag)[0][:-3]}.{target}.built"


def _built_stamp(source: str, target: str) -> bytes:
    return hashlib.sha256(f"{target}\n{source}".encode()).hexdigest().encode()


def _is_built(source: str, tag: str, target: str) -> bool:
    """The marker of (text, target) exists and names that text in full (a hint only: what runs
    is TileLang's build of the checked text)."""
    try:
        with open(_built_marker(source, tag, target), "rb") as f:
            return f.read() == _built_stamp(source, target)
    except OSError:
        return False


def _write_source(source: str, tag: str) -> tuple[str, str]:
    path, digest = _source_path(source, tag)
    return verified_source_file("tilelang", os.path.basename(path), source), digest


def load_prim_func(source: str, tag: str, attr: str):
    """exec the generated text as a module, from its checked file in the cache folder (TileLang's
    parser reads the source back); returns its ``attr``."""
    path, digest = _write_source(source, tag)
    mod = exec_verified(source, path, f"_compilemask_tl_{tag}_{digest}", register=True)
    return getattr(mod, attr)


def compile_program(source: str, tag: str, attr: str, target: str, what: str):
    """Compile a generated program (TileLang reuses its on-disk build of an equal text and
    target, across processes; one process compiles a program at a time, the others wait for it
    and load its build); a build that takes long says once what compiled and why."""
    configure_compile_caches()
    import tilelang

    func = load_prim_func(source, tag, attr)
    marker = _built_marker(source, tag, target)
    with file_lock(marker):
        t0 = time.perf_counter()
        kern = tilelang.compile(func, target=CUDA_TARGET if target == "cuda" else "c")
        took = time.perf_counter() - t0
        if not _is_built(source, tag, target):
            write_atomic(marker, _built_stamp(source, target))
    if took > 1.0:
        later = ("later processes compile it again (this process's cache folder is private "
                 "and temporary)" if in_private_fallback(os.environ.get("TILELANG_CACHE_DIR", ""))
                 else "later processes load it from the cache folder")
        log.warning("compilemask: compiled %s (%s target) in %.1f s: its first use on this "
                    "machine; %s", what, target, took, later)
    return kern


def prebuild(programs, timeout: float = 1800.0) -> int:
    """Compile, at the same time in worker processes, the ``programs`` that this machine has not
    built yet, so that a first use waits for the slowest compile rather than their sum (each
    takes 10-30 s, nearly all of it single-threaded lowering). The builds land in TileLang's
    disk cache, from which :func:`compile_program` then loads them. A program whose worker fails
    is left to :func:`compile_program`, which raises its error in this process. Returns how many
    compiled."""
    configure_compile_caches()  # the workers inherit the cache folders
    todo = {}
    for p in programs:
        if not _is_built(p.source, p.tag, p.target):
            todo.setdefault(_built_marker(p.source, p.tag, p.target), p)
    if len(todo) < 2:  # one compile gains nothing from a worker
        return 0
    t0 = time.perf_counter()
    log.warning("compilemask: compiling %d programs at once (%s): their first use on this "
                "machine", len(todo), "; ".join(f"{p.what}, {p.target} target"
                                                for p in todo.values()))
    procs = []
    for p in todo.values():
        path, _ = _write_source(p.source, p.tag)
        full = hashlib.sha256(p.source.encode()).hexdigest()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", __name__, path, full, p.tag, p.attr, p.target, p.what],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
    log.warning("compilemask: %d programs compiled in %.1f s", len(todo),
                time.perf_counter() - t0)
    return sum(_is_built(p.source, p.tag, p.target) for p in todo.values())


def raw_launch(kern):
    """TileLang's compiled TVM-FFI function without its Python wrapper (which re-derives output
    shapes per call); the wrapper where this TileLang version does not expose it."""
    get = getattr(getattr(kern, "adapter", None), "_get_executable", None)
    try:
        return get() if get is not None else kern
    except Exception:  # noqa: BLE001 - any failure: the public call path still works
        return kern


def _main(argv) -> int:
    """Worker of :func:`prebuild`: compile one program file into TileLang's disk cache, if it
    holds the text whose sha256 the parent passed (else the parent compiles it itself)."""
    path, sha256, tag, attr, target, what = argv
    with open(path, "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        log.warning("compilemask: %s changed since it was written; not compiled", path)
        return 1
    compile_program(data.decode(), tag, attr, target, what)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
