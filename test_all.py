"""
nanoGRPO's checks, plain `python test_all.py` (no pytest). One line per check, then `N passed, N failed`.
`python test_all.py WORD` runs only the checks whose name contains WORD.

With no GPU, Triton kernels run under TRITON_INTERPRET=1 (set here, before triton is imported). The interpreter's
tl.dot is wrong on bfloat16 (triton #11584), so CPU parity runs fp32/fp16; bf16 is checked on the GPU only.
"""
import os
import sys
import time
import traceback

import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cuda" if GPU else "cpu"
torch.set_num_threads(max(1, os.cpu_count() or 1))

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def assert_close(got, want, rtol, name=""):
    """relative error ||got - want|| / ||want|| (Frobenius), in float64"""
    got, want = got.double(), want.double()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert err <= rtol, f"{name}: relative error {err:.3e} > {rtol:.1e}"
    return err


def assert_raises(exc, fn, match):
    try:
        fn()
    except exc as e:
        assert match in str(e), f"expected '{match}' in the error, got: {e}"
        return
    raise AssertionError(f"expected {exc.__name__} containing '{match}', nothing was raised")


# ----------------------------------------------------------------------------------------------------------------
# kernel.py / logprobs.py
# ----------------------------------------------------------------------------------------------------------------

# (kernel checks go here)

# ----------------------------------------------------------------------------------------------------------------
# kv_reuse.py
# ----------------------------------------------------------------------------------------------------------------

def _kv_one_thread(fn):
    """tiny-model checks run on 1 thread: with the 2 cores shared, 2 OpenMP threads made them ~50x slower"""
    import functools

    @functools.wraps(fn)
    def run():
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn()
        finally:
            torch.set_num_threads(n)
    return run


def tiny_model(arch="llama", tied=False, **kw):
    """tiny random fp32 *ForCausalLM (GQA 4 heads / 2 kv heads, hidden 64, 2 layers, vocab 100), eval mode.
    kw overrides the config (e.g. attn_implementation="eager", num_hidden_layers=3)."""
    import transformers
    cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[arch]
    cfg = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=tied,
               attention_dropout=0.0, initializer_range=0.1, attn_implementation="sdpa", bos_token_id=1,
               eos_token_id=2, pad_token_id=0)
    cfg.update(kw)
    attn = cfg.pop("attn_implementation")
    config = getattr(transformers, cls[0])(**cfg)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return getattr(transformers, cls[1])(config).float().eval()


def _kv_batch(B=3, P=7, G=3, C=6, prompt_lens=(7, 1, 4), completion_lens=None, vocab=100, seed=0):
    """left-padded prompts, right-padded completions (mixed lengths: one of length 1, one full)"""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab, (B, P), generator=g)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    for b, n in enumerate(prompt_lens[:B]):
        prompt_mask[b, P - n:] = 1
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    completion_ids = torch.randint(3, vocab, (B * G, C), generator=g)
    lens = completion_lens or [1, C] + torch.randint(1, C + 1, (B * G - 2,), generator=g).tolist()
    completion_mask = (torch.arange(C)[None] < torch.tensor(lens)[:, None]).long()
    return prompt_ids, prompt_mask, completion_ids.masked_fill(completion_mask == 0, 0), completion_mask


def _kv_logp(model, hidden, completion_ids):
    """completion log-probs from hidden states, fp32 log_softmax + gather (independent of logprobs.py)"""
    logits = hidden.float() @ model.lm_head.weight.float().T
    return torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None])[..., 0]  # (B*G, C)


