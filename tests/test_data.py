"""Prompt datasets: both formats and styles, their errors, templating, length filter, shuffle and cursor."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from qurl.data import BOXED_INSTRUCTION, DatasetError, Example, PromptDataset, load_examples

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["What is 12+34? Let's think step by step and output the final answer"] * 20, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = TEMPLATE
    return hf


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def deepscaler_rows(n: int) -> list[dict]:
    return [{"problem": f"What is {i}+{i}?", "answer": str(2 * i), "solution": "ignored"} for i in range(n)]


def verl_rows(n: int) -> list[dict]:
    return [
        {
            "data_source": "dapo",
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i}*3?"}],
            "reward_model": {"ground_truth": str(3 * i), "style": "rule"},
            "extra_info": {"index": i},
        }
        for i in range(n)
    ]


def test_jsonl_deepscaler(tmp_path: Path) -> None:
    rows = deepscaler_rows(3) + [{"problem": "Int answer?", "answer": 7, "data_source": "mine"}]
    ds = PromptDataset(write_jsonl(tmp_path / "train.jsonl", rows), shuffle=False)
    assert len(ds) == 4 and ds.bad_rows == 0
    assert ds[1] == Example(f"{tmp_path}/train.jsonl:2", [{"role": "user", "content": "What is 1+1?"}], "2", "train")
    assert (ds[3].answer, ds[3].data_source) == ("7", "mine")


def test_jsonl_verl(tmp_path: Path) -> None:
    ds = PromptDataset(write_jsonl(tmp_path / "dapo.jsonl", verl_rows(2)), shuffle=False)
    e = ds[1]
    assert e.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1*3?"}]
    assert (e.answer, e.data_source, e.prompt_ids) == ("3", "dapo", None)


def test_parquet_both_styles(tmp_path: Path) -> None:
    pq.write_table(pa.Table.from_pylist(deepscaler_rows(3)), tmp_path / "ds.parquet")
    pq.write_table(pa.Table.from_pylist(verl_rows(2)), tmp_path / "verl.parquet")
    ds = PromptDataset([tmp_path / "ds.parquet", tmp_path / "verl.parquet"], shuffle=False)
    assert [e.answer for e in (ds[i] for i in range(len(ds)))] == ["0", "2", "4", "0", "3"]
    assert ds[2].id == f"{tmp_path}/ds.parquet row 2" and ds[2].data_source == "ds"
    assert ds[4].messages[1] == {"role": "user", "content": "What is 1*3?"} and ds[4].data_source == "dapo"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"nope\.jsonl: dataset file not found$"):
        PromptDataset(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("problem,answer\n")
    with pytest.raises(DatasetError, match=r"x\.csv: unsupported dataset format '\.csv'; allowed: \.jsonl, \.parquet"):
        PromptDataset(tmp_path / "x.csv")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [{"problem": "a"}, {"problem": "b"}],
            r"missing column 'answer' \(deepscaler style needs 'problem' and 'answer'\)",
        ),
        (
            [{"prompt": [{"role": "user", "content": "a"}], "data_source": "x"}],
            r"missing column 'reward_model' \(verl style needs 'prompt' and 'reward_model'\)",
        ),
        (
            [{"question": "a", "answer": "1"}],
            r"missing column 'problem' \(DeepScaleR style\) or 'prompt' \(verl style\)",
        ),
    ],
)
def test_missing_column(tmp_path: Path, fmt: str, rows: list, message: str) -> None:
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DatasetError, match=f"^{path}: {message}$"):
        PromptDataset(path)


BAD_LINES = [
    {"problem": "ok 1", "answer": "1"},
    '{"problem": "unterminated',
    "[1, 2]",
    {"problem": 5, "answer": "1"},
    {"problem": "no answer"},
    {"problem": "   ", "answer": "1"},
    {"problem": "list answer", "answer": [1]},
    {"problem": "ok 2", "answer": "2"},
]


def test_bad_lines_skipped_and_counted(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_LINES)
    with path.open("ab") as f:
        f.write(b"\n\xff\xfe not utf-8\n")  # a blank line (ignored) and a line that is not UTF-8
    ds = PromptDataset(path, shuffle=False)
    assert [ds[i].answer for i in range(len(ds))] == ["1", "2"]
    assert (ds.rows, ds.bad_rows) == (9, 7)
    assert ds.stats() == {"data/prompts": 2, "data/rows": 9, "data/bad_rows": 7, "data/dropped_too_long": 0}
    assert ds.first_bad_rows == [
        f"{path}:2: bad JSON at column 13: Unterminated string starting at",
        f"{path}:3: row is list, expected an object",
        f"{path}:4: field 'problem' is int, expected a string",
        f"{path}:5: missing field 'answer'",
        f"{path}:6: field 'problem' is empty",
    ]


def test_bad_rows_in_verl_style(tmp_path: Path) -> None:
    good = verl_rows(1)[0]
    rows = [
        good,
        {**good, "prompt": "a string, not messages"},
        {**good, "prompt": []},
        {**good, "prompt": [{"role": "robot", "content": "x"}]},
        {**good, "prompt": [{"role": "system", "content": "only system"}]},
        {**good, "reward_model": {"style": "rule"}},
        {**good, "reward_model": "7"},
    ]
    _, report = load_examples([write_jsonl(tmp_path / "v.jsonl", rows)])
    assert report.bad_rows == 6
    assert [b.split(": ", 1)[1] for b in report.first_bad] == [
        "field 'prompt' is str, expected a non-empty list of chat messages",
        "field 'prompt' is list, expected a non-empty list of chat messages",
        "prompt[0] is not a chat message {'role': system|user|assistant, 'content': str}",
        "field 'prompt' has no user message",
        "missing field 'reward_model.ground_truth'",
    ]


def test_strict_names_file_and_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_LINES)
    with pytest.raises(DatasetError, match=f"^{path}:2: bad JSON"):
        PromptDataset(path, strict=True)
    pq.write_table(
        pa.Table.from_pylist([{"problem": "a", "answer": "1"}, {"problem": "b", "answer": None}]),
        tmp_path / "p.parquet",
    )
    with pytest.raises(DatasetError, match=r"p\.parquet row 1: missing field 'answer'$"):
        PromptDataset(tmp_path / "p.parquet", strict=True)


def test_nothing_usable(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "all_bad.jsonl", ["{", "{"])
    with pytest.raises(
        DatasetError, match=r"no usable prompts \(2 rows, 2 bad, 0 over max_prompt_len\); first bad row: .*:1: bad JSON"
    ):
        PromptDataset(path)


def test_chat_template_and_instruction(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    ds = PromptDataset(
        write_jsonl(tmp_path / "v.jsonl", verl_rows(2)), tokenizer, instruction=BOXED_INSTRUCTION, shuffle=False
    )
    e = ds[1]
    assert e.messages[0] == {"role": "system", "content": "Be brief."}
    assert e.messages[1]["content"] == "What is 1*3? " + BOXED_INSTRUCTION
    text = tokenizer.decode(e.prompt_ids)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1*3? "
        + BOXED_INSTRUCTION
        + "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert all(isinstance(t, int) for t in e.prompt_ids)


def test_too_long_prompts_dropped(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    rows = deepscaler_rows(5) + [{"problem": "What is 1+1? " * 40, "answer": "2"}] * 2
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    longest_kept = max(len(x) for x in PromptDataset(path, tokenizer, shuffle=False).take(5) for x in [x.prompt_ids])
    ds = PromptDataset(path, tokenizer, max_prompt_len=longest_kept, shuffle=False)
    assert (len(ds), ds.dropped_too_long) == (5, 2)
    assert all(len(ds[i].prompt_ids) <= longest_kept for i in range(len(ds)))
    assert ds.stats()["data/dropped_too_long"] == 2
    with pytest.raises(DatasetError, match=r"no usable prompts \(7 rows, 0 bad, 7 over max_prompt_len\)"):
        PromptDataset(path, tokenizer, max_prompt_len=3)


def test_tokenizer_errors(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", deepscaler_rows(2))
    with pytest.raises(DatasetError, match="max_prompt_len needs a tokenizer"):
        PromptDataset(path, max_prompt_len=10)
    bare = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    with pytest.raises(DatasetError, match="has no chat_template"):
        PromptDataset(path, bare)


def test_shuffle_deterministic_and_new_each_epoch(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", deepscaler_rows(50))
    a, b, c = PromptDataset(path, seed=1), PromptDataset(path, seed=1), PromptDataset(path, seed=2)
    first = [e.answer for e in a.take(100)]
    assert first == [e.answer for e in b.take(100)]
    assert first != [e.answer for e in c.take(100)]
    epoch0, epoch1 = first[:50], first[50:]
    assert sorted(epoch0) == sorted(epoch1) == sorted(str(2 * i) for i in range(50))  # each epoch is a permutation
    assert epoch0 != epoch1 and (a.epoch, a.position) == (1, 50)
    assert [e.answer for e in PromptDataset(path, shuffle=False).take(3)] == ["0", "2", "4"]


@pytest.mark.parametrize("consumed", [0, 7, 50, 93])
def test_cursor_restore_continues_identically(tmp_path: Path, consumed: int) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", deepscaler_rows(50))
    ds = PromptDataset(path, seed=3)
    ds.take(consumed)
    state = json.loads(json.dumps(ds.state_dict()))  # survives a JSON checkpoint
    expected = [e.id for e in ds.take(60)]
    restored = PromptDataset(path, seed=3)
    restored.load_state_dict(state)
    assert [e.id for e in restored.take(60)] == expected


def test_cursor_refuses_other_dataset(tmp_path: Path) -> None:
    ds = PromptDataset(write_jsonl(tmp_path / "d.jsonl", deepscaler_rows(50)), seed=3)
    with pytest.raises(
        DatasetError, match="saved for 40 prompts with seed 3, but this dataset has 50 prompts with seed 3"
    ):
        ds.load_state_dict({"epoch": 0, "position": 1, "seed": 3, "size": 40})
    with pytest.raises(DatasetError, match="out of range"):
        ds.load_state_dict({"epoch": 0, "position": 51, "seed": 3, "size": 50})
    with pytest.raises(DatasetError, match="expected integers"):
        ds.load_state_dict({"epoch": 0})
