"""Build the CPU demo: data files, tokenizer and a tiny Qwen2 warm-started by supervised training.

Output (``root``, default ``.cache/qurl-demo``, or ``$QURL_DEMO_DIR``, or ``--out``)::

    model/          Hugging Face folder: config.json, model.safetensors, generation_config.json,
                    tokenizer.json, tokenizer_config.json, chat_template.jinja
    train.jsonl     {"problem": ..., "answer": ...} per line (DeepScaleR style)
    heldout.jsonl   the same, the held-out split
    prepare.json    the recipe, its fingerprint, and what the run measured

The warm start stops once greedy accuracy on a dev slice of the train side reaches
``target_acc`` so that the base model lands inside the band where RL has room to show.
A rerun with the same recipe returns at once; a changed recipe rebuilds; the folder is built
beside the root and renamed into place, so a reader never sees half a demo.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from qurl.demo import task as tasks
from qurl.demo.tokenizer import IM_END, PAD, save_tokenizer, train_tokenizer
from qurl.rewards import arith_reward

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

# torch and transformers are imported inside the functions that build or evaluate, so that a
# cached `qurl-prepare-demo` answers in a fraction of a second instead of paying their import.
RECIPE_VERSION = 1  # bump when the code changes what a recipe produces


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that determines the prepared demo; its hash is the cache key."""

    task: str = "add"
    seed: int = 0
    train_size: int = 32768
    heldout_size: int = 512
    dev_size: int = 256
    vocab_size: int = 384
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    max_positions: int = 512
    lr: float = 3e-3
    warmup: int = 20
    batch: int = 256
    max_steps: int = 800
    eval_every: int = 10
    target_acc: float = 0.2
    version: int = RECIPE_VERSION

    def fingerprint(self) -> str:
        """Stable hash of the recipe fields."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def default_root(task: str = "add") -> Path:
    """$QURL_DEMO_DIR or .cache/qurl-demo; other tasks get a sibling folder named after them."""
    base = Path(os.environ.get("QURL_DEMO_DIR") or ".cache/qurl-demo")
    return base if task == "add" else base.with_name(f"{base.name}-{task}")


LOADAVG = Path("/proc/loadavg")  # Linux: its fourth field counts the tasks runnable now


def default_threads() -> int:
    """Torch threads for the warm start: every usable core unless other work keeps them busy now.

    Measured on a shared 2-core machine: with other jobs running, two OpenMP threads made a step 2-9x
    slower than one thread (they wait on each other at every barrier), so a busy machine gets fewer.
    Busy is read now, not from the 1-minute load average, which still counts work that has ended: after
    `make lint`'s compiles it held CI's warm start to one thread.
    """
    cores = len(os.sched_getaffinity(0))
    load = busy_tasks()
    return cores if load < cores / 2 else max(1, int(cores - load))


def busy_tasks() -> float:
    """Other tasks runnable now: the median of five reads of LOADAVG, 20 ms apart, less this process; the 1-minute
    load average where that file is missing."""
    try:
        counts = []
        for _ in range(5):
            counts.append(int(LOADAVG.read_text().split()[3].split("/")[0]))
            time.sleep(0.02)
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]
    return sorted(counts)[2] - 1


def read_info(root: str | Path) -> dict | None:
    """prepare.json of a finished demo folder, or None when there is none."""
    path = Path(root) / "prepare.json"
    if not path.is_file() or not (Path(root) / "model" / "config.json").is_file():
        return None
    return json.loads(path.read_text())


def chat_prompts(tokenizer: PreTrainedTokenizerBase, problems: list[str]) -> list[list[int]]:
    """Token ids of each problem as a user turn followed by the assistant header."""
    convs = [[{"role": "user", "content": p}] for p in problems]
    texts = tokenizer.apply_chat_template(convs, add_generation_prompt=True, tokenize=False)
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def greedy_accuracy(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    problems: list[str],
    answers: list[str],
    batch_size: int = 256,
    max_new_tokens: int = 64,
) -> float:
    """Fraction of problems whose greedy response earns the arith reward (exact integer match)."""
    if len(problems) != len(answers) or not problems:
        raise ValueError(f"problems/answers: need equal non-zero lengths, got {len(problems)} and {len(answers)}")
    from qurl.evaluate import hf_greedy  # imports torch: kept out of the cached CLI path

    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)
    responses = hf_greedy(model, chat_prompts(tokenizer, problems), pad, [eos], max_new_tokens, batch_size)
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    return float(sum(arith_reward(t, a) for t, a in zip(texts, answers))) / len(problems)


def _sft_tensors(
    tokenizer: PreTrainedTokenizerBase, examples: list[tasks.Example]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, labels masked to the response (+ end of turn), and lengths."""
    from qurl.data import sft_batch

    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)
    prompts = chat_prompts(tokenizer, [e.problem for e in examples])
    responses = tokenizer([e.response for e in examples], add_special_tokens=False)["input_ids"]
    return sft_batch(prompts, responses, eos, pad)


