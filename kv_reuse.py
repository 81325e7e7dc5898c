"""
Prompt KV reuse for GRPO: each prompt is run once per group, its keys/values (with their autograd graph) are
repeated G times, and only the completions run on top of them.

    full path  : B*G*(P+C) tokens through the trunk     (every completion re-reads its whole prompt)
    reuse path : B*(P-1) + B*G*C tokens                  (prefill once, then the G completions attend to it)

completion_hidden() returns the final-norm hidden states that predict each completion token; the caller applies
lm_head (logprobs.py). generate_groups() samples G completions per prompt from one prefill with a KV cache.

Why the prefill must keep its graph: d(loss)/d(prompt K/V) is most of the gradient that reaches the prompt's
positions (TRL PR #2669 ran the prefill under no_grad and lost it). Gradient checkpointing re-runs each decoder
layer in backward, so the caches here never append: the prefill's cache *sets* each layer's K/V once, and the
completion pass's cache returns cat(prefix, new) without storing anything, so a recompute sees the same tensors.
transformers' checkpointing wrapper drops `past_key_values` unless the layer has `_can_checkpoint_with_cache`
(5.17 through 5.23), which we set on the layer instances for the duration of the call.
"""
import contextlib
import json
import math
import sys
import time
import warnings

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.modeling_layers import GradientCheckpointingLayer

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


@contextlib.contextmanager
def cache_through_checkpoint(trunk):
    """Let our caches into checkpointed decoder layers (transformers sets past_key_values=None otherwise)."""
    layers = [m for m in trunk.layers if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
            kw = getattr(getattr(layer, "_gradient_checkpointing_func", None), "keywords", {}) or {}
            if kw.get("use_reentrant", True) is not False:
                # reentrant checkpoint runs the layer under no_grad and only backprops into positional args: the
                # prefix K/V (reached through the cache) would get no gradient at all.
                raise ValueError(
                    "kv_reuse needs non-reentrant gradient checkpointing; enable it with "
                    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})")
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache  # back to the class default


# ----------------------------------------------------------------------------------------------------------------
# helpers


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
    if not hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache"):
        return "this transformers version has no GradientCheckpointingLayer._can_checkpoint_with_cache"
    return ""


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
    if not bool((prompt_mask[:, -1] == 1).all()) or bool((prompt_mask.diff(dim=1) < 0).any()):
        raise ValueError("prompts must be left-padded (mask 0...0 1...1, last column real); use "
                         "tokenizer.padding_side='left'")
    if bool((completion_mask.diff(dim=1) > 0).any()):
        raise ValueError("completions must be right-padded (mask 1...1 0...0)")


# ----------------------------------------------------------------------------------------------------------------
# training / scoring forward


def completion_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size, reuse=True):
    """Final-norm hidden states (B*G, C, H); row t predicts completion token t (row 0 comes from the prompt's last
    position). prompt_* (B, P) left-padded; completion_* (B*G, C) right-padded, row = b*G + g."""
    check_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask, group_size)
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
              past_key_values=capture, use_cache=False)
        prefix = Cache(layers=[PrefixLayer(l.keys, l.values, G) for l in capture.layers])
        # 2) completion pass: [last prompt token, completion[:-1]] (B*G, C) on top of the prefix, so output row t
        # predicts completion token t. The 2D mask covers prefix + new tokens; HF builds causal+padding from it.
        ids = torch.cat([prompt_ids[:, -1:].repeat_interleave(G, 0), completion_ids[:, :-1]], dim=1)
        mask = torch.cat([prompt_mask[:, :-1].repeat_interleave(G, 0), prompt_mask[:, -1:].repeat_interleave(G, 0),
                          completion_mask[:, :-1]], dim=1)  # (B*G, P-1+C)
        pos_c = pos[:, -1:].repeat_interleave(G, 0) + torch.arange(C, device=pos.device)  # continues each prompt
        out = trunk(input_ids=ids, attention_mask=mask, position_ids=pos_c, past_key_values=prefix, use_cache=False)
    return out.last_hidden_state  # (B*G, C, H)


# ----------------------------------------------------------------------------------------------------------------
# generation


def prefill(model, ids, mask, pos, cache):
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1].float()  # (B, V)


def decode_one_token(model, tok, mask, pos, cache):
    out = model(input_ids=tok, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1].float()  # (B*G, V)


def sample(logits, warpers):
    if not warpers:  # temperature 0: greedy
        return logits.argmax(-1)
    for w in warpers:
        logits = w(None, logits)
    return torch.multinomial(torch.softmax(logits, dim=-1), 1).squeeze(1)  # torch's global RNG


@torch.no_grad()
def generate_groups(model, prompt_ids, prompt_mask, group_size, max_new_tokens, temperature=1.0, top_p=1.0,
                    top_k=0, eos_token_id=None, pad_token_id=None):
    """G completions per prompt, (B*G, C) right-padded ids and mask (1 up to and including EOS), row = b*G + g.
    C <= max_new_tokens: generation stops as soon as every row has emitted an EOS."""
    if prompt_ids.ndim != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError("prompt_ids and prompt_mask must both be (B, P)")
    if not bool((prompt_mask[:, -1] == 1).all()):
        raise ValueError("prompts must be left-padded (last column real); use tokenizer.padding_side='left'")
    if group_size < 1 or max_new_tokens < 1 or temperature < 0:
        raise ValueError("need group_size >= 1, max_new_tokens >= 1, temperature >= 0")
    eos_token_id = model.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    if eos_token_id is None:
        raise ValueError("pass eos_token_id (int or list of ints)")
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id),
                       device=prompt_ids.device)
    pad = int(eos[0]) if pad_token_id is None else pad_token_id
    # same warper order as HF generate: temperature, top-k, top-p
    warpers = []
    if temperature > 0:
        warpers += [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
        warpers += [TopKLogitsWarper(top_k)] if top_k > 0 else []
        warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    G, dev = group_size, prompt_ids.device
    was_training = model.training
    model.eval()  # no dropout, no checkpointing while sampling
    try:
        pos = positions(prompt_mask)
        cache = DynamicCache(config=model.config)
        logits = prefill(model, prompt_ids, prompt_mask, pos, cache).repeat_interleave(G, 0)  # (B*G, V)
        cache.batch_repeat_interleave(G)  # (B*G, kvh, P, D) per layer
        mask = prompt_mask.repeat_interleave(G, 0)
        next_pos = pos[:, -1:].repeat_interleave(G, 0) + 1  # (B*G, 1)
        done = torch.zeros(mask.shape[0], dtype=torch.bool, device=dev)
        toks, keep = [], []
        for t in range(max_new_tokens):
            tok = sample(logits, warpers).masked_fill(done, pad)
            toks.append(tok)
            keep.append(~done)
            done = done | torch.isin(tok, eos)
            if t == max_new_tokens - 1 or bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = decode_one_token(model, tok[:, None], mask, next_pos, cache)
            next_pos = next_pos + 1
    finally:
        model.train(was_training)
    return torch.stack(toks, 1), torch.stack(keep, 1).long()  # (B*G, C) each
