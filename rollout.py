"""
Rollouts: G completions per prompt, sampled at reasoning lengths near the memory-bandwidth limit.

A decode step of B*G rows must read every weight once plus every live row's K/V. Three things decide how close we get:

1. Attention reads only what exists, once. Each prompt is prefilled once and its K/V stay as they are, (B, kvh, P, D),
   shared by its G rows; each row's own tokens go into a completion cache (B*G, kvh, T, D). decode_kernels.py's
   split-K Triton kernel walks the prompt's real columns and the row's written columns only (GQA inside the kernel,
   no repeat), and applies RoPE to q and this step's key and writes them into the cache on the way.
2. Finished rows stop costing. Rows live in "slots"; slot i decodes cache row rows[i]. Every CHECK_EVERY steps the
   host reads which rows are done; when the live ones fit a bucket of half the slots or fewer (powers of two), they
   are compacted into a smaller batch with its own captured graph. Finished rows never run attention (the kernel
   skips them), and after a compaction they skip the matmuls too. No K/V is copied: only the slot -> row map moves.
3. Few GEMMs. At decode, M = live rows (8-128), and a cuBLAS GEMM costs 4-7 us whatever its size, so the count of
   GEMMs matters more than their bytes: decode_forward runs the model's own modules (embedding, RoPE, norms,
   o_proj, activation, down_proj, LM head) but q|k|v as one GEMM and gate|up as another, on weights concatenated
   once per call (FUSE; 7 GEMMs a layer become 4). DECODE_GEMM = "cuda" runs those 4 as decode_cuda's kernels in
   buckets of up to CUDA_GEMM_MAX_ROWS slots: each loads its weights before the PDL wait, so they stream while the
   kernel before still runs, with the norm, SiLU-mul and residual add in the same launch. DECODE_GEMM = "triton"
   runs them as decode_gemm's decode_linear (RoPE too) in buckets of up to TRITON_GEMM_MAX_ROWS slots. Both are
   opt-in; larger buckets run cuBLAS.

Each decode step (model forward, sampling, bookkeeping) is one CUDA graph replay; the host only checks "done" every
CHECK_EVERY steps. Sampling needs no host sync either (decode_kernels.py: inverse-CDF Triton kernels, or torch ops
behind HF's top-k/top-p warpers). On CUDA, for rollouts of COMPILE_MIN_TOKENS or more, the forward is
torch.compile'd, which fuses the ~30 small elementwise kernels a layer runs in eager mode (RMSNorm, RoPE, SiLU,
residuals) into a handful; in three parts shared by all layers (decode_forward), so it compiles in ~10-30 s at any
depth. Sampling sets training's forward hooks aside (gradient checkpointing's, FSDP2's); a model
torch.compile cannot trace decodes uncompiled, said in one printed line (LAST["compiled"], LAST["compile_error"]).

The model keeps its transformers modules; the decode attention is registered as "nanogrpo_decode" (the model's own
forward runs on it when FUSE is off or the layers are not llama/qwen2/qwen3-shaped), so any llama/qwen2/qwen3-style
checkpoint works, and other models (sliding window, other attention) fall back to model.generate with the same
outputs.

    generate_groups(model, prompt_ids, prompt_mask, group_size, max_new_tokens, temperature=1.0, top_p=1.0,
                    top_k=0, eos_token_id=None, pad_token_id=None) -> (completion_ids, completion_mask) (B*G, C)
"""
import contextlib
import sys
import warnings
import weakref
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import triton
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import decode_cuda  # (registers the op nanogrpo::decode_linear_cuda)
from decode_gemm import decode_linear_op, fold_norm, rms_norm_torch  # noqa: F401 (decode_linear_op: registers the op)
import decode_kernels
from decode_kernels import decode_attention_op, record, sample, sample_triton
from kv_reuse import positions, reuse_unsupported, trim_left_padding
from lora import effective_weight

