"""
LoRA through PEFT (`pip install peft`, needed only for --lora_r > 0). A projection W (out, in) is
    y = x W^T + (alpha / r) * dropout(x) A^T B^T,    A (r, in), B (out, r)
where B starts at 0, so step 0 is the base model. Only A and B train (float32, in the optimizer);
the base stays frozen in the run's dtype, with no float32 master copy. The adapters go into the HF
model in place (peft.inject_adapter_in_model), so the policy keeps its class and
`model.model.layers`, which kv_reuse, rollout and batching read; a PeftModel wrapper would hide
them.
"""
import contextlib
import os
import types

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PREFIX = "base_model.model."  # how a PeftModel names the adapter weights it saves and loads


def targets(spec):
    """--lora_target_modules: comma-separated module names; "" or PEFT's "all-linear" means TARGETS
    (attention + MLP: every Linear but lm_head)."""
    names = tuple(t.strip() for t in spec.split(",") if t.strip())
    return TARGETS if names in ((), ("all-linear",)) else names


def add_lora(model, r, alpha, dropout, targets=TARGETS):
    """Float32 LoRA adapters on every module whose name ends in one of targets; all else frozen."""
    from peft import LoraConfig, inject_adapter_in_model
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in linear)]
    if missing and targets != TARGETS:  # named ones: PEFT adapts those it finds, silent on the rest
        have = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise ValueError(f"--lora_target_modules: no Linear module of this model is named "
                         f"{', '.join(missing)} (its Linear modules: {', '.join(have)})")
    model.requires_grad_(False)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                        bias="none", task_type="CAUSAL_LM")
    inject_adapter_in_model(config, model)
    for p in model.parameters():
        if p.requires_grad:  # the adapters only
            p.data = p.data.float()
    for m in model.modules():
        if is_lora(m):
            m.forward = types.MethodType(lora_forward, m)
    return model


def lora_forward(self, x, *args, **kwargs):
    """PEFT's LoRA Linear forward, y = x W^T + s * dropout(x) A^T B^T, but in x's dtype. PEFT
    computes the adapter in float32 (a float32 copy of x, its dropout, two GEMMs and an add); here
    A and B are rounded to x's dtype as autocast would (their gradients still reach the float32
    parameters) and the add runs inside B's GEMM (addmm)."""
    adapters = [a for a in self.active_adapters if a in self.lora_A]
    dora = any(self.use_dora.get(a) for a in adapters)
    if self.disable_adapters or self.merged or args or kwargs or dora:
        return type(self).forward(self, x, *args, **kwargs)
    y = self.base_layer(x)  # (..., out)
    for a in adapters:
        A, B = self.lora_A[a].weight.to(x.dtype), self.lora_B[a].weight.to(x.dtype)
        h = self.lora_dropout[a](x) @ A.t()  # (..., r)
        out = torch.addmm(y.flatten(0, -2), h.flatten(0, -2), B.t(), alpha=self.scaling[a])
        y = out.view(y.shape)
    return y


def is_lora(module):
    """A PEFT LoRA layer, duck-typed: a run without LoRA never imports peft."""
    return all(hasattr(module, name) for name in ("base_layer", "lora_A", "scaling"))


def effective_weight(linear):
    """(weight, bias) computing what the module computes at eval: a plain nn.Linear's own, or for a
    LoRA layer W + sum_a (alpha/r)_a B_a A_a (in float32, rounded once to W's dtype) and its base's
    bias. None for anything else (DoRA, a merged or disabled adapter, a quantized base)."""
    if isinstance(linear, torch.nn.Linear) and type(linear).forward is torch.nn.Linear.forward:
        return linear.weight, linear.bias
    if not is_lora(linear):
        return None
    base = linear.base_layer
    dora = any(linear.use_dora.get(a, False) for a in linear.active_adapters)
    if type(base) is not torch.nn.Linear or linear.merged or linear.disable_adapters or dora:
        return None
    w = base.weight.float()
    for a in linear.active_adapters:
        if a in linear.lora_A:
            B, A = linear.lora_B[a].weight.float(), linear.lora_A[a].weight.float()
            w = w + linear.scaling[a] * (B @ A)
    return w.to(base.weight.dtype), base.bias


@contextlib.contextmanager
def disabled(model):
    """The model with every LoRA adapter off (the base: the reference for beta > 0), on at exit."""
    layers = [m for m in model.modules() if is_lora(m) and hasattr(m, "enable_adapters")]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def save_adapter(model, path, base_model, r, alpha, dropout, targets):
    """PEFT's adapter directory, adapter_config.json + adapter_model.safetensors (float32), which
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model), path) loads."""
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model)
    config.save_pretrained(path)
    state = get_peft_model_state_dict(model)
    save_file({PREFIX + k: v.detach().float().contiguous().cpu() for k, v in state.items()},
              os.path.join(path, "adapter_model.safetensors"))


def load_adapter(model, path):
    """A save_adapter directory's weights, into a model add_lora prepared with the same config."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    saved = load_file(os.path.join(path, "adapter_model.safetensors"))
    state = {k.removeprefix(PREFIX): v for k, v in saved.items()}
    result = set_peft_model_state_dict(model, state)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"{path}: adapter weights that match no LoRA layer of the model: "
                         f"{result.unexpected_keys[:4]}")
