"""bench/ncu_source.py on a small source-page CSV of the shape Nsight Compute writes (CPU)."""

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after the installed packages
from bench.ncu_source import main, read_kernels, read_samples, stall_lines  # noqa: E402

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_barrier",'
          '"stall_short_sb","stall_barrier (Not Issued)"')


def _kernel(name, rows):
    out = [f'"Kernel Name","{name}"', HEADER]
    for i, (sass, all_, ex, bar, ssb) in enumerate(rows):
        out.append(f'"0x{i:x}","      {sass}","{all_}","0","{ex}","{bar}","{ssb}","{bar}"')
    return out


def test_stall_lines(tmp_path, capsys):
    csv = tmp_path / "src.csv"
    csv.write_text("\n".join(
        _kernel("fwd", [("FFMA R1, R2, R3, R4", 10, 64, 0, 9), ("HGMMA.64x128x16", 50, 64, 2, 0),
                        ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 40, 64, 40, 0)])
        + _kernel("bwd", [("LDS R1, [R2]", 5, 8, 0, 5)])) + "\n")
    kernels = read_samples(str(csv))
    assert [k[0] for k in kernels] == ["fwd", "bwd"]
    reasons, total, lines = stall_lines(kernels[0][1], top=2)
    assert total == 100
    assert reasons == [("barrier", 42), ("short_sb", 9)]
    # the two busiest lines in line order; samples without a reason column are "other"
    assert [(i, n) for i, n, _, _ in lines] == [(1, 50), (2, 40)]
    assert lines[0][3][0] == ("other", 48)
    assert lines[1][3][0] == ("barrier", 40)
    assert read_kernels(str(csv))[0][1][2] == ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 64)
    main([str(csv), "--top", "1", "--stalls", "1"])
    out = capsys.readouterr().out
    assert "100 warp-state samples" in out and "barrier 42.0%" in out
    assert "other 49.0%" in out  # the samples no reason column holds, as on the lines


def test_engines_rounds_interleave_methods_and_keep_each_median(monkeypatch):
    """``--rounds``: later rounds time every method again, one after another, each round
    starting one method later (no method always follows the same one), and a method's time
    is its median over the rounds (the first round's value is the first of them)."""
    from bench import engines

    calls = []
    times = iter([3.0, 30.0, 1.0, 10.0])  # rounds 2 and 3: b, a, then a, b

    def fake_bench(fn, rep, ctx=None):
        calls.append(fn())
        return next(times)

    monkeypatch.setattr(engines, "_bench", fake_bench)
    monkeypatch.setattr(engines, "ROUNDS", 3)
    row = {"mask": "m", "S": 8, "mode": "fwd",
           "a": {"ms": 2.0, "rounds": [2.0], "flops": 4e9},
           "b": {"ms": 20.0, "rounds": [20.0], "flops": 4e9}}
    engines._rounds(row, [("a", lambda: "a", None), ("b", lambda: "b", None)], rep=10)
    assert calls == ["b", "a", "a", "b"]
    assert row["a"]["rounds"] == [2.0, 30.0, 1.0] and row["a"]["ms"] == 2.0
    assert row["b"]["rounds"] == [20.0, 3.0, 10.0] and row["b"]["ms"] == 10.0
    assert row["b"]["tflops"] == 4e9 / 10.0 / 1e9
    assert len(row["a"]["sm_mhz"]) == 2  # the clock after each later round (None without a GPU)
