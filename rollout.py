"""Rollouts: G sampled completions per prompt, decoded near the memory-bandwidth limit (a step must
read every weight once plus every live row's K/V). generate_groups -> prefill -> decode, which runs
decode_one_token per token as a CUDA graph replay. Each prompt is prefilled once, its K/V shared by
its G rows, and the attention kernel (decode_kernels.py) reads only real columns; finished rows
stop costing (once the live rows fit a power-of-two bucket of at most half the slots, they move to
a smaller batch); q|k|v and gate|up are one GEMM each, and torch.compile fuses the small kernels.
Models we cannot decode (sliding window, other attention) fall back to model.generate. Left out:
paged K/V (a group's rows start together, so a dense cache wastes nothing until rows finish, and
compaction handles that) and custom decode GEMMs (BENCHMARKS.md: "Tried and not kept")."""
import contextlib
import functools
import inspect
import sys
import warnings
import weakref
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import triton
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.generation import logits_process

from decode_kernels import decode_attention_op, record, rope_torch, sample, sample_triton
from kv_reuse import positions, reuse_unsupported, setting, trim_left_padding
from lora import effective_weight

CUDA_GRAPH = True  # on CUDA: capture a decode step (forward + sampling) once, replay it per token
CHECK_EVERY = 8  # decode steps between host reads of "which rows are done" (each read is a sync)
MIN_BUCKET = 8  # compaction never goes below this many slots
COMPACT_MIN_STEPS = 32  # compact only if this many steps may remain: a new capture must pay off
ATTENTION = "auto"  # decode attention: triton | torch | auto (triton on CUDA, torch elsewhere)
COMPILE_MIN_TOKENS = 128  # compile the decode from this many new tokens on (fewer never repay it)
COMPILE_BACKEND = "inductor"  # compiles on CUDA only; another backend (tests: aot_eager) on the CPU
FUSE = True  # decode with q|k|v and gate|up as one GEMM each (decode_forward); False: model's own
LAST = {}  # the last call's decode statistics (buckets, steps, path, ...), for tests and benchmarks
DECODE_STATE = []  # the step being run, for decode_attention: HF's attention passes none of ours
CAPTURE = {}  # device -> [side stream, latest graph]: captures share one stream and pool, in turn
COMPILED = {}  # (function, backend) -> its torch.compile wrapper: compiled once per process
UNCOMPILABLE = weakref.WeakKeyDictionary()  # model -> why compiling its decode failed: no retry


# -- CUDA graphs, sampling helpers, the model.generate fallback ------------------------------------
def make_warpers(temperature, top_p, top_k):
    """HF generate's order: temperature, top-k, top-p; None means greedy"""
    if temperature == 0:
        return None
    warpers = [logits_process.TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
    warpers += [logits_process.TopKLogitsWarper(top_k)] if top_k > 0 else []
    return warpers + ([logits_process.TopPLogitsWarper(top_p)] if top_p < 1.0 else [])


def graphed(fn, warmup):
    """fn() captured as a CUDA graph, returns its replay; warmup() runs first (lazy setup cannot run
    in a capture). Not `with torch.cuda.graph()`: it would empty the allocator cache each time."""
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
    CAPTURE[dev][1] = graph  # the previous one is freed when its caller drops it; the pool lives on
    return graph.replay


@torch.no_grad()
def hf_generate_groups(model, prompt_ids, prompt_mask, G, max_new_tokens, temperature, top_p,
                       top_k, eos, pad, return_logprobs=False):
    """generate_groups' fallback for models its decode cannot run: model.generate, same outputs"""
    how = dict(do_sample=False, temperature=None, top_p=None, top_k=None)  # greedy: G equal rows
    if temperature > 0:  # (HF refuses num_return_sequences > 1 without sampling)
        how = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k,
                   num_return_sequences=G)
    with sampling(model):
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                             max_new_tokens=max_new_tokens, eos_token_id=eos.tolist(),
                             pad_token_id=pad, return_dict_in_generate=True,
                             output_scores=return_logprobs, **how)
    ids = out.sequences[:, prompt_ids.shape[1]:]  # (B*G, T), rows b*G + g (greedy: (B, T))
    logps = None
    if return_logprobs:  # out.scores: the logits after HF's warpers, one (rows, V) per step
        scores = torch.stack(out.scores, 1).float()
        logps = scores.log_softmax(-1).gather(2, ids[..., None]).squeeze(2)
    if temperature == 0:
        ids = ids.repeat_interleave(G, 0)
        logps = logps if logps is None else logps.repeat_interleave(G, 0)
    is_eos = torch.isin(ids, eos).long()
    keep = (is_eos.cumsum(1) - is_eos == 0).long()  # no EOS before it: through the first EOS
    n = int(keep.sum(1).max())
    ids, keep = ids[:, :n].masked_fill(keep[:, :n] == 0, pad), keep[:, :n]
    return (ids, keep, logps[:, :n].masked_fill(keep == 0, 0)) if return_logprobs else (ids, keep)


