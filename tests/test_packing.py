"""Token-budget planning and padding-free packing (lit_ess/packing.py) against the padded path."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_ess.logprobs import sequence_logprobs
from lit_ess.packing import pack, packed_logprobs, plan_micro_batches, plan_ranks
from lit_ess.settings import MicroBatch

SAMPLING = [dict(temperature=1.0, top_k=-1, top_p=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)]


def load(path, attn="sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load(tiny_model_dir)


def batch(prompts=(3, 7, 1, 12, 5, 2), completions=(9, 1, 14, 4, 0, 6), seed=0):
    """Left-aligned rows: prompt then completion then padding (a row with no completion included)."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(prompts), max(p + c for p, c in zip(prompts, completions))
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    comp = torch.zeros(B, T, dtype=torch.bool)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        ids[b, :p + c] = torch.randint(4, 260, (p + c,), generator=g)
        mask[b, :p + c] = 1
        comp[b, p:p + c] = True
    return ids, mask, comp


def finite_sum(lp, comp):
    return torch.where(comp & lp.isfinite(), lp, 0).sum()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("width", [None, 12])
@pytest.mark.parametrize("sampling", SAMPLING)
def test_packed_equals_padded(tiny_model_dir, sampling, width, attn):
    """Logprobs, entropies and gradients of packed rows equal the padded batch's on completion tokens
    (width None: one [1, N] line; 12: lines of <= 12 tokens, rows longer than that alone)."""
    model = load(tiny_model_dir, attn)
    ids, mask, comp = batch()
    grads = []
    outs = []
    for fn in (sequence_logprobs, lambda *a, **k: packed_logprobs(*a, **k, width=width)):
        model.zero_grad()
        lp, ent = fn(model, ids, mask, comp, **sampling, with_entropy=True)
        (finite_sum(lp, comp) + (ent * comp).sum()).backward()
        outs.append((torch.where(comp, lp, 0).detach(), torch.where(comp, ent, 0).detach()))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    (lp0, ent0), (lp1, ent1) = outs
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=0)
    assert (lp1[~comp] == 0).all()
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_packed_rows_do_not_attend_to_each_other(model):
    """Changing one row's tokens leaves the other rows' packed logprobs unchanged; and the same forward
    with a 2-D all-ones mask (which turns off transformers' packed-sequence detection) does change them,
    so this test sees cross-row attention when it happens."""
    ids, mask, comp = batch()
    other = ids.clone()
    other[0, :mask[0].sum()] = torch.randint(4, 260, (int(mask[0].sum()),), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, _ = packed_logprobs(model, ids, mask, comp)
        b, _ = packed_logprobs(model, other, mask, comp)
    torch.testing.assert_close(a[1:], b[1:], atol=1e-6, rtol=0)

    p, q = pack(ids, mask), pack(other, mask)
    with torch.no_grad():
        leak = [model(input_ids=x.input_ids, position_ids=x.position_ids, attention_mask=torch.ones_like(x.input_ids),
                      use_cache=False).logits for x in (p, q)]
        tight = [model(input_ids=x.input_ids, position_ids=x.position_ids, use_cache=False).logits for x in (p, q)]
    later = (p.segment_ids != 0) & (torch.arange(p.input_ids.shape[1]) > (p.segment_ids == 0).nonzero()[:, 1].max())
    assert (leak[0] - leak[1])[later].abs().max() > 1e-3        # rows after row 0 see it without the block mask
    assert (tight[0] - tight[1])[later].abs().max() < 1e-6


def test_with_cache_packing_leaks(model):
    """Why packed_logprobs passes use_cache=False: with a cache (the config's default) transformers skips the
    packed-sequence mask and the rows attend to each other."""
    ids, mask, comp = batch()
    p = pack(ids, mask)
    with torch.no_grad():
        alone = model(input_ids=ids[4:5, :5], use_cache=False).logits[0]     # row 4, packed last
        at = p.flat_index[(p.segment_ids.flatten()[p.flat_index] == 4)]
        cached = model(input_ids=p.input_ids, position_ids=p.position_ids).logits.flatten(0, 1)[at]
        packed = model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False).logits.flatten(0, 1)[at]
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    assert int(at[0]) > 0 and (cached - alone).abs().max() > 1e-3


