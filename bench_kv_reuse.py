"""
Benchmark of kv_reuse.py: one training forward + backward (completion_hidden, then the fused
log-prob loss) with each group's prompt run once in a packed row (reuse) against every completion
re-reading its prompt in a padded batch (full), by prompt length. GPU: a Qwen2.5-0.5B-shaped random model in bf16; CPU: a smoke run.

    python bench_kv_reuse.py
"""
import functools
import sys
import traceback

import torch

from kv_reuse import checkpointing_enable, completion_hidden
from bench_logprobs import free, time_ms
from logprobs import token_logprobs

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
B_, G_, C_ = (4, 8, 256) if CUDA else (2, 4, 16)
PROMPT_LENS = (512, 2048, 4096, 8192) if CUDA else (32, 64)
REPS = 3 if CUDA else 1
LOGP_IMPL = "fused" if CUDA else "chunked"  # as the trainer's logprob_impl=auto picks it


def bench_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    if CUDA:  # Qwen2.5-0.5B's shapes
        shape = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, rope_theta=1e6,
                     intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768)
    else:
        shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, vocab_size=1000, max_position_embeddings=1024)
    config = Qwen2Config(**shape, num_key_value_heads=2, tie_word_embeddings=True,
                         rms_norm_eps=1e-6, attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16 if CUDA else torch.float32)
    checkpointing_enable(model)
    return model.train()


def bench_batch(model, P, mixed=False):
    """Random (B, P) prompts and (B*G, C) completions, unpadded; or, mixed, with prompt lengths in
    [P/2, P] (left-padded) and completion lengths in [C/2, C] (right-padded): both paths mask."""
    g = torch.Generator(device=DEV).manual_seed(P)
    V = model.config.vocab_size
    prompt_ids = torch.randint(3, V, (B_, P), device=DEV, generator=g)
    completion_ids = torch.randint(3, V, (B_ * G_, C_), device=DEV, generator=g)
    lo_p, lo_c = (P // 2, C_ // 2) if mixed else (P, C_)  # the shortest prompt and completion
    n_p = torch.randint(lo_p, P + 1, (B_,), device=DEV, generator=g)
    n_c = torch.randint(lo_c, C_ + 1, (B_ * G_,), device=DEV, generator=g)
    n_p[0], n_c[0] = P, C_
    prompt_mask = (torch.arange(P, device=DEV)[None] >= P - n_p[:, None]).long()  # (B, P)
    completion_mask = (torch.arange(C_, device=DEV)[None] < n_c[:, None]).long()  # (B*G, C)
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def train_step(model, batch, reuse):
    """One fwd+bwd of the mean completion log-prob; returns the masked log-probs (B*G, C)."""
    completion_ids, completion_mask = batch[2:]
    keep = completion_mask.bool()
    h = completion_hidden(model, *batch, G_, reuse=reuse)  # (N, H)
    lp = token_logprobs(h, model.lm_head.weight, completion_ids[keep], entropy=False, impl=LOGP_IMPL)[0]
    (-lp.sum() / keep.sum()).backward()
    return torch.zeros(keep.shape, dtype=lp.dtype, device=lp.device).masked_scatter(keep, lp.detach())


def bench_train(model, P, reuse, mixed=False):
    """Median ms per train_step, peak GiB allocated, the masked log-probs, an error ("" if none)."""
    batch = bench_batch(model, P, mixed)
    step = functools.partial(train_step, model, batch, reuse)
    try:
        model.zero_grad(set_to_none=True)
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        ms = time_ms(step, REPS)  # its untimed first call allocates the grads, as in training
        peak = torch.cuda.max_memory_allocated() / 2**30 if CUDA else None
        return ms, peak, step().float().cpu(), ""
    except Exception as e:  # noqa: BLE001 - a failure (an OOM) is a row that says so
        oom = isinstance(e, torch.OutOfMemoryError)
        if not oom:
            traceback.print_exc()
        return None, None, None, "OOM" if oom else f"{type(e).__name__}: {e}"
    finally:
        model.zero_grad(set_to_none=True)
        free()


def cell(v, spec, err=""):
    """v formatted by spec, right-aligned to its width; without a value, err's start or "-"."""
    text = format(v, spec) if v is not None else (err or "-")[:3]
    return text.rjust(int(spec.split(".")[0]))


def main():
    import transformers
    if not CUDA:
        torch.set_num_threads(1)  # tiny smoke shapes: one thread is faster on a shared CPU
    model = bench_model()
    cfg = model.config
    dev_name = torch.cuda.get_device_name() if CUDA else "cpu"
    print(f"kv_reuse benchmark on {dev_name}: torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {'bf16' if CUDA else 'fp32'}, full: sdpa, reuse: packed "
          f"({'flash varlen' if CUDA else 'SDPA a sequence at a time'}), GC on (non-reentrant), "
          f"loss=logprobs.{LOGP_IMPL}")
    print(f"Qwen2-shaped random model: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
          f"vocab {cfg.vocab_size}; B={B_} G={G_} C={C_}; ms per fwd+bwd (median of {REPS}), "
          "peak GiB")
    print(f"{'P':>6} | {'full ms':>9} {'GiB':>6} | {'reuse ms':>9} {'GiB':>6} | {'speedup':>7} "
          f"{'tokens':>7} | {'max|dlogp|':>10}")
    for P, mixed in [(P, False) for P in PROMPT_LENS] + [(PROMPT_LENS[-2], True)]:
        ms_f, gb_f, lp_f, err_f = bench_train(model, P, reuse=False, mixed=mixed)
        ms_r, gb_r, lp_r, err_r = bench_train(model, P, reuse=True, mixed=mixed)
        p, c = (m.sum(1) for m in bench_batch(model, P, mixed)[1::2])  # real lengths
        ceiling = B_ * G_ * (P + C_ - 1) / float((p - 1).sum() + c.sum())  # padded slots / packed
        speedup = ms_f / ms_r if ms_f and ms_r else None
        diff = None if err_f or err_r else (lp_f - lp_r).abs().max().item()
        full = f"{cell(ms_f, '9.1f', err_f)} {cell(gb_f, '6.2f', err_f)}"
        reuse = f"{cell(ms_r, '9.1f', err_r)} {cell(gb_r, '6.2f', err_r)}"
        print(f"{str(P) + '*' * mixed:>6} | {full} | {reuse} | {cell(speedup, '6.2f')}x "
              f"{ceiling:6.2f}x | {cell(diff, '10.2e')}", flush=True)
    print("     * mixed lengths: prompts in [P/2, P], completions in [C/2, C]")
    print("     tokens: the full path's padded slots B*G*(P+C-1) / the packed row's real tokens, the "
          "speedup if time went with tokens (attention and the LM head do not)")


if __name__ == "__main__":
    sys.exit(main())
