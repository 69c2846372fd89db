"""Weight transport (lit_ess/rollout/transport.py): what runs on CPU. The NCCL carrier's bucketing and
wire format are checked against vLLM's own packing code; the broadcast itself needs GPUs."""
import random

import pytest
import torch

from fake_engine import FakeConfig, FakeEngine
from lit_ess.engines import HFConfig, VLLMConfig
from lit_ess.engines.base import visible_devices
from lit_ess.rollout.transport import (NCCL, NCCLReceiver, SharedMemory, Ticket, build_transport, drop_tied,
                                       packed_buckets, plan_buckets, update_info, update_kind)


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")      # vLLM's note on a lone big tensor
def test_buckets_cut_where_vllms_packed_receiver_cuts():
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    rng = random.Random(0)
    for _ in range(50):
        named = [(f"p{i}", torch.zeros(rng.choice([1, 3, 64, 700, 5000]), dtype=rng.choice([torch.float32, torch.bfloat16])))
                 for i in range(rng.randint(1, 30))]
        bucket = rng.choice([1, 100, 1000, 4096, 10**6])
        it, vllm_chunks = iter(named), []
        while (chunk := pack_tensors(it, lambda item: item[1], bucket)) is not None:
            vllm_chunks.append(chunk.names)
        ours = plan_buckets([t.numel() * t.element_size() for _, t in named], bucket)
        assert [[named[i][0] for i in b] for b in ours] == vllm_chunks
        assert [i for b in ours for i in b] == list(range(len(named)))        # fixed order, each once


def test_packed_buckets_round_trip_through_vllms_unpack():
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    g = torch.Generator().manual_seed(0)
    named = [("model.embed_tokens.weight", torch.randn(50, 8, generator=g)),
             ("model.norm.weight", torch.randn(8, generator=g).bfloat16()),
             ("model.layers.0.mlp.up_proj.weight", torch.randn(16, 8, generator=g).t()),   # not contiguous
             ("lm_head.bias", torch.randn(50, generator=g, dtype=torch.float64))]
    info = update_info(named)
    dtypes = [getattr(torch, d) for d in info["dtype_names"]]
    got, start = {}, 0
    for packed, bucket in zip(packed_buckets(named, 600, torch.device("cpu")),
                              plan_buckets([t.numel() * t.element_size() for _, t in named], 600)):
        sizes = [named[i][1].numel() * named[i][1].element_size() for i in bucket]
        got.update(unpack_tensor(packed, info["names"][start:start + len(bucket)], info["shapes"][start:start + len(bucket)],
                                 dtypes[start:start + len(bucket)], sizes))
        start += len(bucket)
    assert start == len(named) and list(got) == [n for n, _ in named]
    for n, t in named:
        assert torch.equal(got[n], t), n


def test_update_info_is_what_vllms_nccl_receiver_accepts():
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    info = update_info([("a", torch.zeros(2, 3)), ("b", torch.zeros(4, dtype=torch.bfloat16))])
    parsed = NCCLWeightTransferUpdateInfo(**info)
    assert parsed.dtype_names == ["float32", "bfloat16"] and parsed.shapes == [[2, 3], [4]]


