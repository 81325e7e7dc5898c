"""
LoRA through PEFT (optional: `pip install peft`, needed only when --lora_r > 0). A projection W (out, in) becomes
    y = x W^T + (alpha / r) * dropout(x) A^T B^T,    A (r, in), B (out, r); B starts at 0, so step 0 is the base model
and only A, B train (float32, in the optimizer); the base stays frozen in the run's dtype, with no float32 master.

The adapters go into the HF model in place (peft.inject_adapter_in_model), so the policy keeps its class and
`model.model.layers`, which kv_reuse, rollout and batching read: a PeftModel wrapper would not. The trainer uses:
    add_lora(model, r, alpha, dropout, targets)   the adapters in, everything else frozen; each LoRA layer's forward
                                                  is lora_forward (the adapter math in the base's dtype, as autocast)
    effective_weight(linear)                      rollout's decode: W + (alpha/r) B A folded once per rollout
    disabled(model)                               the reference model when beta > 0: the base, adapters off
    save_adapter / load_adapter                   ckpt/ as a PEFT adapter directory (PeftModel.from_pretrained loads it)
"""
import contextlib
import os
import types

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # attention + MLP
PREFIX = "base_model.model."  # how a PeftModel names the adapter weights it saves and loads


def targets(spec):
    """--lora_target_modules: comma-separated module names; "" = TARGETS"""
    return tuple(t.strip() for t in spec.split(",") if t.strip()) or TARGETS


def add_lora(model, r, alpha, dropout, targets=TARGETS):
    """LoRA adapters (float32) on every module whose name ends in one of targets; the rest frozen"""
    from peft import LoraConfig, inject_adapter_in_model
    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                                       bias="none", task_type="CAUSAL_LM"), model)
    for p in model.parameters():
        if p.requires_grad:  # (the adapters only)
            p.data = p.data.float()
    for m in model.modules():
        if is_lora(m):
            m.forward = types.MethodType(lora_forward, m)
    return model


def lora_forward(self, x, *args, **kwargs):
    """PEFT's LoRA Linear forward, y = x W^T + s * dropout(x) A^T B^T, but in x's dtype: PEFT computes the adapter in
    float32 (a float32 copy of x, its dropout, two float32 GEMMs and a float32 add per projection: half a 7B LoRA
    update's time). Here A and B are rounded to x's dtype as autocast would (their gradients still reach the float32
    parameters) and the add runs in B's GEMM (addmm). Anything else (DoRA, merged, disabled) is PEFT's own forward."""
    adapters = [a for a in self.active_adapters if a in self.lora_A]
    if self.disable_adapters or self.merged or args or kwargs or any(self.use_dora.get(a) for a in adapters):
        return type(self).forward(self, x, *args, **kwargs)
    y = self.base_layer(x)  # (..., out)
    for a in adapters:
        h = self.lora_dropout[a](x) @ self.lora_A[a].weight.to(x.dtype).t()  # (..., r)
        y = torch.addmm(y.flatten(0, -2), h.flatten(0, -2), self.lora_B[a].weight.to(x.dtype).t(),
                        alpha=self.scaling[a]).view(y.shape)
    return y


def is_lora(module):
    """a PEFT LoRA layer (its base_layer and lora_A/lora_B), duck-typed so that nothing imports peft without LoRA"""
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "scaling")


def effective_weight(linear):
    """(weight, bias) that computes what the module computes at eval: a plain nn.Linear's own, or for a LoRA layer
    W + sum_a (alpha/r)_a B_a A_a (in float32, rounded once to W's dtype), its base's bias; None for anything else
    (DoRA, a merged or disabled adapter, a quantized base: the caller keeps the module's own forward)"""
    if isinstance(linear, torch.nn.Linear) and type(linear).forward is torch.nn.Linear.forward:
        return linear.weight, linear.bias
    if not is_lora(linear):
        return None
    base = linear.base_layer
    if type(base) is not torch.nn.Linear or linear.merged or linear.disable_adapters or \
            any(linear.use_dora.get(a, False) for a in linear.active_adapters):
        return None
    w = base.weight.float()
    for a in linear.active_adapters:
        if a in linear.lora_A:
            w = w + linear.scaling[a] * (linear.lora_B[a].weight.float() @ linear.lora_A[a].weight.float())
    return w.to(base.weight.dtype), base.bias


@contextlib.contextmanager
def disabled(model):
    """the model with every LoRA adapter off (the base model: the reference for beta > 0); back on at exit"""
    layers = [m for m in model.modules() if is_lora(m) and hasattr(m, "enable_adapters")]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def save_adapter(model, path, base_model, r, alpha, dropout, targets):
    """PEFT's adapter directory: adapter_config.json + adapter_model.safetensors (float32), loadable by
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model), path)"""
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets), bias="none",
               task_type="CAUSAL_LM", base_model_name_or_path=base_model).save_pretrained(path)
    state = get_peft_model_state_dict(model)
    save_file({PREFIX + k: v.detach().float().contiguous().cpu() for k, v in state.items()},
              os.path.join(path, "adapter_model.safetensors"))


def load_adapter(model, path):
    """the adapter weights of a save_adapter directory into a model that add_lora prepared with the same config"""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    state = {k.removeprefix(PREFIX): v for k, v in load_file(os.path.join(path, "adapter_model.safetensors")).items()}
    result = set_peft_model_state_dict(model, state)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"{path}: adapter weights that match no LoRA layer of the model: {result.unexpected_keys[:4]}")
