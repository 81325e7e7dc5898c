"""
Prompt KV reuse for GRPO: each prompt is run once per group, its keys/values (with their autograd graph) are repeated
G times, and only the completions run on top of them. The caller applies lm_head to completion_hidden's output
(logprobs.py); sampling the completions is rollout.py's.

    full path  : B*G*(P+C) tokens through the trunk     (every completion re-reads its whole prompt)
    reuse path : B*(P-1) + B*G*C tokens                  (prefill once, then the G completions attend to it)

Why the prefill must keep its graph: the completions' loss reaches the prompt's positions only through their K/V (TRL
PR #2669 ran the prefill under no_grad and lost every weight's gradient from the prompt positions). Gradient
checkpointing re-runs each decoder layer in backward, so the caches here never append (CaptureLayer, PrefixLayer): a
recompute sees the same tensors. transformers' checkpointing wrapper drops a layer's cache argument unless the layer has
`_can_checkpoint_with_cache` (5.17 on), which cache_through_checkpoint sets on the layer instances for the call.

Attention in the completion pass: each of the B*G rows attends its prompt (P-1 keys) plus its own completion,
lower-right causal: HF's mask from our 2D (B*G, P-1+C) padding mask, or none if no prompt is padded (LowerRightCausal).
"""
import contextlib
import functools
import inspect
import sys
import traceback
import warnings

import torch
from torch.nn.attention.bias import causal_lower_right
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from logprobs import free, time_ms, token_logprobs

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # full-attention decoders whose trunk we have checked

# ----------------------------------------------------------------------------------------------------------------
# caches that are idempotent under gradient-checkpoint recompute


