"""python -m compilemask explain|show: success paths and every user error (exit 2, one line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from compilemask.api.cli import parse_meta, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HSTU = os.path.join(ROOT, "compilemask", "masks", "hstu.py")  # its factory hstu() is NAME
HSTU_META = "ctx_end=1024,hist_end=3000,seq_end=4000,group_size=256"

try:
    import matplotlib  # noqa: F401

    needs_mpl = pytest.mark.skipif(False, reason="")
except ImportError:  # the [viz] extra is not installed
    needs_mpl = pytest.mark.skip(reason="needs matplotlib (the [viz] extra)")


@pytest.fixture()
def specs(tmp_path):
    p = tmp_path / "specs.py"
    p.write_text(textwrap.dedent("""
        import compilemask as cm
        from compilemask.masks import causal, prefix_lm, packed_documents

        CAUSAL = causal()
        PREFIX = prefix_lm()
        DOCS = packed_documents()
        NUMBER = 3


        def make():
            return prefix_lm()


        def needs_arg(x):
            return causal()


        def not_a_spec():
            return 42
    """))
    return str(p)


def _err(capsys, cmd, argv):
    rc = run(cmd, argv)
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"compilemask {cmd}: error: ")
    return lines[0]


# ---- success -----------------------------------------------------------------------------------
def test_explain_example(capsys):
    assert run("explain", [f"{HSTU}:hstu", "--no-code"]) == 0
    out = capsys.readouterr().out
    assert "region 2 'target'" in out and "K = 2" in out and "DNF" in out
    assert "def target_sees(i, j):" in out  # the rule as written


def test_explain_row_with_code(capsys):
    assert run("explain", [f"{HSTU}:hstu", "--row", "3100", "--seqlen", "4096", "--meta", HSTU_META,
                           "--code"]) == 0
    out = capsys.readouterr().out
    assert "generated TileLang preprocess" in out
    assert "row 3100 of sequence 0: region target; visible keys [0, 3000), [3000, 3101)" in out


def test_explain_zero_arg_function(capsys, specs):
    assert run("explain", [f"{specs}:make", "--no-code"]) == 0
    assert "MaskSpec 'prefix_lm'" in capsys.readouterr().out


@needs_mpl
def test_show_in_process(capsys, tmp_path, specs):
    png = tmp_path / "p.png"
    rc = run("show", [f"{specs}:PREFIX", "--seqlen", "300", "--seqlen-k", "260", "--meta",
                      "prefix_len=100", "--out", str(png), "--tiles", "32x64"])
    out = capsys.readouterr().out
    assert rc == 0 and png.stat().st_size > 1000
    assert "prefix_lm: seqlen_q=300 seqlen_k=260 K=1 fwd tiles 32x64" in out
    assert len(out.splitlines()) == 1 + 10 + 1 + 1  # head, 10 q-tiles, counts, "wrote"


@needs_mpl
def test_show_subprocess(tmp_path):
    png = tmp_path / "mask.png"
    res = subprocess.run(
        [sys.executable, "-m", "compilemask", "show", f"{HSTU}:hstu", "--seqlen", "4096",
         "--meta", HSTU_META, "--out", str(png)],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "hstu: seqlen_q=4096 seqlen_k=4096 K=2 fwd tiles 128x128 (sequence 0)"
    grid = lines[1:33]
    assert all(len(g) == 32 and set(g) <= set("#~.") for g in grid)
    assert lines[33].startswith("full ") and lines[-1] == f"wrote {png}"
    from PIL import Image

    with Image.open(png) as im:
        info = json.loads(im.text["compilemask"])
    assert info["mode"] == "tiles" and info["seqlen_q"] == 4096  # 16M elements: tile resolution
    # the counts printed equal those drawn
    full, partial, empty = (int(x) for x in lines[33].split()[1:6:2])
    assert info["counts"] == {"full": full, "partial": partial, "empty": empty}


@needs_mpl
def test_show_prints_blocks_for_long_sequences(capsys, tmp_path):
    rc = run("show", [f"{HSTU}:hstu", "--seqlen", "32768", "--meta",
                      "ctx_end=4000,hist_end=20000,seq_end=30000,group_size=1500",
                      "--out", str(tmp_path / "long.png"), "--max-chars", "64"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0 and "(each character: 4x4 tiles)" in lines[0]
    assert len(lines) == 1 + 64 + 2 and all(len(x) == 64 for x in lines[1:65])
    assert lines[65] == ("full 28970  partial 722  empty 35844  of 65536 tiles; "
                         "54.7% of FLOPs skipped")


def test_show_error_subprocess_is_one_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "compilemask", "show", "nope.py:X", "--seqlen",
                          "8"], capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == "compilemask show: error: no such file: nope.py"


# ---- errors: exit code 2, one line -------------------------------------------------------------
def test_missing_file(capsys, tmp_path):
    line = _err(capsys, "show", [str(tmp_path / "none.py") + ":X", "--seqlen", "8"])
    assert "no such file" in line
    assert "no such file" in _err(capsys, "explain", [str(tmp_path / "none.py")])


def test_file_importing_a_sibling_module(capsys, tmp_path):
    (tmp_path / "helpers_for_mask.py").write_text("LIMIT = 5\n")
    (tmp_path / "uses.py").write_text(
        "import compilemask as cm\nfrom helpers_for_mask import LIMIT\n"
        "S = cm.MaskSpec('lim', regions=[cm.Region('all', when=lambda i: True,\n"
        "    visible=lambda i, j: i - LIMIT < j <= i)])\n")
    assert run("explain", [str(tmp_path / "uses.py"), "--no-code"]) == 0
    assert "MaskSpec 'lim'" in capsys.readouterr().out


def test_not_a_python_file(capsys, tmp_path):
    assert "expected FILE.py:NAME" in _err(capsys, "explain", ["masks.txt:X"])


def test_missing_name(capsys, specs):
    line = _err(capsys, "explain", [f"{specs}:NOPE"])
    assert "has no name 'NOPE'" in line and "CAUSAL" in line


def test_ambiguous_default_name(capsys, specs):
    assert "say which MaskSpec" in _err(capsys, "explain", [specs])


@pytest.mark.parametrize("name,why", [
    ("NUMBER", "not a MaskSpec"),
    ("needs_arg", "not a MaskSpec"),
    ("not_a_spec", "not a MaskSpec"),
])
def test_not_a_maskspec(capsys, specs, name, why):
    assert why in _err(capsys, "explain", [f"{specs}:{name}"])


def test_file_that_raises(capsys, tmp_path):
    p = tmp_path / "bad.py"
    p.write_text("raise RuntimeError('boom\\nsecond line')\n")
    line = _err(capsys, "explain", [f"{p}:X"])
    assert "RuntimeError: boom second line" in line


def test_rule_the_compiler_rejects(capsys, tmp_path):
    p = tmp_path / "loop.py"
    p.write_text(textwrap.dedent("""
        import compilemask as cm

        def sees(i, j):
            for k in range(3):
                pass
            return j <= i

        S = cm.MaskSpec("loop", regions=[cm.Region("all", when=lambda i: True, visible=sees)])
    """))
    assert "cannot compile 'loop'" in _err(capsys, "explain", [f"{p}:S"])


def test_unknown_meta(capsys, specs, tmp_path):
    line = _err(capsys, "show", [f"{specs}:PREFIX", "--seqlen", "64", "--meta",
                                 "prefix_len=3,bogus=1", "--out", str(tmp_path / "x.png")])
    assert "no param(s) bogus" in line and "prefix_len" in line
    assert "no param(s) bogus" in _err(capsys, "explain", [f"{specs}:PREFIX", "--meta", "bogus=1"])


def test_missing_meta(capsys, tmp_path):
    line = _err(capsys, "show", [f"{HSTU}:hstu", "--seqlen", "64", "--meta", "ctx_end=3",
                                 "--out", str(tmp_path / "x.png")])
    assert "needs --meta for hist_end, seq_end, group_size" in line
    line = _err(capsys, "explain", [f"{HSTU}:hstu", "--row", "3", "--seqlen", "64"])
    assert "needs --meta for ctx_end" in line


@pytest.mark.parametrize("meta,why", [
    ("prefix_len", "bad --meta item"),
    ("prefix_len=x", "is not an int"),
    ("prefix_len=1.5", "is not an int"),
    ("=3", "bad --meta item"),
    ("prefix_len=1,prefix_len=2", "twice"),
])
def test_bad_meta_syntax(capsys, specs, tmp_path, meta, why):
    line = _err(capsys, "show", [f"{specs}:PREFIX", "--seqlen", "64", "--meta", meta, "--out",
                                 str(tmp_path / "x.png")])
    assert why in line


def test_per_row_array_params_cannot_come_from_the_command_line(capsys, specs, tmp_path):
    line = _err(capsys, "show", [f"{specs}:DOCS", "--seqlen", "64", "--out",
                                 str(tmp_path / "x.png")])
    assert "per-row array" in line


def test_bad_values_and_options(capsys, specs, tmp_path):
    out = str(tmp_path / "x.png")
    assert "invalid int value" in _err(capsys, "show", [f"{specs}:CAUSAL", "--seqlen", "abc"])
    assert "needs --seqlen" in _err(capsys, "show", [f"{specs}:CAUSAL", "--out", out])
    assert "must be positive" in _err(capsys, "show", [f"{specs}:CAUSAL", "--seqlen", "0"])
    assert "preprocess:" in _err(capsys, "show", [f"{specs}:PREFIX", "--seqlen", "64", "--meta",
                                                  "prefix_len=-1", "--out", out])
    assert "tile sizes" in _err(capsys, "show", [f"{specs}:CAUSAL", "--seqlen", "64",
                                                 "--tiles", "48x48", "--out", out])
    assert "bad --tiles" in _err(capsys, "show", [f"{specs}:CAUSAL", "--seqlen", "64",
                                                  "--tiles", "axb", "--out", out])
    assert "--row needs --seqlen" in _err(capsys, "explain", [f"{specs}:CAUSAL", "--row", "3"])
    assert "outside" in _err(capsys, "explain", [f"{specs}:CAUSAL", "--row", "9", "--seqlen",
                                                 "4"])
    assert "unrecognized arguments" in _err(capsys, "show", [f"{specs}:CAUSAL", "--bogus"])
    assert "unknown command" in _err(capsys, "frobnicate", [])


def test_parse_meta():
    assert parse_meta("a=1, b=0x10,c=-2") == {"a": 1, "b": 16, "c": -2}
    assert parse_meta(None) == {} and parse_meta("") == {}


# ---- demo --train ------------------------------------------------------------------------------
def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


@pytest.mark.skipif(not _has_transformers(), reason="needs transformers (the [hf] extra)")
def test_demo_train_subprocess(tmp_path):
    res = subprocess.run([sys.executable, "-m", "compilemask", "demo", "--train"],
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "attn_implementation='compilemask'" in lines[0] and "mask 'hstu'" in lines[0]
    steps = [ln for ln in lines if ln.startswith("step ")]
    losses = [float(ln.split()[-1]) for ln in steps]
    assert [ln.split()[1] for ln in steps] == ["1", "2", "3", "4", "5"]
    assert losses[-1] < losses[0]
    assert lines[-1].endswith("decreasing") and "NOT" not in lines[-1]


def test_demo_train_without_transformers(capsys, monkeypatch):
    from compilemask.__main__ import main

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    assert main(["demo", "--train"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("compilemask demo --train: error: needs transformers")
    assert 'pip install -e ".[hf]"' in err


def test_demo_unknown_argument(capsys):
    from compilemask.__main__ import main

    assert main(["demo", "--bogus"]) == 2
    assert "unknown argument(s) --bogus" in capsys.readouterr().err


# ---- overlapping guards: a row belongs to the first region whose guard holds -------------------
OVERLAP = textwrap.dedent("""
    import compilemask as cm

    SPEC = cm.MaskSpec("overlap", params=["a"], regions=[
        cm.Region("lo", when=lambda i: i < a + 2, visible=lambda i, j: j <= i),
        cm.Region("hi", when=lambda i: i >= a, visible=lambda i, j: j >= i),
    ])
