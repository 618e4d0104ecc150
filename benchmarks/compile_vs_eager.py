"""Diagnostic (GPU): compiled vs eager rollout of a 3-layer bf16 model, per backend and layout.

Prints each forward's relative output error and the relative difference of the committed K/V in the pool.
Used to find (and then verify the fix of) cache corruption when the custom op mutated aliased
per-layer views; the log of the verifying run is ``results/compile_vs_eager_gpu.log``.

    bash .gpu/run.sh python3 benchmarks/compile_vs_eager.py
"""
import sys
import torch
sys.path.insert(0, "tests")
import ardiff_modules as am
from streaming_model import TinyStreamingModel
DT=torch.bfloat16
def run(model, spec, fn, backend, extents, chunks=3):
    cache = am.KVCache(spec, num_pages=64, device="cuda", backend=backend, contiguous_extents=extents)
    st = cache.open_session()
    g = torch.Generator(device="cuda").manual_seed(0)
    for b in spec.branches:
        am.populate_cross_attention(st, b, [blk.cross for blk in model.blocks], torch.randn(16, 64, device="cuda", dtype=DT, generator=g))
    outs=[]; pos=[]
    for c in range(chunks):
        for commit in (False, True):
            x = torch.randn(2, spec.chunk_size, 512, device="cuda", dtype=DT, generator=g)
            with torch.no_grad(), st.prepare_forward(None, spec.chunk_size, commit) as f:
                outs.append(fn(x, f.layers)); pos.append(f.positions.clone())
    return outs, cache, st, pos
torch.manual_seed(0)
model = TinyStreamingModel(dim=512, heads=4, kv_heads=4, layers=3, context_dim=64).cuda().to(DT).eval()
spec = am.KVCacheSpec(num_layers=3, num_kv_heads=4, head_dim=128, chunk_size=256, page_size=64, sink_chunks=1, window_chunks=2, branches=("cond","uncond"), cross_attention=(am.CrossAttentionSpec("text",16),), dtype="bfloat16")
for backend, extents in (("flashinfer", True), ("flashinfer", False), ("reference", False)):
    torch._dynamo.reset()
    comp = torch.compile(model, fullgraph=True)
    e, ce, se, pe = run(model, spec, model, backend, extents)
    c, cc, sc, pc = run(model, spec, comp, backend, extents)
    errs = [round(((a.float()-b.float()).norm()/b.float().norm()).item(), 4) for a, b in zip(c, e)]
    hist = se.visible_chunks("cond")
    pages = [p for ch in hist for p in ch]
    hc = sc.visible_chunks("cond"); pages_c = [p for ch in hc for p in ch]
    kv_e = ce.pool.kv[:, :, pages].float(); kv_c = cc.pool.kv[:, :, pages_c].float()
    print(backend, extents, "out rel err", errs)
    print("   history pages eager", pages, "compiled", pages_c, "pool rel diff", ((kv_c-kv_e).norm()/kv_e.norm()).item(), "pool norm", kv_e.norm().item(), kv_c.norm().item())
    print("   positions equal:", all(torch.equal(a, b) for a, b in zip(pe, pc)))
