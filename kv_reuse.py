"""
The prompt once: the training forward runs each group's prompt once and its G completions on top
of it, packed into one sequence of real tokens (no padding). A micro-batch of groups is one row:

    [prompt_0[:-1] | p_0 c_00[:-1] | p_0 c_01[:-1] | ... | prompt_1[:-1] | p_1 c_10[:-1] | ...]

where p_b is prompt b's last token: its hidden state predicts a completion's first token, so each
completion segment starts with it. Positions restart at len(prompt_b) - 1 in every segment, and a
token sees key k iff k is at or before it, in its group, and in the prompt or in its own segment
(group[t]: token t's group; seg[t]: its completion, or PROMPT):

    allowed(q, k) = k <= q  and  group[k] == group[q]  and  (seg[k] == PROMPT or seg[k] == seg[q])

Every completion then sees exactly what it saw when it was sampled, and the loss reaches the prompt
through the attention like any other token: no K/V copies, no cache.

    padded:  B*G*(P + C - 1) slots (every completion re-reads its prompt; rows padded)
    packed:  sum over groups of (p - 1) + the completions' real lengths

The attention runs the row as variable-length sequences (pack_layout; flash varlen on a GPU),
the prompt's K/V gathered once per completion segment: autograd sums their G gradients back into
the prompt. Left out: sliding-window and hybrid models, which take the padded full path (as HF).
"""
import contextlib
import functools
import inspect
import sys
import warnings
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn
from transformers import AttentionInterface

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # full-attention decoders we have checked
# torch 2.11 and 2.13 spell causal and GQA differently; older flash takes K/V heads as they are
VARLEN_ARGS = inspect.signature(varlen_attn).parameters
CAUSAL = {"window_size": (-1, 0)} if "window_size" in VARLEN_ARGS else {"is_causal": True}


# the packed row: its layout, its sequences, its attention --------------------------------------
def pack_layout(p_len, c_len, P, C, G, device):
    """The packed row of B groups, built on the host from p_len (B,) prompt lengths and c_len (B*G,)
    completion lengths (P and C the padded widths), then sent to device:
      src (T,) each token's index in cat(prompt_ids.flatten(), completion_ids.flatten())
      pos (T,) its position id
      out (N,) the tokens whose hidden states predict the completion tokens, row-major
      seqs     the attention as variable-length sequences: each group's prompt[:-1] over itself,
               then each completion segment over the keys [its prompt[:-1] ++ itself]. Both
               causal, aligned bottom-right: a segment's query i sees keys up to
               len(prompt) - 1 + i. kv_src (T_k,) the packed token of each key, cu_q and cu_k
               (S+1,) the sequences' starts among the queries and the keys, max_q and max_k,
               and the host bounds [(q0, q1, k0, k1)] of each sequence (for varlen_torch)."""
    B, none = len(p_len), torch.zeros(0, dtype=torch.long)
    src, pos, out, kv_src, bounds = [none], [none], [none], [none], []

    def sequence(q0, q1, keys):  # the queries q0..q1-1 of the row over the tokens keys
        k0 = bounds[-1][3] if bounds else 0
        bounds.append((q0, q1, k0, k0 + len(keys)))
        kv_src.append(keys)
    t = 0  # tokens so far
    for b, p in enumerate(p_len):
        last = b * P + P - 1  # the prompt's last token in the flat prompt ids (left-padded)
        prompt = torch.arange(t, t + p - 1)  # prompt[:-1] in the row
        src.append(torch.arange(last - p + 1, last))
        pos.append(torch.arange(p - 1))
        if p > 1:
            sequence(t, t + p - 1, prompt)
        t += p - 1
        for r in range(b * G, (b + 1) * G):
            c, first = c_len[r], B * P + r * C  # completion r's first token in the flat ids
            if c == 0:
                continue
            own = torch.arange(t, t + c)
            src.append(torch.cat([torch.tensor([last]), torch.arange(first, first + c - 1)]))
            pos.append(torch.arange(p - 1, p - 1 + c))
            out.append(own)
            sequence(t, t + c, torch.cat([prompt, own]))
            t += c
    to_dev = lambda xs: torch.cat(xs).long().to(device, non_blocking=True)  # noqa: E731
    cu_q = torch.tensor([0] + [q1 for _, q1, _, _ in bounds], dtype=torch.int32)
    cu_k = torch.tensor([0] + [k1 for _, _, _, k1 in bounds], dtype=torch.int32)
    seqs = SimpleNamespace(
        kv_src=to_dev(kv_src), cu_q=cu_q.to(device, non_blocking=True),
        cu_k=cu_k.to(device, non_blocking=True), bounds=bounds,
        max_q=max((q1 - q0 for q0, q1, _, _ in bounds), default=0),
        max_k=max((k1 - k0 for _, _, k0, k1 in bounds), default=0))
    return to_dev(src), to_dev(pos), to_dev(out), seqs


