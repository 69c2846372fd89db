"""Weight transport: how the trainer's weights reach the engine of the async worker process
(lit_ess/rollout/process.py). One interface, three carriers. (Sync mode needs none: InlineExecutor hands the
trainer's tensors straight to its engine's `load_weights`.)

    trainer side                                      engine side (same process, or the worker process)
    ------------                                      -----------------------------------------------
    ticket = t.push(named_tensors, version,           t.receive(engine, msg)  for every msg, in send order
                    send, in_use)                     t.load(engine, ticket)  before generating with it

`send(msg)` hands a picklable message to the engine side, in order with the generation requests
(the worker process's request queue). A `Ticket` names one pushed
version; requests carry the ticket of the weights they must be generated with. `in_use` lists the
tickets that queued requests still name (a carrier with several buffers must not overwrite those).
Each side builds its own transport object from what the engine config asks for
(`EngineConfig.weight_transfer(in_process=False)`, plain values) with `build_transport`.

* `SharedMemory` (async mode, default): 4 slots of shared memory (one flat tensor per dtype each,
  allocated at the first push and sent once); `push` copies into a slot no ticket in use names,
  `load` hands views of that slot to `engine.load_weights`. Works on CPU and on GPUs (via host memory).
* `NCCL` (async mode on GPUs, the engine on its own devices): vLLM's native weight-transfer API, on an
  engine that has the three methods of `NCCLReceiver` beyond RolloutEngine's (VLLMEngine).
  First push: `send(("init", info))`, then the trainer opens NCCL rank 0 while the engine's workers
  join as ranks 1..n (`init_weight_transfer_engine`). Every push: `send(("update", info, version))`,
  the engine runs `start_weight_update`, `update_weights` (receives), `finish_weight_update`, resets
  its prefix cache and checks the reset; the trainer meanwhile broadcasts the weights bucket by bucket.
  A bucket is `plan_buckets` over the tensors' byte sizes, the exact rule vLLM's packed receiver uses
  to cut its buffers, so both sides agree. Every bucket is materialised whole (FSDP `full_tensor()` on
  every rank, on the default stream, then synchronised) before rank 0 sends it: TRL's sync deadlocked
  with > 2 trainer ranks because gathers and sends interleaved on different streams (trl#6798). The
  order is fixed by the first push (Hugging Face names, as the model's state dict lists them); a tied
  weight (same storage as an earlier tensor, e.g. lm_head = embed_tokens) is sent once.
  The trainer blocks in the broadcast until the engine reaches the update message: the worker loads
  between phases, so a push may wait for the phase being generated to finish.
  LoRA adapters (`lora.sync: adapter`) travel the same way, in the same buckets, under an `("adapter",
  info, version)` message (`update_kind`): vLLM's receiver would load them into the model's weights by
  name, so the engine's workers take the broadcast into host tensors themselves, and the engine writes
  them as a peft folder and serves it as a LoRA request, as it does with adapters from shared memory
  (VLLMEngine.receive_adapter; the CPU test suite does not exercise it).
* `VersionOnly` (ranks > 0 sharing vLLM servers with rank 0, which pushes): nothing travels; `push`
  takes part in FSDP2's gathers, `load` tells the engine the step whose weights it waits for.
"""
from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Protocol, runtime_checkable

import torch
from torch import Tensor

from lit_ess.engines.base import RolloutEngine, WeightTransfer, require_cuda
from lit_ess.lora import is_adapter_payload

Send = Callable[[object], None]
Named = Iterable[tuple[str, Tensor]]


def build_transport(spec: WeightTransfer) -> "WeightTransport":
    """The carrier an engine config asks for (`EngineConfig.weight_transfer`)."""
    if spec.kind == "in_process":
        raise ValueError("weight transfer 'in_process' needs no transport: the sync executor hands the weights "
                         "to its engine")
    if spec.kind == "shared_memory":
        return SharedMemory()
    if spec.kind == "nccl":
        return NCCL(spec.bucket_mb, spec.engine_ranks)
    if spec.kind == "version_only":
        return VersionOnly()
    raise ValueError(f"unknown weight transfer {spec.kind!r}; one of shared_memory, nccl, version_only")


@dataclass(frozen=True)
class Ticket:
    """The weights of optimizer step `version`; `slot`: the buffer holding them (SharedMemory)."""
    version: int
    slot: int | None = None


class WeightTransport(ABC):
    @abstractmethod
    def push(self, named_tensors: Named, version: int, send: Send, in_use: Collection[Ticket] = ()) -> Ticket:
        """Trainer side: make the weights of `version` available to the engine side."""

    def receive(self, engine: RolloutEngine, msg) -> None:
        """Engine side: apply a message `push` sent (in order)."""
        raise RuntimeError(f"{type(self).__name__} sends no messages, got {msg!r:.80}")

    @abstractmethod
    def load(self, engine: RolloutEngine, ticket: Ticket) -> None:
        """Engine side: make `engine` hold the weights of `ticket` (engine.version == ticket.version)."""