def _kv_loss_and_grads(model, batch, G, reuse):
    import kv_reuse
    model.zero_grad(set_to_none=True)
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch
    hidden = kv_reuse.completion_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, G, reuse)
    logp = _kv_logp(model, hidden, completion_ids)
    w = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    (logp * w * completion_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach() * completion_mask, grads


@check
@_kv_one_thread
def test_kv_parity_logp_and_grads():
    """reuse == full path: log-probs to 1e-5, every parameter's grad to 1e-4 relative; GC on (non-reentrant,
    train mode) and off; llama/qwen2/qwen3, tied/untied, sdpa/eager"""
    import kv_reuse
    G = 3
    batch = _kv_batch(G=G)
    cases = [("llama", False, "sdpa"), ("qwen2", True, "sdpa"), ("llama", True, "eager"), ("qwen3", False, "sdpa")]
    calls = {"n": 0}
    update = kv_reuse.PrefixLayer.update

    def counting_update(self, *a, **k):
        calls["n"] += 1
        return update(self, *a, **k)

    for arch, tied, attn in cases:
        for gc in (False, True):
            model = tiny_model(arch, tied, attn_implementation=attn)
            if gc:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            name = f"{arch} tied={tied} {attn} gc={gc}"
            logp_full, grads_full = _kv_loss_and_grads(model, batch, G, reuse=False)
            calls["n"] = 0
            kv_reuse.PrefixLayer.update = counting_update
            try:
                logp_reuse, grads_reuse = _kv_loss_and_grads(model, batch, G, reuse=True)
            finally:
                kv_reuse.PrefixLayer.update = update
            # GC re-runs every layer in backward: the prefix cache must be read twice, and give the same answer
            n_layers = model.config.num_hidden_layers
            assert calls["n"] == n_layers * (2 if gc else 1), f"{name}: {calls['n']} prefix reads"
            err = (logp_reuse - logp_full).abs().max().item()
            assert err <= 1e-5, f"{name}: log-prob max abs error {err:.2e}"
            assert grads_full.keys() == grads_reuse.keys(), f"{name}: different parameters got gradients"
            for n in grads_full:
                assert_close(grads_reuse[n], grads_full[n], 1e-4, f"{name} grad {n}")


@check
@_kv_one_thread
def test_kv_no_grad_and_inference_mode():
    """old/ref log-probs: the reuse path under no_grad and inference_mode equals the full path"""
    import kv_reuse
    G = 3
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch = _kv_batch(G=G, seed=2)
    model = tiny_model("qwen2", tied=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # GC active even without grad
    with torch.no_grad():
        want = _kv_logp(model, kv_reuse.completion_hidden(model, *batch, G, reuse=False), completion_ids)
        got = _kv_logp(model, kv_reuse.completion_hidden(model, *batch, G, reuse=True), completion_ids)
    with torch.inference_mode():
        got_inf = _kv_logp(model, kv_reuse.completion_hidden(model, *batch, G, reuse=True), completion_ids)
    for g_, tag in ((got, "no_grad"), (got_inf, "inference_mode")):
        err = ((g_ - want) * completion_mask).abs().max().item()
        assert err <= 1e-5, f"{tag}: log-prob max abs error {err:.2e}"


@check
@_kv_one_thread
def test_kv_bad_inputs_and_unsupported_models():
    import warnings
    import kv_reuse
    G = 3
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch = _kv_batch(G=G)
    model = tiny_model("llama")
    right_padded = prompt_mask.flip(1)
    assert_raises(ValueError, lambda: kv_reuse.completion_hidden(
        model, prompt_ids, right_padded, completion_ids, completion_mask, G), "left-padded")
    assert_raises(ValueError, lambda: kv_reuse.completion_hidden(
        model, prompt_ids, prompt_mask, completion_ids, completion_mask.flip(1), G), "right-padded")
    assert_raises(ValueError, lambda: kv_reuse.completion_hidden(
        model, prompt_ids, prompt_mask, completion_ids[:-1], completion_mask[:-1], G), "B*G")
    # reentrant checkpointing would silently drop the prompt K/V gradient: refuse it
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    assert_raises(ValueError, lambda: kv_reuse.completion_hidden(model, *batch, G), "use_reentrant")
    # a sliding-window model: one warning, then the full path (never wrong numbers)
    sw = tiny_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert "sliding_attention" in sw.config.layer_types
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = kv_reuse.completion_hidden(sw, *batch, G, reuse=True)
            want = kv_reuse.completion_hidden(sw, *batch, G, reuse=False)
    assert any("full-sequence path" in str(w.message) for w in caught), "no fallback warning"
    assert torch.equal(got, want)


def _kv_generate_reference(model, prompt_ids, prompt_mask, max_new_tokens, eos):
    """model.generate greedy on each prompt alone (unpadded), row by row"""
    rows = []
    for b in range(prompt_ids.shape[0]):
        ids = prompt_ids[b, prompt_mask[b] == 1][None]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=0)
        rows.append(out[0, ids.shape[1]:].tolist())
    return rows


@check
@_kv_one_thread
def test_kv_generate_greedy_matches_hf_generate():
    import kv_reuse
    G, T = 3, 8
    for arch in ("llama", "qwen2"):
        model = tiny_model(arch, tied=arch == "qwen2")
        prompt_ids, prompt_mask, _, _ = _kv_batch(G=G, prompt_lens=(7, 2, 4), seed=3)
        # pick an EOS that greedy decoding really emits mid-way for prompt 0, so stopping is exercised
        free = _kv_generate_reference(model, prompt_ids, prompt_mask, T, eos=99999)
        eos = free[0][3]
        ref = _kv_generate_reference(model, prompt_ids, prompt_mask, T, eos=[eos, 98])
        ids, mask = kv_reuse.generate_groups(model, prompt_ids, prompt_mask, G, T, temperature=0.0,
                                             eos_token_id=[eos, 98], pad_token_id=0)
        assert ids.shape == mask.shape and ids.shape[0] == 3 * G and ids.shape[1] <= T
        for r in range(ids.shape[0]):
            n = int(mask[r].sum())
            want = ref[r // G]
            want = want[:want.index(eos) + 1] if eos in want else want  # up to and including EOS
            assert ids[r, :n].tolist() == want, f"{arch} row {r}: {ids[r, :n].tolist()} != {want}"
            assert mask[r, :n].all() and not mask[r, n:].any() and (ids[r, n:] == 0).all(), f"{arch} row {r} mask"
        n0 = free[0].index(eos) + 1
        assert n0 < T and int(mask[0].sum()) == n0, "EOS must end row 0, with mask 1 on the EOS"


@check
@_kv_one_thread
def test_kv_generate_sampling_reproducible():
    """sampling follows torch's global RNG; top_k=1 is greedy; the G rows of a group are independent samples"""
    import kv_reuse
    G, T = 4, 6
    model = tiny_model("llama")
    prompt_ids, prompt_mask, _, _ = _kv_batch(B=2, G=G, prompt_lens=(7, 3), seed=4)
    kw = dict(eos_token_id=2, pad_token_id=0)
    torch.manual_seed(123)
    a = kv_reuse.generate_groups(model, prompt_ids, prompt_mask, G, T, temperature=2.0, top_p=0.95, **kw)
    torch.manual_seed(123)
    b = kv_reuse.generate_groups(model, prompt_ids, prompt_mask, G, T, temperature=2.0, top_p=0.95, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "same seed, different samples"
    assert len({tuple(r) for r in a[0][:G].tolist()}) > 1, "all G samples of a group are identical"
    greedy = kv_reuse.generate_groups(model, prompt_ids, prompt_mask, G, T, temperature=0.0, **kw)
    top1 = kv_reuse.generate_groups(model, prompt_ids, prompt_mask, G, T, temperature=0.7, top_k=1, **kw)
    assert torch.equal(greedy[0], top1[0]), "top_k=1 sampling != greedy"

# ----------------------------------------------------------------------------------------------------------------
# batching.py / grpo.py
# ----------------------------------------------------------------------------------------------------------------

# (trainer checks go here)

# ----------------------------------------------------------------------------------------------------------------

if __name__ == "__main__":
    words = sys.argv[1:]
    todo = [fn for fn in CHECKS if not words or any(w in fn.__name__ for w in words)]
    print(f"device={DEVICE} torch={torch.__version__} TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}")
    passed = failed = 0
    t_all = time.time()
    for fn in todo:
        t0 = time.time()
        try:
            fn()
            passed += 1
            print(f"PASS {fn.__name__} ({time.time() - t0:.1f}s)", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failing check, keep going
            failed += 1
            print(f"FAIL {fn.__name__} ({time.time() - t0:.1f}s): {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=4)
    print(f"total {time.time() - t_all:.0f}s")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed or not todo else 0)
