"""The MTP head's draft vocabulary (models/mtp.py DraftVocab, `convert --draft-vocab`): subset logits equal the full
lm_head's at those ids, greedy MTP stays identical to plain, sampled MTP keeps plain's joint distribution (and a
misplaced q fails that check), and conversion ranks ids by a corpus, keeps or drops the file, and refuses bad input
with one line."""

import json
import subprocess
import sys
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from conftest import exact_plain_joint, fit_pvalues

from lattice_mlx import SpecOptions, generate
from lattice_mlx.bench.synthetic import random_checkpoint
from lattice_mlx.convert import convert
from lattice_mlx.load import LoadError, load, quantize
from lattice_mlx.models.mtp import DraftVocab
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative import SpecStats, speculate
from lattice_mlx.speculative import pipelined as rounds


@pytest.mark.parametrize("bits", [None, 4, 8], ids=["dense", "q4", "q8"])
@pytest.mark.parametrize("name", ["tied", "untied"])
def test_subset_logits_are_the_full_logits_at_its_ids(checkpoints, name, bits):
    model, _ = load(checkpoints[name])
    if bits:
        quantize(model, bits=bits, group_size=32, quantize_mtp=False)
    ids = [3, 17, 5, 250, 0, 17]  # unsorted, with a repeat: the vocabulary is the sorted set
    vocab = DraftVocab(ids)
    h = mx.random.normal((1, 2, model.args.hidden_size), key=mx.random.key(0))
    got = vocab.lm_logits(model, h)
    want = model.lm_logits(h)[..., vocab.ids]
    assert vocab.size == 5 and got.shape == (1, 2, 5)
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()


def test_to_full_maps_picks_and_q():
    vocab = DraftVocab([7, 2, 9])
    token, q = vocab.to_full(mx.array(1), mx.array([0.2, 0.5, 0.3]), 12)
    assert token.item() == 7
    assert np.allclose(np.array(q), [0, 0, 0.2, 0, 0, 0, 0, 0.5, 0, 0.3, 0, 0])


@pytest.fixture(scope="module")
def small_vocab_ckpt(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("dv") / "ckpt", seed=4, vocab_size=320)


def _with_vocab(path, ids):
    model, tok = load(path)
    model.mtp.draft_vocab = DraftVocab(ids)
    return model, tok


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_mtp_with_a_draft_vocab_equals_plain(small_vocab_ckpt, k, compile_mode, monkeypatch):
    """Half the vocabulary, then a subset that leaves out most of what the head would draft: the output is plain's
    either way (only acceptance changes), and every draft is a subset id."""
    drafted, real = [], DraftVocab.to_full

    def spy(self, draft, q, vocab):
        token, q = real(self, draft, q, vocab)
        drafted.append(token)
        return token, q

    monkeypatch.setattr(DraftVocab, "to_full", spy)
    for ids in (range(0, 320, 2), range(300, 320)):
        model, tok = _with_vocab(small_vocab_ckpt, ids)
        spec = SpecOptions(draft_tokens=k, adaptive=False)
        plain = generate(model, tok, [5, 6, 7, 8], max_tokens=40).tokens
        for traced in (True, False):  # the spy reads drafts only in rounds built op by op (a trace's are symbolic)
            drafted.clear()
            with rounds.tracing(traced):
                got = generate(model, tok, [5, 6, 7, 8], max_tokens=40, speculation=spec)
            assert got.tokens == plain
            if not traced:
                assert drafted and {t.item() for t in drafted} <= set(ids)


def test_traced_rounds_draft_from_the_current_rows_and_vocabulary(small_vocab_ckpt):
    """A traced round takes the draft vocabulary's ids and gathered rows as captured inputs: rows gathered again
    after the lm_head changed, and another vocabulary object, are what the next traced round drafts with (under one
    seed, traced and untraced rounds draw the same tokens; with the rows as trace constants they did not)."""
    model, tok = _with_vocab(small_vocab_ckpt, range(0, 320, 2))
    spec = SpecOptions(draft_tokens=3, adaptive=False)

    def both():
        out = []
        for traced in (False, True):
            with rounds.tracing(traced):
                mx.random.seed(5)
                out.append(generate(model, tok, [5, 6, 7, 8], max_tokens=40, temp=1.0, speculation=spec).tokens)
        return out

    untraced, traced = both()
    assert untraced == traced
    lin = model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head
    lin.weight = lin.weight[::-1]  # the lm_head (or tied embedding) replaced: other rows for the same ids
    untraced, traced = both()
    assert untraced == traced
    model.mtp.draft_vocab = DraftVocab(range(1, 320, 2))  # another vocabulary
    untraced, traced = both()
    assert untraced == traced


