"""The op boundary as a typed contract (``kernels.contract``), the one dispatch module
(``kernels.dispatch``), the mask_mod's aux-tensor layout from one description, and
flash-attn-4 behind one adapter (``kernels.fa4_lib``). CPU only."""

from __future__ import annotations

import ast
import gc
import pathlib
import re
import types

import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask.contract.cache import KeyedRegistry
from compilemask.contract.descriptor import BlockSparseLists, DescriptorArgs
from compilemask.kernels import fa4_lib
from compilemask.kernels.contract import (
    LIST_SLOTS,
    OpSettings,
    OpSlots,
    args_schema,
    op_args,
    schema_of,
    unpack,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("compilemask", "kernels", "codegen", "dsl")


def test_schema_names_every_slot_and_has_no_positional_extra():
    schema = str(torch.ops.compilemask.attention_fwd.default._schema)
    bwd = str(torch.ops.compilemask.attention_bwd.default._schema)
    assert args_schema() in schema and args_schema() in bwd
    assert "extra" not in schema
    # the one list of tensors is the score_mod's tables; every other slot is one named tensor
    assert re.findall(r"Tensor\[\] (\w+)", schema) == ["score_aux"]
    for f in OpSlots._fields:
        assert re.search(rf"\b{f}\b", schema), f
    for f in OpSettings._fields:
        assert re.search(rf"\b{f}\b", schema), f
    # the list slots are FA4's four tensors per direction, in BlockSparseLists order
    assert LIST_SLOTS["fwd"] == tuple(f"fwd_{f}" for f in BlockSparseLists._fields)
    assert all(f in OpSlots._fields for d in LIST_SLOTS.values() for f in d)
    with pytest.raises(TypeError, match="no schema type"):
        schema_of(type("Bad", (), {"_fields": ("x",), "__annotations__": {"x": "dict"}}))


def _fa4_slots():
    mask = cm.compile_mask(masks.hstu())
    meta = masks.random_meta(mask.spec, 2, 150, torch.Generator().manual_seed(3))
    desc = mask.preprocess(meta, 150, batch_size=2)
    sink = torch.randn(4)
    aux = [torch.arange(3.0), torch.arange(4)]
    return desc, OpSlots.of(desc, "fa4", 128, score_aux=aux, sink=sink)


def test_named_slots_round_trip():
    """Slots made for a call, through the op's argument list and through autograd's saved
    tensors, come back the same tensors in the same named slots."""
    desc, slots = _fa4_slots()
    assert slots.lists(backward=False) is not None and slots.cu_seqlens is None
    for got, want in zip(slots.lists(backward=False), desc.block_sparse("fwd")):
        assert got.equal(want)
    for got, want in zip(slots.lists(backward=True), desc.block_sparse("bwd64")):
        assert got.equal(want)
    settings = OpSettings(str(desc.mask.key), 0.5, False, "fa4", "", "", 1)
    d, back, s = unpack(op_args(DescriptorArgs.of(desc), slots, settings))
    assert s == settings and d == DescriptorArgs.of(desc)
    assert all((a is b) or (a == b) for a, b in zip(back, slots))
    saved = OpSlots.rebuild(slots.structure(), slots.tensors())
    for f in OpSlots._fields:
        a, b = getattr(saved, f), getattr(slots, f)
        if isinstance(b, list):
            assert len(a) == len(b) and all(x is y for x, y in zip(a, b)), f
        else:
            assert a is b or a == b, f
    grads = slots.grads("dsink")
    assert grads[OpSlots._fields.index("sink")] == "dsink"
    assert grads[OpSlots._fields.index("score_aux")] == [None, None]
    # a trained table's gradient in its place (OpSettings.train_tables, bit per table)
    grads = slots.grads("dsink", ["dt1"], OpSettings(*settings[:-1], 0b10).trained())
    assert grads[OpSlots._fields.index("score_aux")] == [None, "dt1"]
    # a native segments pattern's offsets, in their own slot
    doc = cm.compile_mask(masks.packed_documents())
    starts = torch.tensor([[0] * 5 + [5] * 7 + [12] * 4])
    seg = doc.preprocess({"doc_start": starts}, 16)
    assert seg.segments is not None
    native = OpSlots.of(seg, "native", 64)
    assert native.cu_seqlens is seg.segments[0] and native.max_seqlen == seg.segments[1]
    assert native.lists(backward=False) is None
    back = native.descriptor(DescriptorArgs.of(seg), doc)
    assert back.segments[0] is seg.segments[0]


def test_compiled_attention_through_the_slots_has_no_graph_break():
    """cm.attention under torch.compile(fullgraph=True) on the CPU, with a learnable sink (a
    slot) and gradients: one graph, equal to eager."""
    desc = cm.compile_mask(masks.sliding_window(5)).preprocess(None, 24, batch_size=2)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 24, 4, 16, generator=g, requires_grad=True) for _ in range(3))
    sink = torch.randn(4, generator=g, requires_grad=True)

    def f(q, k, v, sink):
        return cm.attention(q, k, v, desc, learnable_sink=sink, backend="auto")

    def run(fn):
        out = fn(q, k, v, sink)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v, sink))
        return out, grads

    want = run(f)
    got = run(torch.compile(f, backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b)


def test_registry_is_bounded_and_weak():
    class Obj:
        pass

    reg = KeyedRegistry("thing", keep=2)
    held = Obj()
    reg.register("held", held)
    for i in range(5):  # held by the registry only: the last two stay
        reg.register(f"k{i}", Obj())
    gc.collect()
    assert [f"k{i}" in reg for i in range(5)] == [False, False, False, True, True]
    assert reg.get("held") is held  # held elsewhere: found however many came after
    with pytest.raises(KeyError, match="no thing with key 'k0' alive.*last 2 registered"):
        reg.get("k0")
    # equal keys: any live object of the key answers for it
    a, b = Obj(), Obj()
    reg.register("same", a)
    reg.register("same", b)
    for i in range(3):
        reg.register(f"x{i}", Obj())
    del a
    gc.collect()
    assert reg.get("same") is b
    del b, held
    gc.collect()
    assert "same" not in reg and "held" not in reg
    assert len(reg) <= 2 + 1  # the strong LRU, and nothing else


def test_mask_and_score_mod_registries_are_bounded():
    from compilemask.contract.cache import MASKS, SCORE_MODS

    assert MASKS.keep == 256 and SCORE_MODS.keep == 256
    mask = cm.compile_mask(masks.causal())
    assert MASKS.get(str(mask.key)) is not None


def _aux_reads(source: str) -> dict:
    """``name -> index`` of the generated mask_mod's ``name = aux_tensors[index]`` lines."""
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"^\s+(\w+) = aux_tensors\[(\d+)\]", source, re.M)}