# -- The decode forward: fused projections and our attention op (or the model's forward with it) -
@torch.compiler.disable  # compiled, the launches stay as they are (the CUDA graph captures them)
def decode_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """HF attention "nanogrpo_decode": this step's K/V (n, kvh, 1, D), the rest from DECODE_STATE"""
    st = DECODE_STATE[-1]
    pk, pv, ck, cv = st.layers[module.layer_idx]
    return decode_attention_op(query, key, value, pk, pv, ck, cv, st.rows, st.done, st.start,
                               st.slot, st.G, scaling, st.impl), None


AttentionInterface.register("nanogrpo_decode", decode_attention)


@contextlib.contextmanager
def using_decode_attention(model, st):
    """inside, the model's attention is "nanogrpo_decode" on state st (HF reads it per call)"""
    DECODE_STATE.append(st)
    try:
        with setting(model.config, "_attn_implementation", "nanogrpo_decode"):
            yield
    finally:
        DECODE_STATE.pop()


def model_forward(model, tok, pos):
    """one decode step's logits (n, V) for tokens tok (n, 1) at positions pos (n, 1)"""
    return model(input_ids=tok, position_ids=pos, use_cache=False, logits_to_keep=1).logits[:, -1]


def fuse_projections(model):
    """per layer (w_qkv, b_qkv, w_gate_up, b_gate_up, w_o, b_o, w_down, b_down), LoRA folded in;
    None (the model keeps its forward) if a layer is not llama-shaped or a projection not plain."""
    def cat_bias(wbs):  # the biases concatenated, a missing one as zeros; None if none has one
        if all(b is None for _, b in wbs):
            return None
        return torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in wbs])
    attn_has = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")
    mlp_has = ("gate_proj", "up_proj", "down_proj", "act_fn")
    fused = []
    for layer in model.model.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not all(hasattr(attn, a) for a in attn_has) or not all(hasattr(mlp, a) for a in mlp_has):
            return None
        wbs = [effective_weight(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj,
                                             mlp.up_proj, attn.o_proj, mlp.down_proj)]
        if any(wb is None for wb in wbs):
            return None
        qkv, gate_up, (w_o, b_o), (w_down, b_down) = wbs[:3], wbs[3:5], wbs[5], wbs[6]
        w_qkv, w_gate_up = torch.cat([w for w, _ in qkv]), torch.cat([w for w, _ in gate_up])
        fused.append((w_qkv, cat_bias(qkv), w_gate_up, cat_bias(gate_up), w_o, b_o, w_down, b_down))
    return fused


def project(x, w, b, norm=None, act=None, residual=None):
    """one decode GEMM: residual + act(norm(x) @ W^T + b), act = act_fn(gate) * up for [gate; up]"""
    y = F.linear(x if norm is None else norm(x), w, b)
    if act is not None:
        gate, up = y.chunk(2, -1)
        y = act(gate) * up
    return y if residual is None else residual + y


def rope_in_attention(model):
    """whether the model's apply_rotary_pos_emb gives rope_torch's bits on random heads (a partial
    or interleaved rotary, or another signature, does not): then the attention op applies RoPE"""
    attn = model.model.layers[0].self_attn
    apply = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    g = torch.Generator().manual_seed(0)
    q, k, cos, sin = (torch.randn(2, n, 1, attn.head_dim, generator=g) for n in (3, 2, 1, 1))
    try:
        return all(torch.equal(a, rope_torch(b, cos[:, 0], sin[:, 0]))
                   for a, b in zip(apply(q, k, cos[:, 0], sin[:, 0]), (q, k)))
    except Exception:
        return False


