"""Chunked log-probabilities (lit_ess.logprobs: the LM head a chunk of tokens at a time) against the full
logits: equal log-probabilities, entropies and gradients, and no training forward that builds them."""
import pytest
import torch

from lit_ess.sampling import SamplingConfig
from lit_ess.logprobs import check_chunked_head, sequence_logprobs
from lit_ess.lora import LoRA
from lit_ess.objectives import P3O
from lit_ess.packing import packed_logprobs
from lit_ess.batch import Row, collate
from lit_ess.settings import Compute, MicroBatch

CHUNK = 5
SAMPLING = [dict(temperature=1.0, top_k=-1, top_p=1.0), dict(temperature=0.7, top_k=20, top_p=1.0),
            dict(temperature=1.3, top_k=-1, top_p=0.8), dict(temperature=0.7, top_k=20, top_p=0.9)]


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    """The demo's Qwen2 (tied embeddings, byte vocabulary), and tiny Llama 3 (untied, RoPE scaling) and Qwen3
    (q/k norms) on a BPE vocabulary."""
    from lit_ess.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("families")
    return {"qwen2": load(tiny_model_dir),
            **{f: load(build_tiny_model(root / f, family=f, hidden_size=128, num_layers=2, num_heads=2))
               for f in ("llama3", "qwen3")}}