CUDA_GRAPH = True  # on CUDA: capture each decode step (forward + sampling) as a graph and replay it per token
CHECK_EVERY = 8  # decode steps between host reads of "which rows are done" (a sync that drains the launch queue)
MIN_BUCKET = 8  # compaction never goes below this many slots
COMPACT_MIN_STEPS = 32  # compact only if at least this many steps may remain (a capture costs ~2 steps)
ATTENTION = "auto"  # decode attention: triton | torch | auto (triton on CUDA, torch elsewhere)
SAMPLER = "auto"  # triton (inverse-CDF kernels; temperature only) | torch (any top-k/top-p) | auto: triton if it can
COMPILE = True  # torch.compile the decode forward (fuses norms, RoPE, MLP; attention stays ours)...
COMPILE_MIN_TOKENS = 128  # ...from this many new tokens on: the first compile costs ~10-30 s once a process (26 s
#                          at the 28-layer 1.5B shape on an H200, in decode_forward's parts) and a step saves ~2 ms
#                          (0.5B, 256 rows: 2.3-2.8 ms against 4.0-4.6), repaid after ~40-75 rollouts of 128 tokens.
#                          The default run (64 tokens, 0.90 in 1-3 minutes) stays on CUDA graphs alone
COMPILE_BACKEND = "inductor"  # on CUDA; on the CPU only another backend compiles (tests: aot_eager, no C++ compiler)
FUSE = True  # decode with q|k|v and gate|up as one GEMM each (decode_forward); False: the model's own forward
DECODE_GEMM = "torch"  # decode_forward's GEMMs: torch (cuBLAS; the compiler fuses norms, SiLU, residuals around them)
#                | cuda (decode_cuda.decode_linear_cuda: W loaded before the PDL wait, the norm, SiLU*up and residual
#                  in the launch; Hopper, bf16; buckets of up to CUDA_GEMM_MAX_ROWS slots, larger ones the default)
#                | triton (decode_gemm.decode_linear: RMSNorm, RoPE, SiLU*up, residual inside the GEMM's launch,
#                  for buckets of up to TRITON_GEMM_MAX_ROWS slots; larger ones run cuBLAS on the same weights)
TRITON_GEMM_MAX_ROWS = 16  # H200, both with PDL, one process: with decode_linear a step at 1.5B took 1.71 / 1.65 ms
#                            at 16 / 8 rows against 1.75 / 1.69; at 0.5B 1.06 / 1.02 against 1.05 / 1.02, and at
#                            32 rows 1.54 against 1.12 (BENCHMARKS, "The triton GEMMs under PDL")
CUDA_GEMM_MAX_ROWS = 8  # (decode_cuda.MAX_ROWS = 16 at most) H200, a step with all four GEMMs in CUDA against the
#                          default: 8 rows -22% at 0.5B, -14% at 1.5B; 16 rows +1% and +14% (BENCHMARKS, "x and its
#                          RMSNorm in one pass", "The attention in a small step")
CUDA_GEMMS = ("qkv", "o", "gate_up", "down")  # which of a layer's GEMMs run decode_cuda's kernels (the rest cuBLAS)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # rope types whose inv_freq never changes (not dynamic NTK)
LAST = {}  # the last call's decode statistics: buckets visited, steps, attention impl, decode path (tests, benchmarks)

DECODE_STATE = []  # the decode state of the step being run (or captured): caches, slot -> row map, column


@torch.compiler.disable  # under COMPILE the launches stay as they are (the CUDA graph captures them anyway)
def decode_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers attention function for a decode step, registered as "nanogrpo_decode" (the model's own forward,
    FUSE off): key/value are this step's K/V (n, kvh, 1, D) after RoPE, the caches and the slot -> row map come from
    DECODE_STATE (set by decode_step; a global rather than a forward argument, so that torch.compile never sees,
    guards on or re-traces it), then the op above. attention_mask is None: transformers builds no mask for an
    attention it does not know."""
    st = DECODE_STATE[-1]
    pk, pv, ck, cv = st.layers[module.layer_idx]
    return decode_attention_op(query, key, value, pk, pv, ck, cv, st.rows, st.done, st.start, st.slot, st.G, scaling,
                               st.impl), None


AttentionInterface.register("nanogrpo_decode", decode_attention)


@contextlib.contextmanager
def decode_step(model, st):
    """inside, the model's attention is "nanogrpo_decode" on state st (HF reads config._attn_implementation at
    every forward)"""
    impl = model.config._attn_implementation
    model.config._attn_implementation = "nanogrpo_decode"
    DECODE_STATE.append(st)
    try:
        yield
    finally:
        DECODE_STATE.pop()
        model.config._attn_implementation = impl


# ----------------------------------------------------------------------------------------------------------------
# sampling, graphs, fallback


def make_warpers(temperature, top_p, top_k):
    """HF generate's order: temperature, top-k, top-p; None means greedy"""
    if temperature == 0:
        return None
    warpers = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
    warpers += [TopKLogitsWarper(top_k)] if top_k > 0 else []
    return warpers + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])


CAPTURE = {}  # device index -> [side stream, latest decode graph], reused by the next capture (see graphed)