def _write_jsonl(path: Path, examples: list[tasks.Example]) -> None:
    with path.open("w") as f:
        for e in examples:
            f.write(json.dumps({"problem": e.problem, "answer": e.answer}) + "\n")


def _build(out: Path, recipe: Recipe, progress: bool) -> dict:
    """Write the whole demo into out (an empty folder) and return its prepare.json content."""
    import torch
    import transformers
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    start = time.perf_counter()
    torch.manual_seed(recipe.seed)
    train = tasks.make_split(recipe.task, "train", recipe.train_size, recipe.seed)
    heldout = tasks.make_split(recipe.task, "heldout", recipe.heldout_size, recipe.seed)
    dev = tasks.make_split(recipe.task, "train", recipe.dev_size, recipe.seed + 1)
    _write_jsonl(out / "train.jsonl", train)
    _write_jsonl(out / "heldout.jsonl", heldout)

    # One tokenizer for every task: trained on a fixed mix, so it does not depend on the recipe's task.
    corpus = [
        f"<|im_start|>user\n{e.problem}<|im_end|>\n<|im_start|>assistant\n{e.response}<|im_end|>\n"
        for t in tasks.TASKS
        for e in tasks.make_split(t, "train", 500, 0)
    ]
    tokenizer = save_tokenizer(train_tokenizer(corpus, recipe.vocab_size), out / "model")
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden,
        intermediate_size=recipe.intermediate,
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.kv_heads,
        max_position_embeddings=recipe.max_positions,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=False)
    ids, labels, lengths = _sft_tensors(tokenizer, train)
    max_new = int((labels != -100).sum(1).max()) + 4
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, recipe.warmup)))
    gen = torch.Generator().manual_seed(recipe.seed)
    history: list[list[float]] = []
    dev_acc, loss_value, step = 0.0, float("nan"), 0
    model.train()
    sft_start = time.perf_counter()
    bar = tqdm(total=recipe.max_steps, desc="warm start", unit="step", disable=not progress, file=sys.stderr)
    for step in range(1, recipe.max_steps + 1):
        idx = torch.randint(len(ids), (recipe.batch,), generator=gen)
        width = int(lengths[idx].max())
        loss = model(input_ids=ids[idx, :width], labels=labels[idx, :width]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        loss_value = loss.item()
        bar.update(1)
        if step % recipe.eval_every == 0 or step == recipe.max_steps:
            dev_acc = greedy_accuracy(
                model, tokenizer, [e.problem for e in dev], [e.answer for e in dev], max_new_tokens=max_new
            )
            history.append([step, round(loss_value, 4), dev_acc])
            bar.set_postfix(loss=f"{loss_value:.3f}", dev_acc=f"{dev_acc:.3f}")
            if dev_acc >= recipe.target_acc:
                break
    bar.close()
    sft_s = time.perf_counter() - sft_start
    base_acc = greedy_accuracy(
        model, tokenizer, [e.problem for e in heldout], [e.answer for e in heldout], max_new_tokens=max_new
    )
    model.save_pretrained(out / "model")
    info = {
        "recipe": dataclasses.asdict(recipe),
        "fingerprint": recipe.fingerprint(),
        "steps": step,
        "reached_target": dev_acc >= recipe.target_acc,
        "dev_acc": dev_acc,
        "final_loss": loss_value,
        "base_acc_heldout": base_acc,
        "heldout_size": len(heldout),
        "param_count": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "eos_token_id": eos,
        "pad_token_id": pad,
        "max_new_tokens": max_new,
        "threads": torch.get_num_threads(),
        "sft_s": round(sft_s, 2),
        "wall_s": round(time.perf_counter() - start, 2),
        "eval_history": history,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    (out / "prepare.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def prepare(
    root: str | Path | None = None, recipe: Recipe = Recipe(), threads: int | None = None, progress: bool = True
) -> dict:
    """Prepare the demo under root unless a folder built from the same recipe is already there."""
    if recipe.task not in tasks.TASKS:
        raise ValueError(f"task: unknown task {recipe.task!r}; allowed: {', '.join(tasks.TASKS)}")
    root = Path(root) if root is not None else default_root(recipe.task)
    info = read_info(root)
    if info is not None and info.get("fingerprint") == recipe.fingerprint():
        return info
    import torch

    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    caller_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads or default_threads())
        info = _build(tmp, recipe, progress)
        done = read_info(root)
        if done is not None and done.get("fingerprint") == recipe.fingerprint():
            return done  # another process finished the same recipe first
        if root.exists():
            old = root.parent / f".{root.name}.old-{uuid.uuid4().hex[:8]}"
            root.rename(old)
            tmp.rename(root)
            shutil.rmtree(old)
        else:
            try:
                tmp.rename(root)
            except OSError:  # root appeared meanwhile: keep it if it is the same recipe
                done = read_info(root)
                if done is None or done.get("fingerprint") != recipe.fingerprint():
                    raise
                return done
    finally:
        torch.set_num_threads(caller_threads)
        if tmp.exists():
            shutil.rmtree(tmp)
    return info


def main(argv: list[str] | None = None) -> int:
    """qurl-prepare-demo: build (or find cached) the demo model and data, print its base accuracy."""
    p = argparse.ArgumentParser(prog="qurl-prepare-demo", description=main.__doc__)
    p.add_argument("--out", help="output folder (default: $QURL_DEMO_DIR or .cache/qurl-demo[-TASK])")
    p.add_argument("--task", default="add", choices=tasks.TASKS)
    p.add_argument("--seed", type=int, default=Recipe.seed)
    p.add_argument("--max-steps", type=int, default=Recipe.max_steps, help="warm-start step limit")
    p.add_argument(
        "--target-acc",
        type=float,
        default=Recipe.target_acc,
        help="stop the warm start once dev greedy accuracy reaches this",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: all usable cores, fewer when the machine is busy)",
    )
    args = p.parse_args(argv)
    if args.max_steps < 1:
        p.error(f"--max-steps: must be >= 1, got {args.max_steps}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads: must be >= 1, got {args.threads}")
    if not 0.0 < args.target_acc <= 1.0:
        p.error(f"--target-acc: must be in (0, 1], got {args.target_acc}")
    recipe = Recipe(task=args.task, seed=args.seed, max_steps=args.max_steps, target_acc=args.target_acc)
    root = Path(args.out) if args.out else default_root(args.task)
    t0 = time.perf_counter()
    cached = read_info(root)
    info = prepare(root, recipe, threads=args.threads)
    how = (
        "cached"
        if cached is not None and cached.get("fingerprint") == info["fingerprint"]
        else (f"built in {time.perf_counter() - t0:.0f} s, {info['steps']} warm-start steps")
    )
    print(
        f"demo {args.task} at {root} ({how}): base greedy held-out accuracy {info['base_acc_heldout']:.3f} "
        f"on {info['heldout_size']} problems, {info['param_count']:,} params, vocab {info['vocab_size']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