def _colmask_reads() -> dict:
    """``name -> index`` of ``kernels/fa4_colmask.py``'s ``a, b = aux_data.tensors[i], ...``."""
    text = (ROOT / "kernels" / "fa4_colmask.py").read_text()
    m = re.search(r"(\w+), (\w+) = aux_data\.tensors\[(\d+)\], aux_data\.tensors\[(\d+)\]", text)
    assert m, "fa4_colmask reads its aux tensors elsewhere: update this test"
    return {m.group(1): int(m.group(3)), m.group(2): int(m.group(4))}


@pytest.mark.parametrize("name", ["hstu", "prefix_lm", "tree_verify", "dilated_causal",
                                  "sliding_window", "shared_prompt_rm"])
def test_aux_layout_agrees_with_the_generated_source(name):
    """The mask_mod's source reads each aux tensor at the index ``aux_layout`` gives, and
    ``aux_tensors`` passes exactly those, none of zero width."""
    from compilemask.codegen.cute_mask_mod import (
        VARIANTS,
        aux_layout,
        aux_tensors,
        mask_mod_source,
    )
    from compilemask.pipeline.pipeline import PipelineConfig

    spec = masks.EXAMPLES[name]()
    mask = cm.compile_mask(spec)
    meta = masks.random_meta(spec, 2, 64, torch.Generator().manual_seed(0))
    desc = mask.preprocess(meta or None, 64, batch_size=2, backend="torch",
                           config=PipelineConfig(column_view=mask.column_view is not None))
    tried = 0
    for variant in VARIANTS:
        try:
            source = mask_mod_source(mask, variant)
        except ValueError:  # a variant this mask has not
            continue
        tried += 1
        layout = aux_layout(mask, variant)
        reads = _aux_reads(source)
        if variant == "columns":  # the column view is read by the backward's mask class
            reads.update(_colmask_reads())
        assert reads == {n: i for i, n in enumerate(layout)}, variant
        passed = aux_tensors(desc, variant) or []
        assert len(passed) == len(layout), variant
        assert all(t.dim() >= 2 and t.shape[-1] > 0 for t in passed), variant
    assert tried >= 2