class VersionOnly(WeightTransport):
    """Another trainer rank pushes the weights to the engine's servers (lit_ess.engines.vllm_server
    `FollowerConfig`): this rank consumes its iterator (FSDP2 gathers tensor by tensor on every rank)
    and copies nothing; the engine is told the step and waits for the servers to carry it."""

    def push(self, named_tensors, version, send, in_use=()):
        for _ in named_tensors:
            pass
        return Ticket(version)

    def load(self, engine, ticket):
        engine.load_weights((), ticket.version)


class SharedMemory(WeightTransport):
    """`slots` buffers in shared memory, each one flat tensor per dtype; layout fixed at the first push."""

    def __init__(self, slots: int = 4):
        self.n = slots
        self.slots: list[dict[torch.dtype, Tensor]] | None = None
        self.layout: dict[str, tuple[torch.dtype, int, torch.Size]] = {}
        self.current: int | None = None          # slot of the newest push: kept until replaced

    def push(self, named_tensors, version, send, in_use=()):
        """Copies each tensor into the slot as the iterator yields it, so an FSDP2 policy has at most
        one gathered tensor beside its shards. The first push learns the layout: it keeps host copies
        until the slots exist."""
        if self.slots is None:
            state = {k: v.detach().to("cpu", copy=True) for k, v in named_tensors}
            self.layout, sizes = flat_layout(state)
            self.slots = [{d: torch.empty(n, dtype=d).share_memory_() for d, n in sizes.items()} for _ in range(self.n)]
            send(("slots", self.slots, self.layout))
            named_tensors = state.items()
        busy = {t.slot for t in in_use} | ({self.current} if self.current is not None else set())
        free = [j for j in range(self.n) if j not in busy]
        if not free:
            raise RuntimeError(f"no free weight slot: requests name all {self.n} slots")
        j, seen = free[0], set()
        with torch.no_grad():
            for name, t in named_tensors:
                if name not in self.layout:
                    raise RuntimeError(f"weights changed names between pushes: {name!r} is new")
                dtype, off, shape = self.layout[name]
                self.slots[j][dtype][off:off + t.numel()].view(shape).copy_(t.detach())
                seen.add(name)
                del t                                   # freed before the next one is gathered
        if seen != set(self.layout):
            raise RuntimeError(f"weights changed names between pushes: {sorted(set(self.layout) - seen)[:5]} missing")
        self.current = j
        return Ticket(version, j)

    def receive(self, engine, msg):
        _, self.slots, self.layout = msg

    def load(self, engine, ticket):
        views = [(n, self.slots[ticket.slot][d][off:off + shape.numel()].view(shape))
                 for n, (d, off, shape) in self.layout.items()]
        engine.load_weights(views, ticket.version)


def flat_layout(state: dict[str, Tensor]) -> tuple[dict, dict[torch.dtype, int]]:
    """Offsets of each tensor in one flat buffer per dtype: ({name: (dtype, offset, shape)}, {dtype: numel})."""
    layout, sizes = {}, {}
    for name, t in state.items():
        off = sizes.get(t.dtype, 0)
        layout[name] = (t.dtype, off, t.shape)
        sizes[t.dtype] = off + t.numel()
    return layout, sizes


# ---------------------------------------------------------------------------------------------- NCCL
def drop_tied(named: list[tuple[str, Tensor]]) -> tuple[list[tuple[str, Tensor]], list[str]]:
    """Keep the first of tensors that are the same view of the same storage (tied weights); return the
    kept pairs in order and the dropped names."""
    seen, kept, dropped = set(), [], []
    for name, t in named:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.device)
        if t.numel() and key in seen:
            dropped.append(name)
            continue
        seen.add(key)
        kept.append((name, t))
    return kept, dropped


def plan_buckets(nbytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of consecutive tensors per bucket: a bucket closes after the tensor that makes its total
    exceed `bucket_bytes` (vLLM's packed receiver cuts its buffers by this rule; a tensor larger than a
    bucket travels alone, in a bucket of its own size)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket size must be >= 1 byte, got {bucket_bytes}")
    buckets, cur, total = [], [], 0
    for i, n in enumerate(nbytes):
        cur.append(i)
        total += n
        if total > bucket_bytes:
            buckets.append(cur)
            cur, total = [], 0
    if cur:
        buckets.append(cur)
    return buckets


def update_kind(names: list[str]) -> str:
    """The engine-side handling of one NCCL push: "adapter" for LoRA adapters (lit_ess.lora.adapter_weights,
    `lora.sync: adapter`), which the engine receives into a peft folder and serves as a LoRA request;
    "update" for full (or merged) weights, which vLLM's receiver loads into the model by name."""
    return "adapter" if is_adapter_payload(names) else "update"


def update_info(named: list[tuple[str, Tensor]]) -> dict:
    """vLLM's NCCLWeightTransferUpdateInfo as a dict: names, dtype names, shapes, in send order."""
    return {"names": [n for n, _ in named], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named]}


