"""Packed documents (lightning_tp2d.models.documents): per-document causal attention from document ids.

Single device: the ids from end-of-text tokens and their chunk table; a packed Llama (RoPE: relative positions) gives
each document the logits it has alone, a packed GPT-2 its first document's; bad ids are refused naming both shapes.
Four gloo ranks, one spawned group: "metp" and "2d-metp" (2x2), GPT-2 and Llama (GQA), equal the plain model with
the same documents in loss and every gradient (float64), and the ring calls the plain block kernel exactly for the
runs of queries and keys of one document that see each other (chunk pairs across a document start are skipped, pairs
that cross one are cut at it: no mask anywhere). The data module packs
documents from end-of-text tokens and the training step hands them to the model.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d import metp
from lightning_tp2d.data.datamodule import TokenWindows, collate_documents
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.models.documents import SKIPPED, SPLIT, WHOLE, Documents
from lightning_tp2d.models.llama import Llama, LlamaConfig
from lightning_tp2d.nn.sequence import zigzag_positions
from tests.distributed import run_distributed

SEQ = 32  # 8 zigzag chunks of 4 on a ring of 4; 4 chunks of 8 on a 2x2 grid's rows
# row 0: documents of 5, 20 and 7 tokens; row 1: 13, 3, 16. Starts 5 and 13 fall inside chunks, so some
# off-diagonal pairs have query rows that see no key at all (the merge must add nothing there, not NaN)
DOC_IDS = torch.tensor([[0] * 5 + [1] * 20 + [2] * 7, [0] * 13 + [1] * 3 + [2] * 16])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 256, (2, SEQ), generator=g)
    targets = torch.randint(0, 256, (2, SEQ), generator=g)
    targets[0, :3] = -100
    return idx, targets


# ---- one device ------------------------------------------------------------------------------------------------


def test_doc_ids_from_end_of_text_tokens_and_the_chunk_table():
    tokens = torch.tensor([[7, 9, 256, 4, 4, 256, 256, 1]])
    docs = Documents.from_eos(tokens, 256)
    assert docs.ids.tolist() == [[0, 0, 0, 1, 1, 1, 2, 3]]  # an end-of-text token closes its own document
    assert docs.starts == ((0, 3, 6, 7),)
    links = Documents(DOC_IDS).chunk_links(8)  # chunks of 4: starts 5, 25 (row 0) and 13, 16 (row 1)
    assert links[0][0] == WHOLE and links[1][1] == SPLIT  # chunk 1 = [4, 8) holds row 0's start 5
    assert links[1][0] == SPLIT  # row 0: rows 4 sees 0..4; row 1: one document until 13
    assert links[7][0] == SKIPPED  # starts 5 (row 0) and 13 (row 1) lie between
    assert links[5][4] == WHOLE and links[0][1] == SKIPPED  # [16, 24) one document in both rows; b > a causal
    # the table agrees with the full mask: a pair is skipped iff no query of it sees any key of it
    mask = Documents(DOC_IDS).mask()[:, 0]
    for a in range(8):
        for b in range(a + 1):
            seen = bool(mask[:, 4 * a:4 * a + 4, 4 * b:4 * b + 4].any())
            assert (links[a][b] != SKIPPED) == seen, (a, b)


def test_a_split_chunk_pair_is_cut_into_the_runs_of_one_document_that_see_each_other():
    """Chunks of 4; row 0 starts documents at 5 and 25, row 1 at 13 and 16. Offsets (q0, q1, k0, k1) in the chunks."""
    docs = Documents(DOC_IDS)
    # diagonal [4, 8): row 0 cut at 5, each run causal with itself; row 1 one document
    assert docs.segments(8, 1, 1) == (((0, 1, 0, 1), (1, 4, 1, 4)), ((0, 4, 0, 4),))
    # queries [4, 8) on keys [0, 4): row 0's query 4 (document 0) sees all four keys, 5..7 (document 1) none
    assert docs.segments(8, 1, 0) == (((0, 1, 0, 4),), ((0, 4, 0, 4),))
    # queries [12, 16) on keys [8, 12): row 1's query 12 (document 0, until 13) sees them, 13..15 do not
    assert docs.segments(8, 3, 2) == (((0, 4, 0, 4),), ((0, 1, 0, 4),))
    # queries [16, 20) on keys [12, 16): row 1's document starts at 16 exactly: nothing seen in that row
    assert docs.segments(8, 4, 3) == (((0, 4, 0, 4),), ())
    with pytest.raises(ValueError, match="b <= a"):
        docs.segments(8, 1, 2)


def test_a_packed_llama_gives_each_document_its_logits_alone_and_gpt2_its_first():
    torch.manual_seed(0)
    llama = Llama(LlamaConfig.from_name("llama-tiny")).double().eval()
    gpt2 = GPT2(GPT2Config.from_name("gpt2-tiny")).double().eval()
    idx, _ = _batch()
    with torch.no_grad():
        for b in range(2):
            packed = llama(idx[b:b + 1], doc_ids=DOC_IDS[b:b + 1])[0]
            for d in range(3):
                rows = (DOC_IDS[b] == d).nonzero().flatten()
                alone = llama(idx[b:b + 1, rows])[0]  # RoPE: attention depends on relative positions only
                assert _rel(packed[rows], alone) < 1e-6, (b, d)  # (cos/sin are float32, as transformers')
        first = (DOC_IDS[0] == 0).nonzero().flatten()
        assert _rel(gpt2(idx[:1], doc_ids=DOC_IDS[:1])[0, first], gpt2(idx[:1, first])[0]) < 1e-12
        # one document per row is the plain causal model
        assert _rel(gpt2(idx, doc_ids=torch.zeros_like(idx)), gpt2(idx)) < 1e-12


def test_doc_ids_of_another_shape_or_decreasing_are_refused_naming_both_shapes():
    model = GPT2(GPT2Config.from_name("gpt2-tiny"))
    idx, targets = _batch()
    with pytest.raises(ValueError, match=r"idx's shape \(B, T\) = \(2, 32\), got \(2, 31\)"):
        model(idx, targets, doc_ids=DOC_IDS[:, :31])
    with pytest.raises(ValueError, match="non-decreasing.*row 1 goes from 2 to 0 at position 31"):
        model(idx, targets, doc_ids=torch.cat([DOC_IDS[:, :31], torch.tensor([[2], [0]])], 1))
    module = tp.CausalLMModule("gpt2-tiny")
    module.model = model
    with pytest.raises(ValueError, match=r"\(2, 32\), got \(1, 32\)"):  # on the host batch, before any step
        module.on_before_batch_transfer((idx, targets, Documents(DOC_IDS[:1])), 0)


# ---- four ranks ------------------------------------------------------------------------------------------------


def _count_blocks(monkeypatch_target):
    """Wrap ``metp.attend_block``; returns the call log ``[(batch rows, query rows, key rows, causal)]``."""
    calls = []
    real = monkeypatch_target.attend_block

    def counting(q, k, v, causal, *args, **kwargs):
        assert not [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)], "a mask reached the kernel"
        calls.append((q.shape[0], q.shape[-2], k.shape[-2], causal))
        return real(q, k, v, causal, *args, **kwargs)

    monkeypatch_target.attend_block = counting
    return calls, real


def _expected_blocks(i: int, n: int, docs: Documents) -> tuple[int, Counter]:
    """``(visible chunk pairs, plain blocks)`` rank ``i`` of ``n`` computes in one ring pass, from the full mask and
    the ids: a ``[c, c]`` pair is computed iff some query sees some key in it; inside one document in every row it
    is one block over the batch; otherwise each row's document ``d`` contributes the block of its queries that see a
    key of the pair by the keys they see, over the whole batch when all rows have the same blocks, else row by row.
    Blocks as ``(batch rows, query rows, key rows, causal)``."""
    c = SEQ // (2 * n)
    mask, ids = docs.mask()[:, 0], docs.ids
    pairs, blocks = 0, Counter()
    for a in (i, 2 * n - 1 - i):
        for b in range(a + 1):
            qs, ks = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
            if not mask[:, qs, ks].any():
                continue
            pairs += 1
            if (ids[:, b * c:(a + 1) * c] == ids[:, b * c:b * c + 1]).all():
                blocks[len(ids), c, c, a == b] += 1
                continue
            per_row = []
            for row in range(len(ids)):
                runs = []
                for d in ids[row].unique().tolist():
                    sub = mask[row, qs, ks] & (ids[row, qs] == d)[:, None]  # (c, c): document d's visible pairs
                    q_rows, k_rows = sub.any(1).nonzero().flatten(), sub.any(0).nonzero().flatten()
                    if len(q_rows):
                        runs.append((tuple(q_rows.tolist()), tuple(k_rows.tolist())))
                per_row.append(sorted(runs))
            same = all(runs == per_row[0] for runs in per_row)
            for runs in per_row[:1] if same else per_row:
                for q_rows, k_rows in runs:
                    blocks[len(ids) if same else 1, len(q_rows), len(k_rows), a == b] += 1
    return pairs, blocks


def _ring_parity(rank, world_size):
    docs = Documents(DOC_IDS)
    idx, targets = _batch()
    out = {}
    for layout in ("metp", "2d-metp"):
        mesh = tp.init_mesh(layout, world_size, 1)
        for family in ("gpt2", "llama"):
            torch.manual_seed(0)
            plain = (GPT2(GPT2Config.from_name("gpt2-tiny", n_head=12)) if family == "gpt2"
                     else Llama(LlamaConfig.from_name("llama-tiny"))).double()
            par = tp.parallelize(copy.deepcopy(plain), mesh, layout=layout)
            loss0 = plain(idx, targets, doc_ids=docs)
            calls, real = _count_blocks(metp)
            try:
                loss1 = par(idx, targets, doc_ids=docs)
            finally:
                metp.attend_block = real
            loss0.backward()
            loss1.backward()
            grads = {n: _rel(p.grad.full_tensor(), p0.grad)
                     for (n, p), p0 in zip(par.named_parameters(), plain.parameters())}
            out[layout, family] = {"loss": (loss0.item(), loss1.item()), "grads": grads,
                                   "calls": calls, "plain_loss": plain(idx, targets).item()}
    out["same rows"] = _same_rows_parity(rank, world_size)
    return out


def _same_rows_parity(rank: int, world_size: int) -> tuple[float, float, list]:
    """``ring_attention`` alone on the ring of 4 with two rows cut at the same places (so split pairs run as one
    block over the batch) against SDPA with the full mask: (output error, q|k|v gradient error, kernel calls)."""
    mesh = tp.init_mesh("metp", world_size, 1)
    docs = Documents(torch.stack([DOC_IDS[0], DOC_IDS[0]]))
    g = torch.Generator().manual_seed(3)
    q, k, v, dy = (torch.randn(2, 3, SEQ, 8, generator=g, dtype=torch.float64) for _ in range(4))
    full = torch.stack([q, k, v]).requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(*full, attn_mask=docs.mask())
    ref.backward(dy)
    rows = zigzag_positions(SEQ, world_size, rank)
    shard = full.detach()[..., rows, :].clone().requires_grad_()
    calls, real = _count_blocks(metp)
    try:
        y = metp.ring_attention(shard, mesh, "ring", documents=docs)
    finally:
        metp.attend_block = real
    y.backward(dy[..., rows, :])
    return _rel(y, ref.detach()[..., rows, :]), _rel(shard.grad, full.grad[..., rows, :]), calls


def test_metp_and_2d_metp_with_packed_documents_match_the_plain_model_and_skip_empty_blocks():
    results = run_distributed(_ring_parity, 4)
    docs = Documents(DOC_IDS)
    same = Documents(torch.stack([DOC_IDS[0], DOC_IDS[0]]))
    for rank, out in enumerate(results):
        out_err, grad_err, calls = out.pop("same rows")
        assert out_err <= 1e-12 and grad_err <= 1e-12, (rank, out_err, grad_err)
        assert Counter(calls) == _expected_blocks(rank, 4, same)[1], rank  # every block over both rows at once
        assert all(batch == 2 for batch, *_ in calls)
        for (layout, family), got in out.items():
            loss0, loss1 = got["loss"]
            assert abs(loss1 - loss0) <= 1e-10 * abs(loss0), (layout, family)
            assert abs(loss0 - got["plain_loss"]) > 1e-4  # the documents change the loss: the mask is not a no-op
            worst = max(got["grads"], key=got["grads"].get)
            assert got["grads"][worst] <= 1e-10, (layout, family, worst, got["grads"][worst])
            # plain block-kernel calls in the forward: one per block of one document's queries and keys, layer and
            # query group, nothing else
            n, i = (4, rank) if layout == "metp" else (2, rank // 2)  # "2d-metp": the ring runs along row
            layers = 2
            groups = 1 if family == "gpt2" else 2  # llama-tiny: 12 query heads on 6 key/value heads
            blocks = _expected_blocks(i, n, docs)[1]
            assert Counter(got["calls"]) == Counter({k: layers * groups * v for k, v in blocks.items()}), (
                layout, family, rank)
    # on the ring of 4 (chunks of 4) the documents cut away work the causal mask alone keeps: of the 2n + 1 = 9
    # causal chunk pairs per rank, rank 0 (chunks 0 and 7) computes 5 ((0, 0) and (7, 4..7)), the others 8
    assert [_expected_blocks(i, 4, docs)[0] for i in range(4)] == [5, 8, 8, 8]
    # rank 1 (chunks 1 = [4, 8) and 6 = [24, 28)), row by row (the rows' documents differ in every split pair):
    # (1, 1) row 0 cut at 5 into causal runs of 1 and 3, row 1 whole; (1, 0) row 0's query 4 on keys 0..3, row 1
    # whole; (6, 6) row 0 cut at 25 (runs of 1 and 3), row 1 whole; (6, 1..5) row 0's query 24 (document [5, 25))
    # on its keys in [5, 8) then 4 per chunk, queries 25..27 on none; row 1 (document [16, 32)) on (6, 4) and (6, 5)
    assert _expected_blocks(1, 4, docs)[1] == Counter({(1, 1, 1, True): 2, (1, 3, 3, True): 2, (1, 4, 4, True): 2,
                                                       (1, 1, 4, False): 5, (1, 1, 3, False): 1,
                                                       (1, 4, 4, False): 3})


# ---- the data module -------------------------------------------------------------------------------------------


def test_the_data_module_packs_documents_and_the_training_step_passes_them(tmp_path):
    import lightning.pytorch as L

    corpus = tmp_path / "docs"
    corpus.mkdir()
    for k in range(6):  # six files, joined by end-of-text (256 for the byte tokenizer)
        (corpus / f"{k}.txt").write_text(f"document {k}: " + "abc " * (3 + 5 * k))
    dm = tp.TextDataModule(path=str(corpus), block_size=16, batch_size=2, val_fraction=0.2, shuffle=False,
                           cache=False, pack_documents=True)
    dm.setup()
    idx, targets, docs = next(iter(dm.train_dataloader()))
    assert isinstance(docs, Documents) and docs.shape == idx.shape
    assert torch.equal(docs.ids, Documents.from_eos(idx, 256).ids)
    assert docs.starts_known  # the starts were computed by the loader on the host, not in the step
    has_eos = (idx == 256).any(1)
    assert has_eos.any() and all(len(s) > 1 for s, e in zip(docs.starts, has_eos.tolist()) if e)
    with pytest.raises(ValueError, match="eos_id"):
        tp.TextDataModule(path=str(tmp_path / "t.bin"), pack_documents=True)
    (a, b, c), = [TokenWindows(torch.arange(40).numpy(), 8, eos_id=3)[0]]
    assert c.tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and torch.equal(collate_documents([(a, b, c)])[2].ids, c[None])

    seen = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            forward = module.model.forward

            def recording(idx, targets=None, doc_ids=None):
                seen.append(doc_ids)
                return forward(idx, targets, doc_ids=doc_ids)

            module.model.forward = recording

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, enable_checkpointing=False,
                        callbacks=[Record()])
    trainer.fit(tp.CausalLMModule("gpt2-tiny"), dm)
    assert len(seen) == 1 and isinstance(seen[0], Documents) and seen[0].shape == (2, 16)


def test_tp2d_train_has_the_packing_keys_and_they_reach_the_data_module(tmp_path):
    """``data.pack_documents`` / ``data.eos_id`` in every data option: off by default; on, the composed config
    builds a packing ``TextDataModule`` (the byte tokenizer's end-of-text 256, or the given id for token files,
    which carry no tokenizer), and ``check_config`` plans the ring run as before."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lightning_tp2d import launch
    from lightning_tp2d.train import ConfigError, check_config

    launch.register_resolvers()
    ids = tmp_path / "train.bin"
    torch.arange(200, dtype=torch.int16).numpy().tofile(ids)
    with initialize_config_dir(config_dir=str(launch.CONF_DIR), version_base="1.3", job_name="test"):
        configs = {name: compose(config_name="config", overrides=overrides) for name, overrides in {
            "default": [], "packed": ["data.pack_documents=true", "parallel=metp", "model=llama-tiny"],
            "tokens": ["data=tokens", f"data.path={ids}", "data.pack_documents=true", "data.eos_id=7"],
            "text": ["data=text", f"data.path={tmp_path}", "data.pack_documents=true"],
            "grid": ["data.pack_documents=true", "parallel=tp2d", "model=llama-tiny"]}.items()}
    for name, cfg in configs.items():
        assert set(cfg.data) >= {"pack_documents", "eos_id"}, name
    assert instantiate(configs["default"].data).pack_documents is False
    packed = instantiate(configs["packed"].data)
    assert packed.pack_documents is True and packed.eos_id == 256
    assert instantiate(configs["text"].data).eos_id == 256
    tokens = instantiate(configs["tokens"].data)
    assert tokens.pack_documents is True and tokens.eos_id == 7
    assert check_config(configs["packed"], instantiate(configs["packed"].model)).startswith("layout 'metp'")
    # the "2d" grid has no per-document attention: refused before any process starts, naming the layouts that have
    with pytest.raises(ConfigError, match=r"data.pack_documents=true: layout '2d' .*\['2d-metp', 'metp'\]"):
        check_config(configs["grid"], instantiate(configs["grid"].model))
    from lightning_tp2d.strategy import TP2DStrategy

    strategy = TP2DStrategy(layout="2d", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="layout '2d' has no per-document attention"):
        strategy._check_module_and_data((packed,), fitting=True)

