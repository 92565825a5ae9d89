"""An EAGLE-style draft head: one decoder layer plus a projection, on the target's hidden states.

At position t it reads the target's hidden state f_t (through ``get_drafter_hidden_states``) and
the embedding of the next token x_{t+1}, projects ``[emb(x_{t+1}), f_t]`` (2H -> H), runs one
Llama decoder layer over the history of such pairs, and predicts f_{t+1}; the target's own LM head
turns that into the distribution of x_{t+2}. The target's embedding and LM head are shared, not
copied: the head's own weights are the projection, the layer and a norm (a few MB for SmolLM2).

Files: ``config.json`` (a LlamaConfig of one layer; ``eagle_target_hidden_size`` and
``eagle_target_vocab_size`` name the target it was trained for) and ``model.safetensors``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# ``--eagle-head embedded``: the head distilled for the embedded SmolLM2-135M
# (bench/train_eagle.py; its loss curve and log sit beside it)
EMBEDDED_HEAD = Path(__file__).parent / "heads" / "smollm2-eagle"


def resolve_head_dir(name: str | Path) -> Path:
    return EMBEDDED_HEAD if str(name) == "embedded" else Path(name)


def head_config(target_config: Any, **overrides: Any) -> LlamaConfig:
    """One decoder layer shaped like the target's (a smaller MLP may be given)."""
    t = target_config.get_text_config()
    values: dict[str, Any] = dict(
        vocab_size=1,  # never used: inputs come as embeddings, logits from the target's head
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=getattr(t, "num_key_value_heads", t.num_attention_heads),
        max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
        rope_theta=getattr(t, "rope_theta", 10000.0),
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        eagle_target_hidden_size=t.hidden_size,
        eagle_target_vocab_size=t.vocab_size,
    )
    values.update(overrides)
    return LlamaConfig(**values)


class EagleHead(nn.Module):
    """``fc`` then ``layers`` (a one-layer LlamaModel fed with ``inputs_embeds``)."""

    def __init__(self, config: LlamaConfig, attn_implementation: str) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = LlamaModel._from_config(config, attn_implementation=attn_implementation)
        self.layers.embed_tokens = None  # inputs are embeddings; the target's are shared

    def forward(
        self,
        token_embeds: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        """token_embeds, target_hidden [B, T, H]; returns the predicted hidden states [B, T, H]."""
        x = self.inputs(token_embeds, target_hidden)
        out = self.layers(inputs_embeds=x, position_ids=position_ids, use_cache=False, **kwargs)
        return out.last_hidden_state

    def inputs(self, token_embeds: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """The layer's input: ``fc`` over each (token embedding, target hidden state) pair."""
        return self.fc(torch.cat([token_embeds, target_hidden], dim=-1))

    def save(self, directory: str | Path) -> None:
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=1))
        # clones: a fused head's q/k/v share one tensor (fused_layers.py), which safetensors refuses
        state = {k: v.detach().clone() for k, v in self.state_dict().items()}
        save_file(state, str(d / WEIGHTS_FILE))

    @classmethod
    def load(
        cls,
        directory: str | Path,
        *,
        attn_implementation: str,
        dtype: torch.dtype,
        device: torch.device,
    ) -> EagleHead:
        from safetensors.torch import load_file

        d = resolve_head_dir(directory)
        raw = json.loads((d / CONFIG_FILE).read_text())
        config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures",)})
        head = cls(config, attn_implementation)
        missing, unexpected = head.load_state_dict(load_file(str(d / WEIGHTS_FILE)), strict=False)
        if missing or unexpected:
            raise ValueError(
                f"EAGLE head {d}: weights do not match its config (missing {missing}, "
                f"unexpected {unexpected})"
            )
        return head.to(device=device, dtype=dtype).eval()