def batch(vocab: int, seed: int = 0):
    """Rows of prompt + completion + padding: a completion of 13 tokens (chunk boundaries inside it), one of 1
    token (shorter than a chunk), one of 0, prompts of several lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts, completions = (3, 7, 1, 12, 5), (13, 1, 9, 0, 6)
    B, T = len(prompts), max(p + c for p, c in zip(prompts, completions))
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    comp = torch.zeros(B, T, dtype=torch.bool)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        ids[b, :p + c] = torch.randint(4, vocab, (p + c,), generator=g)
        mask[b, :p + c] = 1
        comp[b, p:p + c] = True
    return ids, mask, comp


def assert_grads_close(got: dict, want: dict) -> None:
    """Every gradient to 1e-6 of its own scale (fp32: the chunks sum the LM head's gradient in another order)."""
    assert got.keys() == want.keys()
    for n in want:
        scale = max(float(want[n].abs().max()), 1.0)
        assert float((got[n] - want[n]).abs().max()) <= 1e-6 * scale, (n, float((got[n] - want[n]).abs().max()), scale)


def scored(model, fn, s, chunk):
    """(lp, entropy, gradients) of a loss that weighs every completion token's logprob and entropy."""
    ids, mask, comp = batch(model.config.vocab_size)
    model.zero_grad(set_to_none=True)
    lp, ent = fn(model, ids, mask, comp, **s, with_entropy=True, chunk=chunk)
    w = torch.arange(comp.numel(), dtype=torch.float32).view(comp.shape).sin()
    keep = comp & lp.isfinite()                    # top-k / top-p give -inf to sampled tokens they drop
    (torch.where(keep, lp * w, 0).sum() + torch.where(comp, ent * w.cos(), 0).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.where(comp, lp, 0), torch.where(comp, ent, 0), grads


@pytest.mark.parametrize("family", ["qwen2", "llama3", "qwen3"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("s", SAMPLING, ids=lambda s: "T{temperature}-k{top_k}-p{top_p}".format(**s))
def test_chunked_equals_full_logits(models, family, layout, s):
    """Chunks of 5 tokens against the full logits: log-probabilities, entropies and every gradient to 1e-6
    (fp32), with T != 1, top-k, top-p, padded and packed rows, tied and untied embeddings."""
    model = models[family]
    fn = sequence_logprobs if layout == "padded" else packed_logprobs
    lp, ent, grads = scored(model, fn, s, CHUNK)
    lp0, ent0, grads0 = scored(model, fn, s, None)
    torch.testing.assert_close(lp, lp0, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, ent0, atol=1e-6, rtol=0)
    assert len(grads) == len(list(model.parameters()))
    assert_grads_close(grads, grads0)


class RefusingHead(torch.nn.Linear):
    """An LM head that refuses more than LIMIT positions at once: a forward that builds the logits of a
    whole micro-batch fails on it."""
    LIMIT = 4

    def forward(self, x):
        n = x.reshape(-1, x.shape[-1]).shape[0]
        if n > self.LIMIT:
            raise RuntimeError(f"LM head asked for the logits of {n} positions at once (limit {self.LIMIT})")
        return super().forward(x)


def rollout_batch(vocab: int, rows: int = 6):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(rows):
        P, C = 3 + i % 2, 4 + i % 3
        out.append(Row(prompt=torch.randint(3, vocab, (P,), generator=g).tolist(),
                       completion=torch.randint(3, vocab, (C,), generator=g).tolist(),
                       logprobs=(-5.5 + 0.5 * torch.randn(C, generator=g)).tolist(),
                       advantage=float(torch.randn((), generator=g)), reward=0.0, version=0, prompt_id=i,
                       prompt_text="", completion_text=""))
    return collate(out, pad_id=0, sampling=SamplingConfig(temperature=0.8, top_k=30, top_p=0.95, max_new_tokens=6))


CUTS = {"rows": {"micro_batch": MicroBatch(size=2)}, "packed": {"micro_batch": MicroBatch(tokens=20, packing=True)},
        "lora": {"micro_batch": MicroBatch(size=3), "lora": LoRA(rank=4)}}


def module(model_dir, chunk, cut):
    from lit_ess.module import PolicyModule

    m = PolicyModule(model_dir, objective=P3O(ref_kl_coef=0.1, entropy_coef=0.01), compute=Compute(logprob_chunk=chunk), **cut)
    torch.manual_seed(0)                  # LoRA's A matrices start random: the same in both modules
    m.configure_model()
    return m


def guard(m) -> None:
    for model in (m.policy, m.ref_policy):
        if model is not None:
            model.get_output_embeddings().__class__ = RefusingHead


@pytest.mark.parametrize("cut", list(CUTS))
def test_a_training_step_never_builds_full_logits(tiny_model_dir, cut):
    """A whole optimizer step (ESS pre-pass, gradient pass with entropy, reference scoring; with LoRA the
    reference is the base with the adapters off) and the proximal scoring of a phase run on a model whose LM
    head refuses more than 4 positions at once, with logprob_chunk 4; and give the gradients and metrics of
    the full-logits step (logprob_chunk null)."""
    m = module(tiny_model_dir, RefusingHead.LIMIT, CUTS[cut])
    guard(m)
    b = rollout_batch(m.policy.config.vocab_size)
    metrics, ess = m.accumulate_gradients(b)
    m.score_proximal([b], pad=b.select([0]))
    grads = {n: p.grad for n, p in m.policy.named_parameters() if p.grad is not None}

    ref = module(tiny_model_dir, None, CUTS[cut])
    ref_metrics, ref_ess = ref.accumulate_gradients(b)
    assert grads and float(ess) == pytest.approx(float(ref_ess), abs=1e-6)
    assert_grads_close(grads, {n: p.grad for n, p in ref.policy.named_parameters() if p.grad is not None})
    for k in ("train/loss", "train/ess", "train/entropy", "train/ref_kl"):
        if k in ref_metrics:
            assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-5, abs=1e-6), k


def test_the_guard_catches_a_step_that_builds_full_logits(tiny_model_dir):
    """The same step with logprob_chunk null (the model's full logits) trips the refusing head: the test
    above can fail."""
    m = module(tiny_model_dir, None, CUTS["rows"])
    guard(m)
    with pytest.raises(RuntimeError, match="logits of .* positions at once"):
        m.accumulate_gradients(rollout_batch(m.policy.config.vocab_size))


def test_a_family_that_changes_its_logits_is_refused(tiny_model_dir):
    """A model whose forward scales the LM head's output (as Gemma's soft-capping or Cohere's logit scale
    do) would be scored without that step: one line, and the way out."""
    from transformers import Qwen2ForCausalLM

    class Scaled(Qwen2ForCausalLM):
        def forward(self, *a, **k):
            out = super().forward(*a, **k)
            out.logits = out.logits * 4.0
            return out

    check_chunked_head(load(tiny_model_dir), 8)              # the plain family passes
    with pytest.raises(ValueError, match=r"^model.compute.logprob_chunk=8: model_path's Scaled changes its LM head's output.*"
                                         r"set model.compute.logprob_chunk: null$"):
        check_chunked_head(Scaled.from_pretrained(tiny_model_dir), 8)


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_logprob_chunk_is_validated(tiny_model_dir, bad):
    from lit_ess.module import PolicyModule

    with pytest.raises(ValueError, match=rf"^model.compute.logprob_chunk must be an integer >= 1 or null, got {bad}"):
        PolicyModule(tiny_model_dir, compute=Compute(logprob_chunk=bad))


def test_hf_engine_behaviour_logprobs_equal_the_trainers(tiny_model_dir):
    """The hf engine's per-step scoring (no [N, T, V] logits kept) gives the trainer's chunked logprobs of
    the tokens it sampled, with temperature, top-k and top-p."""
    from lit_ess.engines import HFConfig

    engine = HFConfig(batch_size=8).build(tiny_model_dir)
    s = SamplingConfig(temperature=0.8, top_k=30, top_p=0.9, max_new_tokens=7, seed=3)
    groups = engine.generate([[5, 17, 40], [9, 9, 200, 31, 7]], 3, s)
    model = load(tiny_model_dir).eval()
    for prompt, group in zip([[5, 17, 40], [9, 9, 200, 31, 7]], groups):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids])
            comp = torch.zeros_like(ids, dtype=torch.bool)
            comp[0, len(prompt):] = True
            with torch.no_grad():
                lp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), comp, s.temperature, s.top_k, s.top_p, chunk=2)
            torch.testing.assert_close(lp[0, len(prompt):], torch.tensor(c.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("s", SAMPLING, ids=lambda s: "T{temperature}-k{top_k}-p{top_p}".format(**s))
@pytest.mark.parametrize("with_entropy", [False, True])
def test_hand_written_gradient_equals_autograd(s, with_entropy):
    """ProcessedLogprob's backward against autograd through token_logprobs, targets dropped by top-k / top-p
    included (their logprob is -inf: no gradient)."""
    from lit_ess.logprobs import ProcessedLogprob, token_logprobs

    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(9, 40, generator=g)).requires_grad_()
    targets = torch.randint(0, 40, (9,), generator=g)
    out = ProcessedLogprob.apply(logits, targets, *s.values(), with_entropy)
    lp, ent = token_logprobs(logits, targets, *s.values(), with_entropy)
    want = torch.stack((lp, ent), -1) if with_entropy else lp.unsqueeze(-1)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    w = torch.where(want.isfinite(), torch.randn(want.shape, generator=g), 0)
    got_grad, = torch.autograd.grad(torch.where(out.isfinite(), out * w, 0).sum(), logits)
    want_grad, = torch.autograd.grad(torch.where(want.isfinite(), want * w, 0).sum(), logits)
    assert (~want.isfinite()).any() or s["top_k"] < 0 and s["top_p"] == 1.0       # some targets were dropped
    torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-5)


def test_a_model_that_ignores_logits_to_keep_is_refused(tiny_model_dir):
    """A forward that swallows logits_to_keep hands its head every position: the indices of the completion
    tokens would point at other positions. Refused in one line, chunked or not."""
    from transformers import Qwen2ForCausalLM

    class Ignores(Qwen2ForCausalLM):
        def forward(self, *a, logits_to_keep=0, **k):
            return super().forward(*a, **k)

    model = Ignores.from_pretrained(tiny_model_dir)
    ids, mask, comp = (x[[0, 1, 3, 4]] for x in batch(model.config.vocab_size))      # prompts of 3 tokens or more
    for chunk in (None, 4):
        with pytest.raises(ValueError, match=r"^Ignores ignores logits_to_keep \(its LM head got \d+ positions a row, "
                                             r"not \d+\): lit-ess cannot score it$"):
            sequence_logprobs(model, ids, mask, comp, chunk=chunk)
