"""The lean decode step of `tether.rl.engines.native.sample_responses` for GPT-2, Llama, Mistral
and Qwen2.

Notation: B rows, P prompt width, R new tokens, H query heads, H_kv key/value heads, D head width,
L = the columns filled so far (prompt, then one per step), V vocabulary.

Two decoders with one interface, `step(token [B], alive [B]) -> logits [B, V]`:

- `ModelForward`: the model's own forward for each token, with transformers' DynamicCache. Works
  for any causal LM and wrapper; under FSDP2 each layer's forward runs, so its hooks gather the
  layer's parameters.
- `LeanDecoder`, for GPT-2, Llama, Mistral and Qwen2 (plain, or with peft's LoRA layers injected):
  keys and values live in buffers allocated once for the whole rollout ([B, H_kv, P + R, D] per
  layer), and a step calls the model's own submodules (embeddings, norms, projections with their
  LoRA layers, rotary embedding, MLP, LM head) and writes only the attention over the cache here,
  with the kernel transformers' sdpa path calls (F.scaled_dot_product_attention).

Why (bench/sampling.py, docs/benchmarks.md): on the GRPO benchmark's policy (GPT-2 style, 4 layers
x 256, B = 32) a decode step took ~7 ms on one CPU thread, of which ~3.5 ms are matmuls; ~0.8 ms
was the forward's per-call machinery (a torch.cat per layer per step to grow the cache, the 4D
mask rebuilt from the 2D one, output classes, wrappers). With the prompt's forward run once per
distinct prompt (`prefill`), a rollout of 8 prompts x 4 samples costs ~0.83x the time it did.

Same samples: the lean step computes the forward's function on the same inputs (same modules, same
attention kernel; the masks are the forward's: padding, finished rows fed pads with attention 0,
and a sliding window over cache columns, `kv > q - window`, as transformers' masking_utils
defines it). Logits agree to float rounding, so for given uniforms the tokens are the same
(tests/test_decode.py compares both against the full forward).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

# Exact class names (subclasses may override forward) -> which lean step runs them.
LEAN_ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama",
                      "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "llama"}


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a peft LoRA PeftModel (its LoRA layers stay injected in it)."""
    get_base = getattr(model, "get_base_model", None)
    config = getattr(model, "active_peft_config", None)
    if get_base is not None and config is not None and not config.is_prompt_learning:
        return get_base()
    return model


