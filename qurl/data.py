"""Prompt datasets: JSONL or Parquet rows in DeepScaleR or verl/DAPO style, tokenized once, drawn in resumable shuffle.

Row styles, detected per file from its columns:
- DeepScaleR: ``problem`` (str) and ``answer`` (str or number); ``data_source`` optional.
- verl / DAPO: ``prompt`` (a list of ``{"role", "content"}`` chat messages), ``reward_model``
  (an object holding ``ground_truth``) and ``data_source`` (optional).
A file that lacks a column of its style entirely is refused; a single row that is malformed is
skipped and counted (or refused with ``strict=True``). Rows are named ``file:LINE`` (JSONL, from 1)
or ``file row I`` (Parquet, from 0).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

BOXED_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
ROLES = ("system", "user", "assistant")
STYLES = {"deepscaler": ("problem", "answer"), "verl": ("prompt", "reward_model")}
FORMATS = (".jsonl", ".parquet")
REPORTED_BAD_ROWS = 5
_TOKENIZE_CHUNK = 512


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file (and line or column)."""


class _BadRow(Exception):
    pass


@dataclass(frozen=True)
class Example:
    id: str  # where the row came from: "file.jsonl:LINE" or "file.parquet row I"
    messages: list[dict[str, str]]
    answer: str
    data_source: str
    prompt_ids: list[int] | None = None  # the chat-templated prompt, when the dataset has a tokenizer


def _text(row: Mapping[str, Any], key: str) -> str:
    value = row.get(key)
    if value is None:
        raise _BadRow(f"missing field {key!r}")
    if not isinstance(value, str):
        raise _BadRow(f"field {key!r} is {type(value).__name__}, expected a string")
    if not value.strip():
        raise _BadRow(f"field {key!r} is empty")
    return value


def _answer(value: Any, key: str) -> str:
    if value is None:
        raise _BadRow(f"missing field {key!r}")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _BadRow(f"field {key!r} is {type(value).__name__}, expected a string or a number")
    text = str(value).strip()
    if not text:
        raise _BadRow(f"field {key!r} is empty")
    return text


def _messages(value: Any) -> list[dict[str, str]]:
    if value is None:
        raise _BadRow("missing field 'prompt'")
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise _BadRow(f"field 'prompt' is {type(value).__name__}, expected a non-empty list of chat messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise _BadRow(f"prompt[{i}] is not a chat message {{'role': {'|'.join(ROLES)}, 'content': str}}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in out):
        raise _BadRow("field 'prompt' has no user message")
    return out


def _normalize(row: Any, style: str, rid: str, default_source: str) -> Example:
    if not isinstance(row, Mapping):
        raise _BadRow(f"row is {type(row).__name__}, expected an object")
    source = row.get("data_source")
    source = source if isinstance(source, str) and source else default_source
    if style == "deepscaler":
        messages = [{"role": "user", "content": _text(row, "problem")}]
        return Example(rid, messages, _answer(row.get("answer"), "answer"), source)
    messages = _messages(row.get("prompt"))
    rm = row.get("reward_model")
    if not isinstance(rm, Mapping):
        raise _BadRow("field 'reward_model' is missing or not an object with 'ground_truth'")
    return Example(rid, messages, _answer(rm.get("ground_truth"), "reward_model.ground_truth"), source)


def _style(path: Path, columns: set[str]) -> str:
    if "prompt" in columns:
        style = "verl"
    elif "problem" in columns:
        style = "deepscaler"
    else:
        raise DatasetError(f"{path}: missing column 'problem' (DeepScaleR style) or 'prompt' (verl style)")
    for col in STYLES[style]:
        if col not in columns:
            need = " and ".join(repr(c) for c in STYLES[style])
            raise DatasetError(f"{path}: missing column {col!r} ({style} style needs {need})")
    return style


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(row id, parsed object or _BadRow) per non-blank line."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            rid = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield rid, _BadRow("line is not valid UTF-8")
                continue
            if not line.strip():
                continue
            try:
                yield rid, json.loads(line.strip())
            except json.JSONDecodeError as e:
                yield rid, _BadRow(f"bad JSON at column {e.colno}: {e.msg}")