@torch.compiler.disable  # a host loop over the sequences: compiled, every layout would recompile
def varlen_torch(q, k, v, m, scale, gqa):
    """The attention of pack_layout's sequences as SDPA, one at a time: the reference, and the
    path on the CPU and in float32 (flash has neither). (T, h, D) queries -> (T, h, D)"""
    out = []
    for q0, q1, k0, k1 in m.bounds:
        mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=q.device)
        mask = mask.tril((k1 - k0) - (q1 - q0))  # bottom-right causal
        out.append(F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=gqa).transpose(0, 1))
    return torch.cat(out)


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """HF attention "nanogrpo_packed": (1, h, T, D) queries over (1, kvh, T, D) keys and values,
    as pack_layout's sequences (attention_mask); flash varlen on a GPU in 16-bit, else
    varlen_torch. GQA inside the kernel (K/V heads are not repeated)."""
    if dropout > 0:
        raise ValueError("the packed attention has no dropout: set attention_dropout=0")
    if torch.is_autocast_enabled(query.device.type):
        # float32 weights under autocast: RoPE leaves q/k in float32 and v in bf16. One dtype here.
        dt = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    m, gqa = attention_mask, query.shape[1] != key.shape[1]
    q = query[0].transpose(0, 1)  # (T, h, D)
    k = key[0].transpose(0, 1)[m.kv_src]  # (T_k, kvh, D): a segment's keys repeat its prompt's
    v = value[0].transpose(0, 1)[m.kv_src]
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        extra = {"enable_gqa": gqa} if "enable_gqa" in VARLEN_ARGS else {}
        out = varlen_attn(q, k, v, m.cu_q, m.cu_k, m.max_q, m.max_k, scale=scaling, **CAUSAL,
                          **extra)
    else:
        out = varlen_torch(q, k, v, m, scaling, gqa)
    return out[None].contiguous(), None  # (1, T, h, D), as HF's attention returns it


AttentionInterface.register("nanogrpo_packed", packed_attention)


@contextlib.contextmanager
def setting(obj, name, value):
    """inside, obj's attribute `name` is value; its old value (False if none) is back on exit"""
    old = getattr(obj, name, False)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def using_packed_attention(model):
    """inside, the model's attention is "nanogrpo_packed" (HF reads it per call)"""
    return setting(model.config, "_attn_implementation", "nanogrpo_packed")


# the forward -----------------------------------------------------------------------------------
def packed_trunk(model, ids, pos, seqs):
    """The decoder over one packed row: embeddings, every layer under the packed attention, the
    final norm -> (1, T, H). A checkpointing model's layers are checkpointed here (HF's function
    and settings), so that a recompute in backward runs under the packed attention again."""
    trunk = model.model
    h = trunk.embed_tokens(ids)  # (1, T, H)
    rope = trunk.rotary_emb(h, pos)  # (cos, sin), each (1, T, D)
    grad = torch.is_grad_enabled()
    for layer in trunk.layers:
        def run(h, layer=layer):  # HF's checkpointing of the layer off: it is checkpointed here
            with using_packed_attention(model), setting(layer, "gradient_checkpointing", False):
                out = layer(h, attention_mask=seqs, position_ids=pos, position_embeddings=rope)
            return out[0] if isinstance(out, tuple) else out
        if getattr(layer, "gradient_checkpointing", False) and layer.training and grad:
            h = layer._gradient_checkpointing_func(run, h)  # HF's checkpoint, as the user set it
        else:
            h = run(h)
    return trunk.norm(h)


