"""Compact Llama / Qwen2 / Qwen3 decoder built from a Hugging Face folder, with KV-cache prefill and decode."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import safe_open

from qurl.cpu_kernels import usable
from qurl.quant import Scheme
from rollout_server.engines.linear import LINEARS, Int8Head, dense_linear

MODEL_TYPES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the decoder needs, read from config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v (and for llama/qwen3 also o) projections carry a bias
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        """Parse `path`/config.json; unsupported architectures fail with one line."""
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in {path}")
        with open(cfg_path) as f:
            c = json.load(f)
        model_type = c.get("model_type")
        if model_type not in MODEL_TYPES:
            supported = ", ".join(MODEL_TYPES)
            raise ValueError(f"unsupported architecture {model_type!r} in {cfg_path}; supported: {supported}")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {c['hidden_act']!r} in {cfg_path}; supported: silu")
        if c.get("use_sliding_window") or any(t != "full_attention" for t in c.get("layer_types") or []):
            raise ValueError(f"sliding-window attention in {cfg_path} is not supported")
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type")) or "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r} in {cfg_path}; supported: {', '.join(ROPE_TYPES)}")
        heads = c["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            intermediate_size=c["intermediate_size"],
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
            rope_scaling=rope if rope_type == "llama3" else None,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(c.get("attention_bias", False)),
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
        )

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the decoder reads from the checkpoint, with its shape."""
        hidden, inter = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {"model.embed_tokens.weight": (self.vocab_size, hidden), "model.norm.weight": (hidden,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, hidden)
        o_bias = self.attention_bias and self.model_type != "qwen2"
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (hidden,)
            projs = {
                "self_attn.q_proj": (q, hidden),
                "self_attn.k_proj": (kv, hidden),
                "self_attn.v_proj": (kv, hidden),
                "self_attn.o_proj": (hidden, q),
                "mlp.gate_proj": (inter, hidden),
                "mlp.up_proj": (inter, hidden),
                "mlp.down_proj": (hidden, inter),
            }
            for name, shape in projs.items():
                shapes[p + name + ".weight"] = shape
                attn = name.startswith("self_attn")
                attn_bias = self.attention_bias and (name != "self_attn.o_proj" or o_bias)
                if (attn and attn_bias) or (not attn and self.mlp_bias):
                    shapes[p + name + ".bias"] = shape[:1]
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = shapes[p + "self_attn.k_norm.weight"] = (self.head_dim,)
        return shapes


def load_safetensors(path: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Read the tensors named in `shapes` from model.safetensors or the shards of model.safetensors.index.json."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        missing = [n for n in shapes if n not in weight_map]
        if missing:
            raise ValueError(f"missing tensor {missing[0]!r} in {index_path} ({len(missing)} missing)")
        by_file: dict[str, list[str]] = {}
        for n in shapes:
            by_file.setdefault(weight_map[n], []).append(n)
    elif os.path.isfile(single):
        by_file = {"model.safetensors": list(shapes)}
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    out: dict[str, torch.Tensor] = {}
    for fname, wanted in by_file.items():
        fpath = os.path.join(path, fname)
        if not os.path.isfile(fpath):
            raise FileNotFoundError(f"shard {fpath} named in the index does not exist")
        with safe_open(fpath, framework="pt") as f:
            present = set(f.keys())
            for n in wanted:
                if n not in present:
                    raise ValueError(f"missing tensor {n!r} in {fpath}")
                out[n] = f.get_tensor(n)
                if tuple(out[n].shape) != shapes[n]:
                    raise ValueError(
                        f"tensor {n!r} in {fpath} has shape {tuple(out[n].shape)}, config.json implies {shapes[n]}"
                    )
    return out


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (fp32) for the default or llama3-scaled rotary embedding."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    if cfg.rope_scaling is None:
        return inv_freq
    s = cfg.rope_scaling
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def own(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A private copy: never keep a view of a memory-mapped checkpoint that a trainer may overwrite."""
    return t.to(device=device, dtype=dtype, copy=True).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in at least fp32 and scaled in the model dtype, as the HF families do."""
    k = usable(x)
    if k is not None and x.dim() == 2 and x.is_contiguous() and weight.dtype == x.dtype and weight.is_contiguous():
        return k.rms_norm(x, weight, eps)
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class Layer:
    """One decoder block's tensors: norms, fused q/k/v, o, fused gate/up, down."""

    def __init__(self, cfg: ModelConfig, i: int, tensors: dict, scheme: Scheme, dtype, device) -> None:
        p = f"model.layers.{i}."
        linear = LINEARS[scheme.name]
        a, m = p + "self_attn.", p + "mlp."
        self.input_norm = own(tensors[p + "input_layernorm.weight"], dtype, device)
        self.post_norm = own(tensors[p + "post_attention_layernorm.weight"], dtype, device)
        self.qkv = linear([a + "q_proj", a + "k_proj", a + "v_proj"], tensors, dtype, device)
        self.o = linear([a + "o_proj"], tensors, dtype, device)
        self.gate_up = linear([m + "gate_proj", m + "up_proj"], tensors, dtype, device)
        self.down = linear([m + "down_proj"], tensors, dtype, device)
        self.named = {
            p + "input_layernorm.weight": self.input_norm,
            p + "post_attention_layernorm.weight": self.post_norm,
        }
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = own(tensors[a + "q_norm.weight"], dtype, device)
            self.k_norm = own(tensors[a + "k_norm.weight"], dtype, device)
            self.named.update({a + "q_norm.weight": self.q_norm, a + "k_norm.weight": self.k_norm})
        self.linears = (self.qkv, self.o, self.gate_up, self.down)
        for lin in self.linears:
            self.named.update(lin.named)


class Transformer:
    """The decoder over a KV cache shaped [layers, slots, kv_heads, max_seq_len, head_dim]."""

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: dict[str, torch.Tensor],
        scheme: Scheme,
        dtype: torch.dtype,
        device: torch.device,
        max_seq_len: int,
        int8_lm_head: bool = False,
    ) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.embed = own(tensors["model.embed_tokens.weight"], dtype, device)
        self.norm = own(tensors["model.norm.weight"], dtype, device)
        self.named: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = own(tensors["lm_head.weight"], dtype, device)
            self.named["lm_head.weight"] = self.lm_head
        # quant.lm_head: logits from an int8 copy (a quarter of an fp32 decode step's bytes); pushes still carry lm_head
        self.head = Int8Head(self.lm_head) if int8_lm_head else None
        self._head_source = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        self.layers = [Layer(cfg, i, tensors, scheme, dtype, device) for i in range(cfg.num_layers)]
        for layer in self.layers:
            self.named.update(layer.named)
        freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), rope_inv_freq(cfg))
        half = cfg.head_dim // 2
        self.cos = torch.cat([freqs, freqs], -1).cos().to(device=device, dtype=dtype)
        sin = freqs.sin()
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: one roll instead of split/neg/cat
        self.sin_signed = torch.cat([-sin, sin], -1).to(device=device, dtype=dtype)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.half = half
        self.scale = cfg.head_dim**-0.5

    def repack(self, names) -> None:
        """Refresh the derived copies (prepacked int8 codes, the int8 lm_head) of the buffers `names` wrote."""
        names = set(names)
        if self.head is not None and self._head_source in names:
            self.head.refresh()
        for layer in self.layers:
            for lin in layer.linears:
                if not names.isdisjoint(lin.named):
                    lin.repack()

    def _qkv(self, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Normed input [M, H] -> rotated q [M, heads, hd], k and v [M, kv_heads, hd]."""
        cfg = self.cfg
        heads, hd = cfg.num_heads + cfg.num_kv_heads, cfg.head_dim
        qkv = layer.qkv(x)
        qk = qkv[:, : self.q_size + self.kv_size].unflatten(-1, (heads, hd))  # q and k heads, rotated together
        v = qkv[:, self.q_size + self.kv_size :].unflatten(-1, (cfg.num_kv_heads, hd))
        if layer.q_norm is not None:
            gain = torch.cat([layer.q_norm.expand(cfg.num_heads, hd), layer.k_norm.expand(cfg.num_kv_heads, hd)])
            qk = rms_norm(qk, gain, cfg.rms_norm_eps)
        qk = qk * cos + qk.roll(self.half, -1) * sin
        return qk[:, : cfg.num_heads], qk[:, cfg.num_heads :], v

    def _mlp(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        x = rms_norm(h, layer.post_norm, self.cfg.rms_norm_eps)
        gate_up = layer.gate_up(x)
        k = usable(gate_up)
        if k is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
            return h + layer.down(k.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, -1)
        return h + layer.down(F.silu(gate) * up)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head in the model dtype (or its int8 copy); fp32 logits."""
        x = rms_norm(h, self.norm, self.cfg.rms_norm_eps)
        return (dense_linear(x, self.lm_head) if self.head is None else self.head(x)).float()

    def prefill_many(
        self, tokens: torch.Tensor, lengths: list[int], k_cache: torch.Tensor, v_cache: torch.Tensor, slots: list[int]
    ) -> torch.Tensor:
        """Run P prompts, right-padded into tokens [P, T], into cache slots `slots` (positions 0..T-1); return each
        one's logits at its last position [P, V]. One forward for all of them: each weight is streamed once for the
        P prompts, not once per prompt (under the causal mask no real token sees the pads after it)."""
        cfg = self.cfg
        p, t = tokens.shape
        cos = self.cos[:t].repeat(p, 1)[:, None]  # rows are prompt-major: position = row % t
        sin = self.sin_signed[:t].repeat(p, 1)[:, None]
        where = torch.tensor(slots, device=tokens.device)
        h = F.embedding(tokens.reshape(-1), self.embed)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, rms_norm(h, layer.input_norm, cfg.rms_norm_eps), cos, sin)
            q = q.unflatten(0, (p, t)).transpose(1, 2)  # [P, heads, T, hd]
            k, v = k.unflatten(0, (p, t)).transpose(1, 2), v.unflatten(0, (p, t)).transpose(1, 2)
            k_cache[i, :, :, :t].index_copy_(0, where, k)
            v_cache[i, :, :, :t].index_copy_(0, where, v)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            h = h + layer.o(o.transpose(1, 2).reshape(p * t, self.q_size))
            h = self._mlp(layer, h)
        last = torch.tensor(lengths, device=tokens.device) - 1 + torch.arange(p, device=tokens.device) * t
        return self.logits(h[last])

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        write_index: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """One token for each of the sequences in cache slots 0..B-1; returns logits [B, V].

        positions [B]: where each token goes; write_index [B*kv_heads]: its rows in a layer's cache
        viewed as [slots*kv_heads*max_seq_len, hd]; mask [B, 1, 1, L] in the model dtype: additive, -inf
        past each sequence's length.
        """
        cfg = self.cfg
        b, length = tokens.shape[0], mask.shape[-1]
        group = cfg.num_heads // cfg.num_kv_heads
        cos, sin = self.cos[positions], self.sin_signed[positions]
        kernels = usable(k_cache)
        # the CPU kernels: rotary and the cache write in one pass (not under Qwen3's q/k norms), decode attention
        own_rope = kernels is not None and not cfg.qk_norm
        own_attention = (
            kernels is not None and kernels.vector_attention and cfg.head_dim % 16 == 0 and cfg.head_dim <= 128
        )
        lengths = positions + 1
        h = F.embedding(tokens, self.embed)
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            kc, vc = k_cache[i], v_cache[i]
            if own_rope:
                q = kernels.rope_cache(layer.qkv(x), cos, sin, kc, vc, positions, cfg.num_heads, cfg.num_kv_heads)
            else:
                q, k, v = self._qkv(layer, x, cos[:, None], sin[:, None])
                kc.view(-1, cfg.head_dim).index_copy_(0, write_index, k.reshape(-1, cfg.head_dim))
                vc.view(-1, cfg.head_dim).index_copy_(0, write_index, v.reshape(-1, cfg.head_dim))
            # the `group` query heads sharing a kv head act as `group` query positions of one sequence
            q = q.reshape(b, cfg.num_kv_heads, group, cfg.head_dim)
            kv = kc[:b, :, :length], vc[:b, :, :length]
            if own_attention:
                o = kernels.decode_attention(q.contiguous(), *kv, lengths, self.scale)
            else:
                o = F.scaled_dot_product_attention(q, *kv, attn_mask=mask, scale=self.scale)
            o = o.reshape(b, self.q_size)
            h = h + layer.o(o)
            h = self._mlp(layer, h)
        return self.logits(h)
