"""Rollouts: G completions per prompt, sampled at reasoning lengths near the memory-bandwidth limit. A decode step of
B*G rows must read every weight once plus every live row's K/V; three things decide how close we get:
1. Attention reads only what exists, once. Each prompt is prefilled once, its K/V shared by its G rows; each row's own
   tokens go into a completion cache, and decode_kernels.py's split-K kernel (its point 1) reads the real columns only.
2. Finished rows stop costing: the attention kernel skips them, and every CHECK_EVERY steps the host reads which rows
   are done; once the live ones fit a power-of-two bucket of at most half the slots, they move to a smaller batch (its
   own captured graph) that skips their matmuls too. No K/V moves: slot i decodes cache row rows[i].
3. Few launches. At decode M = live rows (8-128): a GEMM costs a few us whatever its size. decode_forward does q|k|v and
   gate|up as one GEMM each (FUSE: 4 GEMMs a layer, not 7), a step (forward, sampling, bookkeeping) is one CUDA graph
   replay, and sampling needs no host sync (decode_kernels.py). From COMPILE_MIN_TOKENS new tokens on, torch.compile
   fuses a layer's ~30 small eager elementwise kernels into a handful (models it cannot trace decode uncompiled).
Other models (sliding window, other attention) fall back to model.generate with the same outputs; layers that are not
llama/qwen2/qwen3-shaped run their own forward on our attention ("nanogrpo_decode"). Left out: paged K/V (a group's rows
start together, so a dense cache per row wastes nothing until rows finish, and compaction handles that) and custom
decode GEMMs (8-row steps 14-22% faster on an H200 only: BENCHMARKS, "Tried and not kept")."""
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

import decode_kernels
from decode_kernels import decode_attention_op, record, sample, sample_triton
from kv_reuse import cache_arg, positions, reuse_unsupported, trim_left_padding
from lora import effective_weight

CUDA_GRAPH = True  # on CUDA: capture each decode step (forward + sampling) as a graph and replay it per token
CHECK_EVERY = 8  # decode steps between host reads of "which rows are done" (a sync that drains the launch queue)
MIN_BUCKET = 8  # compaction never goes below this many slots
COMPACT_MIN_STEPS = 32  # compact only if at least this many steps may remain (a capture costs ~2 steps)
ATTENTION = "auto"  # decode attention: triton | torch | auto (triton on CUDA, torch elsewhere)
COMPILE_MIN_TOKENS = 128  # the compile costs ~10-30 s once a process, a step saves ~2 ms: 64 tokens never repay it
COMPILE_BACKEND = "inductor"  # on CUDA; on the CPU only another backend compiles (tests: aot_eager, no C++ compiler)
FUSE = True  # decode with q|k|v and gate|up as one GEMM each (decode_forward); False: the model's own forward
LAST = {}  # the last call's decode statistics: buckets visited, steps, attention impl, decode path (tests, benchmarks)
DECODE_STATE = []  # the decode state of the step being run (or captured): caches, slot -> row map, column