class CaptureLayer(DynamicLayer):
    """Prefill cache layer: keeps the first K/V it sees (with their graph) and never grows. A checkpoint recompute
    calls update() again with recomputed tensors; those are returned for the recomputed attention, not stored."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.keys, self.values, self.is_initialized = key_states, value_states, True
            self.dtype, self.device = key_states.dtype, key_states.device
        return key_states, value_states

    def get_seq_length(self):
        return 0  # the prefill attends only to itself


class PrefixLayer(DynamicLayer):
    """Completion-pass cache layer: a read-only prefix (B, kvh, P', D) shared by G consecutive rows. update() returns
    cat(prefix repeated G times, new) along the sequence and stores nothing."""

    def __init__(self, keys, values, group_size):
        super().__init__()
        self.keys, self.values, self.group_size, self.is_initialized = keys, values, group_size, True
        self.dtype, self.device = keys.dtype, keys.device

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cat(self.keys, key_states), self._cat(self.values, value_states)

    def _cat(self, prefix, new):
        B, kvh, Pp, D = prefix.shape
        G, C = self.group_size, new.shape[-2]
        # one copy: (B, 1, kvh, P', D) broadcast view ++ (B, G, kvh, C, D) -> (B, G, kvh, P'+C, D). The expand's
        # backward sums the G gradients into the prefix, i.e. dK_prompt = sum_g dK_prompt^(g).
        out = torch.cat([prefix[:, None].expand(B, G, kvh, Pp, D), new.view(B, G, kvh, C, D)], dim=-2)
        return out.view(B * G, kvh, Pp + C, D)


class LowerRightCausal(torch.Tensor):
    """4D stand-in for the (B*G, 1, C, P'+C) mask when no row has padding in its prompt. HF hands a 4D mask as given to
    the attention function (lower_right_sdpa), which runs torch's lower-right CausalBias instead, as SDPA itself would
    here: query t sees keys <= P'+t, which flash attention does natively (no mask in memory, no mem-efficient fallback).
    Right padding of the completions needs no mask: a real query never reaches a padding key (all come after it)."""

    @staticmethod
    def __new__(cls, shape, device):
        return torch.Tensor._make_subclass(cls, torch.zeros((), dtype=torch.bool, device=device).expand(shape))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k = args[0], args[1]
            kwargs.pop("is_causal", None)
            kwargs["attn_mask"] = causal_lower_right(q.shape[-2], k.shape[-2])
            return func(*args[:3], **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def lower_right_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' "sdpa" attention, except for a LowerRightCausal mask: there the K/V heads go to SDPA as they are
    (enable_gqa), where HF's sdpa repeats them to the query heads whenever a mask is given (use_gqa_in_sdpa): for
    Qwen2.5-0.5B that is 7 copies of every (B*G, kvh, P'+C, D) K/V in forward and recompute, and a 7-way sum in
    backward. The mask type picks the branch, not a context: a checkpoint recompute runs after completion_hidden."""
    if not isinstance(attention_mask, LowerRightCausal):  # what "sdpa" would be without us, looked up per call
        sdpa = HF_SDPA[0] or type(ALL_ATTENTION_FUNCTIONS)._global_mapping["sdpa"]  # (AttentionInterface.register)
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if torch.is_autocast_enabled(query.device.type):
        # CausalBias hands SDPA to the kernels below autocast, which would have cast q/k/v to one dtype; under
        # autocast with float32 weights RoPE leaves q/k float32 and v bf16, so cast them here as autocast would
        dt = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    # (N, h, C, D) queries over (N, kvh, P'+C, D) keys: query t sees keys <= P'+t (flash: is_causal, bottom-right)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=causal_lower_right(query.shape[-2], key.shape[-2]), dropout_p=dropout,
        scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None  # (N, C, h, D), as HF's attention functions return it


HF_SDPA = []  # [a local "sdpa" override found at install, or None: then the library-wide one, at each call]


def use_lower_right_sdpa():
    """route transformers' "sdpa" through lower_right_sdpa (idempotent); every other mask goes where it went"""
    if not HF_SDPA:
        HF_SDPA.append(ALL_ATTENTION_FUNCTIONS._local_mapping.get("sdpa"))
        ALL_ATTENTION_FUNCTIONS["sdpa"] = lower_right_sdpa  # the shared instance's local mapping


@contextlib.contextmanager
def cache_through_checkpoint(trunk):
    """Let our caches into checkpointed decoder layers (the module docstring says why)."""
    layers = [m for m in trunk.layers if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
            kw = getattr(getattr(layer, "_gradient_checkpointing_func", None), "keywords", {}) or {}
            if kw.get("use_reentrant", True) is not False:
                # reentrant checkpoint runs the layer under no_grad and only backprops into positional args: the
                # prefix K/V (reached through the cache) would get no gradient at all.
                raise ValueError("kv_reuse needs non-reentrant gradient checkpointing (use_reentrant=False); "
                                 "enable it with kv_reuse.checkpointing_enable(model)")
    saved = [layer.__dict__.get("_can_checkpoint_with_cache") for layer in layers]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer, v in zip(layers, saved):
            if v is None:
                del layer._can_checkpoint_with_cache  # back to the class default
            else:
                layer._can_checkpoint_with_cache = v


# torch.compile once a process per function (a new wrapper compiles again); random ops (LoRA's dropout) draw as eager's
# do, so a compiled step equals the eager one
compiled = functools.cache(lambda fn: torch.compile(fn, dynamic=True, options={"fallback_random": True}))


@contextlib.contextmanager
def compiled_pieces(model):
    """The training pass's small ops fused by torch.compile: every RMSNorm (float32 inside, ~8 kernels each way), MLP
    (SiLU(gate) * up between its GEMMs) and RoPE (rotate_half: slices, neg, cat, multiply-adds). Pieces, not whole
    layers: the cache update and attention break a layer's graph, and then a checkpoint's recompute may select another
    compiled variant than its forward did (CheckpointError, torch #166926); a pure piece replays its forward's graph.
    Set on the instances (RoPE: the model's module) for the update only; the rollout compiles its decode its own way."""
    if reuse_unsupported(model):  # llama, qwen2, qwen3: what this was run on; another model's update stays eager
        yield
        return
    mods = [m for m in model.model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP"))]
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]  # (FSDP2's fully_shard subclasses layers)
    rope = getattr(module, "apply_rotary_pos_emb", None)
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
    """gradient checkpointing, non-reentrant by default: the kind the reuse path needs. transformers 5.23 renamed
    gradient_checkpointing_enable (which warns there) to activation_checkpointing_enable."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": use_reentrant})


# ----------------------------------------------------------------------------------------------------------------
# training / scoring forward: its helpers, then completion_hidden


def cache_arg(model, cache):
    """{name: cache} for model's forward: transformers 5.24 renamed `past_key_values` (which then warns) to `cache`"""
    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def positions(mask):
    """position ids for a padded 2D mask, as HF generate makes them: the i-th real token gets position i-1."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 0)


def reuse_unsupported(model):
    """why the reuse path cannot handle this model, or '' if it can"""
    config = model.config
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model_type {getattr(config, 'model_type', None)!r} is not one of {SUPPORTED_MODEL_TYPES}"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"layer_types {sorted(set(layer_types))} include non-full attention (sliding window / hybrid)"
    return ""


def trim_left_padding(ids, mask):
    """drop leading columns that are padding in every row (prompts padded to a fixed max length)"""
    n = int(mask.sum(1).max())  # longest prompt
    return ids[:, ids.shape[1] - n:], mask[:, mask.shape[1] - n:]


def check_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask, group_size):
    if prompt_ids.ndim != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)} must both "
                         "be (B, P)")
    if completion_ids.ndim != 2 or completion_ids.shape != completion_mask.shape:
        raise ValueError(f"completion_ids {tuple(completion_ids.shape)} and completion_mask "
                         f"{tuple(completion_mask.shape)} must both be (B*G, C)")
    B, G = prompt_ids.shape[0], group_size
    if G < 1 or completion_ids.shape[0] != B * G:
        raise ValueError(f"completion rows {completion_ids.shape[0]} != B*G = {B}*{G}; rows are prompt-major "
                         "(row = b*G + g)")
    if prompt_ids.shape[1] < 1 or completion_ids.shape[1] < 1:
        raise ValueError("need at least one prompt and one completion column")
    prompt_mask, completion_mask = prompt_mask.long(), completion_mask.long()
    left_bad, right_bad = torch.stack([(prompt_mask[:, -1] != 1).any() | (prompt_mask.diff(dim=1) < 0).any(),
                                       (completion_mask.diff(dim=1) > 0).any()]).tolist()  # one host sync
    if left_bad:
        raise ValueError("prompts must be left-padded (mask 0...0 1...1, last column real); use "
                         "tokenizer.padding_side='left'")
    if right_bad:
        raise ValueError("completions must be right-padded (mask 1...1 0...0)")


def completion_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size, reuse=True):
    """Final-norm hidden states (B*G, C, H); row t predicts completion token t (row 0 comes from the prompt's last
    position). prompt_* (B, P) left-padded; completion_* (B*G, C) right-padded, row = b*G + g."""
    check_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask, group_size)
    prompt_ids, prompt_mask = trim_left_padding(prompt_ids, prompt_mask.long())
    completion_mask = completion_mask.long()
    trunk, G = model.model, group_size
    (B, P), C = prompt_ids.shape, completion_ids.shape[1]
    if reuse and (why := reuse_unsupported(model)):
        warnings.warn(f"kv_reuse: {why}; using the full-sequence path")
        reuse = False
    if not reuse or P == 1:
        # full path: every row is [prompt, completion[:-1]], (B*G, P+C-1) tokens
        ids = torch.cat([prompt_ids.repeat_interleave(G, 0), completion_ids[:, :-1]], dim=1)
        mask = torch.cat([prompt_mask.repeat_interleave(G, 0), completion_mask[:, :-1]], dim=1)
        out = trunk(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False)
        return out.last_hidden_state[:, P - 1:]  # (B*G, C, H)

    pos = positions(prompt_mask)  # (B, P)
    with cache_through_checkpoint(trunk):
        # 1) prefill prompt[:, :-1] once per group; CaptureLayer keeps each layer's K/V with its graph
        capture = Cache(layers=[CaptureLayer() for _ in trunk.layers])
        trunk(input_ids=prompt_ids[:, :-1], attention_mask=prompt_mask[:, :-1], position_ids=pos[:, :-1],
              **cache_arg(trunk, capture), use_cache=False)
        prefix = Cache(layers=[PrefixLayer(l.keys, l.values, G) for l in capture.layers])
        # 2) completion pass: [last prompt token, completion[:-1]] (B*G, C) on top of the prefix
        ids = torch.cat([prompt_ids[:, -1:].repeat_interleave(G, 0), completion_ids[:, :-1]], dim=1)
        mask = torch.cat([prompt_mask[:, :-1].repeat_interleave(G, 0), prompt_mask[:, -1:].repeat_interleave(G, 0),
                          completion_mask[:, :-1]], dim=1)  # (B*G, P-1+C)
        pos_c = pos[:, -1:].repeat_interleave(G, 0) + torch.arange(C, device=pos.device)  # continues each prompt
        if C > 1 and model.config._attn_implementation == "sdpa" and bool(prompt_mask.all()):
            mask = LowerRightCausal((B * G, 1, C, P - 1 + C), ids.device)  # flash, no materialized mask
            use_lower_right_sdpa()  # ...with the K/V heads unrepeated
        out = trunk(input_ids=ids, attention_mask=mask, position_ids=pos_c, **cache_arg(trunk, prefix), use_cache=False)
    return out.last_hidden_state  # (B*G, C, H)


# ----------------------------------------------------------------------------------------------------------------
# benchmark: `python kv_reuse.py` (GPU: Qwen2.5-0.5B-shaped random model, bf16, SDPA, GC on; CPU: tiny smoke run)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
B_, G_, C_ = (4, 8, 256) if CUDA else (2, 4, 16)
PROMPT_LENS = (512, 2048, 4096, 8192) if CUDA else (32, 64)
REPS = 3 if CUDA else 1
LOGP_IMPL = "fused" if CUDA else "chunked"  # logprobs.py's, as the trainer's logprob_impl=auto picks it


def bench_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    if CUDA:  # Qwen2.5-0.5B shapes
        shape = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                     intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6)
    else:
        shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=1000, max_position_embeddings=1024)
    config = Qwen2Config(**shape, tie_word_embeddings=True, rms_norm_eps=1e-6, attention_dropout=0.0,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16 if CUDA else torch.float32)
    checkpointing_enable(model)
    return model.train()


def bench_batch(model, P, mixed=False):
    """random (B, P) prompts and (B*G, C) completions. mixed=False: no padding anywhere (the full path gets flash +
    is_causal); mixed=True: prompt lengths in [P/2, P] (left-padded) and completion lengths in [C/2, C]
    (right-padded), the first of each full, so both paths need a mask."""
    g = torch.Generator(device=DEV).manual_seed(P)
    V = model.config.vocab_size
    prompt_ids = torch.randint(3, V, (B_, P), device=DEV, generator=g)
    completion_ids = torch.randint(3, V, (B_ * G_, C_), device=DEV, generator=g)
    n_p = torch.randint(P // 2, P + 1, (B_,), device=DEV, generator=g) if mixed else torch.full((B_,), P, device=DEV)
    n_c = torch.randint(C_ // 2, C_ + 1, (B_ * G_,), device=DEV, generator=g) if mixed else torch.full(
        (B_ * G_,), C_, device=DEV)
    n_p[0], n_c[0] = P, C_
    prompt_mask = (torch.arange(P, device=DEV)[None] >= P - n_p[:, None]).long()  # (B, P) left-padded
    completion_mask = (torch.arange(C_, device=DEV)[None] < n_c[:, None]).long()  # (B*G, C) right-padded
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def train_step(model, batch, reuse):
    """one fwd+bwd of the benchmark's loss, the mean completion log-prob; returns the masked log-probs (B*G, C)"""
    completion_ids, completion_mask = batch[2:]
    h = completion_hidden(model, *batch, G_, reuse=reuse)
    lp = token_logprobs(h, model.lm_head.weight, completion_ids, entropy=False, impl=LOGP_IMPL)[0].view(B_ * G_, C_)
    (-(lp * completion_mask).sum() / completion_mask.sum()).backward()
    return lp.detach() * completion_mask


def bench_train(model, P, reuse, mixed=False):
    """median ms per fwd+bwd (train_step), peak GiB allocated, the masked log-probs, and an error ("" if none)"""
    batch = bench_batch(model, P, mixed)
    step = lambda: train_step(model, batch, reuse)  # noqa: E731
    try:
        model.zero_grad(set_to_none=True)
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        ms = time_ms(step, REPS)  # (its untimed first call allocates the grads, as in training)
        peak = torch.cuda.max_memory_allocated() / 2**30 if CUDA else None
        return ms, peak, step().float().cpu(), ""
    except Exception as e:  # noqa: BLE001 - an OOM (or any failure) is a row that says so, not a dead benchmark
        oom = isinstance(e, torch.OutOfMemoryError)
        if not oom:
            traceback.print_exc()
        return None, None, None, "OOM" if oom else f"{type(e).__name__}: {e}"
    finally:
        model.zero_grad(set_to_none=True)
        free()


def main():
    import transformers
    if not CUDA:
        torch.set_num_threads(1)  # tiny smoke shapes; the shared CPU is faster on one thread
    model = bench_model()
    dev_name = torch.cuda.get_device_name() if CUDA else "cpu"
    print(f"kv_reuse benchmark on {dev_name}: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{'bf16' if CUDA else 'fp32'}, sdpa, GC on (non-reentrant), loss=logprobs.{LOGP_IMPL}")
    print(f"Qwen2-shaped random model: hidden {model.config.hidden_size}, {model.config.num_hidden_layers} layers, "
          f"vocab {model.config.vocab_size}; B={B_} G={G_} C={C_}; ms per fwd+bwd (median of {REPS}), peak GiB")
    print(f"{'P':>6} | {'full ms':>9} {'GiB':>6} | {'reuse ms':>9} {'GiB':>6} | {'speedup':>7} {'tokens':>7} | "
          f"{'max|dlogp|':>10}")
    for P, mixed in [(P, False) for P in PROMPT_LENS] + [(PROMPT_LENS[-2], True)]:
        ms_f, gb_f, lp_f, err_f = bench_train(model, P, reuse=False, mixed=mixed)
        ms_r, gb_r, lp_r, err_r = bench_train(model, P, reuse=True, mixed=mixed)
        ceiling = B_ * G_ * (P + C_) / (B_ * (P + G_ * C_))
        speedup = ms_f / ms_r if ms_f and ms_r else None
        diff = (lp_f - lp_r).abs().max().item() if lp_f is not None and lp_r is not None else None
        fmt = lambda v, spec, err="": (format(v, spec) if v is not None else (err or "-")[:3]).rjust(
            int(spec.split(".")[0]))
        print(f"{str(P) + '*' * mixed:>6} | {fmt(ms_f, '9.1f', err_f)} {fmt(gb_f, '6.2f', err_f)} | "
              f"{fmt(ms_r, '9.1f', err_r)} {fmt(gb_r, '6.2f', err_r)} | {fmt(speedup, '6.2f')}x {ceiling:6.2f}x | "
              f"{fmt(diff, '10.2e')}", flush=True)
    print("     * mixed lengths: prompts in [P/2, P] left-padded, completions in [C/2, C] right-padded (mask path)")
    print("     tokens: B*G*(P+C) / B*(P+G*C), the speedup if time went with tokens (attention and the LM head do not)")


if __name__ == "__main__":
    sys.exit(main())