def completion_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size,
                      reuse=True, lengths=None):
    """Final-norm hidden states (N, H) of the N completion tokens (completion_mask's ones,
    row-major), each the state that predicts its token. prompt_* (B, P) left-padded;
    completion_* (B*G, C) right-padded. reuse: the packed prompt-once row; else the padded full
    path, every row [prompt, completion[:-1]]. lengths: the prompts' and completions' lengths as
    host lists, from a caller that measured them on these masks (else the inputs are checked and
    measured here: host reads)."""
    if lengths is None:
        check_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask, group_size)
    trunk, G = model.model, group_size
    if reuse and (why := reuse_unsupported(model)):
        warnings.warn(f"kv_reuse: {why}; using the full-sequence path")
        reuse = False
    if not reuse:  # (B*G, P+C-1) tokens
        prompt_ids, prompt_mask = trim_left_padding(prompt_ids, prompt_mask.long())
        P, completion_mask = prompt_ids.shape[1], completion_mask.long()
        ids = torch.cat([prompt_ids.repeat_interleave(G, 0), completion_ids[:, :-1]], dim=1)
        mask = torch.cat([prompt_mask.repeat_interleave(G, 0), completion_mask[:, :-1]], dim=1)
        out = trunk(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                    use_cache=False)
        return out.last_hidden_state[:, P - 1:][completion_mask.bool()]  # (N, H)

    (B, P), C = prompt_ids.shape, completion_ids.shape[1]
    if lengths is None:
        lens = torch.cat([prompt_mask.long().sum(1), completion_mask.long().sum(1)]).tolist()
        lengths = lens[:B], lens[B:]
    src, pos, out, seqs = pack_layout(*lengths, P, C, G, prompt_ids.device)  # (no read-back)
    ids = torch.cat([prompt_ids.flatten(), completion_ids.flatten()])[src]  # (T,)
    h = packed_trunk(model, ids[None], pos[None], seqs)  # (1, T, H)
    return h[0, out]  # (N, H)


# planning the update's micro-batches ------------------------------------------------------------
def micro_batches(prompt_mask, completion_mask, group_size, micro_batch_tokens, reuse=True):
    """Split the B groups into runs [b0, b1) of whole groups within micro_batch_tokens (a lone group
    over it gets its own). Packed (reuse), a group costs its real tokens: p - 1 + its completions'
    lengths; padded, a run of n groups costs n*G*(P + C) at its longest prompt and completion."""
    G = group_size
    p_len = prompt_mask.sum(1).tolist()  # (B,)
    c_rows = completion_mask.sum(1).view(-1, G)  # (B, G)
    c_sum, c_max = c_rows.sum(1).tolist(), c_rows.amax(1).tolist()

    def cost(b0, b1):
        if reuse:
            return sum(p_len[b] - 1 + c_sum[b] for b in range(b0, b1))
        return (b1 - b0) * G * (max(p_len[b0:b1]) + max(c_max[b0:b1]))
    return split_runs(len(p_len), cost, micro_batch_tokens)


def split_runs(n, cost, budget):
    """items 0..n-1 cut greedily into runs [i0, i1) of cost(i0, i1) <= budget, or of one item"""
    out, i0 = [], 0
    for i in range(1, n):
        if cost(i0, i + 1) > budget:
            out.append((i0, i))
            i0 = i
    out.append((i0, n))
    return out


def token_slots(prompt_mask, completion_mask, group_size, packed):
    """(real tokens, token slots) of one forward, 0-dim device tensors (no host sync): packed, the
    real ones (no padding); padded, every row's P + C - 1 columns"""
    B, G = prompt_mask.shape[0], group_size
    if packed:
        real = prompt_mask.sum() - B + completion_mask.sum()
        return real, real
    real = (prompt_mask.sum(1).repeat_interleave(G) + completion_mask.sum(1) - 1).sum()
    return real, real.new_tensor(B * G * (prompt_mask.shape[1] + completion_mask.shape[1] - 1))