@torch.compiler.disable  # compiled, the launches stay as they are (the CUDA graph captures them anyway)
def decode_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers attention "nanogrpo_decode" (the model's own forward, FUSE off): key/value: this step's K/V
    (n, kvh, 1, D) after RoPE; caches, slot -> row map: DECODE_STATE, a global so torch.compile never guards on it"""
    st = DECODE_STATE[-1]
    pk, pv, ck, cv = st.layers[module.layer_idx]
    return decode_attention_op(query, key, value, pk, pv, ck, cv, st.rows, st.done, st.start, st.slot, st.G, scaling,
                               st.impl), None


AttentionInterface.register("nanogrpo_decode", decode_attention)


@contextlib.contextmanager
def decode_step(model, st):
    """inside, the model's attention is "nanogrpo_decode" on state st (HF reads config._attn_implementation per call)"""
    impl, model.config._attn_implementation = model.config._attn_implementation, "nanogrpo_decode"
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
    """fn() as a CUDA graph: returns replay(). warmup() runs first on the side stream (lazy cuBLAS/Triton setup can't
    run in a capture) and must leave no state the real step would not overwrite. Not `with torch.cuda.graph()`, which
    empties the allocator cache per capture (training re-allocated its working set after each rollout: +15% update
    time), but capture_begin/end. One side stream and pool per device (the allocator keeps freed blocks per stream: a
    stream per call stranded 0.75 GiB each); graphs sharing a pool must not overlap: ours run bucket after bucket."""
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
    """per layer (w_qkv, b_qkv, w_gate_up, b_gate_up, w_o, b_o, w_down, b_down) for decode_forward: q/k/v and gate/up
    concatenated (one GEMM each), o_proj's and down_proj's as they are; a copy per call, as weights change every step.
    LoRA is folded in (lora.effective_weight: W + (alpha/r) B A) at no decode cost. None (the model keeps its forward)
    if layers are not llama/qwen2/qwen3-shaped or a projection is more than x @ W^T + b (wrapped, quantized, custom)."""
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


def project(x, w, b, norm=None, act=None, residual=None):
    """one decode GEMM and its neighbours: residual + act(norm(x) @ W^T + b), act = act_fn(gate) * up, W = [gate; up]"""
    y = F.linear(x if norm is None else norm(x), w, b)
    if act is not None:
        gate, up = y.chunk(2, -1)
        y = act(gate) * up
    return y if residual is None else residual + y


def rope_in_attention(model):
    """whether apply_rotary_pos_emb is rope_torch's (decode_kernels.rope_matches): then the attention op applies RoPE"""
    attn = model.model.layers[0].self_attn
    return decode_kernels.rope_matches(getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None),
                                       attn.head_dim)


def attention_inputs(layer, h, w_qkv, b_qkv, rope_attn, cos, sin):
    """a layer's decode q (n, h, 1, D), k, v (n, kvh, 1, D): q|k|v(norm(h)), qwen3's q/k norms, RoPE unless rope_attn"""
    attn = layer.self_attn
    n, D = h.shape[0], attn.head_dim
    sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
    qkv = project(h, w_qkv, b_qkv, norm=layer.input_layernorm).split(sizes, -1)
    q, k, v = [t.view(n, 1, -1, D).transpose(1, 2) for t in qkv]
    if hasattr(attn, "q_norm"):  # qwen3: RMSNorm per head (over D) before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    if not rope_attn:
        q, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def mlp_block(layer, w, o, h):
    """after a layer's attention output o (n, 1, h, D): h + o_proj(o), then + its MLP on that; the new h (n, 1, H)"""
    _, _, w_gu, b_gu, w_o, b_o, w_down, b_down = w
    h = project(o.reshape(h.shape[0], 1, -1).to(h.dtype), w_o, b_o, residual=h)
    a = project(h, w_gu, b_gu, norm=layer.post_attention_layernorm, act=layer.mlp.act_fn)  # (n, 1, I)
    return project(a, w_down, b_down, residual=h)


def decode_first(model, layer, w, rope_attn, tok, pos):
    """the embedding, RoPE's (cos, sin) and layer 0's attention inputs: (h, cos, sin, q, k, v)"""
    h = model.model.embed_tokens(tok)  # (n, 1, H)
    cos, sin = model.model.rotary_emb(h, pos)
    return (h, cos, sin) + tuple(attention_inputs(layer, h, w[0], w[1], rope_attn, cos, sin))


def decode_between(layer, w, o, h, nxt, w_nxt, rope_attn, cos, sin):
    """a layer's o_proj and MLP, then the next layer's attention inputs: (h, q, k, v)"""
    h = mlp_block(layer, w, o, h)
    return (h,) + tuple(attention_inputs(nxt, h, w_nxt[0], w_nxt[1], rope_attn, cos, sin))


def decode_last(model, layer, w, o, h):
    """the last layer's o_proj and MLP, the final norm, the LM head: (n, V) logits"""
    return model.lm_head(model.model.norm(mlp_block(layer, w, o, h)))[:, -1]


DECODE_PARTS = (decode_first, decode_between, decode_last)