def test_one_module_imports_flash_attn():
    """flash-attn-4 is reached through ``kernels/fa4_lib.py`` only: no other module of the
    package imports it, by statement, by ``importlib`` or in the source it generates."""
    importers = set()
    for folder in PACKAGE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    # a module name, or an import statement in generated source
                    names = [node.value] if re.fullmatch(r"flash_attn(\.\w+)*", node.value) \
                        else re.findall(r"(?:from|import) (flash_attn\S*)", node.value)
                if any(n == "flash_attn" or n.startswith("flash_attn.") for n in names):
                    importers.add(str(path.relative_to(ROOT)))
    assert importers == {"kernels/fa4_lib.py"}


def _fake_fa4(monkeypatch):
    """FA4 as two fake modules, and one patch of a global of one of them."""
    theirs, ours = object(), object()
    mods = {"kernel": types.SimpleNamespace(Mask=theirs),
            "mask": types.SimpleNamespace(Mask=theirs)}
    monkeypatch.setattr(fa4_lib, "module", mods.__getitem__)
    return mods["kernel"], theirs, ours, (("kernel", "Mask", ("mask", "Mask"), ours),)


def test_patches_apply_only_around_our_calls(monkeypatch):
    kernel, theirs, ours, patches = _fake_fa4(monkeypatch)
    with fa4_lib.patched(patches):
        assert kernel.Mask is ours
        with fa4_lib.patched(patches):  # an overlapping call
            assert kernel.Mask is ours
        assert kernel.Mask is ours  # the outer call still runs
    assert kernel.Mask is theirs
    with pytest.raises(RuntimeError, match="a call that fails"), fa4_lib.patched(patches):
        raise RuntimeError("a call that fails")
    assert kernel.Mask is theirs  # restored on an error too


def test_patches_refuse_a_global_that_is_not_fa4s(monkeypatch):
    kernel, theirs, ours, patches = _fake_fa4(monkeypatch)
    kernel.Mask = other = object()  # someone else's replacement (or a moved name)
    with pytest.raises(RuntimeError, match=r"flash_attn.cute.kernel.Mask is not FA4's own"):
        with fa4_lib.patched(patches):
            pass
    assert kernel.Mask is other and fa4_lib._DEPTH == 0


def test_real_fa4_patches_are_scoped():
    """With flash-attn-4 installed: its globals are its own outside this package's calls."""
    pytest.importorskip("flash_attn.cute")
    from compilemask.kernels import fa4

    fwd, bwd, mask = (fa4_lib.module(n) for n in ("flash_fwd_sm90", "flash_bwd_sm90", "mask"))
    assert fwd.AttentionMask is mask.AttentionMask is bwd.AttentionMask
    with fa4_lib.patched(fa4.patches()):
        assert fwd.AttentionMask is not mask.AttentionMask
        assert issubclass(fwd.AttentionMask, mask.AttentionMask)
    assert fwd.AttentionMask is mask.AttentionMask
    assert fa4_lib.version() in fa4_lib.TESTED_VERSIONS


def test_dispatch_selects_once_and_says_why():
    from compilemask.kernels import dispatch

    desc = cm.compile_mask(masks.causal()).preprocess(None, 8)
    q = torch.empty(1, 8, 2, 64)
    assert dispatch.select_engine(q, desc) == "reference"
    assert "not on a CUDA device" in dispatch.why_not(q, desc, "fa4")
    assert "no score_mod" in dispatch.why_not(q, desc, "cute", score_mod=True)
    assert "no learnable_sink" in dispatch.why_not(q, desc, "cute", sink=True)
    assert "deterministic" in dispatch.why_not(q, desc, "fa4", deterministic=True)
    assert dispatch.why_not(q, desc, "reference", score_mod=True, sink=True) is None
    assert "score_mod runs on the fa4 and native" in dispatch.op_refusal("cute", True, False)
    assert "served batch" in dispatch.op_refusal("reference", False, False, served=True)
    assert dispatch.op_refusal("fa4", True, True, served=True) is None
    with pytest.raises(NotImplementedError, match="a score_mod runs on the fa4 and native"):
        from compilemask.kernels.autograd import attention_op

        attention_op(q, q, q, desc, engine="reference", score=("k", []))


