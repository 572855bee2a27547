"""A training batch as tensors, identical on every rank, and how scored groups become one (torch and numpy only:
the policy step and the GPU check import it without the learner's sockets)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qurl.wire.protocol import TrajectoryGroup


@dataclass
class Batch:
    """A batch as tensors, identical on every rank: prompt + response per sample, right padded."""

    input_ids: torch.Tensor  # int64 [N, L]
    prompt_len: torch.Tensor  # int64 [N]
    total_len: torch.Tensor  # int64 [N]: prompt + response
    behav_logp: torch.Tensor  # float32 [N, L]: the behaviour logprob of the token at each response position, else 0
    rewards: torch.Tensor  # float32 [N], as scored by the server
    group: torch.Tensor  # int64 [N]: 0..G-1, the samples of a group are contiguous

    @property
    def num_groups(self) -> int:
        return int(self.group[-1]) + 1 if len(self.group) else 0


def min_version(group: TrajectoryGroup) -> int:
    """The oldest weight version that produced any token of the group."""
    return min(int(s.versions.min()) for s in group.samples)


def collate(groups: list[TrajectoryGroup], pad_id: int) -> Batch:
    """Stack groups into padded tensors (samples of a group stay together, groups in the given order)."""
    rows = [(g.prompt_ids, s) for g in groups for s in g.samples]
    length = max(len(p) + len(s.token_ids) for p, s in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.int64)
    behav = torch.zeros((len(rows), length), dtype=torch.float32)
    prompt_len = torch.empty(len(rows), dtype=torch.int64)
    total_len = torch.empty(len(rows), dtype=torch.int64)
    for i, (prompt, s) in enumerate(rows):
        p, t = len(prompt), len(prompt) + len(s.token_ids)
        ids[i, :p] = torch.from_numpy(prompt.astype(np.int64))
        ids[i, p:t] = torch.from_numpy(s.token_ids.astype(np.int64))
        behav[i, p:t] = torch.from_numpy(np.array(s.logprobs, dtype=np.float32))
        prompt_len[i], total_len[i] = p, t
    rewards = torch.tensor([s.reward for _, s in rows], dtype=torch.float32)
    group = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.samples], dtype=torch.int64)
    return Batch(ids, prompt_len, total_len, behav, rewards, group)
