"""specd's own forward of a Llama-shaped decoder over transformers' modules and weights
(``ModelExecutor`` runs it in place of the model's forward wherever it applies).

One layer, with the kernels of ``fused_kernels.py``:

    x, residual = add_rms_norm(h, residual)      # the previous layer's residual add folded in
    qkv = x @ W_qkv                              # one GEMM for q, k and v
    q = rope_and_cache(qkv)                      # rotary on q and k; k and v into the KV cache
    h = o_proj(attend(q))                        # the paged attention of attention.py
    x, residual = add_rms_norm(h, residual)
    h = down_proj(silu_and_mul(x @ W_gate_up))   # one GEMM for gate and up

About a dozen launches a layer where transformers' eager forward makes some forty (its RMSNorm is
eight kernels, its rotary ten, its MLP five), which is what a decode step replayed from a CUDA graph
pays for on a small model. The fused projections are one weight tensor each: the model's own
``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` weights become views into it, so no
memory is added (the separate weights' cached blocks go back to the device) and the model's own
forward (compiled layers, the benchmarks' HF loops) still works. Only plain ``nn.Linear``
projections in the activations' dtype are fused (not FP8 or other quantized layers).

It applies to decoder layers shaped as Llama's (Llama, SmolLM, Qwen2, Mistral: pre-norm RMSNorm,
q/k/v/o projections with optional bias, no q/k norms, SiLU-gated MLP, rotary in the
``rotate_half`` layout), run on one rank, not compiled. ``for_model`` returns None elsewhere and
the executor calls the model's forward; ``SPECD_FUSED_LAYERS=off`` turns it off.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import PreTrainedModel

from worker import fused_kernels, paged_kernel
from worker.attention import PagedMetadata, attend_flat, attention_output
from worker.config import fused_layers_setting

log = logging.getLogger("specd.worker")

LAYER_CLASSES = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer")
NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum(out), in] (and bias) for ``linears``; their own become views into it."""
    weight = torch.cat([m.weight.data for m in linears])
    bias = None
    if linears[0].bias is not None:
        bias = torch.cat([m.bias.data for m in linears])  # type: ignore[union-attr]
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[start : start + n]
        if bias is not None:
            m.bias.data = bias[start : start + n]  # type: ignore[union-attr]
        start += n
    return weight, bias


def _unsupported(model: PreTrainedModel) -> str | None:
    """Why the fused forward cannot run ``model`` (None: it can)."""
    backbone = model.get_decoder()
    if getattr(model, "specd_num_kv_heads", None) is not None:
        return "tensor-parallel ranks run the model's own layers"
    for name in ("layers", "norm", "rotary_emb"):  # embed_tokens: the EAGLE head has none
        if getattr(backbone, name, None) is None:
            return f"the decoder has no {name}"
    cfg = model.config.get_text_config()
    dtype = backbone.norm.weight.dtype
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
        return "its MLP is not SiLU-gated without bias"
    for layer in backbone.layers:
        if type(layer).__name__ not in LAYER_CLASSES:
            return f"{type(layer).__name__} is not a Llama-shaped layer"
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "q_norm"):
            return "its attention has query/key norms"
        # exactly nn.Linear in the activations' dtype: a quantized subclass (FP8Linear and the
        # like) keeps scales beside its weight that a concatenated weight would drop
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            if type(linear) is not nn.Linear or linear.weight.dtype != dtype:
                return f"its projections are {type(linear).__name__} of {linear.weight.dtype}"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if type(norm).__name__ not in NORM_CLASSES:
                return f"{type(norm).__name__} is not transformers' plain RMSNorm"
    if type(backbone.norm).__name__ not in NORM_CLASSES:
        return f"{type(backbone.norm).__name__} is not transformers' plain RMSNorm"
    return None


