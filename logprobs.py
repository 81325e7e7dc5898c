"""
Per-token log-probs and entropies of the LM head, three ways behind one signature (math: kernel.py):
    token_logprobs(hidden, weight, targets, temperature, entropy, impl="fused") -> (logp, ent)
    naive    full (N, V) logits, fp32 after the matmul, the way TRL does it: simple, O(N*V) memory.
    chunked  torch, C rows of fp32 logits at a time, recomputed in backward; dW accumulates in the
             weight's dtype chunk by chunk, as in Liger. Runs anywhere: the CPU choice.
    fused    kernel.fused_logprobs: Triton, logits never leave registers, fp32 accumulation. Where
             it cannot run, a RuntimeError says to pass impl="chunked" (no silent fallback).
`python bench_logprobs.py` benchmarks them against its `reference` (fp32 on a GPU, fp64 on a CPU).
"""
import torch

from kernel import check_inputs, fused_logprobs

CHUNK_BYTES = 512 * 2**20  # chunked impl: fp32 logits per row chunk


def _logits(hidden, weight, temperature):
    # (n, H) @ (H, V) in the input dtype (tensor cores), then fp32: what lm_head + .float() gives.
    return (hidden @ weight.t()).float() / temperature


def naive_logprobs(hidden, weight, targets, temperature=1.0, entropy=True):
    check_inputs(hidden, weight, targets, temperature)
    z = _logits(hidden, weight, temperature)  # (..., V) fp32, all of it
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - lse
    ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if entropy else None  # as TRL computes it
    return logp, ent


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, entropy):
        # hidden (N, H), weight (V, H), targets (N,) int64
        ctx.set_materialize_grads(False)
        N, C = hidden.shape[0], max(1, CHUNK_BYTES // (4 * weight.shape[0]))  # (C, V) fp32
        logp = hidden.new_empty(N, dtype=torch.float32)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if entropy else None
        for r0 in range(0, N, C):
            z = _logits(hidden[r0:r0 + C], weight, temperature)  # (C, V) fp32
            lse_c = torch.logsumexp(z, dim=-1)
            logp[r0:r0 + C] = z.gather(1, targets[r0:r0 + C, None])[:, 0] - lse_c
            lse[r0:r0 + C] = lse_c
            if entropy:  # -sum p log p: no cancellation of two large terms under a common offset
                logp_all = z - lse_c[:, None]
                ent[r0:r0 + C] = -(logp_all.exp() * logp_all).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature = temperature
        ctx.chunk = C
        return logp, ent

    @staticmethod
    def backward(ctx, g, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        T = ctx.temperature
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dH = torch.zeros_like(hidden) if need_dh else None
        dW = torch.zeros_like(weight) if need_dw else None
        if g is None and g_ent is None:
            return dH, dW, None, None, None
        N, C = hidden.shape[0], ctx.chunk
        for r0 in range(0, N, C):
            h_c, sl = hidden[r0:r0 + C], slice(r0, r0 + C)
            logp_all = _logits(h_c, weight, T) - lse[sl, None]  # (C, V) log p
            p = logp_all.exp()
            dz = torch.zeros_like(p)
            if g is not None:  # g * (onehot - p)
                dz -= g[sl, None] * p
                dz.scatter_add_(1, targets[sl, None], g[sl, None].float())
            if g_ent is not None:  # -g_ent * p * (z - sum p z) = -g_ent * p * (log p + ent)
                dz -= g_ent[sl, None] * p * (logp_all + ent[sl, None])
            dz = (dz / T).to(hidden.dtype)
            if need_dh:
                dH[sl] = dz @ weight
            if need_dw:
                dW.addmm_(dz.t(), h_c)
        return dH, dW, None, None, None


def chunked_logprobs(hidden, weight, targets, temperature=1.0, entropy=True):
    check_inputs(hidden, weight, targets, temperature)
    shape = targets.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    t1 = targets.reshape(-1).to(torch.int64).contiguous()  # (N,)
    logp, ent = _ChunkedLogprobs.apply(h2, weight, t1, float(temperature), bool(entropy))
    return logp.view(shape), (ent.view(shape) if ent is not None else None)


IMPLS = {"naive": naive_logprobs, "chunked": chunked_logprobs, "fused": fused_logprobs}


def token_logprobs(hidden, weight, targets, temperature=1.0, entropy=True, impl="fused"):
    """Dispatch to one of IMPLS; same signature and return as kernel.fused_logprobs."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {sorted(IMPLS)}, got {impl!r}")
    return IMPLS[impl](hidden, weight, targets, temperature, entropy)