def graphed(fn, warmup):
    """fn() captured as a CUDA graph: returns replay(). warmup() runs first on the side stream (lazy cuBLAS/Triton
    setup must not happen inside a capture) and must leave no state behind that the real step would not overwrite.
    capture_begin/end rather than `with torch.cuda.graph()`: that one empties the allocator's cache before every
    capture, so the training step after each generation re-allocated its whole working set (+15% update time in the
    trainer). One side stream and one memory pool per device, reused by every capture: the caching allocator keeps
    freed blocks per stream, so a new stream per call stranded the warm-up's memory (+0.75 GiB reserved per call).
    Graphs that share a pool must not run concurrently: ours run one after another (bucket after bucket)."""
    dev = torch.cuda.current_device()
    if dev not in CAPTURE:
        CAPTURE[dev] = [torch.cuda.Stream(), None]
    side, prev = CAPTURE[dev]
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warmup()
        graph.capture_begin(*(() if prev is None else (prev.pool(),)))
        try:
            fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    CAPTURE[dev][1] = graph  # the previous graph is freed when its caller drops it; the pool lives on in this one
    return graph.replay


@torch.no_grad()
def hf_generate_groups(model, prompt_ids, prompt_mask, G, max_new_tokens, temperature, top_p, top_k, eos, pad,
                       return_logprobs=False):
    """generate_groups' fallback for models its decode cannot handle: model.generate, same output format"""
    if temperature > 0:
        how = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k, num_return_sequences=G)
    else:  # greedy: the G rows of a group are equal; HF refuses num_return_sequences > 1 without sampling
        how = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    with sampling(model):
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=max_new_tokens,
                             eos_token_id=eos.tolist(), pad_token_id=pad, return_dict_in_generate=True,
                             output_scores=return_logprobs, **how)
    ids = out.sequences[:, prompt_ids.shape[1]:]  # (B*G, T), rows b*G + g (greedy: (B, T))
    logps = None if not return_logprobs else torch.stack(out.scores, 1).float().log_softmax(-1).gather(
        2, ids[..., None]).squeeze(2)  # scores: the logits after HF's warpers, one (rows, V) per step
    if temperature == 0:
        ids, logps = ids.repeat_interleave(G, 0), logps if logps is None else logps.repeat_interleave(G, 0)
    is_eos = torch.isin(ids, eos)
    ended = is_eos.long().cumsum(1)
    keep = ((ended == 0) | ((ended == 1) & is_eos)).long()  # up to and including the first EOS
    n = int(keep.sum(1).max())
    out = (ids[:, :n].masked_fill(keep[:, :n] == 0, pad), keep[:, :n])
    return out + ((logps[:, :n].masked_fill(keep[:, :n] == 0, 0),) if return_logprobs else ())


def model_forward(model, tok, pos):
    """one decode step's logits (n, V) for tokens tok (n, 1) at positions pos (n, 1)"""
    out = model(input_ids=tok, position_ids=pos, use_cache=False, logits_to_keep=1)
    return out.logits[:, -1]


def fuse_projections(model):
    """per layer (w_qkv, b_qkv, w_gate_up, b_gate_up, w_o, b_o, w_down, b_down): q/k/v and gate/up weights
    concatenated along the output dim, o_proj's and down_proj's as they are, for decode_forward; None if the model's
    layers are not the llama/qwen2/qwen3 shape it assumes. At decode the GEMMs have M = live rows (8-128), where a
    cuBLAS call costs 4-7 us whatever its size: k_proj and v_proj (0.2 MB each at the 0.5B shape) cost as much as
    q_proj. One GEMM per group saves 3 of 7 per layer. A copy per call (weights change every training step): + the
    q/k/v and MLP-input weights' bytes while sampling. A LoRA projection is folded here, W + (alpha/r) B A, once per
    rollout (lora.effective_weight), so a decode step costs what it costs without LoRA; any other wrapped, quantized
    or re-implemented projection computes more than x @ W^T + b, so such a model keeps its own forward (None)."""
    cat_bias = lambda wbs: None if all(b is None for _, b in wbs) else torch.cat(  # noqa: E731
        [b if b is not None else w.new_zeros(w.shape[0]) for w, b in wbs])
    fused = []
    for layer in model.model.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")) or \
                not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return None
        wbs = [effective_weight(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj,
                                              attn.o_proj, mlp.down_proj)]
        if any(wb is None for wb in wbs):
            return None
        qkv, gu, (w_o, b_o), (w_down, b_down) = wbs[:3], wbs[3:5], wbs[5], wbs[6]
        fused.append((torch.cat([w for w, _ in qkv]), cat_bias(qkv), torch.cat([w for w, _ in gu]), cat_bias(gu),
                      w_o, b_o, w_down, b_down))
    return fused


