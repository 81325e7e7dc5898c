"""
A decode step's transformer layer as one persistent launch (rollout.DECODE_GEMM = "layer"), beside its torch
reference.

With decode_gemm's GEMMs a layer is five launches (q|k|v, attention, merge, o, gate|up, down) and each pays a
kernel-to-kernel gap, a ramp while its first loads are in flight and a tail while its last programs finish: at 8
rows on an H200 o_proj takes 5.9 us for 1.0 us of bytes (BENCHMARKS, "The decode-floor levers"). Here one launch
runs the layer's six phases

    0  q|k|v = RoPE(RMSNorm(h) @ W_qkv^T + b)           decode_gemm._linear_tile, items (head-half tile, K split)
    1  attention partials over the K/V each split owns  decode_kernels._attend_split, items (slot, K/V head, split)
    2  o = merge of the splits by log-sum-exp           decode_kernels._merge_splits, items (slot, head)
    3  h1 = h + o @ W_o^T + b                           _linear_tile, items (column tile, K split)
    4  a = silu(RMSNorm(h1) @ W_gate^T) * (RMSNorm(h1) @ W_up^T)
    5  out = h1 + a @ W_down^T

on a grid of as many programs as are resident on the GPU at once (PROGRAMS_PER_SM an SM, fewer if they do not fit):
program p takes items p, p + programs, ... of a phase, then waits at a grid barrier until every program has
finished the phase, since the next one reads all of its outputs. A barrier costs an atomic round trip to L2 and the
slowest program's last item, not a launch. The phases' code is the five-launch path's, so the two compute the same
bits. Without a GPU (TRITON_INTERPRET, the tests) the interpreter runs programs one after another and no barrier
could ever be passed: the wrapper launches one phase at a time there, the same kernel (FIRST, LAST).

    decode_layer_triton(h, weights, caches, st, rope, eps) -> (n, H): one layer of decode_forward
"""
import os
from typing import List, Optional

import torch
import triton
import triton.language as tl

from decode_gemm import (GEMM_BLOCK_K, ROPE_BLOCK_N, _linear_tile, _prefetch_weights, _tile_rows,
                         decode_linear_torch)
from decode_kernels import BLOCK_N as ATTN_BLOCK_N, _attend_split, _merge_splits, counters, decode_attention_torch

PROGRAMS_PER_SM = 1  # persistent programs an SM (capped by what fits: registers, shared memory)
NUM_WARPS, NUM_STAGES = 4, 4  # the persistent kernel's launch (one for every phase)
BLOCK_N, BLOCK_N_PAIR = 16, 16  # a GEMM item's columns: o, down; gate|up (twice: gate and up)
ROUNDS = 1  # a GEMM phase's items: at most this many a program (a program's items run one after another)
MAX_SPINS = 1 << 20  # a barrier gives up after this many polls (~1 s) and flags it (SYNC[2]): a wrong residency
#                      count must fail loudly, not hang the GPU
PREFETCH = True  # ask L2 for a later phase's W while a phase waits on latency, not bandwidth (GPU only): W_o at
#                  q|k|v, the first PREFETCH_STEPS K steps of gate|up's items at the attention, of down's after
#                  gate|up, and the next layer's W_qkv after down (its launch then starts from L2)
PREFETCH_STEPS = 4
SYNC = {}  # device -> int32 [barrier arrivals, programs done, timed-out barriers] (0 between launches)


@triton.jit
def _grid_barrier(sync_ptr, target, MAX_SPINS: tl.constexpr):
    """wait until every program has arrived here: sync_ptr[0] counts arrivals over the launch, target = programs x
    barriers so far. Every program must be resident (the grid is sized so), or the spin never ends: after MAX_SPINS
    polls it gives up and bumps sync_ptr[2]"""
    tl.debug_barrier()  # every thread's writes of the phase are issued before the (one-thread) release
    n = tl.atomic_add(sync_ptr, 1, sem="acq_rel") + 1
    spins = 0
    while (n < target) & (spins < MAX_SPINS):
        n = tl.atomic_add(sync_ptr, 0, sem="acquire")
        spins += 1
    if n < target:
        tl.atomic_add(sync_ptr + 2, 1)
    tl.debug_barrier()  # and every thread reads the others' outputs after the acquire


