# probe (issue 20): gate|up and down plans forced at 16 rows (and 8), in a layer chain of decode_cuda's kernels, us a layer;
# against the compiled default and with one GEMM in cuBLAS. python plan16.py on an H200; reverted in the next commit
import sys
sys.path.insert(0, ".")
import torch
import decode_cuda as dc
from decode_gemm import decode_linear_torch

dev = torch.device("cuda")
orig = dc.plan
FORCE = {}  # "gu"/"down" -> (defines overrides, grid)


def plan(M, N, K, norm, glu, sms):
    p = orig(M, N, K, norm, glu, sms)
    key = "gu" if glu else "down" if (not norm and K > 4 * N // 2 and K > 2048) else None
    if key in FORCE:
        upd, grid = FORCE[key]
        d = dict(p[0], **upd) if p else None
        return d, grid
    return p


dc.plan = plan


def mk(shape):
    H, I, nq, nkv, L = dc.SHAPES[shape]
    D = H // nq
    gen = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s, sc=0.02: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=gen) * sc  # noqa
    layers = [dict(qkv=r(H + 2 * nkv * D, H), b=r(H + 2 * nkv * D), o=r(H, H, sc=0.005), gu=r(2 * I, H),
                   down=r(H, I), n1=1 + r(H, sc=0.1), n2=1 + r(H, sc=0.1)) for _ in range(L)]
    return layers, r


def cublas_mixed(which):   # the chain with `which` GEMMs in torch (eager cuBLAS inside the graph), the rest cuda
    def g(x, w, b=None, gn=None, residual=None, eps=1e-6, glu=False):
        kind = "gu" if glu else "down" if (gn is None and residual is not None and w.shape[1] > w.shape[0]) else "x"
        return (decode_linear_torch if kind in which else dc.decode_linear_cuda)(x, w, b, gn, residual, eps, glu)
    return g


CONFIGS = {
    "1.5B": {16: [("plan", {}),
                  ("gu 768 x3", {"gu": (dict(KCH=768, NST=3, PW=1), 132)}),
                  ("gu 512 x4", {"gu": (dict(KCH=512, NST=4, PW=1), 132)}),
                  ("gu 512 x5", {"gu": (dict(KCH=512, NST=5, PW=1), 132)}),
                  ("gu 384 x6", {"gu": (dict(KCH=384, NST=6, PW=1), 132)}),
                  ("down ks7 1280 x2 1/SM", {"down": (dict(KS=7, NW=8, KCH=1280, NST=2, PW=2), 126)}),
                  ("down ks5 1792 x2 1/SM", {"down": (dict(KS=5, NW=8, KCH=1792, NST=2, PW=2), 130)}),
                  ("down ks10 896 x2 2/SM", {"down": (dict(KS=10, NW=8, KCH=896, NST=2, PW=2), 260)}),
                  ("down ks14 640 x2 2/SM", {"down": (dict(KS=14, NW=8, KCH=640, NST=2, PW=2), 252)}),
                  ("down ks7 1280 x1 2/SM", {"down": (dict(KS=7, NW=8, KCH=1280, NST=1, PW=1), 259)})],
             8: [("plan", {})]},
    "0.5B": {16: [("plan", {}),
                  ("gu 448 x5", {"gu": (dict(KCH=448, NST=5, PW=1), 132)}),
                  ("gu 448 x6", {"gu": (dict(KCH=448, NST=6, PW=1), 132)})],
             8: [("plan", {})]},
}

for shape, by_rows in CONFIGS.items():
    layers, r = mk(shape)
    H, I, nq, nkv, L = dc.SHAPES[shape]
    for M, confs in by_rows.items():
        h = r(M, H, sc=1.0)
        want = dc.layer_chain(layers, h, decode_linear_torch)
        compiled = torch.compile(lambda hh: dc.layer_chain(layers, hh, decode_linear_torch), dynamic=False,
                                 options={"triton.enable_pdl": True})
        t_comp = min(dc.graph_us(lambda: compiled(h)) / L for _ in range(2))
        print(f"{shape} {M} rows: compiled + PDL {t_comp:.1f} us a layer", flush=True)
        for name, force in confs:
            FORCE.clear(); FORCE.update(force)
            p = layers[0]
            a_gu = (h, p["gu"], None, p["n2"], None, 1e-6, True)
            a_dn = (r(M, I, sc=1.0), p["down"], None, None, h)
            try:
                got = dc.layer_chain(layers, h, dc.decode_linear_cuda)
                err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                t = min(dc.graph_us(lambda: dc.layer_chain(layers, h, dc.decode_linear_cuda)) / L for _ in range(3))
                tg = dc.graph_us(lambda: dc.decode_linear_cuda(*a_gu))
                td = dc.graph_us(lambda: dc.decode_linear_cuda(*a_dn))
                print(f"| {shape} | {M} | {name} | chain {t:.1f} | gu {tg:.1f} | down {td:.1f} | err {err:.1e} |",
                      flush=True)
            except Exception as e:
                print(f"| {shape} | {M} | {name} | FAILED {type(e).__name__}: {str(e)[:200]} |", flush=True)
        FORCE.clear()
        for which in (("down",), ("gu",), ("gu", "down")):
            f = cublas_mixed(which)
            t = min(dc.graph_us(lambda: dc.layer_chain(layers, h, f)) / L for _ in range(3))
            print(f"| {shape} | {M} | {'+'.join(which)} in cuBLAS | chain {t:.1f} |", flush=True)
