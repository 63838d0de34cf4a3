"""The cache folder: what is cached is checked against its full text before it runs (an edited,
truncated or planted file, a planted ``.pyc``, is written anew and never run), written
atomically under a per-artefact lock (one process compiles, the others wait); a folder that
cannot be used (missing and not creatable, not writable, writable by others, owned by another
user) gives one warning and a private temporary folder removed at exit; a folder deleted while
running is created again."""

import hashlib
import logging
import os
import py_compile
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

from compilemask.codegen import tilelang_build as tb
from compilemask.contract import env

_SOURCE = "ANSWER = 42\n\n\ndef answer():\n    return ANSWER\n"


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    """A fresh cache root for this test (``cache_dir`` reads it once per process)."""
    root = tmp_path / "cache" / "root"
    monkeypatch.setenv(env.CACHE_DIR_VAR, str(root))
    env.cache_dir.cache_clear()
    yield root
    env.cache_dir.cache_clear()


def _path(tag="prog"):
    return tb._source_path(_SOURCE, tag)[0]


def _evil(marker) -> str:
    """A program that, if it ever ran, would leave ``marker`` behind."""
    return f"open({str(marker)!r}, 'w').close()\nANSWER = 43\n\n\ndef answer():\n    return 43\n"


def test_written_once_and_run_from_its_text(cache_root):
    assert tb.load_prim_func(_SOURCE, "prog", "answer")() == 42
    path = _path()
    assert path.startswith(str(cache_root)) and open(path).read() == _SOURCE
    for d in (os.path.dirname(path), cache_root):  # private, every folder made
        assert stat.S_IMODE(os.stat(d).st_mode) & 0o077 == 0, d


@pytest.mark.parametrize("how", ["one digit", "truncated", "planted"])
def test_a_changed_file_is_written_again_never_run(cache_root, tmp_path, caplog, how):
    marker = tmp_path / "ran"
    path = _path()
    if how == "planted":  # put there under the program's name before its first use
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").write(_evil(marker))
    else:
        tb.load_prim_func(_SOURCE, "prog", "answer")
        text = _SOURCE.replace("42", "43") if how == "one digit" else _SOURCE[:20]
        open(path, "w").write(text)
    with caplog.at_level(logging.WARNING, logger="compilemask"):
        assert tb.load_prim_func(_SOURCE, "prog", "answer")() == 42
    assert open(path).read() == _SOURCE
    assert not marker.exists()
    said = [r.getMessage() for r in caplog.records if "does not hold" in r.getMessage()]
    assert len(said) == 1 and path in said[0], said