""")


@needs_mpl
def test_show_accepts_overlapping_guards(capsys, tmp_path):
    p = tmp_path / "overlap.py"
    p.write_text(OVERLAP)
    png = tmp_path / "o.png"
    rc = run("show", [str(p), "--seqlen", "256", "--meta", "a=100", "--tiles", "64x64",
                      "--out", str(png)])
    out, err = capsys.readouterr()
    assert rc == 0 and err == "" and png.stat().st_size > 1000
    assert out.splitlines()[1:5] == ["~...", "~~~~", "..~#", "...~"]


# ---- --out: any image format matplotlib writes -------------------------------------------------
@needs_mpl
@pytest.mark.parametrize("ext,magic", [("jpg", b"\xff\xd8"), ("svg", b"<?xml"),
                                       ("pdf", b"%PDF")])
def test_show_writes_what_matplotlib_writes(capsys, specs, tmp_path, ext, magic):
    out = tmp_path / f"mask.{ext}"
    rc = run("show", [f"{specs}:PREFIX", "--seqlen", "64", "--meta", "prefix_len=3", "--out",
                      str(out)])
    assert rc == 0, capsys.readouterr().err
    assert out.read_bytes().startswith(magic)
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out}"


@needs_mpl
def test_show_unsupported_extension_is_one_line(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "compilemask", "show", f"{HSTU}:hstu", "--seqlen", "256",
         "--meta", HSTU_META, "--out", str(tmp_path / "mask.foo")],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.startswith("compilemask show: error: cannot write ")
    assert "unsupported image format '.foo' (supported: " in res.stderr and "png" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "mask.foo").exists()


# ---- explain: the generated code on request ----------------------------------------------------
def test_explain_code_is_opt_in(capsys):
    assert run("explain", [f"{HSTU}:hstu"]) == 0
    short = capsys.readouterr().out
    assert "K = 2" in short and "generated" not in short
    assert run("explain", [f"{HSTU}:hstu", "--code"]) == 0
    assert "generated TileLang preprocess" in capsys.readouterr().out
    assert run("explain", [f"{HSTU}:hstu", "--code", "--no-code"]) == 0  # the last one wins
    assert "generated" not in capsys.readouterr().out


# ---- a per-row array read at anything but i or j -----------------------------------------------
def test_explain_rejected_array_subscript_is_one_line(capsys, tmp_path):
    p = tmp_path / "ahead.py"
    p.write_text(textwrap.dedent("""
        import compilemask as cm

        def ahead(i, j):
            return j < nxt[i + 1]

        S = cm.MaskSpec("ahead", params=["nxt"], regions=[
            cm.Region("r", when=lambda i: True, visible=ahead)])
    """))
    line = _err(capsys, "explain", [f"{p}:S"])
    assert "cannot compile 'ahead'" in line
    assert f"Region 'r', visible function 'ahead' ({p}:5): unsupported subscript 'nxt[i + 1]'" \
        in line