def packed_buckets(named: list[tuple[str, Tensor]], bucket_bytes: int, device: torch.device):
    """Yield each bucket as one uint8 tensor on `device` (vLLM's packed wire format: the tensors' bytes
    back to back, in order), every tensor of the bucket materialised before it is packed."""
    for bucket in plan_buckets([_nbytes(t) for _, t in named], bucket_bytes):
        full = [materialize(named[i][1]) for i in bucket]
        yield torch.cat([t.to(device, non_blocking=True).contiguous().view(-1).view(torch.uint8) for t in full])


def materialize(t: Tensor) -> Tensor:
    """The full tensor: FSDP2's DTensor all-gathers (a collective: every rank must call it)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@runtime_checkable
class NCCLReceiver(Protocol):
    """What the NCCL transport needs of an engine beyond RolloutEngine's (VLLMEngine has it): join the
    trainer's group, receive full weights, receive LoRA adapters (model.lora.sync: adapter)."""

    def init_weight_transfer(self, init_info: dict) -> None:
        """Join the trainer's NCCL group as ranks 1..n (blocks until the trainer opens rank 0)."""

    def receive_weights(self, update_info: dict, version: int) -> None:
        """Receive the broadcast weights of `version` (`update_info`: names, dtype names, shapes in send order)."""

    def receive_adapter(self, update_info: dict, version: int) -> None:
        """Receive LoRA adapters of `version` and sample with them from now on."""


class NCCL(WeightTransport):
    """vLLM's NCCL weight transfer; the trainer is rank 0, the engine's `engine_ranks` workers 1..n.

    Args:
        bucket_mb: MiB broadcast (and gathered, under FSDP) at once, plus at most one tensor.
        engine_ranks: the engine's GPU workers (tensor x pipeline parallel size).
        master_address: host of the rendezvous store (the trainer's address as the engine sees it).
    """

    def __init__(self, bucket_mb: float = 256.0, engine_ranks: int = 1, master_address: str = "127.0.0.1"):
        require_cuda("transport: nccl")
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.engine_ranks, self.master_address = engine_ranks, master_address
        self.group = None                        # trainer side: vLLM's PyNcclCommunicator
        self.order: list[str] | None = None

    def push(self, named_tensors, version, send, in_use=()):
        named, _ = drop_tied(list(named_tensors))
        names = [n for n, _ in named]
        if self.order is None:
            self.order = names
        elif names != self.order:
            raise RuntimeError(f"weights changed names or order between pushes: {sorted(set(names) ^ set(self.order))[:5]}")
        if self.group is None:
            self._connect(send)
        send((update_kind(names), update_info(named), version))
        stream, device = torch.cuda.current_stream(), torch.device("cuda", torch.cuda.current_device())
        for packed in packed_buckets(named, self.bucket_bytes, device):
            stream.synchronize()                                # the bucket's gathers and copies are done
            self.group.broadcast(packed, src=0, stream=stream)
            stream.synchronize()
        return Ticket(version)

    def _connect(self, send: Send) -> None:
        import os

        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")     # as vLLM's workers set it (else the group fails)

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        world = 1 + self.engine_ranks
        send(("init", {"master_address": self.master_address, "master_port": port, "rank_offset": 1,
                       "world_size": world, "packed": True, "packed_buffer_size_bytes": self.bucket_bytes,
                       "packed_num_buffers": 2}))
        self.group = trainer_init({"master_address": self.master_address, "master_port": port, "world_size": world},
                                  rank=0)

    def receive(self, engine, msg):
        kind = msg[0]
        if not isinstance(engine, NCCLReceiver):
            what = "adapter" if kind == "adapter" else "weight"
            raise NotImplementedError(f"{type(engine).__name__} has no NCCL {what} transfer: use transport: shared_memory")
        if kind == "init":
            engine.init_weight_transfer(msg[1])
        elif kind == "update":
            engine.receive_weights(msg[1], msg[2])
        elif kind == "adapter":
            engine.receive_adapter(msg[1], msg[2])
        else:
            raise RuntimeError(f"NCCL transport: unknown message {kind!r}")

    def load(self, engine, ticket):
        if engine.version != ticket.version:     # messages and requests share one ordered queue
            raise RuntimeError(f"NCCL transport: the engine holds version {engine.version}, the request "
                               f"names {ticket.version}")


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()
