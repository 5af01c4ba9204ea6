"""Context parallelism and packing in the trainer (`parallel.cp`, `parallel.cp_method`,
`data.packing`): document masks keep attention inside documents, and every cp method trains
along the single-process loss curve (the oracle), composed with data parallelism."""

from __future__ import annotations

import torch

from harness import run_world
from conftest import tiny_tree
from loomtrain.data import WindowSampler, load_corpus
from loomtrain.models import GPT
from loomtrain.parallel.sequence import SequenceRuntime
from loomtrain.train.metrics import read_metrics
from test_zero import _train_many


def test_documents_follow_the_files(doc_corpus):
    corpus = load_corpus(str(doc_corpus), 0.1, 256)
    sampler = WindowSampler(corpus.train, 32, 0, corpus.train_doc_starts)
    docs = sampler.documents(range(64))
    assert docs.shape == (64, 32)
    assert bool((docs[:, 1:] >= docs[:, :-1]).all())  # documents run in stream order
    crossings = int((docs[:, 1:] != docs[:, :-1]).sum())
    assert crossings > 64  # rows hold several documents
    # a new document starts exactly where a file starts
    x, _ = sampler.batch(range(64))
    starts = set(corpus.train_doc_starts.tolist())
    for row, g in enumerate(range(64)):
        base = sampler.window_of(g) * 32
        for t in range(1, 32):
            assert (docs[row, t] != docs[row, t - 1]) == ((base + t) in starts)


def test_packing_masks_attention_at_document_boundaries(doc_corpus):
    """A packed row's logits equal those of each document run alone (at the same positions):
    no token sees another document."""
    corpus = load_corpus(str(doc_corpus), 0.1, 256)
    sampler = WindowSampler(corpus.train, 32, 0, corpus.train_doc_starts)
    x, y = sampler.batch(range(4))
    docs = sampler.documents(range(4))
    torch.manual_seed(0)
    model = GPT(256, 32, 32, 2, 2).eval()
    runtime = SequenceRuntime(model, None, "local", "softmax")
    model.sequence = runtime
    with torch.no_grad():
        runtime.shard(x, y, docs)
        packed = model(x)
        for b in range(4):
            cuts = [0, *[t for t in range(1, 32) if docs[b, t] != docs[b, t - 1]], 32]
            for a, e in zip(cuts, cuts[1:]):
                runtime.shard(x[b:b + 1, a:e], y[b:b + 1, a:e], None)
                model.position_ids = torch.arange(a, e)
                alone = model(x[b:b + 1, a:e])
                model.position_ids = None
                # the same operations on fewer keys: fp32 sums of other lengths, ~1e-7
                torch.testing.assert_close(packed[b:b + 1, a:e], alone, rtol=1e-5, atol=1e-5)


LLAMA_GQA1 = {"name": "llama", "n_heads": 4, "n_kv_heads": 1, "sliding_window": 7}
CP_ORACLE = [  # (model, parallel, data) run in one world of 4 against one process
    ({}, {"cp": 2}, {}),
    ({}, {"cp": 2}, {"packing": True}),
    ({}, {"cp": 2, "cp_method": "ulysses"}, {"packing": True}),
    ({"attention": "linear", "linear_decay": True}, {"cp": 2}, {"packing": True}),
    ({}, {"cp": 4}, {"packing": True}),
    # dynamic hybrid dp x cp: the pool of 4 deals each micro-step's documents
    ({}, {"cp": 2}, {"packing": True, "balance": True}),
    ({}, {}, {"packing": True, "balance": True}),
    # cp_method = "auto" (tests/test_sequence_auto.py): 2 heads, Ulysses; 1 head: ring attention,
    # packed documents, every block checkpointed (the budget is below any block's estimate)
    ({}, {"cp": 2, "cp_method": "auto"}, {}),
    ({"n_heads": 1}, {"cp": 2, "cp_method": "auto", "activation_budget_mb": 0.01}, {"packing": True}),
    # the llama: rotary positions of the chunks, grouped-query k and v (1 or 2 kv heads of 4,
    # unrepeated through the ring and through Ulysses when cp splits them) and a sliding window
    # that ends inside chunks; the hybrid pool attends whole documents locally
    (LLAMA_GQA1, {"cp": 2}, {"packing": True}),
    (LLAMA_GQA1, {}, {"packing": True, "balance": True}),
    ({**LLAMA_GQA1, "n_kv_heads": 2}, {"cp": 2, "cp_method": "ulysses"}, {}),
    (LLAMA_GQA1, {"cp": 2, "cp_method": "ulysses"}, {"packing": True}),
    # under ZeRO, sharded (and summed) over dp x cp: ring with stage 3, Ulysses on the llama
    # with stage 2, the hybrid pool with stage 1
    ({}, {"cp": 2, "zero_stage": 3}, {"packing": True}),
    ({**LLAMA_GQA1, "n_kv_heads": 2}, {"cp": 2, "cp_method": "ulysses", "zero_stage": 2}, {}),
    ({}, {"zero_stage": 1}, {"packing": True, "balance": True}),
    # with tensor parallelism (cp2 x tp2): the kernels on each tp rank's heads; Megatron's
    # sequence parallelism splits each cp rank's tokens again over tp
    ({"n_heads": 4}, {"cp": 2, "tp": 2}, {"packing": True}),
    ({"n_heads": 4}, {"cp": 2, "tp": 2, "sequence_parallel": True, "cp_method": "ulysses"}, {}),
    ({**LLAMA_GQA1, "n_kv_heads": 2}, {"cp": 2, "tp": 2, "sequence_parallel": True},
     {"packing": True}),
]
# in bf16 (fp32 master weights; the ring kernel merges in fp32): within 2% of the fp32 curve
CP_BF16 = [({}, {"cp": 2}, {"packing": True}),
           ({**LLAMA_GQA1, "n_kv_heads": 2}, {"cp": 2, "cp_method": "ulysses", "zero_stage": 3}, {})]