# helpers: which models, positions, input checks, compiled pieces, checkpointing ----------------
def positions(mask):
    """Position ids for a left-padded 2D mask, as HF generate makes them (padding: 0)."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 0)


def reuse_unsupported(model):
    """Why the reuse path cannot handle this model, or "" if it can."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    layer_types = getattr(model.config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return (f"layer_types {sorted(set(layer_types))} include non-full attention "
                "(sliding window / hybrid)")
    return ""


def trim_left_padding(ids, mask):
    """Drop the leading columns that are padding in every row (prompts padded to a fixed length)."""
    n = int(mask.sum(1).max())  # the longest prompt
    return ids[:, ids.shape[1] - n:], mask[:, mask.shape[1] - n:]


def check_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask, group_size):
    if prompt_ids.ndim != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask "
                         f"{tuple(prompt_mask.shape)} must both be (B, P)")
    if completion_ids.ndim != 2 or completion_ids.shape != completion_mask.shape:
        raise ValueError(f"completion_ids {tuple(completion_ids.shape)} and completion_mask "
                         f"{tuple(completion_mask.shape)} must both be (B*G, C)")
    B, G = prompt_ids.shape[0], group_size
    if G < 1 or completion_ids.shape[0] != B * G:
        raise ValueError(f"completion rows {completion_ids.shape[0]} != B*G = {B}*{G}; rows are "
                         "prompt-major (row = b*G + g)")
    if prompt_ids.shape[1] < 1 or completion_ids.shape[1] < 1:
        raise ValueError("need at least one prompt and one completion column")
    prompt_mask, completion_mask = prompt_mask.long(), completion_mask.long()
    left_bad = (prompt_mask[:, -1] != 1).any() | (prompt_mask.diff(dim=1) < 0).any()
    right_bad = (completion_mask.diff(dim=1) > 0).any()
    left_bad, right_bad = torch.stack([left_bad, right_bad]).tolist()  # one host sync
    if left_bad:
        raise ValueError("prompts must be left-padded (mask 0...0 1...1, last column real); use "
                         "tokenizer.padding_side='left'")
    if right_bad:
        raise ValueError("completions must be right-padded (mask 1...1 0...0)")


@functools.cache
def compiled(fn):
    """fn compiled once; random ops (LoRA's dropout) draw as eager's do, so the steps are equal."""
    return torch.compile(fn, dynamic=True, options={"fallback_random": True})


@contextlib.contextmanager
def compiled_pieces(model, packed=True):
    """The training pass compiled by torch.compile, set on the instances (RoPE: its module) for the
    update only. packed: every decoder layer whole (projections, RoPE, the packed attention as one
    op, the MLP, the residual adds; its pieces' compiled forwards are traced into the layer's graph)
    and the final RMSNorm; a checkpoint's recompute replays its forward's graph, as a packed row has
    no cache or mask to pick another variant. The padded path (packed=False): the pieces only,
    every RMSNorm, MLP and RoPE; its layers take HF's padding mask, and compiled whole around it
    they run slower than eager on a GPU."""
    if reuse_unsupported(model):  # a model we have not checked: its update stays eager
        yield
        return
    mods = [m for m in model.model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP"))]
    if packed:  # (the layers by their list: FSDP2's fully_shard renames their classes)
        mods += list(model.model.layers)
    # the attention's module by its class's name (FSDP2's fully_shard subclasses the layers).
    # packed: the layer's graph traces RoPE with the rest; a compiled RoPE set beside it (where
    # transformers' `kernels` makes RoPE an nn.Module) would reach dynamo by two paths, an error
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    rope = None if packed else getattr(module, "apply_rotary_pos_emb", None)
    try:
        for m in mods:
            m.forward = compiled(type(m).forward).__get__(m)
        if rope is not None:
            module.apply_rotary_pos_emb = compiled(rope)
        yield
    finally:
        for m in mods:
            m.__dict__.pop("forward", None)  # back to the class's
        if rope is not None:
            module.apply_rotary_pos_emb = rope


def checkpointing_enable(model, use_reentrant=False):
    """Gradient checkpointing, non-reentrant by default (torch's advice), by either HF name."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    enable = enable or model.gradient_checkpointing_enable
    enable({"use_reentrant": use_reentrant})