def _parquet_rows(path: Path) -> tuple[set[str], list[tuple[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        columns = set(pq.read_schema(path).names)
        wanted = [c for c in ("problem", "answer", "prompt", "reward_model", "data_source") if c in columns]
        rows = pq.read_table(path, columns=wanted).to_pylist()
    except Exception as e:  # noqa: BLE001  (pyarrow raises several types for a corrupt file)
        raise DatasetError(f"{path}: cannot read Parquet: {e}".splitlines()[0]) from None
    return columns, [(f"{path} row {i}", r) for i, r in enumerate(rows)]


@dataclass
class LoadReport:
    rows: int = 0
    bad_rows: int = 0
    first_bad: list[str] = field(default_factory=list)

    def bad(self, rid: str, reason: str, strict: bool) -> None:
        if strict:
            raise DatasetError(f"{rid}: {reason}")
        self.bad_rows += 1
        if len(self.first_bad) < REPORTED_BAD_ROWS:
            self.first_bad.append(f"{rid}: {reason}")


def load_examples(paths: Sequence[str | Path], strict: bool = False) -> tuple[list[Example], LoadReport]:
    """Every usable row of the files, in file order, and what was skipped."""
    if not paths:
        raise DatasetError("no dataset files given")
    examples: list[Example] = []
    report = LoadReport()
    for p in map(Path, paths):
        if not p.is_file():
            raise DatasetError(f"{p}: dataset file not found")
        if p.suffix not in FORMATS:
            raise DatasetError(f"{p}: unsupported dataset format {p.suffix!r}; allowed: {', '.join(FORMATS)}")
        bad_before = report.bad_rows
        if p.suffix == ".parquet":
            columns, items = _parquet_rows(p)
        else:
            items = list(_jsonl_rows(p))
            columns = {k for _, r in items if isinstance(r, Mapping) for k in r}
        # Judge columns only when some row parsed; a file of only bad lines reports those lines.
        style = _style(p, columns) if columns else None
        first_here = ""
        for rid, row in items:
            report.rows += 1
            try:
                if isinstance(row, _BadRow):
                    raise row
                examples.append(_normalize(row, style or "deepscaler", rid, p.name.split(".")[0]))
            except _BadRow as e:
                report.bad(rid, str(e), strict)
                first_here = first_here or f"{rid}: {e}"
        if report.bad_rows > bad_before:
            log.warning("%s: skipped %d bad rows; first: %s", p, report.bad_rows - bad_before, first_here)
    return examples, report


def with_instruction(messages: list[dict[str, str]], instruction: str) -> list[dict[str, str]]:
    """A copy of the messages with the instruction appended to the last user message."""
    if not instruction:
        return messages
    out = [dict(m) for m in messages]
    last = max(i for i, m in enumerate(out) if m["role"] == "user")
    out[last]["content"] = out[last]["content"].rstrip() + " " + instruction
    return out


def tokenize_prompts(tokenizer: Any, conversations: list[list[dict[str, str]]]) -> list[list[int]]:
    """Chat-templated prompt ids, ending with the assistant generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat_template")
    out: list[list[int]] = []
    for i in range(0, len(conversations), _TOKENIZE_CHUNK):
        chunk = conversations[i : i + _TOKENIZE_CHUNK]
        ids = tokenizer.apply_chat_template(chunk, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping):  # transformers 5.x returns a BatchEncoding, 4.x a list
            ids = ids["input_ids"]
        out.extend(list(map(int, x)) for x in ids)
    return out


def sft_batch(prompts: list[list[int]], responses: list[list[int]], eos: int, pad: int) -> tuple[Any, Any, Any]:
    """Right-padded ids of prompt + response + eos, labels on the response and its eos only (-100 elsewhere), lengths:
    the supervised warm starts' one layout."""
    import torch

    seqs = [p + r + [eos] for p, r in zip(prompts, responses)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad)
    labels = torch.full((len(seqs), width), -100)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, len(p) : len(s)] = ids[i, len(p) : len(s)]
    return ids, labels, torch.tensor([len(s) for s in seqs])


class PromptDataset:
    """Prompts drawn without replacement in a seeded per-epoch shuffle, with a resumable cursor.

    The order of epoch e is a permutation seeded by (seed, e), so a cursor (epoch, position)
    restored with ``load_state_dict`` continues with exactly the prompts that would have come.
    """

    def __init__(
        self,
        paths: Sequence[str | Path] | str | Path,
        tokenizer: Any = None,
        *,
        max_prompt_len: int | None = None,
        instruction: str = "",
        seed: int = 0,
        shuffle: bool = True,
        strict: bool = False,
    ) -> None:
        if max_prompt_len is not None and tokenizer is None:
            raise DatasetError("data.max_prompt_len needs a tokenizer to count prompt tokens")
        if max_prompt_len is not None and max_prompt_len < 1:
            raise DatasetError(f"data.max_prompt_len: must be >= 1, got {max_prompt_len}")
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        examples, report = load_examples(paths, strict)
        examples = [replace(e, messages=with_instruction(e.messages, instruction)) for e in examples]
        self.rows, self.bad_rows, self.first_bad_rows = report.rows, report.bad_rows, report.first_bad
        self.dropped_too_long = 0
        self._ids: list[np.ndarray] | None = None
        if tokenizer is not None:
            ids = tokenize_prompts(tokenizer, [e.messages for e in examples])
            keep = [i for i, x in enumerate(ids) if max_prompt_len is None or len(x) <= max_prompt_len]
            self.dropped_too_long = len(examples) - len(keep)
            if self.dropped_too_long:
                log.warning("dropped %d prompts longer than %d tokens", self.dropped_too_long, max_prompt_len)
            examples = [examples[i] for i in keep]
            self._ids = [np.asarray(ids[i], dtype=np.int32) for i in keep]
        if not examples:
            first = f"; first bad row: {self.first_bad_rows[0]}" if self.first_bad_rows else ""
            raise DatasetError(
                f"{', '.join(map(str, paths))}: no usable prompts "
                f"({self.rows} rows, {self.bad_rows} bad, {self.dropped_too_long} over max_prompt_len){first}"
            )
        self._examples = examples
        self.seed, self.shuffle = int(seed), shuffle
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, np.arange(0)

    def __len__(self) -> int:
        return len(self._examples)

    def __getitem__(self, i: int) -> Example:
        e = self._examples[i]
        return e if self._ids is None else replace(e, prompt_ids=self._ids[i].tolist())

    def stats(self) -> dict[str, int]:
        """Counts for the metrics log."""
        return {
            "data/prompts": len(self),
            "data/rows": self.rows,
            "data/bad_rows": self.bad_rows,
            "data/dropped_too_long": self.dropped_too_long,
        }

    def order(self, epoch: int) -> np.ndarray:
        """Indices of the prompts in the order epoch `epoch` draws them."""
        if epoch != self._order_epoch:
            n = len(self._examples)
            self._order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order_epoch = epoch
        return self._order

    def next(self) -> Example:
        """The next prompt; crosses into the next epoch (and a new shuffle) when one is used up."""
        if self.position >= len(self._examples):
            self.epoch, self.position = self.epoch + 1, 0
        i = int(self.order(self.epoch)[self.position])
        self.position += 1
        return self[i]

    def take(self, n: int) -> list[Example]:
        """The next n prompts."""
        return [self.next() for _ in range(n)]

    def state_dict(self) -> dict[str, int]:
        """The cursor, small enough for a checkpoint's JSON."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": len(self)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a cursor saved by state_dict from a dataset of the same size and seed."""
        try:
            epoch, position, seed, size = (int(state[k]) for k in ("epoch", "position", "seed", "size"))
        except (KeyError, TypeError, ValueError):
            raise DatasetError(
                f"data cursor: expected integers epoch, position, seed, size; got {dict(state)}"
            ) from None
        if (seed, size) != (self.seed, len(self)):
            raise DatasetError(
                f"data cursor: saved for {size} prompts with seed {seed}, but this dataset has "
                f"{len(self)} prompts with seed {self.seed}"
            )
        if epoch < 0 or not 0 <= position <= size:
            raise DatasetError(f"data cursor: epoch {epoch}, position {position} out of range for {size} prompts")
        self.epoch, self.position = epoch, position
