"""SGLang rollout engine for GPU nodes: one sglang.Engine per replica behind the embedded engine's interface.

Written against sglang 0.5.23 (names read from its source). Generation sends token ids (skip_tokenizer_init) with
n samples per request and reads per-token logprobs and weight-version spans from meta_info. A weight update is
one session: pause (retract) -> begin_weight_update -> bucketed update_weights_from_tensor (or _from_distributed)
-> end_weight_update -> continue. INT8 goes through our custom loader (sglang_int8_loader), FP8 block 128x128
and full precision through SGLang's own loaders. Quantized engines start from dummy weights and get version 0
from the checkpoint, quantized with qurl.quant exactly as the learner quantizes its pushes.
Not thread-safe: call everything from the thread that built the engine (its asyncio loop lives there).
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import signal
from collections.abc import Hashable, Iterator
from typing import Any

import torch

from qurl.quant import FP8_BLOCK, INT8, SCALE_SUFFIXES, SCHEMES, is_quantized_linear, quantize_state_dict
from qurl.wire import delta
from qurl.wire import sglang_payload as payload
from rollout_server.engines import Completion, GenRequest, GenResult, check_names, run_to_completion
from rollout_server.engines.sglang_args import engine_args, fp8_refit_problem
from rollout_server.engines.sglang_fp8_loader import LOADER_PATH as FP8_LOADER_PATH
from rollout_server.engines.sglang_int8_loader import LOADER_PATH

SGLANG_VERSION = "0.5.23"
INSTALL_HINT = (
    "rollout.engine=sglang needs the sglang package: install the `sglang` extra on a GPU node "
    "(pip install -e '.[sglang]')"
)
POLL_S = 0.005  # how long step() lets SGLang's event loop run when nothing has finished yet
UPDATE_GROUP = payload.GROUP_NAME


def require_sglang() -> None:
    """One clear line when sglang is missing or not the version this adapter and the INT8 loader were built for."""
    try:
        import sglang
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    if sglang.__version__ != SGLANG_VERSION:
        raise ValueError(f"rollout.engine=sglang supports sglang {SGLANG_VERSION}, found {sglang.__version__}")


def tensor_update_request(per_rank: list[bytes], load_format: str | None, last: bool, version: int) -> Any:
    """UpdateWeightsFromTensorReqInput for one bucket; only the last bucket flushes the cache and sets the version."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    return UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=list(per_rank),
        load_format=load_format,
        flush_cache=last,
        weight_version=str(version) if last else None,
    )