def attention_inputs(layer, h, w_qkv, b_qkv, rope_attn, cos, sin):
    """q (n, h, 1, D), k, v (n, kvh, 1, D): q|k|v(norm(h)), q/k norms (qwen3), RoPE unless in op"""
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
    """after a layer's attention output o (n, 1, h, D): h + o_proj(o), plus its MLP: (n, 1, H)"""
    _, _, w_gu, b_gu, w_o, b_o, w_down, b_down = w
    h = project(o.reshape(h.shape[0], 1, -1).to(h.dtype), w_o, b_o, residual=h)
    a = project(h, w_gu, b_gu, norm=layer.post_attention_layernorm, act=layer.mlp.act_fn)
    return project(a, w_down, b_down, residual=h)  # a: (n, 1, intermediate)


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


def decode_forward(model, fused, st, tok, pos, compiled=False):
    """model_forward's (n, V) logits, fused projections, our attention op on state st. compiled:
    each part between attention ops is one graph for all layers (three compiles for any depth)"""
    def call(fn, *args):
        return run_compiled(fn, *args) if compiled else fn(*args)
    layers, L, rope = model.model.layers, len(fused), st.rope_attn
    h, cos, sin, q, k, v = call(decode_first, model, layers[0], fused[0], rope, tok, pos)
    for i, (pk, pv, ck, cv) in enumerate(st.layers):
        o = torch.ops.nanogrpo.decode_attention(
            q, k, v, pk, pv, ck, cv, st.rows, st.done, st.start, st.slot, st.G,
            layers[i].self_attn.scaling, st.impl, *((cos, sin) if rope else ()))  # (n, 1, h, D)
        if i == L - 1:
            return call(decode_last, model, layers[i], fused[i], o, h)
        h, q, k, v = call(decode_between, layers[i], fused[i], o, h, layers[i + 1], fused[i + 1],
                          rope, cos, sin)


def run_compiled(fn, *args):
    """fn(*args) through torch.compile: dynamic shapes (slot counts vary by bucket), no duck sizing
    (it would tie the slot count to an equal model dimension), fullgraph for decode_forward parts"""
    from torch._inductor import config as inductor_config
    from torch.fx.experimental import _config as fx_config  # private, in torch 2.1 through 2.13
    key = (fn, COMPILE_BACKEND)
    if key not in COMPILED:
        pdl = COMPILE_BACKEND == "inductor" and hasattr(inductor_config.triton, "enable_pdl")
        COMPILED[key] = torch.compile(fn, backend=COMPILE_BACKEND, dynamic=True,
                                      fullgraph=fn in (decode_first, decode_between, decode_last),
                                      options={"triton.enable_pdl": True} if pdl else None)
    with fx_config.patch(use_duck_shape=False):
        return COMPILED[key](*args)


def forward_compiled_or_not(model, fn, *args):
    """run_compiled(fn, *args), or fn(*args) once compiling failed on this model: one printed line,
    not the run. Compiles happen in the warm-up, never inside a capture, so falling back is safe."""
    if model not in UNCOMPILABLE:
        try:
            return fn(*args, compiled=True) if fn is decode_forward else run_compiled(fn, *args)
        except torch._dynamo.exc.TorchDynamoException as e:  # Unsupported, InductorError, ...
            first = next((line for line in str(e).splitlines() if line.strip()), "")
            UNCOMPILABLE[model] = f"{type(e).__name__}: {first[:200]}"
            print(f"rollout: torch.compile cannot compile {fn.__name__} for this model "
                  f"({UNCOMPILABLE[model]}); decoding uncompiled (CUDA graphs on)", flush=True)
    return fn(*args)


@contextlib.contextmanager
def sampling(model):
    """eval mode and no forward hooks (training's: gradient checkpointing's input-grad hook, FSDP2's
    unshard/reshard, as dist.gathered unshards for the whole rollout), restored on exit"""
    was_training = model.training
    saved = [(m, m._forward_pre_hooks, m._forward_hooks) for m in model.modules()]
    for m, pre, post in saved:
        m._forward_pre_hooks, m._forward_hooks = type(pre)(), type(post)()
    model.eval()
    try:
        yield
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks, m._forward_hooks = pre, post
        model.train(was_training)


# -- K/V budget: how many rows decode at once ------------------------------------------------------
def eos_tensor(eos_token_id, device):
    """the ids that end a completion, an int or a list of ints (or () for none), as (n_eos,) long"""
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device)


