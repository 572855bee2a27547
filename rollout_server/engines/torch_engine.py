"""The embedded rollout engine: continuous batching over a preallocated KV cache, in-place weight updates.

Active sequences always occupy cache slots 0..B-1: a finished sequence's slot is refilled by moving
the last active sequence into it, so one decode step runs over contiguous cache views.
Not thread-safe: call add_request / step / update_weights from one thread (the server loop).
"""

from __future__ import annotations

import collections
import hashlib
import random
from collections.abc import Hashable

import torch

from qurl.quant import Scheme, quantize_state_dict
from qurl.wire import delta
from rollout_server.engines import Completion, GenRequest, GenResult, check_names, run_to_completion
from rollout_server.engines.model import ModelConfig, Transformer, load_safetensors
from rollout_server.engines.sampling import sample

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
# Prompt tokens one step() may prefill (at least one prompt always goes in), as vLLM's max_num_batched_tokens: the
# server loop beats its heartbeat between steps, and 64 queued eval prompts prefilled in one step kept it silent past
# the learner's 30 s presumed-gone limit in fp32 on a shared core (AVX2 EPYC; docs/RESULTS.md §11).
PREFILL_TOKENS_PER_STEP = 512


PAD_WASTE = 1.25  # a batched prefill computes at most this many padded tokens per real one


