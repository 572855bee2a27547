"""How much each peer's rejection bounds would reject at quantized rollout's mismatch, on the real model (issue 32).

Each rollout format's engine samples responses (T = 1) to real held-out prompts; transformers in fp32 (the learner's
precision in the CPU recipes) scores the same tokens, so log rho = logp_fp32 - logp_engine per token, as
mismatch/kl_k3 sees it at step 0. Every bound set is applied with qurl's own mask pieces (qurl.corrections.masks),
so the fractions are what training would drop: tokens, and sequences that lose at least one token.

Cases: the learning recipe's start (configs/smollm2-gym-cpu.yaml: the warm-started model, reasoning-gym prompts,
16-token answers) and the base SmolLM2 on GSM-Symbolic prompts with 128-token answers (sequence masks grow with
length). Formats: bf16 (what the peers' bounds were tuned on), INT8 W8A8, FP8 block (slow on CPU: fewer prompts),
INT8 with 4-bit weights (quant.weight_bits=4, the stress regime).

    python benchmarks/rejection.py [--prompts 32] [--cases gym,gsm] [--out results/rejection-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, machine_info  # noqa: E402

from qurl.algorithms import kept_tokens  # noqa: E402
from qurl.corrections.spec import LossSpec  # noqa: E402
from qurl.corrections.tokens import Tokens  # noqa: E402
from qurl.data import PromptDataset  # noqa: E402
from qurl.real.prepare import MODEL_DIR, default_root  # noqa: E402
from rollout_server.engines import GenRequest, load_engine  # noqa: E402

# (name, mask, LossSpec settings): the peers' defaults (../shared/docs/corrections.md) and qurl's candidates
BOUNDS = [
    ("token [0.5, 2] (verl token RS, SkyRL token mask)", "token", dict(token_mask_low=0.5, token_mask_high=2.0)),
    ("token [0.5, 5] (NeMo RL IcePop)", "token", dict(token_mask_low=0.5, token_mask_high=5.0)),
    ("product [0.5, 2] (verl Seq-MIS, SkyRL)", "sequence", dict(seq_mask_low=0.5, seq_mask_high=2.0)),
    ("product <= 3 (TRL sequence_mask)", "sequence", dict(seq_mask_low=1e-30, seq_mask_high=3.0)),
    ("geometric +-0.01% (slime mis.yaml)", "geometric", dict(geo_mask_low=0.9999, geo_mask_high=1.0001)),
    ("geometric +-0.1% (verl Geo-RS)", "geometric", dict(geo_mask_low=0.999, geo_mask_high=1.001)),
    ("geometric 0.999-1.002 (NeMo RL seq-mask-tis)", "geometric", dict(geo_mask_low=0.999, geo_mask_high=1.002)),
    ("geometric +-1% (SkyRL)", "geometric", dict(geo_mask_low=0.99, geo_mask_high=1.01)),
    ("geometric +-2%", "geometric", dict(geo_mask_low=0.98, geo_mask_high=1.02)),
    ("geometric +-5%", "geometric", dict(geo_mask_low=0.95, geo_mask_high=1.05)),
    ("geometric +-10%", "geometric", dict(geo_mask_low=0.9, geo_mask_high=1.1)),
    ("veto rho < 1e-4 (verl, slime)", "veto", dict(veto_floor=1e-4)),
]
FORMATS = {  # name -> load_engine arguments
    "bf16": dict(quant="none", dtype="bfloat16"),
    "int8": dict(quant="int8"),
    "fp8": dict(quant="fp8"),
    "int8-4bit": dict(quant="int8", weight_bits=4),
}


def case_paths(case: str) -> tuple[str, str, int]:
    """(model folder, held-out prompts, new tokens) of a case."""
    root = default_root()
    if case == "gym":
        return str(root / "gym" / "warm"), str(root / "gym" / "heldout.jsonl"), 16
    return str(root / MODEL_DIR), str(root / "gsm" / "heldout.jsonl"), 128


def _quantiles(x: torch.Tensor) -> dict[str, float]:
    q = torch.quantile(x.double(), torch.tensor([0.5, 0.75, 0.9, 0.95], dtype=torch.float64))
    return dict(zip(("p50", "p75", "p90", "p95"), q.tolist()))


@torch.no_grad()
def measure(case: str, fmt: str, n_prompts: int) -> dict:
    model, data, new_tokens = case_paths(case)
    tok = AutoTokenizer.from_pretrained(model)
    ds = PromptDataset(data, tok, shuffle=False)
    prompts = [ds[i].prompt_ids for i in range(min(n_prompts, len(ds)))]
    started = time.perf_counter()
    engine = load_engine(model, max_batch=len(prompts), max_seq_len=512, **FORMATS[fmt])
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    reqs = [
        GenRequest(p, max_new_tokens=new_tokens, temperature=1.0, seed=i, stop_token_ids=stop)
        for i, p in enumerate(prompts)
    ]
    results = engine.generate(reqs)
    del engine
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    rows = [r.samples[0] for r in results]
    width = max(len(s.token_ids) for s in rows)
    prox = torch.zeros(len(rows), width)
    behav = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (p, s) in enumerate(zip(prompts, rows)):
        n = len(s.token_ids)
        logits = hf(torch.tensor([p + s.token_ids])).logits[0, len(p) - 1 : -1]
        prox[i, :n] = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
        behav[i, :n] = torch.tensor(s.logprobs)
        mask[i, :n] = True
    t = Tokens.clean(prox, prox, behav, torch.zeros(len(rows)), mask)
    log_rho, rho = t.log_rho[mask], t.rho[mask]
    out = {
        "case": case,
        "format": fmt,
        "model": os.path.relpath(model),
        "prompts": len(rows),
        "tokens": int(mask.sum()),
        "mean_length": float(mask.sum()) / len(rows),
        "kl_k3": (rho - 1 - log_rho).mean().item(),
        "kl_k1": (-log_rho).mean().item(),
        "abs_log_rho_mean": log_rho.abs().mean().item(),
        "seconds": round(time.perf_counter() - started, 1),
        # per sequence |mean log rho| and |sum log rho|: where any geometric or product bound would cut
        "abs_geo_log_quantiles": _quantiles(t.row_mean(t.log_rho).abs().squeeze(-1)),
        "abs_product_log_quantiles": _quantiles(t.row_sum(t.log_rho).abs().squeeze(-1)),
        "rejected": {},
    }
    for name, mask_name, bounds in BOUNDS:
        keep = kept_tokens(prox, behav, mask, LossSpec(mask=mask_name, **bounds))
        out["rejected"][name] = {
            "tokens": 1 - keep.sum().item() / mask.sum().item(),
            "sequences": (mask & ~keep).any(-1).float().mean().item(),
        }
    print(json.dumps({k: v for k, v in out.items() if k != "rejected"}), file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--fp8-prompts", type=int, default=8, help="FP8 decodes slowly on CPU")
    ap.add_argument("--cases", default="gym,gsm")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [
        measure(case, fmt, args.fp8_prompts if fmt == "fp8" else args.prompts)
        for case in args.cases.split(",")
        for fmt in args.formats.split(",")
    ]
    emit({"benchmark": "rejection", "machine": machine_info(), "bounds": BOUNDS, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