def gemms_fit(model, fused, device, gemm):
    """decode_forward's GEMMs may be decode_gemm's or decode_cuda's (gemm: DECODE_GEMM triton or cuda): their
    prologue is transformers' RMSNorm (weight * x / rms, eps variance_epsilon), their epilogue SiLU(gate) * up, their
    inputs and the weights they read (fuse_projections': a LoRA adapter folded in) one dtype, no autocast; cuda's
    also a Hopper GPU and bf16 (decode_cuda.unsupported)"""
    norms = [m for layer in model.model.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    dt = model.model.embed_tokens.weight.dtype
    return (getattr(model.config, "hidden_act", None) == "silu" and not torch.is_autocast_enabled(device.type)
            and not (gemm == "cuda" and decode_cuda.unsupported(device, dt))
            and all(type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and m.weight.dtype == dt
                    for m in norms)
            and all(t is None or t.dtype == dt for layer in fused for t in layer))


def project(st, x, w, b, norm=None, act=None, residual=None, name=""):
    """one decode GEMM with its neighbours: residual + act(norm(x) @ W^T + b), act(y) = act_fn(gate) * up on W's
    two halves [gate; up]. st.gemm "triton" or "cuda" (for the GEMMs named in CUDA_GEMMS): one launch of
    decode_gemm's or decode_cuda's (name: qkv, o, gate_up or down); else the model's modules and F.linear
    ("folded": on the triton path's weights, the norm's weight in W: the norm without it)"""
    if st.gemm == "cuda" and name in CUDA_GEMMS:
        return torch.ops.nanogrpo.decode_linear_cuda(x, w, b, None if norm is None else norm.weight, residual,
                                                     0. if norm is None else norm.variance_epsilon, act is not None)
    if st.gemm == "triton":
        return torch.ops.nanogrpo.decode_linear(x, w, b, norm is not None, residual,  # (W: the norm's weight in)
                                                0. if norm is None else norm.variance_epsilon, act is not None,
                                                "triton")
    if norm is not None:  # ("folded": W has the norm's weight in it, so the norm runs without it)
        x = norm(x) if st.gemm == "torch" else rms_norm_torch(x, None, norm.variance_epsilon)
    y = F.linear(x, w, b)
    if act is not None:
        gate, up = y.chunk(2, -1)
        y = act(gate) * up
    return y if residual is None else residual + y


def epilogue_rope(model, device):
    """what decode_linear needs to apply RoPE in q|k|v's epilogue (DECODE_GEMM triton), as decode-state fields:
    rope = (inv_freq, scale), qk_norms = [q_norm; k_norm] (2D,) per layer (qwen3; else None) and their eps; None
    where the model's RoPE stays: a rope type whose inv_freq changes with the length (dynamic NTK), or on a GPU a
    head half under 16 columns (it is a tile, and tl.dot wants >= 16)"""
    rotary, attns = model.model.rotary_emb, [layer.self_attn for layer in model.model.layers]
    if getattr(rotary, "rope_type", "default") not in STATIC_ROPE or (device.type == "cuda" and attns[0].head_dim < 32):
        return None
    return dict(rope=(rotary.inv_freq.float(), float(rotary.attention_scaling)),
                qk_norms=[torch.cat([a.q_norm.weight, a.k_norm.weight]) if hasattr(a, "q_norm") else None
                          for a in attns],
                qk_eps=getattr(getattr(attns[0], "q_norm", None), "variance_epsilon", 0.))


def rope_in_attention(model):
    """whether the attention op may apply the model's RoPE: its own apply_rotary_pos_emb is rope_torch's formula
    (decode_kernels.rope_matches: rotate-half on whole heads, as llama/qwen2/qwen3). Then decode_forward hands the
    op (cos, sin) and q|k|v unrotated, and a layer runs no RoPE kernel (H200: BENCHMARKS, "RoPE in the attention")"""
    attn = model.model.layers[0].self_attn
    return decode_kernels.rope_matches(getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None),
                                       attn.head_dim)