def _round_tokens(model, seeds) -> list[tuple[int, ...]]:
    """Tokens 2..5 of a generation at temperature 1 (the first comes from prefill): one K=3 MTP round and its bonus
    when all drafts are accepted."""
    sampler, options, out = Sampler(temp=1.0), SpecOptions(draft_tokens=3, adaptive=False), []
    for seed in seeds:
        mx.random.seed(seed)
        gen = speculate(model, mx.array([1, 2, 1, 2, 1]), sampler=sampler, options=options,
                        stats=SpecStats.of(options))
        out.append(tuple(next(gen) for _ in range(5))[1:])
    return out


def _min_pvalue(joint, spec) -> float:
    """The least chi-square p-value of the speculative tokens 2..5 against plain sampling's exact joint, over the
    pairs (t1, t2), (t2, t3), (t3, t4) and t4 alone."""
    return min(fit_pvalues(joint, spec, ((0, 1), (1, 2), (2, 3), (3,))).values())


def test_sampled_mtp_with_a_draft_vocab_keeps_the_distribution(tiny_vocab_model, monkeypatch):
    """Vocabulary 8, drafts from {0, 1, 3, 6}: every position of a K=3 round and its bonus follow plain sampling;
    the same check fails when q is scattered onto the wrong ids (the drafted token's q misread)."""
    model = tiny_vocab_model
    before = model.mtp.draft_vocab
    try:
        model.mtp.draft_vocab = DraftVocab([0, 1, 3, 6])
        joint = exact_plain_joint(model, [1, 2, 1, 2, 1], 5, Sampler(temp=1.0)).sum(axis=0)  # t1..t4
        seeds = range(500_000, 500_000 + 300)
        assert _min_pvalue(joint, _round_tokens(model, seeds)) > 1e-3

        def misplaced(self, draft, q, vocab):
            token = self.ids[draft]
            return token, (None if q is None else mx.zeros((vocab,), dtype=q.dtype).at[self.ids[::-1]].add(q))

        monkeypatch.setattr(DraftVocab, "to_full", misplaced)
        # built op by op: the rounds traced above replay the correct graph, and the planted one reads the vocabulary's
        # ids, which a trace does not capture
        with rounds.tracing(False):
            assert _min_pvalue(joint, _round_tokens(model, seeds)) < 1e-4
    finally:
        model.mtp.draft_vocab = before


def test_convert_ranks_draft_ids_by_corpus_and_load_attaches_them(small_vocab_ckpt, tmp_path):
    _, tok = load(small_vocab_ckpt)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the cat sat on the mat. " * 40)
    (corpus / "b.py").write_text("def f(x):\n    return x + 1\n" * 30)
    counts = Counter(tok.encode((corpus / "a.txt").read_text(), add_special_tokens=False))
    counts.update(tok.encode((corpus / "b.py").read_text(), add_special_tokens=False))
    out = convert(str(small_vocab_ckpt), str(tmp_path / "out"), draft_vocab=6, draft_corpus=str(corpus))
    saved = json.loads((out / DraftVocab.FILE).read_text())
    top = sorted(counts, key=lambda i: (-counts[i], i))[:6]
    eos = set(tok.eos_token_ids)
    assert set(saved["ids"]) == set(top) | eos and saved["ids"] == sorted(saved["ids"])
    assert saved["coverage"] == pytest.approx(sum(counts[i] for i in saved["ids"]) / sum(counts.values()), abs=1e-6)
    model, tok2 = load(out)
    assert model.mtp.draft_vocab.size == len(saved["ids"])
    spec = SpecOptions(draft_tokens=2, adaptive=False)
    assert generate(model, tok2, [5, 6, 7], max_tokens=24, speculation=spec).tokens == \
        generate(model, tok2, [5, 6, 7], max_tokens=24).tokens
    # a later conversion keeps it by default and drops it with --draft-vocab 0
    again = convert(str(out), str(tmp_path / "again"))
    assert json.loads((again / DraftVocab.FILE).read_text()) == saved
    off = convert(str(out), str(tmp_path / "off"), draft_vocab=0)
    assert not (off / DraftVocab.FILE).exists() and load(off)[0].mtp.draft_vocab is None