def decode_forward(model, fused, st, tok, pos, compiled=False):
    """model_forward's (n, V) logits from the model's modules, but q|k|v and gate|up one GEMM each (fuse_projections)
    and attention as nanogrpo::decode_attention on st. Cut at the attention ops (no compiler fuses across them anyway):
    decode_first, per layer attention + decode_between (residual add + next norm still fuse), decode_last. compiled:
    each part one graph for all layers: three compiles serve any depth (28-layer 1.5B: 26 s, 148 s as one graph)."""
    call = run_compiled if compiled else (lambda fn, *args: fn(*args))
    layers, L, rope = model.model.layers, len(fused), st.rope_attn
    h, cos, sin, q, k, v = call(decode_first, model, layers[0], fused[0], rope, tok, pos)
    for i, (pk, pv, ck, cv) in enumerate(st.layers):
        o = torch.ops.nanogrpo.decode_attention(q, k, v, pk, pv, ck, cv, st.rows, st.done, st.start, st.slot,
                                                st.G, layers[i].self_attn.scaling, st.impl,
                                                *((cos, sin) if rope else ()))  # (n, 1, h, D)
        if i == L - 1:
            return call(decode_last, model, layers[i], fused[i], o, h)
        h, q, k, v = call(decode_between, layers[i], fused[i], o, h, layers[i + 1], fused[i + 1], rope, cos, sin)


COMPILED = {}  # (function, backend) -> its torch.compile wrapper, built once per process
UNCOMPILABLE = weakref.WeakKeyDictionary()  # model -> why torch.compile failed on its decode forward (not retried)


def run_compiled(fn, *args):
    """fn(*args) (model_forward or a decode_forward part) via torch.compile: dynamic shapes (slot counts vary by
    bucket), no duck sizing (it would tie the slot count to an equal model dim, recompiling 5-8 s once a bucket breaks
    the tie), PDL in its Triton kernels where torch has it (decode_kernels.pdl_launch: -4 to -10% a step, H200)."""
    from torch._inductor import config as inductor_config
    from torch.fx.experimental import _config as fx_config  # private, but in torch 2.1 through 2.13
    key = (fn, COMPILE_BACKEND)
    if key not in COMPILED:  # decode_forward's parts have no graph break at all: fullgraph makes one an error
        pdl = COMPILE_BACKEND == "inductor" and hasattr(inductor_config.triton, "enable_pdl")
        COMPILED[key] = torch.compile(fn, backend=COMPILE_BACKEND, dynamic=True, fullgraph=fn in DECODE_PARTS,
                                      options={"triton.enable_pdl": True} if pdl else None)
    with fx_config.patch(use_duck_shape=False):
        return COMPILED[key](*args)


def forward_compiled_or_not(model, fn, *args):
    """run_compiled(fn, *args), or fn(*args) once compile failed on this model (data-dependent Python, say): costing
    speed and one printed line, not the run. Compiles run in warm-ups, never in a capture: falling back is safe."""
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
    """eval mode and no forward hooks, restored on exit. They are training's: output.requires_grad_(True) on the input
    embedding (gradient checkpointing; torch 2.11's fullgraph decode refuses it, and steps would build autograd state),
    FSDP2's unshard/reshard (dist.gathered unshards for the whole rollout; graphs would capture their stream waits)."""
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


def eos_tensor(eos_token_id, device):
    """the ids that end a completion, an int or a list of ints (or () for none), as a (n_eos,) long tensor"""
    return torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), dtype=torch.long,
                        device=device)


def kv_bytes_per_token(config, dtype_bytes=2):
    """one token's K and V: 2 * layers * K/V heads * head_dim * dtype bytes (1.5B: 28 KiB in bf16); 0: unknown"""
    n = [getattr(config, k, None) for k in ("num_hidden_layers", "num_attention_heads", "hidden_size")]
    if None in n:
        return 0
    D = getattr(config, "head_dim", None) or n[2] // n[1]
    return 2 * n[0] * (getattr(config, "num_key_value_heads", None) or n[1]) * D * dtype_bytes