def _is_sharded(model: nn.Module) -> bool:
    """FSDP2 units (their parameters exist whole only inside their forward) or DTensor weights."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return (any(isinstance(m, FSDPModule) for m in model.modules())
            or any(type(p).__name__ == "DTensor" for p in model.parameters()))


def lean_architecture(model: nn.Module) -> str | None:
    """"gpt2" or "llama" when `LeanDecoder` computes `model`'s forward, else None (use
    `ModelForward`): a known class from transformers, sdpa or eager attention, no dropout active,
    not sharded."""
    model = _unwrap(model)
    kind = LEAN_ARCHITECTURES.get(type(model).__name__)
    config = getattr(model, "config", None)
    if kind is None or not type(model).__module__.startswith("transformers.models."):
        return None
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return None  # flash / flex kernels round differently; keep the model's own path
    if kind == "gpt2" and (config.add_cross_attention or config.reorder_and_upcast_attn):
        return None
    if model.training and (getattr(config, "attention_dropout", 0.0) or any(
            isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())):
        return None  # dropout draws would have to match the forward's
    return None if _is_sharded(model) else kind


class LeanDecoder:
    """Decode steps through the model's submodules over preallocated key/value buffers.

    Build with `LeanDecoder.build` (None when the model is not supported). The buffers hold
    columns 0..P+R-1 of every row; `mask` [B, P + R] is True on the columns a later token may
    attend to (real prompt tokens, tokens of rows alive when fed).
    """

    def __init__(self, model: nn.Module, kind: str, keys: list[torch.Tensor],
                 values: list[torch.Tensor], mask: torch.Tensor, length: int,
                 next_position: torch.Tensor):
        self.model, self.kind = model, kind
        self.keys, self.values = keys, values  # per layer [B, H_kv, P + R, D]
        self.mask = mask  # [B, P + R] bool
        self.length = length  # L: columns filled
        self.next_position = next_position  # [B, 1] position id of the next token
        if kind == "gpt2":
            self.trunk, self.layers = model.transformer, model.transformer.h
            self.windows = [None] * len(self.layers)
        else:
            self.trunk, self.layers = model.model, model.model.layers
            # The model's own rotary helper (Llama, Mistral and Qwen2 each define theirs).
            self.apply_rotary = sys.modules[type(model).__module__].apply_rotary_pos_emb
            self.windows = [_window(model, layer.self_attn) for layer in self.layers]

    @classmethod
    def build(cls, model: nn.Module, cache, attention_mask: torch.Tensor,
              next_position: torch.Tensor, max_new_tokens: int) -> LeanDecoder | None:
        """A decoder continuing from transformers' prefill `cache` (prompt mask [B, P]), or None
        when `model` is not supported (`lean_architecture`)."""
        kind = lean_architecture(model)
        layers = getattr(cache, "layers", None)
        if kind is None or layers is None:
            return None
        batch, width = attention_mask.shape
        columns = width + max_new_tokens
        keys, values = [], []
        for layer in layers:
            kept = layer.keys.shape[-2]  # P, or the last window - 1 columns of a sliding layer
            # Uninitialised is safe: a step reads only columns it has written (>= P) and, of
            # the prompt's, those the layer kept (a window never reaches further back).
            k = layer.keys.new_empty(batch, layer.keys.shape[1], columns, layer.keys.shape[-1])
            v = layer.values.new_empty(batch, layer.values.shape[1], columns,
                                       layer.values.shape[-1])
            k[:, :, width - kept:width] = layer.keys
            v[:, :, width - kept:width] = layer.values
            keys.append(k)
            values.append(v)
        mask = torch.zeros((batch, columns), dtype=torch.bool, device=attention_mask.device)
        mask[:, :width] = attention_mask.bool()
        return cls(_unwrap(model), kind, keys, values, mask, width, next_position)

    @torch.no_grad()
    def step(self, token: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """Feed `token` [B] at the next column (attended to later only where `alive`): logits
        [B, V] for the token after it."""
        column = self.length
        self.mask[:, column] = alive  # finished rows feed pads with attention 0, as in the forward
        self.length += 1
        token = token[:, None]  # [B, 1]
        if self.kind == "gpt2":
            hidden = self._gpt2(token)
        else:
            hidden = self._llama(token)
        self.next_position = self.next_position + 1
        return self.model.lm_head(hidden)[:, -1]

    def _gpt2(self, token: torch.Tensor) -> torch.Tensor:
        """GPT2Model.forward for one new column: [B, 1] ids -> final hidden states [B, 1, d]."""
        trunk = self.trunk
        hidden = trunk.drop(trunk.wte(token) + trunk.wpe(self.next_position))
        for index, block in enumerate(self.layers):
            attn = block.attn
            shape = (token.shape[0], 1, -1, attn.head_dim)
            qkv = attn.c_attn(block.ln_1(hidden)).split(attn.split_size, dim=2)
            query, key, value = (t.view(shape).transpose(1, 2) for t in qkv)  # [B, H, 1, D]
            attended = self._attend(index, query, key, value, attn.scaling)
            hidden = hidden + attn.resid_dropout(attn.c_proj(attended))
            hidden = hidden + block.mlp(block.ln_2(hidden))
        return trunk.ln_f(hidden)

    def _llama(self, token: torch.Tensor) -> torch.Tensor:
        """LlamaModel.forward (Mistral's, Qwen2's) for one new column: [B, 1] -> [B, 1, d]."""
        trunk = self.trunk
        hidden = trunk.embed_tokens(token)
        cos, sin = trunk.rotary_emb(hidden, self.next_position)
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            shape = (token.shape[0], 1, -1, attn.head_dim)
            normed = layer.input_layernorm(hidden)
            query = attn.q_proj(normed).view(shape).transpose(1, 2)  # [B, H, 1, D]
            key = attn.k_proj(normed).view(shape).transpose(1, 2)  # [B, H_kv, 1, D]
            value = attn.v_proj(normed).view(shape).transpose(1, 2)
            query, key = self.apply_rotary(query, key, cos, sin)
            hidden = hidden + attn.o_proj(self._attend(index, query, key, value, attn.scaling))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return trunk.norm(hidden)

    def _attend(self, index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: float) -> torch.Tensor:
        """Store layer `index`'s new key/value [B, H_kv, 1, D] at the current column and attend
        from `query` [B, H, 1, D] over the columns it may see: softmax(q k^T * scaling + mask) v
        (Vaswani et al. 2017, eq. 1). Returns [B, 1, H * D], heads in the forward's order."""
        column = self.length - 1
        self.keys[index][:, :, column] = key[:, :, 0]
        self.values[index][:, :, column] = value[:, :, 0]
        window = self.windows[index]
        # A sliding layer sees kv > q - window (masking_utils.sliding_window_overlay).
        start = 0 if window is None else max(0, column - window + 1)
        keys = self.keys[index][:, :, start:column + 1]  # [B, H_kv, L, D]
        values = self.values[index][:, :, start:column + 1]
        mask = self.mask[:, None, None, start:column + 1]  # [B, 1, 1, L]
        batch, heads, _, dim = query.shape
        # Grouped-query attention: kv head j serves query heads j*G .. j*G + G-1 (repeat_kv's
        # order), so they go in as G query rows of head j instead of repeating the cache.
        grouped = query.reshape(batch, keys.shape[1], heads // keys.shape[1], dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scaling)
        return out.reshape(batch, 1, heads * dim)


def _window(model: nn.Module, attention: nn.Module) -> int | None:
    """A layer's sliding attention window in columns, None for full attention."""
    name = type(model).__name__
    if name == "MistralForCausalLM":
        return getattr(model.config, "sliding_window", None)  # every layer (modeling_mistral)
    if name == "Qwen2ForCausalLM":
        return attention.sliding_window  # the upper layers, per config.layer_types
    return None