class FusedDecoder:
    """The fused forward of one model's decoder (``forward``), with its fused weights. One per
    model (``for_model``), shared by every executor that runs it."""

    def __init__(self, model: PreTrainedModel, use_triton: bool) -> None:
        backbone = model.get_decoder()
        cfg = model.config.get_text_config()
        self.backbone = backbone
        self.use_triton = use_triton
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.qkv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.gate_up: list[torch.Tensor] = []
        for layer in backbone.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.qkv.append(_fuse([attn.q_proj, attn.k_proj, attn.v_proj]))
            self.gate_up.append(_fuse([mlp.gate_proj, mlp.up_proj])[0])
        device = backbone.norm.weight.device
        if device.type == "cuda":
            # the separate weights' blocks are free now but cached, too small for the fused
            # ones; hand them back before the KV cache is sized and the graphs are captured
            torch.cuda.empty_cache()

    @staticmethod
    def for_model(model: PreTrainedModel, *, compiled: bool) -> FusedDecoder | None:
        """The fused decoder of ``model`` (a causal LM, or a bare decoder as the EAGLE head's),
        or None where it does not apply (logged)."""
        why = None
        if fused_layers_setting() == "off":
            why = "SPECD_FUSED_LAYERS=off"
        elif compiled:
            why = "--enable-torch-compile compiles the model's own layers"
        found = getattr(model, "_specd_fused_decoder", None)
        if why is None and found is not None:
            return found  # type: ignore[no-any-return]
        why = why or _unsupported(model)
        if why is not None:
            log.info("fused layers off: %s", why)
            return None
        device = next(model.parameters()).device
        cfg = model.config.get_text_config()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # the rotary kernel's tile is the head dim, as the paged kernel's is
        use_triton = device.type == "cuda" and paged_kernel.available(int(head_dim))
        found = FusedDecoder(model, use_triton)
        model._specd_fused_decoder = found  # type: ignore[assignment]
        log.info("fused layers on (%s kernels)", "triton" if use_triton else "torch")
        return found

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedMetadata
    ) -> torch.Tensor:
        """[T] ids and positions -> final hidden states [T, hidden] (after the final norm)."""
        return self.forward_embeds(self.backbone.embed_tokens(input_ids), positions, meta)

    def forward_embeds(
        self, h: torch.Tensor, positions: torch.Tensor, meta: PagedMetadata
    ) -> torch.Tensor:
        """[T, hidden] input embeddings and [T] positions -> final hidden states [T, hidden]."""
        b = self.backbone
        tri = self.use_triton
        cos, sin = b.rotary_emb(h[None], positions[None])  # [1, T, D] each
        cos, sin = cos[0], sin[0]
        residual: torch.Tensor | None = None
        cache = meta.kv_cache
        t = h.shape[0]
        # one attention output for every layer: the kernel writes only requests' rows, so the
        # padding rows are zeroed once, not once a layer
        attn_out = None  # [T, H, D]
        if meta.kernel:
            shape = (t, self.num_heads, cache.keys[0].shape[-1])
            attn_out = attention_output(meta, shape, h.dtype, h.device)
        for i, layer in enumerate(b.layers):
            ln = layer.input_layernorm
            x, residual = fused_kernels.rms_norm(
                h, ln.weight, ln.variance_epsilon, residual, use_triton=tri
            )
            w, bias = self.qkv[i]
            qkv = torch.nn.functional.linear(x, w, bias)  # [T, (H + 2 KVH) * D]
            attn = layer.self_attn
            q = fused_kernels.rope_and_cache(
                qkv,
                cos,
                sin,
                meta.slot_mapping,
                cache.keys[attn.layer_idx],
                cache.values[attn.layer_idx],
                self.num_heads,
                self.num_kv_heads,
                use_triton=tri,
            )  # [T, H, D]
            o = attend_flat(meta, attn.layer_idx, q, attn.scaling, attn_out)  # [T, H, D]
            h = attn.o_proj(o.reshape(t, -1))
            ln = layer.post_attention_layernorm
            x, residual = fused_kernels.rms_norm(
                h, ln.weight, ln.variance_epsilon, residual, use_triton=tri
            )
            gate_up = torch.nn.functional.linear(x, self.gate_up[i])  # [T, 2 I]
            h = layer.mlp.down_proj(fused_kernels.silu_and_mul(gate_up, use_triton=tri))
        final, _ = fused_kernels.rms_norm(
            h, b.norm.weight, b.norm.variance_epsilon, residual, use_triton=tri
        )
        return final