def _trees(tmp_path, doc_corpus, world, cases, train=None):
    return [tiny_tree(tmp_path, doc_corpus, model=model, data=data,
                      parallel={"nproc": world, **(parallel if world > 1 else {})},
                      train=train or {})
            for model, parallel, data in cases]


def test_oracle_context_parallel_with_data_parallel(tmp_path, doc_corpus):
    """cp2 x dp2 (ring, Ulysses, LASP, auto; with and without packing), cp4 and the dynamic
    hybrid pools train 20 steps along the single-process curve of the same model and data."""
    references = {}
    for model, _, data in CP_ORACLE:
        data = {k: v for k, v in data.items() if k != "balance"}
        references.setdefault((tuple(model.items()), tuple(data.items())), (model, {}, data))
    ref_cases = list(references.values())
    run_world(_train_many, 1, _trees(tmp_path, doc_corpus, 1, ref_cases), str(tmp_path / "ref"),
              timeout_s=200)
    run_world(_train_many, 4, _trees(tmp_path, doc_corpus, 4, CP_ORACLE)
              + _trees(tmp_path, doc_corpus, 4, CP_BF16, {"precision": "bf16"}), str(tmp_path / "cp"),
              timeout_s=300)
    for j, (model, parallel, data) in enumerate(CP_BF16):
        ref = read_metrics(tmp_path / "ref" / f"run{ref_cases.index((model, {}, data))}")
        got = read_metrics(tmp_path / "cp" / f"run{len(CP_ORACLE) + j}")
        rel = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(got, ref))
        assert len(got) == 20 and rel < 0.02, (model, parallel, rel)
    for i, (model, parallel, data) in enumerate(CP_ORACLE):
        plain = {k: v for k, v in data.items() if k != "balance"}  # the same maths
        ref = read_metrics(tmp_path / "ref" / f"run{ref_cases.index((model, {}, plain))}")
        got = read_metrics(tmp_path / "cp" / f"run{i}")
        assert len(got) == len(ref) == 20 and ref[-1]["loss"] < ref[0]["loss"] - 0.3
        # attention merged blockwise (online softmax, chunk states) and gradients summed over
        # four ranks in another order: fp32 rounding, ~1e-7 relative after 20 AdamW steps
        for key in ("loss", "grad_norm"):
            rel = max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(got, ref))
            assert rel < 1e-4, (model, parallel, data, key, rel)
        if data.get("balance"):
            dealt = sum(r["work_imbalance"] for r in got) / len(got)
            whole_rows = sum(r["dp_work_imbalance"] for r in got) / len(got)
            assert dealt < whole_rows, (dealt, whole_rows)
        # ring: send; Ulysses: all_to_all; LASP: all_gather (balance: only steps that split);
        # packing alone (cp = 1, no pool) attends locally
        sent = sum(r["comm_bytes"].get(op, 0) for r in got for op in ("send", "all_to_all", "all_gather"))
        assert (sent > 0) == (parallel.get("cp", 1) > 1 or "balance" in data), (model, parallel, data)
