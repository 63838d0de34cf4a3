"""The benchmark's FlexAttention mask_mods are the same masks as our MaskSpecs (CPU check)."""

import sys
from pathlib import Path

import pytest
import torch

import compilemask as cm

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after the installed packages
from bench.workloads import WORKLOADS, flex_mask_mod, make_meta  # noqa: E402


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_flex_mask_mod_equals_compiled_mask(name):
    from torch.nn.attention.flex_attention import create_mask

    S, B = 200, 3
    meta = make_meta(name, B, S, seed=1)
    mask = cm.compile_mask(WORKLOADS[name]())
    ours = mask.preprocess(meta, seqlen_q=S, batch_size=B).dense_mask()
    flex = create_mask(flex_mask_mod(name, meta), B, None, S, S, device="cpu")[:, 0]
    assert torch.equal(ours, flex)
    assert ours.any() and not ours.all()


def test_merge_runs_into_one_table_and_plot(tmp_path):
    """bench/attention.py --merge: points of several device calls in one table and plot (CPU);
    a later file's measurement of a method replaces an earlier one, a later OOM does not, other
    methods of the row are kept, and the sources' header lines are kept."""
    pytest.importorskip("matplotlib")
    from bench.attention import main

    def row(mask, S, ms):
        cm_ = {"ms": ms, "tflops": 100.0 / ms, "kernel_ms": ms - 1, "preprocess_ms": 0.01,
               "fwd_ms": ms / 4}
        return {"mask": mask, "S": S, "B": 131072 // S, "cm": cm_,
                "flex_flash": {"ms": 2 * ms, "tflops": 50.0 / ms, "kernel_ms": ms,
                               "block_mask_ms": 1.0}}

    runs = {"a": [row("hstu", 1024, 4.0), row("hstu", 32768, 60.0)],
            "b": [row("hstu", 32768, 57.0), row("causal", 1024, 3.0)],
            # a peer measured alone, and a sweep's OOM that a fresh process did not have
            "c": [{"mask": "hstu", "S": 32768, "B": 4,
                   "flex_triton": {"ms": 90.0, "tflops": 1.0, "kernel_ms": 89.0}},
                  {"mask": "hstu", "S": 1024, "B": 128,
                   "cm": {"ms": None, "tflops": None, "kernel_ms": None, "note": "OOM"}}]}
    paths = []
    for name, rows in runs.items():
        p = tmp_path / f"attention_train_{name}.json"
        p.write_text(__import__("json").dumps(rows))
        p.with_suffix(".md").write_text(f"# t\n\nheader of run {name}\n")
        paths.append(str(p))
    main(["--mode", "train", "--merge", *paths, "--out", str(tmp_path / "out"), "--tag", "m"])
    md = (tmp_path / "out" / "attention_train_m.md").read_text()
    main_table = md.split("Breakdown")[0]
    lines = [x for x in main_table.splitlines() if x.startswith(("| hstu", "| causal"))]
    # in the workloads' order, then by S
    assert [x.split(" | ")[:2] for x in lines] == [["| causal", "1024"], ["| hstu", "1024"],
                                                    ["| hstu", "32768"]]
    assert "57.000" in lines[2] and "60.000" not in md
    assert "90.000" in lines[2] and "114.000" in lines[2]  # flex_triton from c, flex_flash from b
    assert "4.000" in lines[1] and "OOM" not in lines[1]
    assert "hstu flex_triton @ 32768" in md  # which points each source file gave
    # Table 1 breakdown: cm's forward was timed alone in every row; bwd = kernel - fwd
    assert "| hstu | 32768 | cm | 0.010 | 14.250 | 41.750 | 57.000 |" in md
    assert "2.00x" in lines[0]  # best peer / cm
    assert "header of run a" in md and "header of run b" in md
    assert (tmp_path / "out" / "attention_train_m.png").stat().st_size > 0


def test_serving_and_score_mod_bench_pieces():
    """The serving bench's table and the engine bench's score_mods and tree workload (CPU):
    the tree's FlexAttention mask_mod equals our mask, the score_mods run as Flex calls them."""
    from torch.nn.attention.flex_attention import create_mask

    from bench.engines import SPECS, make_score_mod, workload_mask_mod, workload_meta
    from bench.serving import paged_markdown, to_markdown

    rows = [{"Sk": 8192, "Sq": 1, "engine": "native", "fa4": 0.05, "cm": 0.05, "desc": 0.02,
             "cm+desc": 0.07, "fa4_graph": 0.04, "cm_graph": 0.05, "cm+desc_graph": 0.3,
             "fa4_host": 0.09, "cm_host": 0.11, "desc_program": 0.01,
             "cm+desc_program_graph": 0.06}]
    table = to_markdown(rows, "# decode")
    assert ("| 8192 | 1 | native | 0.0500 | 0.0500 | 1.00x | 0.0200 | 0.0700 | 0.0400 | 0.0500 "
            "| 0.80x | 0.3000 | 0.0900 | 0.1100 | 0.0100 | 0.0600 |") in table
    paged = paged_markdown([{"Sk": 8192, "Sq": 4, "page_size": 64, "fa4": 0.06,
                             "cm_causal": 0.06, "cm_prefix_lm": 0.08}])
    assert "| 8192 | 4 | 64 | 0.0600 | 0.0600 | 1.00x | 0.0800 | 0.75x |" in paged
    meta = workload_meta("tree_verify", 2, 600, "cpu")
    mask = cm.compile_mask(SPECS["tree_verify"]())
    ours = mask.preprocess(meta, seqlen_q=600, batch_size=2).dense_mask()
    flex = create_mask(workload_mask_mod("tree_verify", meta, 600), 2, None, 600, 600,
                       device="cpu")[:, 0]
    assert torch.equal(ours, flex)
    drafts = ours[:, -256:]  # each sees the whole prefix, itself and at most 8 ancestors
    assert drafts[:, :, :-256].all() and (drafts[:, :, -256:].sum(-1) <= 9).all()
    s = torch.zeros(1, 8, 4, 4)
    idx = [torch.arange(n).view(shape) for n, shape in (
        (1, (1, 1, 1, 1)), (8, (1, 8, 1, 1)), (4, (1, 1, 4, 1)), (4, (1, 1, 1, 4)))]
    for name in ("alibi", "softcap", "t5", "temperature"):
        assert make_score_mod(name, "cpu")(s, *idx).shape == s.shape
