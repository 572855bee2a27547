"""Templates the base model sometimes solves: a training set with a learning signal for the real ablation (issue 21).

SmolLM2-135M solves about 2% of the recipe's problems, so most GRPO groups have zero advantage. This
measures each template's pass rate with the prepared model (transformers' sampling at T = 1 over the whole
vocabulary, full precision, a few fresh instances x a few samples per template, seeded) and keeps the templates
with at least one correct sample. It writes, next to the recipe's files in ``gsm/``::

    train-easy.jsonl     problems from the kept training templates (same one-shot prompt as train.jsonl)
    heldout-easy.jsonl   problems from the kept held-out templates (still disjoint from training); not written
                         when no held-out template passed
    fresh-easy.jsonl     new instances of the kept training templates, none of them in train-easy.jsonl: an
                         eval set that moves when the trained templates are learned
    easy.json            the settings, every template's passes / samples, the kept lists, the wall time
    easy-counts.json     the measured passes alone, written before any filter, so a failed filter never costs the
                         measurement again

The instances measured are drawn with their own seed, so they are not the problems written out.
``qurl-prepare-real --easy`` runs it once; a rerun with the same settings returns at once.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from qurl.real.gsm import Problem, load_generators, make_problems

EASY_VERSION = 2  # bump when the code changes what the same settings produce (2: transformers' sampling, fp32)


@dataclasses.dataclass(frozen=True)
class EasySettings:
    """What determines the measured pass rates and the written files."""

    instances: int = 3  # problems per template
    samples: int = 4  # samples per problem, T = 1
    max_new_tokens: int = 160
    seed: int = 11  # instances measured: another seed than any file's
    min_passes: int = 1  # keep a template with at least this many correct samples
    version: int = EASY_VERSION


def _prompt(shot: Problem, question: str) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": shot.question},
        {"role": "assistant", "content": shot.solution},
        {"role": "user", "content": question},
    ]


def pass_counts(model_dir: Path, shot: Problem, templates: list[int], s: EasySettings) -> dict[int, int]:
    """Correct samples per template out of instances x samples: transformers' sampling at T = 1, batches of prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qurl.data import tokenize_prompts
    from qurl.rewards import gsm8k_reward

    generators = load_generators()
    problems = [
        p
        for t in templates
        for p in make_problems(generators, [t], s.instances, s.seed * 1009 + t)  # one template: per-template draws
    ]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = tokenize_prompts(tok, [_prompt(shot, p.question) for p in problems])
    torch.manual_seed(s.seed)
    counts = dict.fromkeys(templates, 0)
    batch = 8
    with tqdm(total=len(ids) * s.samples, desc="easy templates", unit="sample", file=sys.stderr) as bar:
        for i in range(0, len(ids), batch):
            chunk = ids[i : i + batch]
            width = max(map(len, chunk))
            input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in chunk])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk])
            with torch.no_grad():
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=s.max_new_tokens,
                    num_return_sequences=s.samples,
                    eos_token_id=tok.eos_token_id,
                    pad_token_id=pad,
                )
            texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
            for j, text in enumerate(texts):
                p = problems[i + j // s.samples]
                counts[p.template] += int(gsm8k_reward(text, p.answer))
            bar.update(len(texts))
    return counts


def _write(path: Path, problems: list[Problem], shot: Problem) -> None:
    with path.open("w") as f:
        for p in problems:
            row = {
                "prompt": _prompt(shot, p.question),
                "reward_model": {"ground_truth": p.answer},
                "data_source": "gsm_symbolic",
                "template": p.template,
            }
            f.write(json.dumps(row) + "\n")


def write_fresh(out: Path, generators: dict, templates: list[int], recipe: dict, shot: Problem) -> None:
    """fresh-easy.jsonl: heldout_size new instances of the kept training templates, none in train-easy.jsonl."""
    seen = {json.loads(line)["prompt"][-1]["content"] for line in (out / "train-easy.jsonl").open()}
    draws = make_problems(generators, templates, 2 * recipe["heldout_size"], recipe["seed"] + 3)
    _write(out / "fresh-easy.jsonl", [p for p in draws if p.question not in seen][: recipe["heldout_size"]], shot)


def measured_counts(
    model_dir: Path, out: Path, templates: list[int], shot: Problem, s: EasySettings
) -> tuple[dict[int, int], float]:
    """pass_counts and its wall seconds, or their saved copy for these settings (easy-counts.json, written as soon
    as they are measured)."""
    saved = out / "easy-counts.json"
    if saved.is_file():
        cached = json.loads(saved.read_text())
        if cached.get("settings") == dataclasses.asdict(s) and set(map(int, cached["counts"])) == set(templates):
            return {int(t): n for t, n in cached["counts"].items()}, cached["wall_s"]
    start = time.perf_counter()
    counts = pass_counts(model_dir, shot, templates, s)
    wall_s = round(time.perf_counter() - start, 1)
    saved.write_text(json.dumps({"settings": dataclasses.asdict(s), "counts": counts, "wall_s": wall_s}) + "\n")
    return counts, wall_s


def prepare_easy(root: Path, info: dict, model_dir: Path, s: EasySettings = EasySettings()) -> dict:
    """Measure the model at model_dir, filter and write the easy splits under root/gsm unless easy.json already holds
    these settings."""
    out = root / "gsm"
    done = out / "easy.json"
    recipe = info["recipe"]
    generators = load_generators()
    shot = make_problems(generators, [info["shot_template"]], 1, recipe["seed"] + 2)[0]  # the recipe's shot
    if done.is_file() and json.loads(done.read_text()).get("settings") == dataclasses.asdict(s):
        cached = json.loads(done.read_text())
        if not (out / "fresh-easy.jsonl").is_file():
            write_fresh(out, generators, cached["train_templates"], recipe, shot)
        return cached
    train_t, held_t = info["train_templates"], info["heldout_templates"]
    counts, wall_s = measured_counts(model_dir, out, train_t + held_t, shot, s)
    kept_train = [t for t in train_t if counts[t] >= s.min_passes]
    kept_held = [t for t in held_t if counts[t] >= s.min_passes]
    if not kept_train:
        raise RuntimeError(f"no training template passed {s.min_passes} of {s.instances * s.samples} samples: {counts}")
    _write(out / "train-easy.jsonl", make_problems(generators, kept_train, recipe["train_size"], recipe["seed"]), shot)
    held_path = out / "heldout-easy.jsonl"
    held_path.unlink(missing_ok=True)
    if kept_held:
        _write(held_path, make_problems(generators, kept_held, recipe["heldout_size"], recipe["seed"] + 1), shot)
    write_fresh(out, generators, kept_train, recipe, shot)
    per = s.instances * s.samples
    result = {
        "settings": dataclasses.asdict(s),
        "samples_per_template": per,
        "passes": {str(t): counts[t] for t in train_t + held_t},
        "train_templates": kept_train,
        "heldout_templates": kept_held,
        "train_pass_rate": sum(counts[t] for t in kept_train) / (per * len(kept_train)),
        "heldout_pass_rate": sum(counts[t] for t in kept_held) / (per * len(kept_held)) if kept_held else None,
        "all_train_pass_rate": sum(counts[t] for t in train_t) / (per * len(train_t)),
        "wall_s": wall_s,
    }
    done.write_text(json.dumps(result, indent=1) + "\n")
    return result