def test_convert_without_corpus_takes_the_lowest_ids(small_vocab_ckpt, tmp_path):
    out = convert(str(small_vocab_ckpt), str(tmp_path / "out"), draft_vocab=10)
    saved = json.loads((out / DraftVocab.FILE).read_text())
    _, tok = load(small_vocab_ckpt)
    assert set(saved["ids"]) == set(range(10)) | set(tok.eos_token_ids) and saved["coverage"] is None


def _convert_cli(*args):
    return subprocess.run([sys.executable, "-m", "lattice_mlx.convert", *map(str, args)], capture_output=True,
                          text=True)


def test_draft_vocab_errors_are_one_line(small_vocab_ckpt, no_mtp_checkpoint, tmp_path):
    cases = [
        ((no_mtp_checkpoint, "--draft-vocab", 8), "no MTP head"),
        ((small_vocab_ckpt, "--draft-vocab", 320), "below the vocabulary size"),
        ((small_vocab_ckpt, "--draft-corpus", tmp_path), "--draft-vocab N"),
        ((small_vocab_ckpt, "--draft-vocab", 8, "--draft-corpus", tmp_path / "missing"), "no such file"),
        ((small_vocab_ckpt, "--draft-vocab", -1), ">= 0"),
    ]
    for i, (args, words) in enumerate(cases):
        src, *rest = args
        res = _convert_cli("--hf-path", src, "--mlx-path", tmp_path / f"o{i}", *rest)
        lines = res.stderr.strip().splitlines()
        assert res.returncode != 0 and len(lines) == 1 and words in lines[0], (args, res.stderr)
        assert "Traceback" not in res.stderr and not (tmp_path / f"o{i}").exists()


def test_corrupt_draft_vocab_file_is_one_line(small_vocab_ckpt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(small_vocab_ckpt, bad)
    for content in ('{"ids": [1, 2, 99999]}', "not json", '{"ids": []}'):
        (bad / DraftVocab.FILE).write_text(content)
        with pytest.raises(LoadError, match="not a draft vocabulary"):
            load(bad)
        res = subprocess.run([sys.executable, "-m", "lattice_mlx.generate", "--model", str(bad), "--prompt", "hi",
                              "--max-tokens", "2"], capture_output=True, text=True)
        assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_unreadable_draft_vocab_and_converting_past_a_corrupt_one(small_vocab_ckpt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(small_vocab_ckpt, bad)
    (bad / DraftVocab.FILE).mkdir()  # unreadable as a file: OSError
    with pytest.raises(LoadError, match="not a draft vocabulary"):
        load(bad)
    (bad / DraftVocab.FILE).rmdir()
    (bad / DraftVocab.FILE).write_text("not json")
    with pytest.raises(LoadError, match="not a draft vocabulary"):
        convert(str(bad), str(tmp_path / "kept"))  # kept by default: named, not copied
    assert not (tmp_path / "kept").exists()
    out = convert(str(bad), str(tmp_path / "replaced"), draft_vocab=8)  # replaced: the old one is never read
    assert load(out)[0].mtp.draft_vocab.size >= 8
    assert not (convert(str(bad), str(tmp_path / "dropped"), draft_vocab=0) / DraftVocab.FILE).exists()


def test_tree_wider_than_the_draft_vocab_is_refused(small_vocab_ckpt):
    model, tok = _with_vocab(small_vocab_ckpt, [1, 2])
    with pytest.raises(ValueError, match="more children than the head's draft vocabulary"):
        generate(model, tok, [5, 6], max_tokens=4, speculation=SpecOptions(tree="3-1"))