@pytest.mark.parametrize("paged", [False, True])
def test_served_batches_go_through_the_op(monkeypatch, paged):
    """A served batch's forward runs the attention op (its served slots): FA4 gets the same
    length arguments as before, and the fake implementation the packed layout's shapes."""
    from test_serving import _packed_batch, _paged, _unpack

    from compilemask.api import serving
    from compilemask.kernels import fa4

    mask = cm.compile_mask(masks.prefix_lm())
    used_k, used_q = [30, 17, 1], [5, 3, 1]
    _, d, q, k, v = _packed_batch(mask, torch.Generator().manual_seed(0), used_k, used_q)
    calls = []

    def fake_served(q, k, v, desc, scale, engine, **lengths):
        calls.append((desc, scale, engine, lengths))
        return torch.zeros_like(q), q.new_zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(fa4, "fwd_served", fake_served)
    if paged:
        k, v, table = _paged(tuple(_unpack(t, used_k) for t in (k, v)), 8, torch.Generator())
        out = serving._fa4(q, k, v, d, None, "fa4", page_table=table)
    else:
        out = serving._fa4(q, k, v, d, 0.5, "fa4")
    assert out.shape == q.shape
    (desc, scale, engine, lengths), = calls
    assert engine == "fa4" and scale == (0.5 if not paged else q.shape[-1] ** -0.5)
    cu = torch.tensor([0, *torch.tensor(used_q).cumsum(0).tolist()], dtype=torch.int32)
    assert lengths["cu_seqlens_q"].equal(cu) and lengths["max_seqlen_q"] == d.seqlen_q
    if paged:
        assert set(lengths) == {"cu_seqlens_q", "max_seqlen_q", "seqused_k", "page_table"}
        assert lengths["page_table"] is table and lengths["seqused_k"].tolist() == used_k
    else:
        assert set(lengths) == {"cu_seqlens_q", "max_seqlen_q", "cu_seqlens_k", "max_seqlen_k"}
        assert lengths["max_seqlen_k"] == d.seqlen_k
        assert lengths["cu_seqlens_k"].tolist() == [0, *torch.tensor(used_k).cumsum(0).tolist()]
    # the op itself (schema, fake shapes: [total_q, H, D] and [H, total_q])
    served = dict(serving._lengths(d, paged))
    if paged:
        served["page_table"] = table
    slots = OpSlots.of(d, "fa4", q.shape[-1], **served)
    assert slots.served
    settings = OpSettings(str(d.mask.key), 0.5, False, "fa4", "", "", 1)
    torch.library.opcheck(torch.ops.compilemask.attention_fwd.default,
                          (q, k, v, *op_args(DescriptorArgs.of(d), slots, settings)),
                          test_utils=("test_schema", "test_faketensor"))


def test_fa4_check_is_a_constant_under_fullgraph_compile():
    # the check reads the cache folders (os.stat), which dynamo cannot trace: a compiled
    # cm.attention on CUDA reaches it through the engine choice
    def f(x):
        return x + (1 if fa4_lib.unavailable_reason() is None else 2)

    want = f(torch.zeros(3))
    got = torch.compile(f, fullgraph=True, backend="eager")(torch.zeros(3))
    assert torch.equal(got, want)


def test_fa4_lists_built_in_every_call_are_said_once(caplog):
    """The fa4 engine on a CUDA descriptor without lists (a proved-native mask's producer writes
    none) builds them in every call: said once, naming the mask and the fix; a descriptor with
    lists, or one on the CPU, is silent."""
    from compilemask.contract.log import said
    from compilemask.kernels.contract import OpSlots

    desc = cm.compile_mask(masks.causal()).preprocess(None, 300, batch_size=1)

    class OnCuda:  # the descriptor as a CUDA one looks to the slots (no GPU needed)
        def __init__(self, lists):
            self.lists, self.device = lists, torch.device("cuda")

        def __getattr__(self, name):
            return getattr(desc, name)

    said.clear()
    with caplog.at_level("WARNING", logger="compilemask"):
        OpSlots.of(desc, "fa4", 128)
        OpSlots.of(OnCuda(lists=object()), "fa4", 128)
        assert not caplog.records
        for _ in range(2):
            slots = OpSlots.of(OnCuda(lists=None), "fa4", 128)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "'causal'" in msgs[0] and "with_lists(desc)" in msgs[0], msgs
    assert torch.equal(slots.fwd_mask_cnt, desc.block_sparse("fwd").mask_cnt)