def test_a_planted_pyc_never_runs(cache_root, tmp_path):
    # a .pyc that the import system would take for the file's (same size and time): never read
    marker = tmp_path / "ran"
    tb.load_prim_func(_SOURCE, "prog", "answer")
    path = _path()
    evil = _evil(marker)
    evil = evil[: len(_SOURCE)].ljust(len(_SOURCE), "\n") if len(evil) > len(_SOURCE) else evil
    evil_path = tmp_path / "evil.py"
    evil_path.write_text(_evil(marker))
    st = os.stat(path)
    pyc = os.path.join(os.path.dirname(path), "__pycache__",
                       os.path.basename(path)[:-3] + f".{sys.implementation.cache_tag}.pyc")
    py_compile.compile(str(evil_path), cfile=pyc, dfile=path)
    # the .pyc's header: the genuine file's time and size, as if compiled from it
    data = bytearray(open(pyc, "rb").read())
    data[8:12] = int(st.st_mtime).to_bytes(4, "little")
    data[12:16] = (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    open(pyc, "wb").write(bytes(data))
    assert tb.load_prim_func(_SOURCE, "prog", "answer")() == 42
    assert not marker.exists()


def test_a_predicate_file_planted_never_runs(cache_root, tmp_path):
    pytest.importorskip("cutlass")
    from compilemask.codegen import cute_predicate

    marker = tmp_path / "ran"
    src = "import cutlass.cute as cute\n\n\n@cute.jit\ndef f(x):\n    return x\n"
    path = os.path.join(env.cache_dir("predicates"),
                        f"cm_pred_{cute_predicate.source_hash(src)}.py")
    open(path, "w").write(_evil(marker) + "\nf = None\n")
    assert cute_predicate.compile_predicate(src, "f") is not None
    assert not marker.exists() and open(path).read() == src


def test_a_prebuild_worker_refuses_a_changed_file(cache_root):
    path, _ = tb._write_source(_SOURCE, "prog")
    wrong = hashlib.sha256(b"another program").hexdigest()
    assert tb._main([path, wrong, "prog", "answer", "c", "test"]) == 1
    assert not tb._is_built(_SOURCE, "prog", "c")


def test_tilde_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(env.CACHE_DIR_VAR, "~/cm")
    assert env.cache_root() == str(tmp_path / "cm")


def _unusable(tmp_path, how):
    if how == "missing, cannot be created":
        blocker = tmp_path / "file"
        blocker.write_text("")
        return blocker / "cache"  # under a file: no folder can be made there
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    if how == "group writable":
        os.chmod(d, 0o770)
    elif how == "another user's":
        if os.geteuid() != 0:
            pytest.skip("making a folder another user's needs root")
        os.chown(d, 54321, -1)
    elif how == "read-only":
        if os.geteuid() == 0:
            # root writes through permissions: a folder no one can write in
            if not os.path.isdir("/sys/kernel") or os.access("/sys/kernel", os.W_OK) and \
                    env._writable("/sys/kernel"):
                pytest.skip("no read-only folder here")
            return "/sys/kernel"
        os.chmod(d, 0o500)
    return d


@pytest.mark.parametrize("how", ["missing, cannot be created", "group writable",
                                 "another user's", "read-only"])
def test_an_unusable_folder_warns_once_and_uses_a_private_one(tmp_path, monkeypatch, caplog,
                                                              how):
    bad = _unusable(tmp_path, how)
    monkeypatch.setenv(env.CACHE_DIR_VAR, str(bad))
    env.cache_dir.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="compilemask"):
            d = env.cache_dir("tilelang")
            assert env.cache_dir("tilelang") == d  # once per process
        said = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
        assert len(said) == 1 and str(bad) in said[0] and "removed when it exits" in said[0]
        assert not d.startswith(str(bad)) and env.in_private_fallback(d)
        st = os.stat(d)
        assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077 == 0
        assert tb.load_prim_func(_SOURCE, "prog", "answer")() == 42  # and it works there
    finally:
        env.cache_dir.cache_clear()
        if os.path.isdir(tmp_path / "cache"):
            os.chmod(tmp_path / "cache", 0o700)


def test_the_private_folder_is_removed_at_exit(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    run = subprocess.run(
        [sys.executable, "-c",
         "from compilemask.contract.env import cache_dir; print(cache_dir('fa4'))"],
        env={**os.environ, env.CACHE_DIR_VAR: str(blocker / "cache")}, capture_output=True,
        text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    used = run.stdout.strip().splitlines()[-1]
    assert "is not used" in run.stderr and not os.path.exists(used), (used, run.stderr)


def test_a_folder_deleted_while_running_is_created_again(cache_root):
    assert tb.load_prim_func(_SOURCE, "prog", "answer")() == 42
    shutil.rmtree(cache_root)
    assert tb.load_prim_func(_SOURCE, "other", "answer")() == 42
    assert os.path.exists(tb._source_path(_SOURCE, "other")[0])
    assert stat.S_IMODE(os.stat(cache_root).st_mode) & 0o077 == 0


# two processes compile one program: a fake TileLang whose disk cache is one file per program;
# the per-program lock lets one compile while the other waits, then loads its build
_COMPILER = textwrap.dedent('''
    import os, sys, time, types
    log, builds = sys.argv[1], sys.argv[2]
    fake = types.ModuleType("tilelang")

    def compile(func, target):
        build = os.path.join(builds, "build")
        with open(log, "a") as f:
            if os.path.exists(build):
                f.write(f"load {os.getpid()}\\n")
                return "kernel"
            f.write(f"compile {os.getpid()}\\n")
        time.sleep(2.0)
        open(build, "w").close()
        return "kernel"

    fake.compile = compile
    sys.modules["tilelang"] = fake
    from compilemask.codegen import tilelang_build as tb
    src = "def answer():\\n    return 42\\n"
    print(tb.compile_program(src, "prog", "answer", "c", "test"))
''')


def test_two_processes_compile_one_program_once(cache_root, tmp_path):
    script = tmp_path / "compile.py"
    script.write_text(_COMPILER)
    log = tmp_path / "log"
    procs = [subprocess.Popen([sys.executable, str(script), str(log), str(tmp_path)],
                              env=os.environ.copy(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip() == "kernel", err
    kinds = sorted(line.split()[0] for line in log.read_text().splitlines())
    assert kinds == ["compile", "load"], kinds
    assert tb._is_built("def answer():\n    return 42\n", "prog", "c")
