"""Prompt-shared packing (learner/packing.py): the layout, and log-probs and gradients equal to the unpacked forward
on small Llama and Qwen2 models with both attention implementations that take a 4D mask."""

from __future__ import annotations

import pytest
import torch

from learner.logprobs import token_logprobs
from learner.packing import pack, packed_logprobs

PAD = 0


def shared_prompt_rows(prompts: list[int], responses: list[list[int]], vocab: int, seed: int):
    """Right-padded rows [n, T] of groups (one prompt per group, one response length per sample)."""
    g = torch.Generator().manual_seed(seed)
    rows, prompt_len, total_len, group = [], [], [], []
    for gi, (p, lengths) in enumerate(zip(prompts, responses)):
        prompt = torch.randint(3, vocab, (p,), generator=g)
        for r in lengths:
            rows.append(torch.cat([prompt, torch.randint(3, vocab, (r,), generator=g)]))
            prompt_len.append(p)
            total_len.append(p + r)
            group.append(gi)
    ids = torch.full((len(rows), max(total_len)), PAD, dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return ids, torch.tensor(prompt_len), torch.tensor(total_len), torch.tensor(group)


def test_pack_lays_out_one_row_per_group_with_the_prompt_once():
    ids = torch.tensor([[5, 6, 7, 10, 11, 0], [5, 6, 7, 20, 0, 0], [8, 9, 30, 31, 32, 33]])
    packed = pack(ids, torch.tensor([3, 3, 2]), torch.tensor([5, 4, 6]), torch.tensor([0, 0, 1]), 2, PAD)

    assert packed.input_ids.tolist() == [[5, 6, 7, 10, 11, 20], [8, 9, 30, 31, 32, 33]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 3, 4, 5]]
    allowed = packed.allowed[0, 0].int().tolist()
    assert allowed[5] == [1, 1, 1, 0, 0, 1]  # the second response sees the prompt and itself, not the first one
    assert allowed[4] == [1, 1, 1, 1, 1, 0]
    assert allowed[2] == [1, 1, 1, 0, 0, 0]
    # targets at positions 2..5 of each row, predicted from the packed position of the token before them
    assert packed.source.tolist() == [
        [1, 2, 3, 4],  # 7 from 6, 10 from 7, 11 from 10, a pad (masked) from 11
        [1, 2, 5, 5],  # 7 from 6, 20 from 7, pads from 20
        [6 + 1, 6 + 2, 6 + 3, 6 + 4],
    ]


def test_pack_refuses_a_group_whose_samples_differ_in_prompt():
    ids = torch.tensor([[5, 6, 10], [5, 7, 11]])
    with pytest.raises(ValueError, match="group 0 do not share one prompt"):
        pack(ids, torch.tensor([2, 2]), torch.tensor([3, 3]), torch.tensor([0, 0]), 2, PAD)


def tiny_model(kind: str, attention: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation=attention,
    )
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True))
    return Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=False))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_logprobs_and_gradients_equal_the_unpacked_ones(kind, attention):
    model = tiny_model(kind, attention)
    ids, prompt_len, total_len, group = shared_prompt_rows([7, 4, 9], [[3, 6, 1], [5, 5], [2, 8, 4, 0]], 97, 1)
    start = int(prompt_len.min())
    pos = torch.arange(start, ids.shape[1])
    mask = (pos >= prompt_len[:, None]) & (pos < total_len[:, None])
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    results = []
    for packed in (False, True):
        model.zero_grad()
        if packed:
            layout = pack(ids, prompt_len, total_len, group, start, PAD)
            out = packed_logprobs(model, layout, ids[:, start:], 0.7, entropy=True)
        else:
            out = token_logprobs(model, ids, start, 0.7, entropy=True)
        (out.logp * weights * mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((out.logp.detach()[mask], out.entropy[mask], grads))
    (plain, plain_h, plain_g), (packed, packed_h, packed_g) = results
    torch.testing.assert_close(packed, plain, rtol=0, atol=2e-5)
    torch.testing.assert_close(packed_h, plain_h, rtol=0, atol=2e-5)
    for name, grad in plain_g.items():
        torch.testing.assert_close(packed_g[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_logprobs_name_an_attention_that_takes_no_mask():
    model = tiny_model("llama", "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    ids, prompt_len, total_len, group = shared_prompt_rows([3], [[2, 2]], 97, 0)
    layout = pack(ids, prompt_len, total_len, group, 3, PAD)
    with pytest.raises(ValueError, match="or eager attention; the model uses flash_attention_2"):
        packed_logprobs(model, layout, ids[:, 3:], 1.0)


def test_packed_planner_keeps_groups_whole_within_the_budget():
    from learner.batch import Batch
    from learner.policy_step import PLANNERS
    from qurl.config import CHOICES

    assert set(PLANNERS) == set(CHOICES["train.micro_batches"])
    ids, prompt_len, total_len, group = shared_prompt_rows([10, 10, 10], [[5, 5], [20, 1], [2, 2]], 97, 0)
    batch = Batch(ids, prompt_len, total_len, torch.zeros(ids.shape), torch.zeros(len(group)), group)
    every = torch.arange(len(group))
    plan = lambda budget: [c.tolist() for c in PLANNERS["packed"](every, batch, budget)]  # noqa: E731
    # packed lengths 20, 31, 14, sorted 14, 20, 31: all three pad to 3 x 31 = 93 tokens; within 62, one forward
    # of 14 + 20 padded to 40 and one of 31 beat 14 alone and 20 + 31 padded to 62
    assert plan(1000) == [[4, 5, 0, 1, 2, 3]]
    assert plan(62) == [[4, 5, 0, 1], [2, 3]]
    assert plan(5) == [[4, 5], [0, 1], [2, 3]]
