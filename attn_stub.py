"""engine with the decode attention replaced by a PDL copy kernel (STUB=1): what the attention costs in each path.
usage: STUB=1 python attn_stub.py rows 0.5B 8 [rollout.DECODE_GEMM="'cuda'"]"""
import os, runpy, sys
sys.path.insert(0, os.getcwd())
import torch, triton, triton.language as tl
import decode_kernels as dk

@triton.jit
def _copy(q_ptr, out_ptr, stride_qn, stride_qh, H: tl.constexpr, D: tl.constexpr, USE_GDC: tl.constexpr):
    pid = tl.program_id(0)
    n, h = pid // H, pid % H
    dk._wait_for_previous_kernel(USE_GDC)
    offs = tl.arange(0, D)
    tl.store(out_ptr + pid * D + offs, tl.load(q_ptr + n * stride_qn + h * stride_qh + offs))

def stub(q, k_new, v_new, layer, st, scale, cos=None, sin=None):
    n, h, _, D = q.shape
    out = torch.empty(n, 1, h, D, dtype=q.dtype, device=q.device)
    _copy[(n * h,)](q, out, q.stride(0), q.stride(1), H=h, D=D, num_warps=1, **dk.pdl_launch(q.device))
    return out

if os.environ.get("STUB") == "1":
    dk.decode_attention_triton = stub
    print("attention: STUB (PDL copy kernel)")
sys.argv = ["bench_rollout.py"] + sys.argv[1:]
runpy.run_path("bench_rollout.py", run_name="__main__")