def _similar_lengths(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` in runs of similar length, each padded to its longest within PAD_WASTE of its real tokens:
    one padded batch of eight 45-token prompts and one of 250 computed 3.7x its real tokens (RESULTS §13)."""
    runs: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if runs and lengths[i] * (len(runs[-1]) + 1) <= PAD_WASTE * (real + lengths[i]):
            runs[-1].append(i)
            real += lengths[i]
        else:
            runs.append([i])
            real = lengths[i]
    return runs


class _Seq:
    """One sample in flight: its tokens so far and where it sits in the cache."""

    __slots__ = ("request_id", "index", "req", "stop", "gen", "tokens", "logprobs", "versions", "length")

    def __init__(self, request_id: Hashable, index: int, req: GenRequest, gen: torch.Generator, length: int) -> None:
        self.request_id, self.index, self.req, self.gen = request_id, index, req, gen
        self.stop = set(req.stop_token_ids)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.length = length  # tokens held in the cache; the last sampled token is not yet among them

    def push(self, token: int, logprob: float, version: int) -> str | None:
        """Record a sampled token; return the finish reason if it ends the sequence."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if token in self.stop:
            return "stop"
        return "length" if len(self.tokens) >= self.req.max_new_tokens else None


def sample_seed(seed: int, index: int) -> int:
    """Distinct, reproducible generator seed for sample `index` of a request seeded with `seed`."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class TorchEngine:
    """Continuous-batching generation with fp / INT8 / FP8 linears; see design.md section 4."""

    def __init__(self, model: Transformer, max_batch: int, max_seq_len: int) -> None:
        if max_batch < 1 or max_seq_len < 2:
            raise ValueError(f"need max_batch >= 1 and max_seq_len >= 2, got {max_batch} and {max_seq_len}")
        cfg = model.cfg
        self.model, self.max_batch, self.max_seq_len = model, max_batch, max_seq_len
        self.device = model.device
        shape = (cfg.num_layers, max_batch, cfg.num_kv_heads, max_seq_len, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=model.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=model.dtype, device=self.device)
        rows = torch.arange(max_batch * cfg.num_kv_heads, device=self.device).view(max_batch, cfg.num_kv_heads)
        self._row_base = rows * max_seq_len  # first cache row of (slot, kv head) in a layer viewed as [-1, hd]
        self._weights = dict(model.named)
        self._version = 0
        self._active: list[_Seq] = []
        self._waiting: collections.deque = collections.deque()  # [request_id, req, next sample index]
        self._remaining: dict[Hashable, int] = {}  # request id -> samples not yet handed back
        self._rng = random.Random()

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        scheme: Scheme,
        dtype: str = "float32",
        device: str = "cpu",
        max_batch: int = 64,
        max_seq_len: int = 2048,
        weight_bits: int = 8,
        int8_lm_head: bool = False,
    ) -> TorchEngine:
        """Load full-precision HF weights, quantize them with qurl.quant, and keep exactly those buffers.

        load_engine has checked the settings: `scheme` is a registry record, `dtype` one of _DTYPES.
        """
        cfg = ModelConfig.from_dir(path)
        tensors = quantize_state_dict(load_safetensors(path, cfg.tensor_shapes()), scheme.name, weight_bits)
        model = Transformer(cfg, tensors, scheme, _DTYPES[dtype], torch.device(device), max_seq_len, int8_lm_head)
        return cls(model, max_batch, max_seq_len)

    @property
    def version(self) -> int:
        """Weight version that produces the next tokens."""
        return self._version

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The engine's named weight tensors (HF names, quantized layout); read them, update via update_weights."""
        return dict(self._weights)

    @property
    def num_running(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        """Samples queued but not yet admitted."""
        return sum(entry[1].n - entry[2] for entry in self._waiting)

    def has_work(self) -> bool:
        return bool(self._active or self._waiting)

    def add_request(self, req: GenRequest, request_id: Hashable) -> None:
        """Queue a request; its samples come back from step() as (request_id, sample index, Completion)."""
        self._check(req)
        if request_id in self._remaining:
            raise ValueError(f"request id {request_id!r} is already in flight")
        self._remaining[request_id] = req.n
        self._waiting.append([request_id, req, 0])

    def _check(self, req: GenRequest) -> None:
        vocab = self.model.cfg.vocab_size
        if not req.prompt_ids:
            raise ValueError("prompt_ids is empty")
        if any(not 0 <= t < vocab for t in req.prompt_ids):
            raise ValueError(f"prompt_ids hold a token outside [0, {vocab})")
        if req.n < 1 or req.max_new_tokens < 1:
            raise ValueError(f"need n >= 1 and max_new_tokens >= 1, got n={req.n}, max_new_tokens={req.max_new_tokens}")
        if len(req.prompt_ids) + req.max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({len(req.prompt_ids)}) + max_new_tokens ({req.max_new_tokens}) exceeds "
                f"max_seq_len {self.max_seq_len}"
            )
        if not req.temperature >= 0 or not 0 < req.top_p <= 1 or not (req.top_k == -1 or req.top_k >= 1):
            raise ValueError(
                "need temperature >= 0, 0 < top_p <= 1, top_k -1 or >= 1; "
                f"got {req.temperature}, {req.top_p}, {req.top_k}"
            )

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Run `requests` to completion; one GenResult per request, samples in index order."""
        return run_to_completion(self, requests)

    @torch.inference_mode()
    def step(self) -> list[tuple[Hashable, int, Completion]]:
        """Admit waiting samples into free slots (prefill, up to PREFILL_TOKENS_PER_STEP prompt tokens), then decode
        one token for every active sequence."""
        finished: list[tuple[Hashable, int, Completion]] = []
        done: list[tuple[int, str]] = []  # (slot, finish reason)
        if self._waiting and len(self._active) < self.max_batch:
            self._admit(done)
        self._release(done, finished)
        if self._active:
            self._decode(done)
            self._release(done, finished)
        return finished

    def _admit(self, done: list[tuple[int, str]]) -> None:
        """Prefill waiting requests, in order, into as many free slots as their samples need, together in one forward
        (up to PREFILL_TOKENS_PER_STEP prompt tokens; the first always goes in)."""
        picked: list[tuple[list, int, int]] = []  # (waiting entry, samples admitted, first slot)
        slot, tokens = len(self._active), 0
        for entry in self._waiting:
            if slot >= self.max_batch or tokens >= PREFILL_TOKENS_PER_STEP:
                break
            k = min(self.max_batch - slot, entry[1].n - entry[2])
            picked.append((entry, k, slot))
            slot, tokens = slot + k, tokens + len(entry[1].prompt_ids)
        lengths = [len(entry[1].prompt_ids) for entry, _, _ in picked]
        logits: list[torch.Tensor | None] = [None] * len(picked)
        for run in _similar_lengths(lengths):  # one padded forward per run: padding stays under PAD_WASTE
            prompts = torch.zeros(len(run), max(lengths[i] for i in run), dtype=torch.long, device=self.device)
            for row, i in enumerate(run):
                prompts[row, : lengths[i]] = torch.tensor(picked[i][0][1].prompt_ids, dtype=torch.long)
            slots = [picked[i][2] for i in run]
            out = self.model.prefill_many(prompts, [lengths[i] for i in run], self.k_cache, self.v_cache, slots)
            for row, i in enumerate(run):
                logits[i] = out[row]
        for (entry, k, slot), t, row in zip(picked, lengths, logits):
            request_id, req, first = entry
            if k > 1:
                self.k_cache[:, slot + 1 : slot + k, :, :t] = self.k_cache[:, slot : slot + 1, :, :t]
                self.v_cache[:, slot + 1 : slot + k, :, :t] = self.v_cache[:, slot : slot + 1, :, :t]
            seqs = []
            for index in range(first, first + k):
                seed = sample_seed(req.seed, index) if req.seed is not None else self._rng.getrandbits(63)
                seqs.append(_Seq(request_id, index, req, torch.Generator().manual_seed(seed), t))
            self._active.extend(seqs)
            self._sample(row.expand(k, -1), seqs, slot, done)
            entry[2] += k
        while self._waiting and self._waiting[0][2] == self._waiting[0][1].n:
            self._waiting.popleft()

    def _decode(self, done: list[tuple[int, str]]) -> None:
        seqs = self._active
        tokens = torch.tensor([s.tokens[-1] for s in seqs], dtype=torch.long, device=self.device)
        positions = torch.tensor([s.length for s in seqs], dtype=torch.long, device=self.device)
        length = max(s.length for s in seqs) + 1
        write_index = (self._row_base[: len(seqs)] + positions[:, None]).flatten()
        visible = torch.arange(length, device=self.device)[None, :] <= positions[:, None]
        mask = torch.zeros(visible.shape, dtype=self.model.dtype, device=self.device)
        mask = mask.masked_fill_(~visible, -torch.inf)[:, None, None, :]
        logits = self.model.decode(tokens, positions, self.k_cache, self.v_cache, write_index, mask)
        for s in seqs:
            s.length += 1
        self._sample(logits, seqs, 0, done)

    def _sample(self, logits: torch.Tensor, seqs: list[_Seq], first_slot: int, done: list[tuple[int, str]]) -> None:
        reqs = [s.req for s in seqs]
        tokens, logprobs = sample(
            logits,
            [r.temperature for r in reqs],
            [r.top_p for r in reqs],
            [r.top_k for r in reqs],
            [1.0 - torch.rand((), generator=s.gen).item() for s in seqs],  # in (0, 1]
        )
        for i, (s, tok, lp) in enumerate(zip(seqs, tokens.tolist(), logprobs.tolist())):
            reason = s.push(tok, lp, self._version)
            if reason is not None:
                done.append((first_slot + i, reason))

    def _release(self, done: list[tuple[int, str]], finished: list[tuple[Hashable, int, Completion]]) -> None:
        """Hand back finished sequences; move the last active sequence into each freed slot."""
        for slot, reason in sorted(done, reverse=True):
            s = self._active[slot]
            finished.append((s.request_id, s.index, Completion(s.tokens, s.logprobs, s.versions, reason)))
            last = len(self._active) - 1
            if slot != last:
                moved = self._active[last]
                n = moved.length
                self.k_cache[:, slot, :, :n] = self.k_cache[:, last, :, :n]
                self.v_cache[:, slot, :, :n] = self.v_cache[:, last, :, :n]
                self._active[slot] = moved
            self._active.pop()
            self._remaining[s.request_id] -= 1
            if not self._remaining[s.request_id]:
                del self._remaining[s.request_id]
        done.clear()

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int, partial: bool = False) -> None:
        """Copy new weights into the existing buffers in place; everything is checked before anything is written.

        Without `partial`, `named_tensors` must name every engine tensor (see `weights`).
        """
        expected = self._weights
        check_names(expected, named_tensors, partial)
        for name, t in named_tensors.items():
            dst = expected[name]
            if tuple(t.shape) != tuple(dst.shape) or t.dtype != dst.dtype:
                raise ValueError(
                    f"update_weights: {name} is {t.dtype} {tuple(t.shape)}, "
                    f"the engine holds {dst.dtype} {tuple(dst.shape)}"
                )
        with torch.inference_mode():  # also fine for buffers created inside inference mode
            for name, t in named_tensors.items():
                expected[name].copy_(t)
            self.model.repack(named_tensors)
        self._version = int(version)

    def apply_delta(
        self, whole: dict[str, torch.Tensor], deltas: dict[str, delta.Delta], version: int, checksum: str
    ) -> None:
        """Apply a delta push (qurl.wire.delta.split_push) in place as `version`: all or nothing, proven by checksum."""
        with torch.inference_mode():
            delta.apply(self._weights, whole, deltas, checksum)
            self.model.repack([*whole, *deltas])
        self._version = int(version)