def test_pack_layout():
    ids, mask, comp = batch(prompts=(2, 1, 3), completions=(1, 3, 0))
    p = pack(ids, mask)
    assert p.input_ids.shape == (1, 10)
    # rows longest first: rows 1 (4 tokens) and 0 (3) tie-broken by length then index, then row 2 (3)
    assert p.segment_ids.tolist() == [[1, 1, 1, 1, 0, 0, 0, 2, 2, 2]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]]
    assert torch.equal(p.input_ids.flatten()[p.flat_index], ids.flatten()[p.batch_index])
    q = pack(ids, mask, width=4)                       # lines of <= 4 tokens: [1], [0], [2]; tails are padding
    assert q.input_ids.shape == (3, 4)
    assert q.segment_ids.tolist() == [[1, 1, 1, 1], [0, 0, 0, -1], [2, 2, 2, -1]]
    assert q.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 0]]


def test_pack_refuses_unaligned_rows():
    ids, mask, comp = batch()
    mask[2] = mask[2].flip(0)
    with pytest.raises(ValueError, match="row 2 is not left-aligned"):
        pack(ids, mask)


def test_plan_by_hand():
    # padded cost: rows x longest. 10 alone would fit 2 x 10 = 20 with 7 -> [10, 7]; then [6, 5, 3] (3 x 6 = 18)
    assert plan_micro_batches([3, 10, 6, 7, 5], 20) == [[1, 3], [2, 4, 0]]
    # packed cost: sum. [10, 7, 3] = 20, [6, 5]
    assert plan_micro_batches([3, 10, 6, 7, 5], 20, packed=True) == [[1, 3, 0], [2, 4]]
    # a row over the budget is a micro-batch of its own
    assert plan_micro_batches([30, 2, 2], 8) == [[0], [1, 2]]
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        plan_micro_batches([1], 0)


lengths_st = st.lists(st.integers(0, 64), min_size=0, max_size=40)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, budget=st.integers(1, 200), world=st.integers(1, 4), packed=st.booleans())
def test_plan_invariants(lengths, budget, world, packed):
    plans = plan_ranks(lengths, budget, world, packed)
    assert len(plans) == world
    assert len({len(p) for p in plans}) == 1                                   # same number of passes
    assert len(plans[0]) >= 1 or not lengths
    rows = sorted(i for p in plans for mb in p for i in mb)
    assert rows == list(range(len(lengths)))                                    # every row exactly once
    for p in plans:
        for mb in p:
            if len(mb) > 1:
                cost = sum(lengths[i] for i in mb) if packed else len(mb) * max(lengths[i] for i in mb)
                assert cost <= budget                                          # budget, except lone oversize rows
    tokens = [sum(lengths[i] for mb in p for i in mb) for p in plans]
    assert max(tokens) - min(tokens) <= max(lengths, default=0)               # balanced within one row
    assert plan_ranks(lengths, budget, world, packed) == plans                  # deterministic
    single = plan_micro_batches(lengths, budget, packed)
    assert sorted(i for mb in single for i in mb) == list(range(len(lengths)))


def test_packing_is_refused_for_a_family_whose_attention_ignores_position_ids(tmp_path):
    """OPT (as Bloom and MPT) builds its causal mask without position_ids: packed rows would attend to the
    rows before them, and a run trained on leaky rows with an ESS of 0.9997 (above the alarm). The module's
    packed forward is checked against its padded forward once at start: one line."""
    from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

    from lit_ess.module import PolicyModule
    from lit_ess.tiny import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    OPTForCausalLM(OPTConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=2,
                             max_position_embeddings=64, word_embed_proj_dim=64, pad_token_id=tok.pad_token_id,
                             dropout=0.0, attention_dropout=0.0)).save_pretrained(tmp_path / "opt")
    tok.save_pretrained(tmp_path / "opt")
    with pytest.raises(ValueError, match=r"^model.micro_batch.packing=true: model_path's OPTForCausalLM does not keep packed rows "
                                         r"apart .*set model.micro_batch.packing: false$"):
        PolicyModule(str(tmp_path / "opt"), micro_batch=MicroBatch(packing=True)).configure_model()
    PolicyModule(str(tmp_path / "opt"), micro_batch=MicroBatch(packing=False)).configure_model()          # padded rows are fine


def test_packing_check_passes_the_families_that_keep_rows_apart(tiny_model_dir):
    from lit_ess.module import PolicyModule

    PolicyModule(tiny_model_dir, micro_batch=MicroBatch(packing=True)).configure_model()