def test_lora_adapters_cross_the_nccl_wire_format_into_a_peft_folder(tiny_model_dir, tmp_path):
    """lora.sync: adapter over NCCL, what runs on CPU: the push is announced as "adapter" (full and merged
    weights as "update"); the adapter payload, packed into buckets as the trainer broadcasts them and
    cut and unpacked with vLLM's own code as its receiver does, makes a peft folder (what each engine
    worker writes) whose model gives the trainer's adapted logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    from lit_ess.lora import LoRA, adapter_weights, merged_weights, write_adapter

    adapted = LoRA(rank=4, alpha=8, target_modules=["q_proj", "down_proj"]).apply(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(n)))
    named = list(adapter_weights(adapted))
    assert update_kind([n for n, _ in named]) == "adapter"
    assert update_kind([n for n, _ in merged_weights(adapted)]) == "update"
    info, bucket = update_info(named), 3000                           # several buckets
    dtypes, sizes = [getattr(torch, d) for d in info["dtype_names"]], [t.nbytes for _, t in named]
    cuts = plan_buckets(sizes, bucket)                 # where vLLM's receiver cuts (the first test of this file)
    received = {}
    for packed, cut in zip(packed_buckets(named, bucket, torch.device("cpu")), cuts, strict=True):
        received.update(unpack_tensor(packed, [info["names"][i] for i in cut], [info["shapes"][i] for i in cut],
                                      [dtypes[i] for i in cut], [sizes[i] for i in cut]))
    assert len(cuts) > 1 and list(received) == info["names"]
    folder = write_adapter(tmp_path / "v1", received)
    x = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), folder)(x).logits
        assert torch.allclose(served, adapted(x).logits, atol=1e-5)


def test_tied_embeddings_are_sent_once():
    m = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(10, 4), "lm_head": torch.nn.Linear(4, 10, bias=False)})
    m["lm_head"].weight = m["embed_tokens"].weight
    kept, dropped = drop_tied(list(m.state_dict().items()))
    assert [n for n, _ in kept] == ["embed_tokens.weight"] and dropped == ["lm_head.weight"]
    untied = {"a": torch.zeros(3), "b": torch.zeros(3)}                 # equal values, separate storage
    assert drop_tied(list(untied.items()))[1] == []


def test_shared_memory_never_overwrites_a_slot_a_request_names():
    t, engine_side, engine = SharedMemory(slots=3), SharedMemory(slots=3), FakeEngine(FakeConfig())
    send = lambda msg: engine_side.receive(engine, msg)                  # noqa: E731  (the queue, in order)
    a = t.push({"w": torch.tensor([1.0])}.items(), 1, send)
    b = t.push({"w": torch.tensor([2.0])}.items(), 2, send, in_use=[a])
    c = t.push({"w": torch.tensor([3.0])}.items(), 3, send, in_use=[a, b])
    assert len({a.slot, b.slot, c.slot}) == 3
    with pytest.raises(RuntimeError, match="no free weight slot"):
        t.push({"w": torch.tensor([4.0])}.items(), 4, send, in_use=[a, b])   # c is the newest: kept too
    for ticket, w in ((a, 1.0), (b, 2.0), (c, 3.0)):
        engine_side.load(engine, ticket)
        assert (engine.version, engine.w) == (ticket.version, w)
    d = t.push({"w": torch.tensor([5.0])}.items(), 5, send, in_use=[c])
    assert d.slot in (a.slot, b.slot)
    with pytest.raises(RuntimeError, match="changed names"):
        t.push({"v": torch.tensor([0.0])}.items(), 6, send)


def test_default_transports_and_placement():
    for c in (HFConfig(), FakeConfig(), VLLMConfig()):
        assert c.weight_transfer(in_process=True).kind == "in_process"      # sync: the executor hands them over
        with pytest.raises(ValueError, match="needs no transport"):
            build_transport(c.weight_transfer(in_process=True))
        assert type(build_transport(c.weight_transfer(in_process=False))) is SharedMemory
        assert c.worker_env() == {}                                       # colocated


def test_what_the_nccl_transport_needs_of_an_engine_is_its_own_protocol():
    """RolloutEngine holds what every engine does (generate, load_weights, close); the NCCL receive methods
    are NCCLReceiver's: the in-process vLLM engine has them, the others do not and are refused in one line."""
    from lit_ess.engines.base import RolloutEngine
    from lit_ess.engines.hf_engine import HFEngine
    from lit_ess.engines.vllm_engine import VLLMEngine
    from lit_ess.engines.vllm_server import VLLMServerEngine

    assert not any(hasattr(RolloutEngine, m) for m in ("init_weight_transfer", "receive_weights", "receive_adapter"))
    assert issubclass(VLLMEngine, NCCLReceiver)
    assert not any(issubclass(c, NCCLReceiver) for c in (HFEngine, VLLMServerEngine, FakeEngine))
    nccl = NCCL.__new__(NCCL)                  # the engine side only: no group, no GPU
    for msg, what in ((("init", {}), "weight"), (("update", {}, 1), "weight"), (("adapter", {}, 1), "adapter")):
        with pytest.raises(NotImplementedError, match=f"^FakeEngine has no NCCL {what} transfer: use transport: "
                                                      f"shared_memory$"):
            nccl.receive(FakeEngine.__new__(FakeEngine), msg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without CUDA")
def test_gpu_only_choices_fail_with_one_clear_line_without_cuda():
    with pytest.raises(ValueError, match=r"transport: nccl needs CUDA GPUs .* this machine has none"):
        build_transport(VLLMConfig(transport="nccl", worker_devices=[1]).weight_transfer(in_process=False))
    with pytest.raises(ValueError, match=r"transport: nccl needs CUDA"):
        NCCL()
    with pytest.raises(ValueError, match=r"worker_devices=\[4, 5\] needs CUDA GPUs"):
        VLLMConfig(worker_devices=[4, 5]).worker_env()


def test_placement_and_transport_config_is_validated():
    with pytest.raises(ValueError, match="transport: nccl needs worker_devices"):
        VLLMConfig(transport="nccl")
    with pytest.raises(ValueError, match="worker_devices must be distinct"):
        VLLMConfig(worker_devices=[1, 1])
    with pytest.raises(ValueError, match="worker_devices must be distinct"):
        VLLMConfig(worker_devices=[])
    with pytest.raises(ValueError, match="fewer devices than the engine's 2 ranks"):
        VLLMConfig(worker_devices=[3], vllm_kwargs={"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="transport='ipc' is not one of"):
        VLLMConfig(transport="ipc")
    with pytest.raises(ValueError, match="bucket_mb must be > 0"):
        VLLMConfig(bucket_mb=0)
    with pytest.raises(ValueError, match="set data.schedule.mode: async"):
        VLLMConfig(worker_devices=[2]).weight_transfer(in_process=True)
    with pytest.raises(ValueError, match="bucket size must be >= 1"):
        plan_buckets([4], 0)


def test_worker_devices_map_through_the_parents_visible_devices():
    assert visible_devices([4, 5, 6, 7], None) == "4,5,6,7"
    assert visible_devices([1, 2], "3,5,7") == "5,7"
    with pytest.raises(ValueError, match="shows 2 devices"):
        visible_devices([2], "0,1")


def test_shared_memory_push_holds_one_yielded_tensor_at_a_time():
    """An FSDP2 policy's weights are gathered one tensor at a time as the iterator is consumed: after
    the first push (which learns the layout), a push copies each tensor into its slot before taking the
    next, so no earlier gathered tensor is still alive (it held them all, the whole model per rank)."""
    import gc
    import weakref

    alive = []

    def gathered():
        for i in range(5):
            t = torch.full((4, 3), float(i))
            alive.append(weakref.ref(t))
            gc.collect()
            assert sum(r() is not None for r in alive) == 1, "an earlier gathered tensor is still held"
            yield f"w{i}", t
            del t

    t = SharedMemory(slots=2)
    t.push(((f"w{i}", torch.zeros(4, 3)) for i in range(5)), 0, lambda msg: None)      # learns the layout
    ticket = t.push(gathered(), 1, lambda msg: None)
    assert [float(t.slots[ticket.slot][torch.float32][12 * i]) for i in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]