@triton.jit
def _prefetch_items(w_ptr, pid, programs, TILES, SPLIT, K_PER, N, K, stride_wn, PAIR: tl.constexpr,
                    ROPE: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEPS):
    """prefetch into L2 the first STEPS K steps of W of this program's items of a GEMM phase (the first m tile's:
    every m tile reads the same W)"""
    for i in range(pid, TILES * SPLIT, programs):
        k0 = (i % SPLIT) * K_PER
        rows = _tile_rows((i // SPLIT) % TILES, N, ROPE, HALF, BLOCK_N)
        _prefetch_weights(w_ptr + tl.minimum(rows, N - 1) * stride_wn, (HALF if ROPE else N) * stride_wn, PAIR, k0,
                          tl.minimum(k0 + tl.minimum(K_PER, STEPS * BLOCK_K), K), K, BLOCK_K)


@triton.jit
def _decode_layer_kernel(h_ptr, qkv_ptr, o_ptr, h1_ptr, a_ptr, out_ptr,  # activations (n, *) in the model's dtype
                         wqkv_ptr, bqkv_ptr, wo_ptr, bo_ptr, wgu_ptr, bgu_ptr, wd_ptr, bd_ptr,  # W (N, K), b (N,)
                         wqkv_next_ptr,  # the next layer's W_qkv (PREFETCH)
                         pos_ptr, freq_ptr, qkn_ptr,  # RoPE: positions (n,), inv_freq (D/2,), [q_norm; k_norm] (2D,)
                         pk_ptr, pv_ptr, ck_ptr, cv_ptr, rows_ptr, done_ptr, start_ptr, slot_ptr,  # decode state
                         att_o_ptr, lse_ptr, part_ptr, count_ptr, sync_ptr,  # scratch: splits, partials, counters
                         M, H, I, NQKV, NQ, NK, G, P, eps_attn, eps_mlp, rope_scale, qk_eps, qk_scale, PF_STEPS,
                         QKV_TILES, QKV_KPER, O_TILES, O_KPER, GU_TILES, GU_KPER, D_TILES, D_KPER, M_TILES,
                         stride_pb, stride_ph, stride_pl, stride_cn, stride_ch, stride_cl,
                         QKV_BIAS: tl.constexpr, O_BIAS: tl.constexpr, GU_BIAS: tl.constexpr, D_BIAS: tl.constexpr,
                         QK_NORM: tl.constexpr, D: tl.constexpr, QPK: tl.constexpr, QPK_PAD: tl.constexpr,
                         ATT_SPLITS: tl.constexpr, QKV_SPLIT: tl.constexpr, QKV_BN: tl.constexpr,
                         O_SPLIT: tl.constexpr, O_BN: tl.constexpr, GU_SPLIT: tl.constexpr, GU_BN: tl.constexpr,
                         D_SPLIT: tl.constexpr, D_BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         ATT_BLOCK: tl.constexpr, PRECISION: tl.constexpr, MAX_SPINS: tl.constexpr,
                         PREFETCH: tl.constexpr,
                         FIRST: tl.constexpr, LAST: tl.constexpr):
    """phases FIRST..LAST-1 of the layer (module docstring), a grid barrier between two phases. Item i of a GEMM
    phase: K split i % SPLIT of tile i // SPLIT (n tile t % TILES, m tile t // TILES), so a tile's splits run at
    once on neighbouring programs; the last split to arrive sums the partials (_linear_tile)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    HALF: tl.constexpr = D // 2
    barriers = 0
    if (FIRST <= 0) and (LAST > 0):  # q|k|v = RoPE(RMSNorm(h) W_qkv^T + b): x stays h, y the (n, NQKV) buffer
        if PREFETCH:  # W_o, for phase 3 (the next phases wait on latency: HBM has time)
            _prefetch_items(wo_ptr, pid, programs, O_TILES, O_SPLIT, O_KPER, H, NQ * D, NQ * D, False, False, O_BN,
                            O_BN, BLOCK_K, O_KPER // BLOCK_K)
        for i in range(pid, QKV_TILES * M_TILES * QKV_SPLIT, programs):
            t = i // QKV_SPLIT
            _linear_tile(h_ptr, wqkv_ptr, bqkv_ptr, h_ptr, qkv_ptr, part_ptr, count_ptr, pos_ptr, freq_ptr, qkn_ptr,
                         t % QKV_TILES, t // QKV_TILES, i % QKV_SPLIT, t, M, NQKV, H, QKV_KPER, eps_attn, NQ,
                         NQ + NK, rope_scale, qk_eps, H, H, 0, NQKV, True, False, QKV_BIAS, False, True, QK_NORM,
                         HALF, QKV_SPLIT, BLOCK_M, QKV_BN, BLOCK_K, PRECISION)
    if (FIRST <= 0) and (LAST > 1):
        barriers += 1
        _grid_barrier(sync_ptr, barriers * programs, MAX_SPINS)
    if (FIRST <= 1) and (LAST > 1):  # attention: q, k_new, v_new are views of the q|k|v rows
        if PREFETCH:  # the start of gate|up's items
            _prefetch_items(wgu_ptr, pid, programs, GU_TILES, GU_SPLIT, GU_KPER, I, H, H, True, False, GU_BN, GU_BN,
                            BLOCK_K, PF_STEPS)
        for i in range(pid, M * NK * ATT_SPLITS, programs):
            r = i // ATT_SPLITS
            _attend_split(qkv_ptr, qkv_ptr + NQ * D, qkv_ptr + (NQ + NK) * D, pk_ptr, pv_ptr, ck_ptr, cv_ptr,
                          rows_ptr, done_ptr, start_ptr, slot_ptr, att_o_ptr, lse_ptr, o_ptr, count_ptr, r // NK,
                          r % NK, i % ATT_SPLITS, NK, G, P, qk_scale, NQKV, D, NQKV, D, NQKV, D,
                          stride_pb, stride_ph, stride_pl, stride_cn, stride_ch, stride_cl, QPK, QPK_PAD, D,
                          ATT_BLOCK, ATT_SPLITS, PRECISION, False)
    if (FIRST <= 1) and (LAST > 2) and (ATT_SPLITS > 1):
        barriers += 1
        _grid_barrier(sync_ptr, barriers * programs, MAX_SPINS)
    if (FIRST <= 2) and (LAST > 2) and (ATT_SPLITS > 1):  # merge the splits: o (n, NQ * D)
        for i in range(pid, M * NQ, programs):
            _merge_splits(att_o_ptr, lse_ptr, o_ptr, i, D, ATT_SPLITS)
    if (FIRST <= 2) and (LAST > 3):
        barriers += 1
        _grid_barrier(sync_ptr, barriers * programs, MAX_SPINS)
    if (FIRST <= 3) and (LAST > 3):  # h1 = h + o W_o^T + b
        for i in range(pid, O_TILES * M_TILES * O_SPLIT, programs):
            t = i // O_SPLIT
            _linear_tile(o_ptr, wo_ptr, bo_ptr, h_ptr, h1_ptr, part_ptr, count_ptr, pos_ptr, freq_ptr, qkn_ptr,
                         t % O_TILES, t // O_TILES, i % O_SPLIT, t, M, H, NQ * D, O_KPER, 0., 0, 0, 1., 0.,
                         NQ * D, NQ * D, H, H, False, False, O_BIAS, True, False, False, O_BN, O_SPLIT, BLOCK_M,
                         O_BN, BLOCK_K, PRECISION)
    if (FIRST <= 3) and (LAST > 4):
        barriers += 1
        _grid_barrier(sync_ptr, barriers * programs, MAX_SPINS)
    if (FIRST <= 4) and (LAST > 4):  # a = silu(RMSNorm(h1) W_gate^T) * RMSNorm(h1) W_up^T
        for i in range(pid, GU_TILES * M_TILES * GU_SPLIT, programs):
            t = i // GU_SPLIT
            _linear_tile(h1_ptr, wgu_ptr, bgu_ptr, h1_ptr, a_ptr, part_ptr, count_ptr, pos_ptr, freq_ptr, qkn_ptr,
                         t % GU_TILES, t // GU_TILES, i % GU_SPLIT, t, M, I, H, GU_KPER, eps_mlp, 0, 0, 1., 0.,
                         H, H, 0, I, True, True, GU_BIAS, False, False, False, GU_BN, GU_SPLIT, BLOCK_M, GU_BN,
                         BLOCK_K, PRECISION)
        if PREFETCH:  # the start of down's items, while the slowest gate|up items finish
            _prefetch_items(wd_ptr, pid, programs, D_TILES, D_SPLIT, D_KPER, H, I, I, False, False, D_BN, D_BN,
                            BLOCK_K, PF_STEPS)
    if (FIRST <= 4) and (LAST > 5):
        barriers += 1
        _grid_barrier(sync_ptr, barriers * programs, MAX_SPINS)
    if (FIRST <= 5) and (LAST > 5):  # out = h1 + a W_down^T + b
        for i in range(pid, D_TILES * M_TILES * D_SPLIT, programs):
            t = i // D_SPLIT
            _linear_tile(a_ptr, wd_ptr, bd_ptr, h1_ptr, out_ptr, part_ptr, count_ptr, pos_ptr, freq_ptr, qkn_ptr,
                         t % D_TILES, t // D_TILES, i % D_SPLIT, t, M, H, I, D_KPER, 0., 0, 0, 1., 0.,
                         I, I, H, H, False, False, D_BIAS, True, False, False, D_BN, D_SPLIT, BLOCK_M, D_BN,
                         BLOCK_K, PRECISION)
        if PREFETCH:  # the next layer's W_qkv: its launch starts from L2
            _prefetch_items(wqkv_next_ptr, pid, programs, QKV_TILES, QKV_SPLIT, QKV_KPER, NQKV, H, H, True, True,
                            D // 2, QKV_BN, BLOCK_K, QKV_KPER // BLOCK_K)
    if barriers > 0:  # the last program out resets the barrier for the next launch (nobody polls it any more)
        if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel") == programs - 1:
            tl.atomic_xchg(sync_ptr, 0)
            tl.atomic_xchg(sync_ptr + 1, 0)


def gemm_phase(M, N, K, pair, programs, block_n, rope=False):
    """(BLOCK_N, SPLIT, K_PER, n tiles) of a GEMM phase, its items in one round (at most one a program: a second
    round is a tail the phase waits for): block_n columns a tile (a pair: two W rows each), doubled while there are
    more tiles than programs (not with RoPE: a tile is inside a head half), then K split in powers of two while
    twice the items still fit and each split keeps >= 2 steps"""
    while not rope and triton.cdiv(N, block_n) > programs and block_n < 128:
        block_n *= 2
    tiles = triton.cdiv(N, block_n)
    split = 1
    while tiles * split * 2 <= programs * ROUNDS and triton.cdiv(K, GEMM_BLOCK_K) >= 4 * split:
        split *= 2
    return block_n, split, triton.cdiv(triton.cdiv(K, split), GEMM_BLOCK_K) * GEMM_BLOCK_K, tiles


def stages_that_fit(BM, phases):
    """NUM_STAGES, or fewer where a phase's x and W tiles (BM + BLOCK_N, twice for a pair, by BLOCK_K) a stage would
    pass 200 KB of shared memory; phases: (BLOCK_N, pair) each"""
    return min(NUM_STAGES, 200 * 1024 // max((BM + bn * (2 if pair else 1)) * GEMM_BLOCK_K * 2 for bn, pair in phases))


def attention_splits(n, kvh, programs):
    """key splits per (slot, K/V head): about two items a program"""
    return max(1, min(64, triton.next_power_of_2(triton.cdiv(2 * programs, n * kvh))))


RESIDENT = {}  # (device, launch constants) -> programs of the layer kernel the GPU holds at once


def resident_programs(device, args, const):
    """PROGRAMS_PER_SM an SM, or as many as fit one SM's registers, shared memory and warps (a grid barrier needs
    every program resident), times the SMs: the kernel is compiled first (warmup) to know what it uses"""
    key = (device, tuple(sorted(const.items())))
    if key not in RESIDENT:
        props = torch.cuda.get_device_properties(device)
        kernel = _decode_layer_kernel.warmup(*args, **const, FIRST=0, LAST=6, grid=(1,))
        kernel._init_handles()  # (n_regs is read when the binary is loaded)
        warps = const["num_warps"]
        by_regs = 65536 // (triton.cdiv(kernel.n_regs * 32, 256) * 256 * warps)  # (allocated 256 a warp at a time)
        by_smem = props.shared_memory_per_multiprocessor // (kernel.metadata.shared + 1024)  # (1 KB: the system's)
        RESIDENT[key] = max(1, min(PROGRAMS_PER_SM, by_regs, by_smem, 64 // warps)) * props.multi_processor_count
    return RESIDENT[key]


def sync_counters(device):
    """the device's int32 [arrivals, programs done, timed-out barriers], allocated once (CUDA graphs keep it)"""
    key = (device.type, device.index or 0)
    if key not in SYNC:
        SYNC[key] = torch.zeros(4, dtype=torch.int32, device=device)
    return SYNC[key]


def decode_layer_triton(h, w, caches, st, rope, eps, programs=None, phases=None, w_qkv_next=None):
    """one layer of decode_forward in one launch (on the CPU, TRITON_INTERPRET: one launch a phase). h (n, H);
    w = (w_qkv, b_qkv, w_o, b_o, w_gu, b_gu, w_down, b_down) (the RMSNorms' weights folded into w_qkv and w_gu:
    decode_gemm.fold_norm); caches = (pk, pv, ck, cv); st: rows, done, start, slot (the decode state), G, pos (n,);
    rope = (inv_freq (D/2,), scale, n_q, n_kv, [q_norm; k_norm] (2D,) or None, its eps, attention scale);
    eps = (input norm's, post-attention norm's). Writes this step's K/V into ck/cv. -> (n, H). programs: the grid
    (default: what is resident); phases: the launches' [first, last) phase ranges (default: all in one; one a
    launch in the interpreter); w_qkv_next: the next layer's W_qkv, prefetched into L2 at the end (PREFETCH)"""
    w_qkv, b_qkv, w_o, b_o, w_gu, b_gu, w_down, b_down = w
    pk, pv, ck, cv = caches
    inv_freq, rope_scale, nq, nk, qkn, qk_eps, scale = rope
    (M, H), D, I, dev = h.shape, pk.shape[3], w_gu.shape[0] // 2, h.device
    NQKV = w_qkv.shape[0]
    assert h.is_contiguous() and all(t.is_contiguous() for t in w if t is not None) and pk.stride() == pv.stride() \
        and ck.stride() == cv.stride() and pk.stride(3) == ck.stride(3) == 1
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or dev.type != "cuda"
    BM = max(16, min(128, triton.next_power_of_2(M)))
    m_tiles = triton.cdiv(M, BM)
    dummy = w_qkv  # (pointers a disabled branch never reads)

    def launch(programs):  # the kernel's arguments and constants for a grid of this many programs
        S = attention_splits(M, nk, programs)
        qkv_bn = D // 2 if qkn is not None else min(D // 2, ROPE_BLOCK_N)  # (the q/k norms need the whole head)
        phases = dict(QKV=gemm_phase(M, NQKV // 2, H, True, programs, qkv_bn, rope=True),
                      O=gemm_phase(M, H, nq * D, False, programs, BLOCK_N),
                      GU=gemm_phase(M, I, H, True, programs, BLOCK_N_PAIR),
                      D=gemm_phase(M, H, I, False, programs, BLOCK_N))
        part_size = max(tiles * m_tiles * split * BM * (2 * bn + 1) for bn, split, _, tiles in phases.values())
        qkv, o, h1, a, out = (torch.empty(M, n, dtype=h.dtype, device=dev) for n in (NQKV, nq * D, H, I, H))
        att_o = torch.empty(M, nq, S, D, dtype=torch.float32, device=dev)  # the attention splits' partials
        lse = torch.empty(M, nq, S, dtype=torch.float32, device=dev)
        part = torch.empty(part_size, dtype=torch.float32, device=dev)  # the GEMMs' split-K partials
        count = counters(dev, max(tiles * m_tiles for _, _, _, tiles in phases.values()))
        args = [h, qkv, o, h1, a, out, w_qkv, dummy if b_qkv is None else b_qkv, w_o, dummy if b_o is None else b_o,
                w_gu, dummy if b_gu is None else b_gu, w_down, dummy if b_down is None else b_down,
                w_qkv if w_qkv_next is None else w_qkv_next, st.pos, inv_freq, dummy if qkn is None else qkn,
                pk, pv, ck, cv, st.rows, st.done, st.start, st.slot,
                att_o, lse, part, count, sync_counters(dev), M, H, I, NQKV, nq, nk, st.G, pk.shape[2], eps[0], eps[1],
                rope_scale, qk_eps, scale * 1.4426950408889634, PREFETCH_STEPS]
        for k in ("QKV", "O", "GU", "D"):
            args += [phases[k][3], phases[k][2]]
        args += [m_tiles, *pk.stride()[:3], *ck.stride()[:3]]
        const = dict(QKV_BIAS=b_qkv is not None, O_BIAS=b_o is not None, GU_BIAS=b_gu is not None,
                     D_BIAS=b_down is not None, QK_NORM=qkn is not None, D=D, QPK=nq // nk,
                     QPK_PAD=max(16, triton.next_power_of_2(nq // nk)), ATT_SPLITS=S,
                     **{f"{k}_SPLIT": phases[k][1] for k in phases}, **{f"{k}_BN": phases[k][0] for k in phases},
                     BLOCK_M=BM, BLOCK_K=GEMM_BLOCK_K, ATT_BLOCK=ATTN_BLOCK_N, MAX_SPINS=MAX_SPINS,
                     PREFETCH=PREFETCH and not interpret,
                     PRECISION="ieee" if h.dtype == torch.float32 else "tf32", num_warps=NUM_WARPS,
                     num_stages=stages_that_fit(BM, [(phases[k][0], k in ("QKV", "GU")) for k in phases]))
        return args, const, out
    if interpret:
        programs = programs or 3
    elif programs is None:  # as many as are resident at once (what the first guess compiles to says)
        programs = PROGRAMS_PER_SM * torch.cuda.get_device_properties(dev).multi_processor_count
        programs = min(programs, resident_programs(dev, *launch(programs)[:2]))
    args, const, out = launch(programs)
    phases = phases or ([(p, p + 1) for p in range(6)] if interpret else [(0, 6)])
    for first, last in phases:
        _decode_layer_kernel[(programs,)](*args, **const, FIRST=first, LAST=last)
    return out


def decode_layer_torch(h, w, caches, st, rope, eps):
    """reference (and the CPU path): decode_forward's layer in the model's ops, on the same (folded) weights"""
    w_qkv, b_qkv, w_o, b_o, w_gu, b_gu, w_down, b_down = w
    inv_freq, rope_scale, nq, nk, qkn, qk_eps, scale = rope
    M, D = h.shape[0], caches[0].shape[3]
    ones = torch.ones(h.shape[1], dtype=h.dtype, device=h.device)  # (the norms' weights are in W)
    qkv = decode_linear_torch(h, w_qkv, b_qkv, ones, None, eps[0], False,
                              (st.pos, inv_freq, rope_scale, nq, nk, qkn, qk_eps))
    q, k, v = qkv.split([nq * D, nk * D, nk * D], -1)
    o = decode_attention_torch(q.reshape(M, nq, 1, D), k.reshape(M, nk, 1, D), v.reshape(M, nk, 1, D), caches,
                               st, scale)
    h1 = decode_linear_torch(o.reshape(M, nq * D), w_o, b_o, residual=h)
    a = decode_linear_torch(h1, w_gu, b_gu, ones, None, eps[1], True)
    return decode_linear_torch(a, w_down, b_down, residual=h1)


@torch.library.custom_op("nanogrpo::decode_layer", mutates_args=("ck", "cv"))
def decode_layer_op(h: torch.Tensor, w_qkv: torch.Tensor, b_qkv: Optional[torch.Tensor], w_o: torch.Tensor,
                    b_o: Optional[torch.Tensor], w_gu: torch.Tensor, b_gu: Optional[torch.Tensor],
                    w_down: torch.Tensor, b_down: Optional[torch.Tensor], pk: torch.Tensor, pv: torch.Tensor,
                    ck: torch.Tensor, cv: torch.Tensor, rows: torch.Tensor, done: torch.Tensor, start: torch.Tensor,
                    slot: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, qk_norm: Optional[torch.Tensor],
                    heads: List[int], G: int, eps_attn: float, eps_mlp: float, rope_scale: float, qk_eps: float,
                    scale: float, impl: str, w_qkv_next: Optional[torch.Tensor] = None) -> torch.Tensor:
    """decode_layer_triton (impl "triton") or decode_layer_torch as a torch op, so that torch.compile keeps the
    one-graph decode with it inside (it knows the op writes ck/cv). h (n, 1, H) -> (n, 1, H); w_qkv_next: the next
    layer's, prefetched into L2"""
    from types import SimpleNamespace
    st = SimpleNamespace(rows=rows, done=done, start=start, slot=slot, G=G, pos=pos.reshape(-1))
    args = (h.reshape(h.shape[0], -1).contiguous(), (w_qkv, b_qkv, w_o, b_o, w_gu, b_gu, w_down, b_down),
            (pk, pv, ck, cv), st, (inv_freq, rope_scale, heads[0], heads[1], qk_norm, qk_eps, scale),
            (eps_attn, eps_mlp))
    out = decode_layer_triton(*args, w_qkv_next=w_qkv_next) if impl == "triton" else decode_layer_torch(*args)
    return out.view(h.shape)


@decode_layer_op.register_fake
def _(h, w_qkv, b_qkv, w_o, b_o, w_gu, b_gu, w_down, b_down, pk, pv, ck, cv, rows, done, start, slot, pos, inv_freq,
      qk_norm, heads, G, eps_attn, eps_mlp, rope_scale, qk_eps, scale, impl, w_qkv_next=None):
    return torch.empty_like(h)
