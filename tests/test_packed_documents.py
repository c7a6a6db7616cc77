"""Packed documents (lightning_tp2d.models.documents): per-document causal attention from document ids.

Single device: the ids from end-of-text tokens and their chunk table; a packed Llama (RoPE: relative positions) gives
each document the logits it has alone, a packed GPT-2 its first document's; bad ids are refused naming both shapes.
Four gloo ranks, one spawned group: "metp" and "2d-metp" (2x2), GPT-2 and Llama (GQA), equal the plain model with
the same documents in loss and every gradient (float64), and the ring calls the block kernel exactly for the chunk
pairs in which some query may see some key (pairs across a document start are skipped). The data module packs
documents from end-of-text tokens and the training step hands them to the model.
"""

from __future__ import annotations

import copy

import pytest
import torch

import lightning_tp2d as tp
from lightning_tp2d import metp
from lightning_tp2d.data.datamodule import TokenWindows, collate_documents
from lightning_tp2d.models import GPT2, GPT2Config
from lightning_tp2d.models.documents import MASKED, SKIPPED, WHOLE, Documents
from lightning_tp2d.models.llama import Llama, LlamaConfig
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
    assert links[0][0] == WHOLE and links[1][1] == MASKED  # chunk 1 = [4, 8) holds row 0's start 5
    assert links[1][0] == MASKED  # row 0: rows 4 sees 0..4; row 1: one document until 13
    assert links[7][0] == SKIPPED  # starts 5 (row 0) and 13 (row 1) lie between
    assert links[5][4] == WHOLE and links[0][1] == SKIPPED  # [16, 24) one document in both rows; b > a causal
    # the table agrees with the full mask: a pair is skipped iff no query of it sees any key of it
    mask = Documents(DOC_IDS).mask()[:, 0]
    for a in range(8):
        for b in range(a + 1):
            seen = bool(mask[:, 4 * a:4 * a + 4, 4 * b:4 * b + 4].any())
            assert (links[a][b] != SKIPPED) == seen, (a, b)


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
    """Wrap ``metp.attend_block``; returns the call log ``[masked?]``."""
    calls = []
    real = monkeypatch_target.attend_block

    def counting(*args, **kwargs):
        calls.append(kwargs.get("mask", args[6] if len(args) > 6 else None) is not None)
        return real(*args, **kwargs)

    monkeypatch_target.attend_block = counting
    return calls, real


def _expected_blocks(i: int, n: int, docs: Documents) -> tuple[int, int]:
    """``(pairs, masked pairs)`` of chunk pairs rank ``i`` of ``n`` computes in one ring pass, from the full mask: a
    pair is computed iff some query sees some key; it needs a mask iff it is not one document in every row."""
    c = SEQ // (2 * n)
    mask, ids = docs.mask()[:, 0], docs.ids
    pairs = masked = 0
    for a in (i, 2 * n - 1 - i):
        for b in range(a + 1):
            if mask[:, a * c:(a + 1) * c, b * c:(b + 1) * c].any():
                pairs += 1
                masked += bool((ids[:, b * c:(a + 1) * c] != ids[:, b * c:b * c + 1]).any())
    return pairs, masked


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
                                   "calls": (len(calls), sum(calls)), "plain_loss": plain(idx, targets).item()}
    return out


def test_metp_and_2d_metp_with_packed_documents_match_the_plain_model_and_skip_empty_blocks():
    results = run_distributed(_ring_parity, 4)
    docs = Documents(DOC_IDS)
    for rank, out in enumerate(results):
        for (layout, family), got in out.items():
            loss0, loss1 = got["loss"]
            assert abs(loss1 - loss0) <= 1e-10 * abs(loss0), (layout, family)
            assert abs(loss0 - got["plain_loss"]) > 1e-4  # the documents change the loss: the mask is not a no-op
            worst = max(got["grads"], key=got["grads"].get)
            assert got["grads"][worst] <= 1e-10, (layout, family, worst, got["grads"][worst])
            # block-kernel calls in the forward: one per visible chunk pair, layer and query group, nothing else
            n, i = (4, rank) if layout == "metp" else (2, rank // 2)  # "2d-metp": the ring runs along row
            layers = 2
            groups = 1 if family == "gpt2" else 2  # llama-tiny: 12 query heads on 6 key/value heads
            pairs, masked = _expected_blocks(i, n, docs)
            assert got["calls"] == (layers * groups * pairs, layers * groups * masked), (layout, family, rank)
    # on the ring of 4 (chunks of 4) the documents cut away work the causal mask alone keeps: of the 2n + 1 = 9
    # causal chunk pairs per rank, rank 0 (chunks 0 and 7) computes 5 ((0, 0) and (7, 4..7)), the others 8
    assert [_expected_blocks(i, 4, docs)[0] for i in range(4)] == [5, 8, 8, 8]


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
