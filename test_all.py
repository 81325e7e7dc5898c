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

# (kv_reuse checks go here)

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