def attention_inputs(st, layer, h, w_qkv, b_qkv, qk_norm, pos, cos, sin):
    """the layer's q (n, h, 1, D), k and v (n, kvh, 1, D) at a decode step: q|k|v of the normed h, the q/k norms
    (qwen3), RoPE (unless st.rope_attn: the attention op applies it). With the triton GEMMs and a static RoPE
    (st.rope: inv_freq, scale; qk_norm: the layer's [q_norm; k_norm] or None) all of it is one launch"""
    attn, norm = layer.self_attn, layer.input_layernorm
    n, D = h.shape[0], attn.head_dim
    sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
    heads = lambda q, k, v: [t.view(n, 1, -1, D).transpose(1, 2) for t in (q, k, v)]  # noqa: E731
    if st.gemm == "triton" and st.rope is not None:
        qkv = torch.ops.nanogrpo.decode_linear(h, w_qkv, b_qkv, True, None, norm.variance_epsilon, False,
                                               "triton", pos, st.rope[0], qk_norm,
                                               [sizes[0] // D, sizes[1] // D], st.rope[1], st.qk_eps)
        return heads(*qkv.split(sizes, -1))
    q, k, v = heads(*project(st, h, w_qkv, b_qkv, norm=norm, name="qkv").split(sizes, -1))
    if hasattr(attn, "q_norm"):  # qwen3: RMSNorm per head before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)  # (over the last dim, D)
    if st.rope_attn:  # the attention op applies RoPE (no launch of its own)
        return q, k, v
    q, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def mlp_block(st, layer, w, o, h):
    """after a layer's attention output o (n, 1, h, D): h + o_proj(o), then + its MLP on that; the new h (n, 1, H)"""
    _, _, w_gu, b_gu, w_o, b_o, w_down, b_down = w
    h = project(st, o.reshape(h.shape[0], 1, -1).to(h.dtype), w_o, b_o, residual=h, name="o")
    a = project(st, h, w_gu, b_gu, norm=layer.post_attention_layernorm, act=layer.mlp.act_fn, name="gate_up")
    return project(st, a, w_down, b_down, residual=h, name="down")  # (a: (n, 1, I))


def decode_first(model, st, layer, w, qk_norm, tok, pos):
    """the embedding, RoPE's (cos, sin) and layer 0's attention inputs: (h, cos, sin, q, k, v)"""
    h = model.model.embed_tokens(tok)  # (n, 1, H)
    cos, sin = model.model.rotary_emb(h, pos)
    return (h, cos, sin) + tuple(attention_inputs(st, layer, h, w[0], w[1], qk_norm, pos, cos, sin))


def decode_between(st, layer, w, o, h, nxt, w_nxt, qk_norm, pos, cos, sin):
    """a layer's o_proj and MLP, then the next layer's attention inputs: (h, q, k, v)"""
    h = mlp_block(st, layer, w, o, h)
    return (h,) + tuple(attention_inputs(st, nxt, h, w_nxt[0], w_nxt[1], qk_norm, pos, cos, sin))


def decode_last(model, st, layer, w, o, h):
    """the last layer's o_proj and MLP, the final norm, the LM head: (n, V) logits"""
    return model.lm_head(model.model.norm(mlp_block(st, layer, w, o, h)))[:, -1]


DECODE_PARTS = (decode_first, decode_between, decode_last)


def decode_forward(model, fused, st, tok, pos, compiled=False):
    """model_forward for one decode step with fused projections: the model's own modules (embedding, RoPE,
    RMSNorms, q/k norms, activation, LM head) in the order its forward calls them, but q|k|v = x @ W_qkv^T + b_qkv
    and gate|up = x @ W_gu^T + b_gu as one GEMM each, o_proj and down_proj on their weights from fuse_projections
    (a LoRA adapter folded in), and the attention as the op nanogrpo::decode_attention on the decode state st
    (caches, slot -> row map, column). (n, V) logits.
    In parts cut at the attention ops, which no compiler fuses across anyway: decode_first, then per layer the
    attention and decode_between (its o_proj and MLP with the next layer's norm, q|k|v and RoPE, so a residual add
    and the next norm still fuse), decode_last. compiled: each part through torch.compile (run_compiled), one graph
    each; the layers' parts are one function on each layer's weights, so three compiles serve any depth (BENCHMARKS,
    "The decode forward compiled in parts": 26 s at 1.5B against 148 s as one graph, a step as fast)."""
    call = run_compiled if compiled else (lambda fn, *args: fn(*args))
    layers, L = model.model.layers, len(fused)
    qk_norms = getattr(st, "qk_norms", None) or [None] * L  # (the triton GEMMs' RoPE epilogue: qwen3's q/k norms)
    h, cos, sin, q, k, v = call(decode_first, model, st, layers[0], fused[0], qk_norms[0], tok, pos)
    for i, (pk, pv, ck, cv) in enumerate(st.layers):
        o = torch.ops.nanogrpo.decode_attention(q, k, v, pk, pv, ck, cv, st.rows, st.done, st.start, st.slot,
                                                st.G, layers[i].self_attn.scaling, st.impl,
                                                *((cos, sin) if st.rope_attn else ()))  # (n, 1, h, D)
        if i == L - 1:
            return call(decode_last, model, st, layers[i], fused[i], o, h)
        h, q, k, v = call(decode_between, st, layers[i], fused[i], o, h, layers[i + 1], fused[i + 1],
                          qk_norms[i + 1], pos, cos, sin)


COMPILED = {}  # (function, backend) -> its torch.compile wrapper, built once per process
UNCOMPILABLE = weakref.WeakKeyDictionary()  # model -> why torch.compile failed on its decode forward (not retried)


def run_compiled(fn, *args):
    """fn(*args) (model_forward, or one of decode_forward's parts) through torch.compile, compiled once per process,
    with dynamic shapes: the slot count changes from bucket to bucket, and (model_forward) the attention's graph
    break starts a new frame per layer whose inputs mark_dynamic would not reach, so static shapes would recompile
    every layer's frame at every new bucket size. Without duck sizing: it would tie the slot count
    to any model dimension of the same size at trace time (128 slots = 2 K/V heads x 64) and recompile when a bucket
    breaks the tie (seen: 5-8 s inside a timed run). With decode_kernels.PDL (read at the first compile) the
    compiler's Triton kernels launch with programmatic dependent launch where torch has it (triton.enable_pdl;
    Hopper and later): each overlaps its launch with the kernel before, -4 to -10% a step on an H200."""
    from torch._inductor import config as inductor_config
    from torch.fx.experimental import _config as fx_config  # private, but in torch 2.1 through 2.13
    key = (fn, COMPILE_BACKEND)
    if key not in COMPILED:  # decode_forward's parts have no graph break at all: fullgraph makes one an error
        pdl = decode_kernels.PDL and COMPILE_BACKEND == "inductor" and hasattr(inductor_config.triton, "enable_pdl")
        COMPILED[key] = torch.compile(fn, backend=COMPILE_BACKEND, dynamic=True, fullgraph=fn in DECODE_PARTS,
                                      options={"triton.enable_pdl": True} if pdl else None)
    with fx_config.patch(use_duck_shape=False):
        return COMPILED[key](*args)


def forward_compiled_or_not(model, fn, *args):
    """run_compiled(fn, *args), or fn(*args) once torch.compile has failed on this model: a module it cannot trace
    (a custom layer with data-dependent Python, say) costs the compiled forward's speed, with one printed line, not
    the run. Training's hooks are no such case: generate_groups sets them aside (sampling). Compilation
    happens in the graph's warm-up call, never inside a capture, so falling back there is safe."""
    if model not in UNCOMPILABLE:
        try:
            return fn(*args, compiled=True) if fn is decode_forward else run_compiled(fn, *args)
        except torch._dynamo.exc.TorchDynamoException as e:  # (Unsupported, BackendCompilerFailed, InductorError...)
            first = next((line for line in str(e).splitlines() if line.strip()), "")
            UNCOMPILABLE[model] = f"{type(e).__name__}: {first[:200]}"
            print(f"rollout: torch.compile cannot compile {fn.__name__} for this model ({UNCOMPILABLE[model]}); "
                  f"decoding with the uncompiled forward (CUDA graphs still on)", flush=True)
    return fn(*args)


@contextlib.contextmanager
def sampling(model):
    """the model as generation wants it, restored on exit: eval mode (no dropout, no gradient checkpointing) and
    every module's forward hooks set aside. Generation is inference; the hooks are training's: gradient
    checkpointing's on the input embedding (output.requires_grad_(True), which torch 2.11's compiler refuses inside
    the fullgraph decode, and which would make every decode step build autograd state), FSDP2's unshard/reshard on
    each unit (dist.gathered has unsharded the weights for the whole rollout; a CUDA graph would capture their
    stream waits). A hook a user registers for training is set aside too."""
    was_training, saved = model.training, [(m, m._forward_pre_hooks, m._forward_hooks) for m in model.modules()]
    for m, pre, post in saved:
        m._forward_pre_hooks, m._forward_hooks = type(pre)(), type(post)()
    model.eval()
    try:
        yield
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks, m._forward_hooks = pre, post
        model.train(was_training)


# ----------------------------------------------------------------------------------------------------------------
# generate_groups


def eos_tensor(eos_token_id, device):
    """the ids that end a completion, an int or a list of ints (or () for none), as a (n_eos,) long tensor"""
    return torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), dtype=torch.long,
                        device=device)