def kv_bytes_per_token(config, dtype_bytes=2):
    """one token's K and V: 2 * layers * K/V heads * head_dim * dtype bytes; 0 if unknown"""
    keys = ("num_hidden_layers", "num_attention_heads", "hidden_size")
    layers, heads, hidden = (getattr(config, k, None) for k in keys)
    if None in (layers, heads, hidden):
        return 0
    D = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * layers * kv_heads * D * dtype_bytes


def waves(B, G, P, T, kv_token, budget):
    """[(b0, b1, rows)]: B groups of G rows (P prompt columns, T new tokens) with K/V within budget
    bytes (None: no cap): whole groups b0:b1 while one fits, else a group in parts of `rows` rows"""
    group = kv_token * (P + G * max(T - 1, 1))  # the prompt once + G completion caches of T-1
    if budget is None or B * group <= budget:  # (kv_token 0: the config lacks the fields: no cap)
        return [(0, B, G)]
    if group <= budget:
        n = int(budget // group)
        return [(b, min(b + n, B), G) for b in range(0, B, n)]
    rows = int((budget / kv_token - P) // max(T - 1, 1))
    if rows < 1:
        raise torch.cuda.OutOfMemoryError(
            f"rollout: one completion of {T} tokens after a {P}-token prompt needs "
            f"{(P + T) * kv_token / 2**30:.1f} GiB of K/V ({kv_token} bytes a token) and "
            f"{budget / 2**30:.1f} GiB is free for it: lower --max_completion_len or "
            f"--max_prompt_len, or raise --rollout_kv_gib")
    return [(b, b + 1, rows) for b in range(B)]


def generate_in_waves(model, prompt_ids, prompt_mask, group_size, max_new_tokens, kv_budget,
                      eos_token_id, pad_token_id, **kw):
    """generate_groups(..., return_logprobs=True) with at most kv_budget bytes of K/V live at once
    (waves() says how): the same rows, right-padded to the longest; LAST["waves"]: the calls."""
    G, P = group_size, int(prompt_mask.sum(1).max())
    kv_token = kv_bytes_per_token(model.config, next(model.parameters()).element_size())
    outs = []
    for b0, b1, rows in waves(prompt_ids.shape[0], G, P, max_new_tokens, kv_token, kv_budget):
        for g0 in range(0, G, rows):
            outs.append(generate_groups(
                model, prompt_ids[b0:b1], prompt_mask[b0:b1], min(rows, G - g0), max_new_tokens,
                eos_token_id=eos_token_id, pad_token_id=pad_token_id, return_logprobs=True, **kw))
    LAST["waves"] = len(outs)
    pad = (pad_token_id if pad_token_id is not None
           else int(eos_tensor(eos_token_id, prompt_ids.device)[0]))
    C = max(ids.shape[1] for ids, _, _ in outs)
    ids = torch.cat([F.pad(x, (0, C - x.shape[1]), value=pad) for x, _, _ in outs])
    mask = torch.cat([F.pad(x, (0, C - x.shape[1]), value=0) for _, x, _ in outs])
    logps = torch.cat([F.pad(x, (0, C - x.shape[1]), value=0) for _, _, x in outs])
    return ids, mask, logps


# -- generate_groups: prefill, then decode one token at a time -------------------------------------
def cache_arg(model, cache):
    """{name: cache} for model's forward: newer transformers call `past_key_values` `cache`."""
    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def prefill(model, prompt_ids, prompt_mask):
    """the prompts' last logits (B, V), positions (B, P) and per layer K, V (B, kvh, P, D)"""
    pos, cache = positions(prompt_mask), DynamicCache(config=model.config)
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=pos,
                **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
    dev = prompt_ids.device.type  # one K/V dtype for all layers (autocast would mix fp32 and bf16)
    kv_dtype = (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev)
                else cache.layers[0].keys.dtype)
    prefix = [(layer.keys.to(kv_dtype).contiguous(), layer.values.to(kv_dtype).contiguous())
              for layer in cache.layers]
    return out.logits[:, -1], pos, prefix


def draw(rs, logits):
    """(n,) tokens and log-probs from (n, V) logits: sample_triton if it applies, else sample()"""
    if rs.seed is not None:
        return sample_triton(logits, rs.seed, rs.temperature)
    return sample(logits, rs.warpers)


def decode_logits(rs, slots):
    """(n, V) logits for the slots' fed tokens; writes their K/V at column rs.slot (idempotent)"""
    st = SimpleNamespace(layers=rs.layers, rows=slots.rows, done=slots.done, start=rs.start,
                         slot=rs.slot, G=rs.G, impl=rs.attn_impl, rope_attn=rs.rope_attn)
    if rs.fused is not None:
        fn, args = decode_forward, (rs.model, rs.fused, st, slots.tok, slots.pos)
        context = contextlib.nullcontext()  # decode_forward takes the state as an argument
    else:
        fn, args = model_forward, (rs.model, slots.tok, slots.pos)
        context = using_decode_attention(rs.model, st)
    with context:
        return forward_compiled_or_not(rs.model, fn, *args) if rs.compiled else fn(*args)


def decode_one_token(rs, slots):
    """one step: a token per slot, recorded at column rs.slot + 1 of its row (then all advance)"""
    tok, lp = draw(rs, decode_logits(rs, slots))
    record(tok, lp, slots, rs.slot, rs.ids, rs.logps, rs.keep, rs.is_eos, rs.pad)


def make_step(rs, slots):
    """decode_one_token on these slots as a no-argument function: a CUDA graph replay, or eager"""
    step = functools.partial(decode_one_token, rs, slots)
    if not rs.graph:
        return step
    try:
        return graphed(step, functools.partial(decode_logits, rs, slots))
    except Exception as e:  # a failed capture leaves CUDA state (RNG offsets, pools) unusable
        raise RuntimeError("rollout.generate_groups: CUDA graph capture of the decode step failed "
                           "(e.g. a host sync inside this model's forward); "
                           "set rollout.CUDA_GRAPH = False") from e


def decode(rs, slots):
    """tokens 1..T-1, step s feeding token s-1 at completion column s-1; every CHECK_EVERY steps
    the host reads which rows are done, to stop or compact. Returns the number of steps run."""
    step, s = make_step(rs, slots), 1
    while s < rs.T:
        n, n_live = slots.rows.shape[0], int((~slots.done).sum())  # the host sync of this check
        if n_live == 0:
            break
        nb = max(MIN_BUCKET, triton.next_power_of_2(n_live))
        if nb <= n // 2 and rs.T - s >= COMPACT_MIN_STEPS:  # compact: the live slots first (stable)
            order = torch.argsort(slots.done.to(torch.int8), stable=True)[:nb]
            slots = SimpleNamespace(rows=slots.rows[order], tok=slots.tok[order],
                                    pos=slots.pos[order], done=slots.done[order])
            step = make_step(rs, slots)
            LAST["buckets"].append(nb)
        for _ in range(min(CHECK_EVERY, rs.T - s)):
            step()
            s += 1
    return s - 1


@torch.no_grad()
def generate_groups(model, prompt_ids, prompt_mask, group_size, max_new_tokens, temperature=1.0,
                    top_p=1.0, top_k=0, eos_token_id=None, pad_token_id=None,
                    return_logprobs=False, compile=True):
    """G completions per prompt: (B*G, C) right-padded ids and mask (1 through EOS), row b*G + g.
    temperature=0: greedy. eos_token_id: int, list, or () for none. return_logprobs: also (B*G, C)
    float32 log-probs under the warped distribution each token was drawn from, 0 on padding."""
    if prompt_ids.ndim != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError("prompt_ids and prompt_mask must both be (B, P)")
    if not bool((prompt_mask[:, -1] == 1).all()):
        raise ValueError("prompts must be left-padded (last column real); "
                         "use tokenizer.padding_side='left'")
    if group_size < 1 or max_new_tokens < 1 or temperature < 0:
        raise ValueError("need group_size >= 1, max_new_tokens >= 1, temperature >= 0")
    eos_token_id = model.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    if eos_token_id is None:
        raise ValueError("pass eos_token_id (int, list of ints, or () for none)")
    eos = eos_tensor(eos_token_id, prompt_ids.device)
    if pad_token_id is None and len(eos) == 0:
        raise ValueError("pass pad_token_id when there is no eos_token_id")
    pad = int(eos[0]) if pad_token_id is None else pad_token_id
    why = reuse_unsupported(model)  # (our attention needs full attention in every layer)
    impl = model.config._attn_implementation
    if not why and impl not in ("sdpa", "eager"):
        why = f"attn_implementation {impl!r} is not 'sdpa' or 'eager'"
    if why:
        warnings.warn(f"rollout.generate_groups: {why}; sampling with model.generate")
        LAST.clear()
        LAST["path"] = "generate"
        return hf_generate_groups(model, prompt_ids, prompt_mask, group_size, max_new_tokens,
                                  temperature, top_p, top_k, eos, pad, return_logprobs)
    warpers = make_warpers(temperature, top_p, top_k)
    prompt_ids, prompt_mask = trim_left_padding(prompt_ids, prompt_mask.long())
    (B, P), G, T, dev = prompt_ids.shape, group_size, max_new_tokens, prompt_ids.device
    N = B * G
    attn_impl = ("triton" if dev.type == "cuda" else "torch") if ATTENTION == "auto" else ATTENTION
    graph = CUDA_GRAPH and dev.type == "cuda"
    compiled = (compile and T >= COMPILE_MIN_TOKENS
                and (dev.type == "cuda" or COMPILE_BACKEND != "inductor"))
    with sampling(model):
        logits, pos, prefix = prefill(model, prompt_ids, prompt_mask)  # (B, V), (B, P)
        seed = None  # the Triton sampler's, from torch's generator: reproducible under manual_seed
        if temperature > 0 and top_k == 0 and top_p >= 1 and dev.type == "cuda":
            seed = torch.randint(2**62, (1,), device=dev)
        fused = fuse_projections(model) if FUSE else None
        # per layer: prompt K, V and completion K, V (N, kvh, T-1, D), zeros (torch reads them all)
        C = max(T - 1, 1)
        layers = [(k, v, k.new_zeros(N, k.shape[1], C, k.shape[3]),
                   v.new_zeros(N, v.shape[1], C, v.shape[3])) for k, v in prefix]
        rs = SimpleNamespace(
            model=model, G=G, T=T, pad=pad, temperature=temperature, warpers=warpers, seed=seed,
            ids=torch.full((N, T), pad, dtype=torch.long, device=dev),  # every sampled token
            keep=torch.zeros(N, T, dtype=torch.bool, device=dev),  # True through each row's EOS
            logps=torch.zeros(N, T, dtype=torch.float32, device=dev),  # the sampler's log-probs
            is_eos=torch.zeros(logits.shape[-1], dtype=torch.bool, device=dev),  # (V,) a lookup
            layers=layers, start=(P - prompt_mask.sum(1)).to(torch.int32),  # first real column
            slot=torch.zeros(1, dtype=torch.long, device=dev),  # the fed token's column: step - 1
            fused=fused, rope_attn=fused is not None and rope_in_attention(model),
            attn_impl=attn_impl, graph=graph, compiled=compiled)
        rs.is_eos[eos[eos < rs.is_eos.numel()]] = True  # (torch.isin would sync)
        tok, lp = draw(rs, logits.repeat_interleave(G, 0))  # token 0 of every row, (N,)
        rs.ids[:, 0], rs.keep[:, 0], rs.logps[:, 0] = tok, True, lp
        del logits  # (B, V): not needed while decoding
        # slot i decodes cache row rows[i]: (n,) rows, (n, 1) fed token and position, (n,) done
        slots = SimpleNamespace(rows=torch.arange(N, device=dev), tok=tok[:, None].clone(),
                                pos=pos[:, -1:].repeat_interleave(G, 0) + 1, done=rs.is_eos[tok])
        LAST.clear()
        LAST.update(buckets=[N], steps=0, attention=attn_impl, graph=graph,
                    fused=fused is not None, rope="attention" if rs.rope_attn else "torch")
        LAST["steps"] = decode(rs, slots)
        failed = model in UNCOMPILABLE  # (a failure is said once, then not retried)
        LAST["compiled"] = compiled and not failed
        if failed:
            LAST["compile_error"] = UNCOMPILABLE[model]
        uncompiled = "fallback" if failed else "graph" if graph else "eager"
        LAST["path"] = "compiled" if LAST["compiled"] else uncompiled
    n = int(rs.keep.sum(1).max())  # columns after every row had finished are all padding
    ids, keep = rs.ids[:, :n], rs.keep[:, :n].long()
    return (ids, keep, rs.logps[:, :n]) if return_logprobs else (ids, keep)
