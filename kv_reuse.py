"""
Prompt KV reuse for GRPO: a group's prompt runs once, with gradients, its keys and values are
repeated G times, and only the G completions run on top of them. The caller applies lm_head to
completion_hidden's output (logprobs.py); rollout.py samples the completions.

    full path:   B*G*(P+C) tokens through the trunk (every completion re-reads its prompt)
    reuse path:  B*(P-1) + B*G*C tokens (the prefill once, then the completions attend to it)

The prefill keeps its graph: the loss reaches the prompt positions only through their K/V. Gradient
checkpointing re-runs each layer in backward, so the caches never append (CaptureLayer, PrefixLayer)
and a recompute sees the same tensors. Left out: sliding-window and hybrid models (full path only).
"""
import contextlib
import functools
import inspect
import sys
import warnings

import torch
from torch.nn.attention.bias import causal_lower_right
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # full-attention decoders we have checked


# caches that are idempotent under gradient-checkpoint recompute -----------------------------------
class CaptureLayer(DynamicLayer):
    """Prefill cache layer: keeps the first K/V it sees (with their graph) and never grows. A
    checkpoint recompute calls update() again; its tensors go to the recomputed attention only."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.keys, self.values, self.is_initialized = key_states, value_states, True
            self.dtype, self.device = key_states.dtype, key_states.device
        return key_states, value_states

    def get_seq_length(self):
        return 0  # the prefill attends only to itself


class PrefixLayer(DynamicLayer):
    """Completion-pass cache layer: a read-only prefix (B, kvh, P', D) shared by G consecutive rows.
    update() returns cat(prefix repeated G times, new) along the sequence and stores nothing."""

    def __init__(self, keys, values, group_size):
        super().__init__()
        self.keys, self.values, self.group_size = keys, values, group_size
        self.is_initialized, self.dtype, self.device = True, keys.dtype, keys.device

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cat(self.keys, key_states), self._cat(self.values, value_states)

    def _cat(self, prefix, new):
        B, kvh, Pp, D = prefix.shape
        G, C = self.group_size, new.shape[-2]
        # One copy: (B, 1, kvh, P', D) broadcast ++ (B, G, kvh, C, D) -> (B, G, kvh, P'+C, D).
        # The expand's backward sums the G gradients into the prefix: dK = sum_g dK^(g).
        out = torch.cat([prefix[:, None].expand(B, G, kvh, Pp, D), new.view(B, G, kvh, C, D)], -2)
        return out.view(B * G, kvh, Pp + C, D)


class LowerRightCausal(torch.Tensor):
    """A 4D stand-in for the (B*G, 1, C, P'+C) mask when no prompt is padded. HF hands a 4D mask to
    the attention function as it is, and there (lower_right_sdpa, or SDPA itself) it becomes torch's
    lower-right CausalBias: query t sees keys <= P'+t, which flash attention does natively, with no
    mask in memory. Right-padded completions need no mask: padding keys all come after real ones."""

    @staticmethod
    def __new__(cls, shape, device):
        empty = torch.zeros((), dtype=torch.bool, device=device).expand(shape)
        return torch.Tensor._make_subclass(cls, empty)

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


def lower_right_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     **kwargs):
    """transformers' "sdpa" attention, except under a LowerRightCausal mask: there the K/V heads go
    to SDPA as they are (enable_gqa), where HF's sdpa would repeat every K/V h/kvh times whenever a
    mask is given (and sum h/kvh gradients in backward). The mask's type picks the branch, not a
    context manager, because a checkpoint recompute runs after completion_hidden has returned."""
    if not isinstance(attention_mask, LowerRightCausal):
        # what "sdpa" is without us: a local override found at install, else the library's, now
        sdpa = HF_SDPA[0] or type(ALL_ATTENTION_FUNCTIONS)._global_mapping["sdpa"]
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                    **kwargs)
    if torch.is_autocast_enabled(query.device.type):
        # CausalBias runs SDPA's kernels below autocast, which would have cast q/k/v to one dtype.
        # Under autocast with float32 weights RoPE leaves q/k in float32 and v in bf16: cast here.
        dt = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    # (N, h, C, D) queries over (N, kvh, P'+C, D) keys: query t sees keys <= P'+t
    mask, gqa = causal_lower_right(query.shape[-2], key.shape[-2]), query.shape[1] != key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None  # (N, C, h, D), as HF's attention returns it


HF_SDPA = []  # [the local "sdpa" override that use_lower_right_sdpa found, or None]


def use_lower_right_sdpa():
    """Route transformers' "sdpa" through lower_right_sdpa (idempotent)."""
    if not HF_SDPA:
        HF_SDPA.append(ALL_ATTENTION_FUNCTIONS._local_mapping.get("sdpa"))
        ALL_ATTENTION_FUNCTIONS["sdpa"] = lower_right_sdpa  # the shared instance's local mapping


@contextlib.contextmanager
def cache_through_checkpoint(trunk):
    """Let our caches into checkpointed decoder layers: transformers' checkpointing wrapper drops
    a layer's cache argument unless the layer has `_can_checkpoint_with_cache`, set for the call."""
    layers = [m for m in trunk.layers if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
            checkpoint_fn = getattr(layer, "_gradient_checkpointing_func", None)
            kw = getattr(checkpoint_fn, "keywords", None) or {}
            if kw.get("use_reentrant", True) is not False:
                # Reentrant checkpointing runs the layer under no_grad and backprops only into
                # positional args: the prefix K/V (reached through the cache) would get no gradient.
                raise ValueError("kv_reuse needs non-reentrant gradient checkpointing "
                                 "(use_reentrant=False); enable it with "
                                 "kv_reuse.checkpointing_enable(model)")
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


@functools.cache
def compiled(fn):
    """fn compiled once; random ops (LoRA's dropout) draw as eager's do, so the steps are equal."""
    return torch.compile(fn, dynamic=True, options={"fallback_random": True})


@contextlib.contextmanager
def compiled_pieces(model):
    """The training pass's small ops fused by torch.compile: every RMSNorm, MLP and RoPE. Pieces,
    not whole layers: the cache update and attention break a layer's graph, and a checkpoint's
    recompute may then pick another compiled variant than its forward did (a CheckpointError); a
    pure piece replays its graph. Set on the instances (RoPE: its module) for the update only."""
    if reuse_unsupported(model):  # a model we have not checked: its update stays eager
        yield
        return
    mods = [m for m in model.model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP"))]
    # the attention's module by its class's name (FSDP2's fully_shard subclasses the layers)
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
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
    """Gradient checkpointing, non-reentrant by default: the kind the reuse path needs. Newer
    transformers renamed gradient_checkpointing_enable to activation_checkpointing_enable."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    enable = enable or model.gradient_checkpointing_enable
    enable({"use_reentrant": use_reentrant})


# the training / scoring forward: its helpers, then completion_hidden ------------------------------
def cache_arg(model, cache):
    """{name: cache} for model's forward: newer transformers call `past_key_values` `cache`."""
    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def positions(mask):
    """Position ids for a padded 2D mask, as HF generate makes them: real token i gets i-1."""
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


def completion_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size,
                      reuse=True):
    """Final-norm hidden states (B*G, C, H); row t predicts completion token t (row 0 comes from the
    prompt's last position). prompt_* (B, P) left-padded; completion_* (B*G, C) right-padded."""
    check_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask, group_size)
    prompt_ids, prompt_mask = trim_left_padding(prompt_ids, prompt_mask.long())
    completion_mask = completion_mask.long()
    trunk, G = model.model, group_size
    (B, P), C = prompt_ids.shape, completion_ids.shape[1]
    if reuse and (why := reuse_unsupported(model)):
        warnings.warn(f"kv_reuse: {why}; using the full-sequence path")
        reuse = False
    if not reuse or P == 1:
        # the full path: every row is [prompt, completion[:-1]], (B*G, P+C-1) tokens
        ids = torch.cat([prompt_ids.repeat_interleave(G, 0), completion_ids[:, :-1]], dim=1)
        mask = torch.cat([prompt_mask.repeat_interleave(G, 0), completion_mask[:, :-1]], dim=1)
        out = trunk(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                    use_cache=False)
        return out.last_hidden_state[:, P - 1:]  # (B*G, C, H)

    pos = positions(prompt_mask)  # (B, P)
    with cache_through_checkpoint(trunk):
        # 1) Prefill prompt[:, :-1] once per group; CaptureLayer keeps each layer's K/V and graph.
        capture = Cache(layers=[CaptureLayer() for _ in trunk.layers])
        trunk(input_ids=prompt_ids[:, :-1], attention_mask=prompt_mask[:, :-1],
              position_ids=pos[:, :-1], **cache_arg(trunk, capture), use_cache=False)
        prefix = Cache(layers=[PrefixLayer(l.keys, l.values, G) for l in capture.layers])
        # 2) The completion pass: [last prompt token, completion[:-1]] (B*G, C) on the prefix.
        ids = torch.cat([prompt_ids[:, -1:].repeat_interleave(G, 0), completion_ids[:, :-1]], 1)
        mask = torch.cat([prompt_mask.repeat_interleave(G, 0), completion_mask[:, :-1]], 1)
        # the completion rows' positions continue their prompt's
        pos_c = pos[:, -1:].repeat_interleave(G, 0) + torch.arange(C, device=pos.device)
        if C > 1 and model.config._attn_implementation == "sdpa" and bool(prompt_mask.all()):
            # No prompt is padded: flash attention, no mask in memory, K/V heads not repeated.
            mask = LowerRightCausal((B * G, 1, C, P - 1 + C), ids.device)
            use_lower_right_sdpa()
        out = trunk(input_ids=ids, attention_mask=mask, position_ids=pos_c,
                    **cache_arg(trunk, prefix), use_cache=False)
    return out.last_hidden_state  # (B*G, C, H)