def distributed_update_request(
    meta: tuple[list[str], list[str], list[list[int]]], group_name: str, last: bool, version: int
) -> Any:
    """UpdateWeightsFromDistributedReqInput for one flattened-bucket broadcast."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

    names, dtypes, shapes = meta
    return UpdateWeightsFromDistributedReqInput(
        names=list(names),
        dtypes=list(dtypes),
        shapes=[list(x) for x in shapes],
        group_name=group_name,
        flush_cache=last,
        weight_version=str(version) if last else None,
        load_format="flattened_bucket",
    )


def request_dict(req: GenRequest) -> dict[str, Any]:
    """GenerateReqInput keyword arguments for one GenRequest: n samples, max_new_tokens always set, logprobs on."""
    sampling = {
        "n": req.n,
        "max_new_tokens": req.max_new_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stop_token_ids": list(req.stop_token_ids),
    }
    return {"input_ids": list(req.prompt_ids), "sampling_params": sampling, "return_logprob": True}


def token_versions(meta: dict[str, Any], num_tokens: int) -> list[int]:
    """Per-token weight versions from meta_info's weight_versions spans, else its single weight_version."""
    try:
        spans = meta.get("weight_versions")
        if not spans:
            return [int(meta["weight_version"])] * num_tokens
        versions: list[int | None] = [None] * num_tokens
        for span in spans:
            for i in range(span["start"], min(span["end"], num_tokens)):
                versions[i] = int(span["version"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"sglang meta_info carries no integer weight version ({exc!r}); start it with weight_version='0'"
        ) from None
    if None in versions:
        raise ValueError(f"sglang weight_versions spans {spans} do not cover {num_tokens} output tokens")
    return versions  # type: ignore[return-value]


def parse_output(out: dict[str, Any]) -> Completion:
    """One SGLang result dict -> Completion; tokens and logprobs come from meta_info.output_token_logprobs."""
    meta = out["meta_info"]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in ("stop", "length"):
        raise RuntimeError(f"sglang did not finish the request: {finish}")
    triples = meta["output_token_logprobs"]
    if any(lp is None for lp, _, _ in triples):
        raise ValueError("sglang returned a token without a logprob; requests must set return_logprob")
    tokens = [int(tok) for _, tok, _ in triples]
    return Completion(
        token_ids=tokens,
        logprobs=[float(lp) for lp, _, _ in triples],
        versions=token_versions(meta, len(tokens)),
        finish_reason=kind,
    )


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a Hugging Face folder."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


def expected_tensors(path: str, scheme: str) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Name -> (shape, dtype or None for "any floating") of every tensor a push must carry, from safetensors headers."""
    from safetensors import safe_open

    s = SCHEMES[scheme]
    out: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
    for f in checkpoint_files(path):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                shape = tuple(st.get_slice(name).get_shape())
                if s.scale_suffix and is_quantized_linear(name):
                    out[name] = (shape, s.code_dtype)
                    out[name + s.scale_suffix] = (s.scale_shape(shape), torch.float32)
                else:
                    out[name] = (shape, None)
    return out


def check_push(expected: dict, tensors: dict[str, torch.Tensor], partial: bool = False) -> None:
    """Refuse a push whose names, shapes or dtypes differ from what the engine loads (see expected_tensors)."""
    check_names(expected, tensors, partial)
    for name, t in tensors.items():
        shape, dtype = expected[name]
        if tuple(t.shape) != shape or (t.dtype != dtype if dtype is not None else not t.is_floating_point()):
            want = dtype if dtype is not None else "floating"
            raise ValueError(f"update_weights: {name} is {t.dtype} {tuple(t.shape)}, the engine loads {want} {shape}")


def keep_host_copy(host: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], scheme: str) -> None:
    """Store CPU copies of `tensors` in `host`, the base the next delta applies to; for `none` nothing (full pushes
    only: the base would be the whole model per replica). Takes the scheme, as one checkpoint file may hold no codes."""
    if SCHEMES[scheme].code_dtype is None:
        return
    for name, t in tensors.items():
        host[name] = t.to("cpu", copy=True).contiguous()


def apply_to_host(
    host: dict[str, torch.Tensor], whole: dict[str, torch.Tensor], deltas: dict[str, delta.Delta], checksum: str
) -> dict[str, torch.Tensor]:
    """Apply a delta push to the host copy; return what SGLang must load: every changed tensor, a code tensor with
    its scale (the two travel as one unit), and tensors the host lacks as sent. Raises like qurl.wire.delta.apply, host
    unchanged."""
    touched = {name: t for name, t in whole.items() if name in host}
    delta.apply(host, touched, deltas, checksum)
    out = {name: t for name, t in whole.items() if name not in host}
    for name in [*deltas, *touched]:
        code = next((name[: -len(s)] for s in SCALE_SUFFIXES if name.endswith(s) and name[: -len(s)] in host), name)
        out.update({n: host[n] for n in (code, *(code + s for s in SCALE_SUFFIXES)) if n in host})
    return out


class SGLangEngine:
    """generate / add_request / step / update_weights / version over one sglang.Engine (see design.md section 4)."""

    def __init__(self, engine: Any, *, scheme: str, tp_size: int, expected: dict, bucket_bytes: int) -> None:
        self.engine, self.scheme, self.tp_size = engine, scheme, tp_size
        self.expected, self.bucket_bytes = expected, bucket_bytes
        self._loop: asyncio.AbstractEventLoop = engine.loop
        self._tm = engine.tokenizer_manager
        self._version = 0
        self.host: dict[str, torch.Tensor] = {}  # CPU copy of every tensor (quantized schemes): the delta base
        self._tasks: dict[asyncio.Task, tuple[Hashable, int]] = {}  # task -> (request id, n)
        self._in_flight: set[Hashable] = set()

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        quant: str = "int8",
        dtype: str = "bfloat16",
        device: str = "cuda",
        max_batch: int = 64,
        max_seq_len: int = 2048,
        tp_size: int = 1,
        gpus: list[int] | None = None,
        seed: int = 0,
        mem_fraction: float | None = None,
        server_args: dict[str, Any] | None = None,
        bucket_bytes: int = payload.UPDATE_BUCKET_BYTES,
    ) -> SGLangEngine:
        """Start SGLang on `gpus` (default: tp_size GPUs from device "cuda:N"), then load version 0."""
        require_sglang()
        scheme = quant  # a scheme name (load_engine resolved any alias); engine_args refuses what SGLang cannot refit
        if device == "cpu":
            if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
                raise ValueError(
                    "rollout.engine=sglang with rollout.device=cpu needs SGLANG_USE_CPU_ENGINE=1 (SGLang's "
                    "CPU engine; on this project's CPUs only with the test stand-ins of make test-sglang)"
                )
            gpus = None
        elif gpus is None:
            if device != "cuda" and not device.startswith("cuda:"):
                raise ValueError(
                    f"rollout.device={device!r}: the sglang engine runs on CUDA GPUs ('cuda' or 'cuda:N') "
                    "or, for tests, on the CPU ('cpu')"
                )
            first = int(device.partition(":")[2] or 0)
            gpus = list(range(first, first + tp_size))
        if scheme == FP8_BLOCK.name and gpus is not None:
            problem = fp8_refit_problem(torch.cuda.get_device_capability(gpus[0]))
            if problem:
                raise ValueError(problem)
        args = engine_args(
            path,
            scheme=scheme,
            dtype=dtype,
            tp_size=tp_size,
            gpus=gpus,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            seed=seed,
            mem_fraction=mem_fraction,
            server_args=server_args,
        )
        expected = expected_tensors(path, scheme)
        import sglang

        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        on_signal = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            sgl = sglang.Engine(**args)
            sgl.loop.run_until_complete(_start_handle_loop(sgl.tokenizer_manager))
            sgl.loop.remove_signal_handler(signal.SIGTERM)
        finally:  # SGLang re-runs logging.basicConfig(force=True) and takes SIGTERM: keep the server's log lines
            root.handlers[:] = handlers  # and its clean stop (SGLang's SIGQUIT handler, for a crashed child, stays)
            root.setLevel(level)
            for sig, handler in on_signal.items():
                if handler is not None:
                    signal.signal(sig, handler)
        self = cls(sgl, scheme=scheme, tp_size=tp_size, expected=expected, bucket_bytes=bucket_bytes)
        if scheme != "none":
            try:
                self._session(self._checkpoint_buckets(path), version=0)
            except BaseException:
                self.close()
                raise
        return self

    @property
    def load_format(self) -> str | None:
        """The update load_format of this scheme: our INT8 loader, our checked FP8 loader, SGLang's own for none."""
        return {INT8.name: LOADER_PATH, FP8_BLOCK.name: FP8_LOADER_PATH}.get(self.scheme)

    # -- generation ----------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Weight version that produces the next tokens."""
        return self._version

    @property
    def num_running(self) -> int:
        """Samples handed to SGLang and not yet returned (it queues past max_running_requests itself)."""
        return sum(n for _, n in self._tasks.values())

    @property
    def num_waiting(self) -> int:
        """Always 0: every added request goes to SGLang at once."""
        return 0

    def has_work(self) -> bool:
        return bool(self._tasks)

    def add_request(self, req: GenRequest, request_id: Hashable) -> None:
        """Queue a request; its n samples come back together from step() as (request_id, index, Completion)."""
        if request_id in self._in_flight:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if not req.prompt_ids or req.n < 1 or req.max_new_tokens < 1:
            raise ValueError(
                f"need a prompt, n >= 1 and max_new_tokens >= 1, got {len(req.prompt_ids)} tokens, "
                f"n={req.n}, max_new_tokens={req.max_new_tokens}"
            )
        task = self._loop.create_task(self.engine.async_generate(**request_dict(req)))
        self._tasks[task] = (request_id, req.n)
        self._in_flight.add(request_id)

    def step(self) -> list[tuple[Hashable, int, Completion]]:
        """Let SGLang run until some request finishes (or POLL_S passes); return the finished samples."""
        if not self._tasks:
            return []
        done, _ = self._loop.run_until_complete(
            asyncio.wait(list(self._tasks), timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
        )
        finished: list[tuple[Hashable, int, Completion]] = []
        for task in done:
            request_id, n = self._tasks.pop(task)
            self._in_flight.discard(request_id)
            outs = task.result()
            outs = outs if isinstance(outs, list) else [outs]
            if len(outs) != n:
                raise RuntimeError(f"sglang returned {len(outs)} samples for a request of n={n}")
            finished.extend((request_id, i, parse_output(out)) for i, out in enumerate(outs))
        return finished

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Run `requests` to completion; one GenResult per request, samples in index order."""
        return run_to_completion(self, requests)

    # -- weights -------------------------------------------------------------------------------

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int, partial: bool = False) -> None:
        """Apply a push (quantize_state_dict's output) as `version`; every name, shape and dtype is checked first."""
        check_push(self.expected, named_tensors, partial)
        named = payload.named_tensors(named_tensors, self.scheme)
        self._session(iter(payload.buckets(named, self.bucket_bytes)), version)
        keep_host_copy(self.host, named_tensors, self.scheme)

    def apply_delta(
        self, whole: dict[str, torch.Tensor], deltas: dict[str, delta.Delta], version: int, checksum: str
    ) -> None:
        """Apply a delta push to the host copy (all or nothing, proven by checksum), then send SGLang what changed.

        If SGLang then fails, the host copy is ahead of the GPU: the caller asks for a full push, which resets both.
        """
        check_push(self.expected, whole, partial=True)
        changed = apply_to_host(self.host, whole, deltas, checksum)
        if not changed:  # nothing moved: SGLang refuses an empty update; its weight version still moves
            self._set_weight_version(version)
            return
        self._session(iter(payload.buckets(payload.named_tensors(changed, self.scheme), self.bucket_bytes)), version)

    def _set_weight_version(self, version: int) -> None:
        """SGLang labels each token with its weight version: move it without a weight update (nothing changed), so
        the tokens that follow are not counted one version staler than they are."""
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        request = UpdateWeightVersionReqInput(new_version=str(int(version)), abort_all_requests=False)
        self._loop.run_until_complete(self._tm.update_weight_version(request))
        self._version = int(version)

    def _checkpoint_buckets(self, path: str) -> Iterator[payload.Named]:
        """Version 0 from the checkpoint, one safetensors file at a time, quantized like the learner's pushes."""
        from safetensors.torch import load_file

        for f in checkpoint_files(path):
            tensors = quantize_state_dict(load_file(f), self.scheme)
            keep_host_copy(self.host, tensors, self.scheme)
            yield from payload.buckets(payload.named_tensors(tensors, self.scheme), self.bucket_bytes)

    def _session(self, bucket_iter: Iterator[payload.Named], version: int) -> None:
        """pause(retract) -> begin -> a tensor update per bucket -> end -> continue; the version lands with the last."""
        load_format = self.load_format

        def request(bucket: payload.Named, last: bool) -> Any:
            obj = tensor_update_request(payload.serialize_named(bucket, self.tp_size), load_format, last, version)
            return self._tm.update_weights_from_tensor(obj, None)

        self._run_session(bucket_iter, request)
        self._version = int(version)

    def apply_serialized(self, payloads: list[list[bytes]], version: int, load_format: str | None = None) -> None:
        """Colocated push: per bucket, one payload per TP rank already serialized by the learner (CUDA IPC handles)."""
        if self.scheme != "none" and load_format not in (None, self.load_format):
            raise ValueError(
                f"{self.scheme} refits load through {self.load_format}; load_format={load_format!r} would skip it"
            )
        fmt = self.load_format if self.scheme != "none" else load_format

        def request(per_rank: list[bytes], last: bool) -> Any:
            if len(per_rank) != self.tp_size:
                raise ValueError(f"need one payload per TP rank ({self.tp_size}), got {len(per_rank)}")
            return self._tm.update_weights_from_tensor(tensor_update_request(per_rank, fmt, last, version), None)

        self._run_session(iter(payloads), request)
        self._version = int(version)

    def init_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = UPDATE_GROUP,
        backend: str = "nccl",
    ) -> None:
        """Join this replica's TP ranks to the learner's broadcast group (ranks rank_offset .. rank_offset+tp-1)."""
        ok, msg = self.engine.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )
        if not ok:
            raise RuntimeError(f"sglang init_weights_update_group failed: {msg}")

    def check_metas(self, metas: list[tuple[list[str], list[str], list[list[int]]]], partial: bool = False) -> None:
        """check_push on bucket metadata alone (names, dtypes, shapes), before any bytes are loaded."""
        check_push(
            self.expected,
            {
                n: torch.empty(s, dtype=getattr(torch, d), device="meta")
                for names, dtypes, shapes in metas
                for n, d, s in zip(names, dtypes, shapes, strict=True)
            },
            partial,
        )

    def receive_broadcast(
        self,
        metas: list[tuple[list[str], list[str], list[list[int]]]],
        version: int,
        group_name: str = UPDATE_GROUP,
        partial: bool = False,
    ) -> None:
        """Separate-GPU push: one flattened NCCL broadcast per bucket (bucket_meta of each) from learner rank 0."""
        if self.scheme == INT8.name:
            raise ValueError(
                "INT8 refits need update_weights_from_tensor: sglang 0.5.23 loads distributed updates "
                "with model.load_weights, which cannot write w8a8_int8 weights after the first load"
            )
        self.check_metas(metas, partial)

        def request(meta: tuple, last: bool) -> Any:
            return self._tm.update_weights_from_distributed(
                distributed_update_request(meta, group_name, last, version), None
            )

        self._run_session(iter(metas), request)
        self._version = int(version)

    def _run_session(self, items: Iterator, request) -> None:
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            ContinueGenerationReqInput,
            EndWeightUpdateReqInput,
            PauseGenerationReqInput,
        )

        run = self._loop.run_until_complete
        run(self._tm.pause_generation(PauseGenerationReqInput(mode="retract")))
        try:
            _ok(run(self._tm.begin_weight_update(BeginWeightUpdateReqInput(), None)), "begin_weight_update")
            try:
                item = next(items, None)
                if item is None:
                    raise ValueError("a weight update needs at least one tensor")
                while item is not None:
                    following = next(items, None)
                    _ok(run(request(item, last=following is None)), "weight update")
                    item = following
            finally:
                _ok(run(self._tm.end_weight_update(EndWeightUpdateReqInput(), None)), "end_weight_update")
        finally:
            run(self._tm.continue_generation(ContinueGenerationReqInput()))

    def close(self) -> None:
        """Shut the SGLang subprocesses down."""
        self.engine.shutdown()


async def _start_handle_loop(tokenizer_manager: Any) -> None:
    """Start SGLang's output loop now, inside its event loop: that is where it adds its SIGTERM handler."""
    tokenizer_manager.auto_create_handle_loop()


def _ok(result: tuple[bool, str], what: str) -> None:
    success, message = result
    if not success:
        raise RuntimeError(f"sglang {what} failed: {message}")