@torch.no_grad()
def generate_groups(model, prompt_ids, prompt_mask, group_size, max_new_tokens, temperature=1.0, top_p=1.0,
                    top_k=0, eos_token_id=None, pad_token_id=None, return_logprobs=False):
    """G completions per prompt, (B*G, C) right-padded ids and mask (1 up to and including EOS), row = b*G + g.
    C <= max_new_tokens: the longest row. Greedy when temperature=0. eos_token_id: int, list, or () for none.
    return_logprobs: also (B*G, C) float32, each token's log-prob under the distribution it was drawn from (after
    temperature/top-k/top-p; greedy: plain softmax), as the sampler computed it (0 on padding)."""
    if prompt_ids.ndim != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError("prompt_ids and prompt_mask must both be (B, P)")
    if not bool((prompt_mask[:, -1] == 1).all()):
        raise ValueError("prompts must be left-padded (last column real); use tokenizer.padding_side='left'")
    if group_size < 1 or max_new_tokens < 1 or temperature < 0:
        raise ValueError("need group_size >= 1, max_new_tokens >= 1, temperature >= 0")
    eos_token_id = model.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    if eos_token_id is None:
        raise ValueError("pass eos_token_id (int, list of ints, or () for none)")
    eos = eos_tensor(eos_token_id, prompt_ids.device)
    if pad_token_id is None and len(eos) == 0:
        raise ValueError("pass pad_token_id when there is no eos_token_id")
    pad = int(eos[0]) if pad_token_id is None else pad_token_id
    impl = model.config._attn_implementation
    why = reuse_unsupported(model) or (impl not in ("sdpa", "eager") and
                                       f"attn_implementation {impl!r} is not 'sdpa' or 'eager'")
    if why:  # the decode attention assumes full attention everywhere (no sliding window)
        warnings.warn(f"rollout.generate_groups: {why}; sampling with model.generate")
        LAST.clear()
        LAST.update(path="generate")
        return hf_generate_groups(model, prompt_ids, prompt_mask, group_size, max_new_tokens, temperature, top_p,
                                  top_k, eos, pad, return_logprobs)
    warpers = make_warpers(temperature, top_p, top_k)
    prompt_ids, prompt_mask = trim_left_padding(prompt_ids, prompt_mask.long())
    (B, P), G, dev = prompt_ids.shape, group_size, prompt_ids.device
    N, T = B * G, max_new_tokens
    attn_impl = ("triton" if dev.type == "cuda" else "torch") if ATTENTION == "auto" else ATTENTION
    graph = CUDA_GRAPH and dev.type == "cuda"
    compiled = COMPILE and T >= COMPILE_MIN_TOKENS and (dev.type == "cuda" or COMPILE_BACKEND != "inductor")
    with sampling(model):  # eval mode, no training hooks
        # 1) prefill each prompt once; its K/V (B, kvh, P, D) per layer are the shared prefix of its G rows
        pos = positions(prompt_mask)  # (B, P)
        cache = DynamicCache(config=model.config)
        out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=pos, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        # one layout for K and V; one dtype: the autocast dtype if on (fp32 weights under autocast mix fp32 and bf16)
        kv_dtype = (torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else
                    cache.layers[0].keys.dtype)
        prefix = [(l.keys.to(kv_dtype).contiguous(), l.values.to(kv_dtype).contiguous()) for l in cache.layers]
        ids = torch.full((N, T), pad, dtype=torch.long, device=dev)  # (B*G, T) every sampled token lands here
        keep = torch.zeros(N, T, dtype=torch.bool, device=dev)
        logps = torch.zeros(N, T, dtype=torch.float32, device=dev)
        if temperature > 0 and top_k == 0 and top_p >= 1 and (SAMPLER == "triton" or (SAMPLER == "auto" and
                                                                                    dev.type == "cuda")):
            seed = torch.randint(2**62, (1,), device=dev)  # from torch's generator: reproducible under manual_seed
            draw = lambda logits: sample_triton(logits, seed, temperature)
        else:
            draw = lambda logits: sample(logits, warpers)
        tok, lp = draw(out.logits[:, -1].repeat_interleave(G, 0))  # token 0 of every row, (B*G,)
        ids[:, 0], keep[:, 0], logps[:, 0] = tok, True, lp
        is_eos = torch.zeros(out.logits.shape[-1], dtype=torch.bool, device=dev)  # (V,) a lookup: torch.isin syncs
        is_eos[eos[eos < is_eos.numel()]] = True
        done = is_eos[tok]
        del out, cache
        # 2) decode tokens 1..T-1. Step s feeds token s-1 at completion column s-1 (the cache never holds the last)
        #    completion cache (B*G, kvh, T-1, D) per layer; zeros: the torch path reads it whole under a mask
        layers = [(k, v, k.new_zeros(N, k.shape[1], max(T - 1, 1), k.shape[3]),
                   v.new_zeros(N, v.shape[1], max(T - 1, 1), v.shape[3])) for k, v in prefix]
        start = (P - prompt_mask.sum(1)).to(torch.int32)  # (B,) first real prompt column
        slot = torch.zeros(1, dtype=torch.long, device=dev)  # completion column of the fed token, = step - 1
        slots = SimpleNamespace(rows=torch.arange(N, device=dev), tok=tok[:, None].clone(),
                                pos=pos[:, -1:].repeat_interleave(G, 0) + 1, done=done)  # (n,), (n, 1), (n, 1), (n,)
        fused = fuse_projections(model) if FUSE else None
        forward_fn = decode_forward if fused is not None else model_forward
        gemm = DECODE_GEMM if DECODE_GEMM in ("triton", "cuda") and fused is not None and \
            gemms_fit(model, fused, dev, DECODE_GEMM) else "torch"
        rope, rope_attn = None, fused is not None and rope_in_attention(model)
        if gemm == "triton":  # RoPE in q|k|v's epilogue where it can; W with the RMSNorm's weight in its columns
            rope = epilogue_rope(model, dev)
            fused = [(fold_norm(w_qkv, layer.input_layernorm.weight), b_qkv,
                      fold_norm(w_gu, layer.post_attention_layernorm.weight), b_gu, *rest)
                     for layer, (w_qkv, b_qkv, w_gu, b_gu, *rest) in zip(model.model.layers, fused)]
        LAST.clear()
        LAST.update(buckets=[N], steps=0, attention=attn_impl, graph=graph, fused=fused is not None, gemm=gemm,
                    gemms=[], rope="epilogue" if rope else "attention" if rope_attn else "torch")
        #                   (gemms: each bucket's: torch|triton|cuda|folded; rope: where RoPE runs)

        def make_step(sl):
            # (the attention op picks the split count for the slots it gets; rope: epilogue_rope's fields)
            n = sl.rows.shape[0]  # (above the custom GEMMs' bucket sizes: cuBLAS, on the folded W for triton)
            st = SimpleNamespace(layers=layers, rows=sl.rows, done=sl.done, start=start, slot=slot, G=G,
                                 impl=attn_impl, gemm="folded" if gemm == "triton" and n > TRITON_GEMM_MAX_ROWS else
                                 "torch" if gemm == "cuda" and n > CUDA_GEMM_MAX_ROWS else gemm,
                                 **(rope or dict(rope=None)))
            st.rope_attn = rope_attn and not (st.gemm == "triton" and st.rope is not None)  # (else: q|k|v's epilogue)
            LAST["gemms"].append(st.gemm)

            def forward():  # (n, V) logits; writes this step's K/V into the cache at column slot (idempotent)
                args = (model, fused, st, sl.tok, sl.pos) if fused is not None else (model, sl.tok, sl.pos)
                with contextlib.nullcontext() if fused is not None else decode_step(model, st):  # (state: an arg)
                    return forward_compiled_or_not(model, forward_fn, *args) if compiled else forward_fn(*args)

            def step():  # draw (n,) tokens and log-probs; record them at column slot + 1 of each slot's row
                record(*draw(forward()), sl, slot, ids, logps, keep, is_eos, pad)
            if not graph:
                return step
            try:
                return graphed(step, forward)
            except Exception as e:  # a failed capture leaves CUDA state (RNG offsets, pools) unusable: stop here
                raise RuntimeError("rollout.generate_groups: CUDA graph capture of the decode step failed (e.g. a "
                                   "host sync inside this model's forward); set rollout.CUDA_GRAPH = False") from e

        step = make_step(slots)
        s = 1
        while s < T:
            n, n_live = slots.rows.shape[0], int((~slots.done).sum())  # the host sync of this check
            if n_live == 0:
                break
            nb = max(MIN_BUCKET, triton.next_power_of_2(n_live))
            if nb <= n // 2 and T - s >= COMPACT_MIN_STEPS:
                # live slots first, then finished ones to fill the bucket (their writes land in finished rows)
                order = torch.argsort(slots.done.to(torch.int8), stable=True)[:nb]
                slots = SimpleNamespace(rows=slots.rows[order], tok=slots.tok[order], pos=slots.pos[order],
                                        done=slots.done[order])
                step = make_step(slots)
                LAST["buckets"].append(nb)
            for _ in range(min(CHECK_EVERY, T - s)):
                step()
                s += 1
        LAST["steps"] = s - 1
        LAST["compiled"] = compiled and model not in UNCOMPILABLE  # (a failure is said once, then not retried)
        if model in UNCOMPILABLE:
            LAST["compile_error"] = UNCOMPILABLE[model]
        # the path in one word: compiled (+ graph on CUDA) | fallback (compile failed: uncompiled) | graph | eager
        LAST["path"] = ("compiled" if LAST["compiled"] else "fallback" if "compile_error" in LAST else
                        "graph" if graph else "eager")
    n = int(keep.sum(1).max())  # columns after every row had finished are all padding
    return (ids[:, :n], keep[:, :n].long()) + ((logps[:, :n],) if return_logprobs else ())