def waves(B, G, P, T, kv_token, budget):
    """[(b0, b1, rows)]: B groups of G rows (P prompt columns, T new tokens), K/V within budget bytes (None: no cap):
    the prompts b0:b1 together, whole groups while one fits (its rows share the prompt's K/V), else each group in parts
    of `rows` rows, a part prefilling the prompt again"""
    group = kv_token * (P + G * max(T - 1, 1))  # the prompt once + G completion caches of T-1 columns
    if budget is None or B * group <= budget:  # (kv_token 0: a config without the fields, unknown: no cap)
        return [(0, B, G)]
    if group <= budget:
        n = int(budget // group)
        return [(b, min(b + n, B), G) for b in range(0, B, n)]
    rows = int((budget / kv_token - P) // max(T - 1, 1))
    if rows < 1:
        raise torch.cuda.OutOfMemoryError(
            f"rollout: one completion of {T} tokens after a {P}-token prompt needs {(P + T) * kv_token / 2**30:.1f} "
            f"GiB of K/V ({kv_token} bytes a token) and {budget / 2**30:.1f} GiB is free for it: lower "
            f"--max_completion_len or --max_prompt_len, or raise --rollout_kv_gib")
    return [(b, b + 1, rows) for b in range(B)]


def generate_in_waves(model, prompt_ids, prompt_mask, group_size, max_new_tokens, kv_budget, eos_token_id, pad_token_id,
                      **kw):
    """generate_groups(..., return_logprobs=True) with the K/V of at most kv_budget bytes live at once (waves() says
    how); the same rows in the same order, right-padded to the longest. LAST["waves"]: how many calls it took."""
    G, P = group_size, int(prompt_mask.sum(1).max())
    kv_token = kv_bytes_per_token(model.config, next(model.parameters()).element_size())
    plan = waves(prompt_ids.shape[0], G, P, max_new_tokens, kv_token, kv_budget)
    outs = [generate_groups(model, prompt_ids[b0:b1], prompt_mask[b0:b1], min(rows, G - g0), max_new_tokens,
                            eos_token_id=eos_token_id, pad_token_id=pad_token_id, return_logprobs=True, **kw)
            for b0, b1, rows in plan for g0 in range(0, G, rows)]
    LAST["waves"] = len(outs)
    pad = pad_token_id if pad_token_id is not None else int(eos_tensor(eos_token_id, prompt_ids.device)[0])
    C = max(o[0].shape[1] for o in outs)
    return tuple(torch.cat([F.pad(o[i], (0, C - o[i].shape[1]), value=pad if i == 0 else 0) for o in outs])
                 for i in range(3))  # ids (pad), mask (0), log-probs (0)


@torch.no_grad()
def generate_groups(model, prompt_ids, prompt_mask, group_size, max_new_tokens, temperature=1.0, top_p=1.0,
                    top_k=0, eos_token_id=None, pad_token_id=None, return_logprobs=False, compile=True):
    """G completions per prompt: (B*G, C) right-padded ids and mask (1 through EOS), row b*G + g, C: longest row.
    temperature=0: greedy. eos_token_id: int, list, or () for none. return_logprobs: also (B*G, C) float32, each token's
    log-prob as the sampler computed it, under the distribution after temperature/top-k/top-p (greedy: plain softmax),
    0 on padding. compile: torch.compile decoding if max_new_tokens >= COMPILE_MIN_TOKENS (CUDA graphs either way)."""
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
        LAST["path"] = "generate"
        return hf_generate_groups(model, prompt_ids, prompt_mask, group_size, max_new_tokens, temperature, top_p,
                                  top_k, eos, pad, return_logprobs)
    warpers = make_warpers(temperature, top_p, top_k)
    prompt_ids, prompt_mask = trim_left_padding(prompt_ids, prompt_mask.long())
    (B, P), G, dev = prompt_ids.shape, group_size, prompt_ids.device
    N, T = B * G, max_new_tokens
    attn_impl = ("triton" if dev.type == "cuda" else "torch") if ATTENTION == "auto" else ATTENTION
    graph = CUDA_GRAPH and dev.type == "cuda"
    compiled = compile and T >= COMPILE_MIN_TOKENS and (dev.type == "cuda" or COMPILE_BACKEND != "inductor")
    with sampling(model):  # 1) prefill each prompt once: its K/V (B, kvh, P, D) a layer, the prefix of its G rows
        pos = positions(prompt_mask)  # (B, P)
        cache = DynamicCache(config=model.config)
        out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=pos, **cache_arg(model, cache),
                    use_cache=True, logits_to_keep=1)
        kv_dtype = (torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else
                    cache.layers[0].keys.dtype)  # one K/V layout and dtype: fp32 weights under autocast mix dtypes
        prefix = [(l.keys.to(kv_dtype).contiguous(), l.values.to(kv_dtype).contiguous()) for l in cache.layers]
        ids = torch.full((N, T), pad, dtype=torch.long, device=dev)  # (B*G, T) every sampled token lands here
        keep = torch.zeros(N, T, dtype=torch.bool, device=dev)
        logps = torch.zeros(N, T, dtype=torch.float32, device=dev)
        if temperature > 0 and top_k == 0 and top_p >= 1 and dev.type == "cuda":  # inverse-CDF kernels, else torch ops
            seed = torch.randint(2**62, (1,), device=dev)  # from torch's generator: reproducible under manual_seed
            draw = lambda logits: sample_triton(logits, seed, temperature)
        else:
            draw = lambda logits: sample(logits, warpers)
        tok, lp = draw(out.logits[:, -1].repeat_interleave(G, 0))  # token 0 of every row, (B*G,)
        ids[:, 0], keep[:, 0], logps[:, 0] = tok, True, lp
        is_eos = torch.zeros(out.logits.shape[-1], dtype=torch.bool, device=dev)  # (V,) a lookup: torch.isin syncs
        is_eos[eos[eos < is_eos.numel()]] = True
        done = is_eos[tok]
        del out, cache  # 2) decode tokens 1..T-1: step s feeds token s-1 at column s-1 (the cache never holds the last)
        layers = [(k, v, k.new_zeros(N, k.shape[1], max(T - 1, 1), k.shape[3]),  # zeros: torch reads it whole, masked
                   v.new_zeros(N, v.shape[1], max(T - 1, 1), v.shape[3])) for k, v in prefix]  # (B*G, kvh, T-1, D)
        start = (P - prompt_mask.sum(1)).to(torch.int32)  # (B,) first real prompt column
        slot = torch.zeros(1, dtype=torch.long, device=dev)  # completion column of the fed token, = step - 1
        slots = SimpleNamespace(rows=torch.arange(N, device=dev), tok=tok[:, None].clone(),
                                pos=pos[:, -1:].repeat_interleave(G, 0) + 1, done=done)  # (n,), (n, 1), (n, 1), (n,)
        fused = fuse_projections(model) if FUSE else None
        forward_fn = decode_forward if fused is not None else model_forward
        rope_attn = fused is not None and rope_in_attention(model)  # RoPE inside the attention kernel
        LAST.clear()
        LAST.update(buckets=[N], steps=0, attention=attn_impl, graph=graph, fused=fused is not None,
                    rope="attention" if rope_attn else "torch")
        def make_step(sl):  # the decode step of slots sl (the attention op picks its split count for their number)
            st = SimpleNamespace(layers=layers, rows=sl.rows, done=sl.done, start=start, slot=slot, G=G,
                                 impl=attn_impl, rope_attn=rope_attn)
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
                order = torch.argsort(slots.done.to(torch.int8), stable=True)[:nb]  # live first, finished fill up
                slots = SimpleNamespace(rows=slots.rows[order], tok=slots.tok[order], pos=slots.pos[order],
                                        done=slots.done[order])  # finished slots' writes land in finished rows
                step = make_step(slots)
                LAST["buckets"].append(nb)
            for _ in range(min(CHECK_EVERY, T - s)):
                step()
                s += 1
        LAST["steps"] = s - 1
        LAST["compiled"] = compiled and model not in UNCOMPILABLE  # (a failure is said once, then not retried)
        if model in UNCOMPILABLE:
            LAST["compile_error"] = UNCOMPILABLE[model]
        LAST["path"] = "compiled" if LAST["compiled"] else "fallback" if model in UNCOMPILABLE else \
            "graph" if graph else "eager"  # compiled (+ graph on CUDA) | fallback (compile failed: uncompiled)
    n = int(keep.sum(1).max())  # columns after every row had finished are all padding
    return (ids[:, :n], keep[:, :n].long()) + ((logps[:, :n],) if return_logprobs else ())
