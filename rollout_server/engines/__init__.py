"""Rollout engines behind one interface: `load_engine` (where the engine settings are checked) plus the request and
result records."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from qurl.quant import lookup

ENGINES = ("torch", "sglang")
DTYPES = ("float32", "bfloat16", "float64")  # float64: parity checks against a reference, not for rollout


@dataclass
class GenRequest:
    """One prompt to sample `n` responses for; temperature 0 means greedy."""

    prompt_ids: list[int]
    n: int = 1
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Completion:
    """One sampled response: a stop token, when hit, is its last token; versions say which weights made each token."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: Literal["stop", "length"]


@dataclass
class GenResult:
    """The `n` samples of one request, in sample order."""

    samples: list[Completion]


def check_names(expected: Iterable[str], names: Iterable[str], partial: bool) -> None:
    """Refuse a weight push naming a tensor the engine lacks, or (unless partial) missing one it holds."""
    expected, names = set(expected), set(names)
    unknown = sorted(names - expected)
    if unknown:
        hint = " (tied embeddings: send model.embed_tokens.weight only)" if unknown[0] == "lm_head.weight" else ""
        raise ValueError(f"update_weights: unknown tensor {unknown[0]!r}{hint} ({len(unknown)} unknown)")
    missing = [] if partial else sorted(expected - names)
    if missing:
        raise ValueError(
            f"update_weights: missing tensor {missing[0]!r} ({len(missing)} missing; pass partial=True for a subset)"
        )


def run_to_completion(
    engine, requests: list[GenRequest], on_sample: Callable[[], object] | None = None
) -> list[GenResult]:
    """`generate` of every engine: drive its add_request/step API until each request has all n samples
    (`on_sample` after each finished one, for a progress bar over a long batch)."""
    if engine.has_work():
        raise RuntimeError("generate() needs an idle engine; drive add_request()/step() instead")
    out: list[list[Completion | None]] = [[None] * req.n for req in requests]
    for i, req in enumerate(requests):
        engine.add_request(req, i)
    while engine.has_work():
        for rid, index, sample in engine.step():
            out[rid][index] = sample
            if on_sample is not None:
                on_sample()
    return [GenResult(samples=s) for s in out]


def load_engine(
    model_path: str,
    engine: str = "torch",
    quant: str = "int8",
    dtype: str = "float32",
    device: str = "cpu",
    max_batch: int = 64,
    max_seq_len: int = 2048,
    tp_size: int = 1,
    gpus: list[int] | None = None,
    mem_fraction: float | None = None,
    seed: int = 0,
    weight_bits: int = 8,
    int8_lm_head: bool = False,
    server_args: dict | None = None,
):
    """Build a rollout engine from a Hugging Face folder; the import stays lazy so this module is light.

    tp_size, gpus (this replica's GPUs, see sglang_args.placement), mem_fraction, seed and server_args (any other
    ServerArgs field) apply to SGLang only;
    weight_bits < 8 (torch engine, int8 only) is the quant.weight_bits mismatch study knob;
    int8_lm_head (torch engine, int8 only) is quant.lm_head: logits from an int8 copy of the lm_head.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; allowed: {', '.join(ENGINES)}")
    scheme = lookup(quant)  # the one check of the quant setting; everything below takes the record
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    if weight_bits != 8 and engine != "torch":
        raise ValueError(f"weight_bits={weight_bits} needs engine 'torch', got {engine!r}")
    if int8_lm_head and (engine != "torch" or scheme.name != "int8"):
        raise ValueError(f"int8_lm_head needs engine 'torch' and quant 'int8', got {engine!r} and {scheme.name!r}")
    if engine == "sglang":  # GPU nodes; fails with one line (install the `sglang` extra) where sglang is absent
        from rollout_server.engines.sglang_engine import SGLangEngine

        return SGLangEngine.from_pretrained(
            model_path,
            quant=scheme.name,
            dtype=dtype,
            device=device,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            tp_size=tp_size,
            gpus=gpus,
            mem_fraction=mem_fraction,
            seed=seed,
            server_args=server_args,
        )
    if tp_size != 1:
        raise ValueError(f"rollout.tp_size={tp_size} needs rollout.engine=sglang; the torch engine runs on one device")
    from rollout_server.engines.torch_engine import TorchEngine

    return TorchEngine.from_pretrained(
        model_path,
        scheme,
        dtype=dtype,
        device=device,
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        weight_bits=weight_bits,
        int8_lm_head=int8_lm_head,
    )
