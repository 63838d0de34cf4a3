"""bench/train_e2e.py on the CPU: the smoke run (tiny Qwen3, compilemask against SDPA, losses
equal), the flex mask_mods of the packed workloads against our dense masks, the attention-share
rule, and the merge of several runs' JSON into one table and plot."""

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.append(str(Path(__file__).resolve().parents[1]))  # after the installed packages
from bench import train_e2e  # noqa: E402

SMOKE_MASKS = "hstu,hstu_packed,causal,docs"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    rows = train_e2e.main(["--smoke", "--masks", SMOKE_MASKS, "--out", str(out), "--tag", "t"])
    return out, rows


@pytest.mark.slow  # the bench's smoke run: 4 masks x 2 backends of a tiny Qwen3
def test_smoke_losses_agree_and_table_has_rows(smoke):
    out, rows = smoke
    assert [(r["mask"], r["backend"]) for r in rows] == [
        (m, b) for m in SMOKE_MASKS.split(",") for b in ("compilemask", "sdpa")]
    for r in rows:
        assert "error" not in r, r
        assert len(r["losses"]) == 3 and r["step_ms"] > 0 and r["tokens_s"] > 0
    by = {(r["mask"], r["backend"]): r for r in rows}
    for m in SMOKE_MASKS.split(","):
        a, b = by[(m, "compilemask")]["losses"], by[(m, "sdpa")]["losses"]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-2 * max(a), (m, a, b)
    md = (out / "train_e2e_t.md").read_text()
    assert "WARNING" not in md
    for m in SMOKE_MASKS.split(","):
        assert f"| {m} | 128 | compilemask |" in md and f"| {m} | 128 | sdpa |" in md
    assert train_e2e.ATTN_RULE in md and "bench/train_e2e.py --smoke" in md
    assert json.loads((out / "train_e2e_t.json").read_text())["rows"][0]["mask"] == "hstu"


@pytest.mark.parametrize("name,S", [("hstu_packed", 128), ("hstu_packed", 4096),
                                    ("docs", 128), ("docs", 4096)])
def test_flex_mask_mod_equals_our_mask(name, S):
    wl = train_e2e.Workload(name, S, torch.device("cpu"))
    meta = wl.rows()
    if S <= 128:  # the full dense mask; at 4096 rows sampled to keep it quick
        rows = torch.arange(S)
    else:
        rows = torch.randperm(S, generator=torch.Generator().manual_seed(0))[:96]
    mm = wl.mask_mod(meta)
    got = mm(torch.tensor(0), torch.tensor(0), rows[:, None], torch.arange(S)[None])
    dense = wl.mask.preprocess(meta, seqlen_q=S, batch_size=1).dense_mask()[0]
    assert torch.equal(got, dense[rows])
    if name == "hstu_packed":
        cu, longest = wl.segments()
        assert int(cu[-1]) == S and len(cu) > 3 and longest <= S
        assert int(wl.position_ids()[0, int(cu[1])]) == 0


def test_attention_share_rule():
    kernels = [("kernel_cutlass_FlashAttentionForwardSm90_0", 30.0),
               ("triton_tem_fused_flex_attention_backward_0", 20.0),
               ("preprocess_kernel", 1.0), ("block_sparse_kernel", 1.0),
               ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", 8.0),
               ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 30.0),
               ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", 5.0),
               ("triton_red_fused__to_copy_mul_pow_rsqrt_0", 5.0)]
    s = train_e2e.attention_share(kernels)
    assert s["attn_us"] == 60.0 and s["total_us"] == 100.0 and s["share"] == pytest.approx(0.6)
    assert [c for _, _, c in s["top"]][:2] == [True, False]  # GEMMs are not attention


def test_merge_keeps_measurements_over_later_errors(tmp_path):
    def run(name, rows):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({"header": [f"# run {name}", "", "`cmd`"], "rows": rows}))
        return str(p)

    ok = {"mask": "causal", "S": 8192, "backend": "flex_fa4", "step_ms": 200.0,
          "step_mean_ms": 201.0, "tokens_s": 40960.0, "mask_ms": 0.5, "losses": [12.0, 11.9]}
    cm_row = dict(ok, backend="compilemask", step_ms=100.0, losses=[12.0, 11.95])
    a = run("a", [ok])
    b = run("b", [dict(ok, step_ms=None, error="OOM: x"), cm_row])
    md = train_e2e.merge([a, b], tmp_path, "m")
    assert "| causal | 8192 | compilemask | 100.0 (201.0) |" in md
    assert "| 2.00x |" in md  # flex_fa4's 200 ms over ours
    assert "5.00e-02 vs compilemask" in md and "OOM" not in md
    assert "run a" in md and "run b" in md
    pytest.importorskip("matplotlib")  # the plot beside the table (the viz extra)
    assert (tmp_path / "train_e2e_m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["layers", "model"])
def test_smoke_compiled_losses_agree(tmp_path, scope):
    """The compiled model (each decoder layer, or the whole model) trains as the eager one:
    compilemask against SDPA, both compiled."""
    rows = train_e2e.main(["--smoke", "--compile", "--compile-scope", scope, "--masks", "hstu",
                           "--out", str(tmp_path), "--tag", scope])
    by = {r["backend"]: r for r in rows}
    assert set(by) == {"compilemask", "sdpa"} and not any("error" in r for r in rows), rows
    a, b = by["compilemask"]["losses"], by["sdpa"]["losses"]
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-2 * max(a), (a, b)
    assert f"compile on ({scope})" in (tmp_path / f"train_e2e_{scope}.md").read_text()
