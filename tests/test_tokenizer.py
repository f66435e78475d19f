"""ClipTokenizer against transformers' CLIPTokenizer on the same vocabulary files."""

import numpy as np
import pytest
import transformers

from sclaro_jax.data.tokenizer import ClipTokenizer, load_bpe

WORDS = ("a photo of the cat dog man woman riding horse playing guitar on in with holding "
         "air conditioner mounted wall garbage truck trash can street children kitchen eating "
         "pizza table skateboard ramp jumping running talking driving").split()
PUNCT = list(".,;:!?'\"()[]{}-_/\\@#$%^&*+=<>|~`") + ["...", "--", "'s", "'t", "'re", "'ll"]
UNICODE = ["café", "naïve", "Ångström", "straße", "ñandú", "日本語", "中文字符", "한국어", "Ελληνικά",
           "русский", "עברית", "العربية", "🙂", "👨‍👩‍👧", "🚗💨", "e\u0301", "ﬁ", "Ⅻ", "①②",
           "\u00a0", "\u200b", "\u3000", "ＡＢＣ", "x²", "½", "–", "—", "…", "«»", "“quoted”"]
SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<|endoftext|>x", "a<|startoftext|>b"]


def make_corpus(n=1200, seed=0):
    rng = np.random.default_rng(seed)
    corpus = ["", " ", "\n\t  ", "a photo of a cat", "A PHOTO OF A CAT", "don't stop",
              "I'm here, you're there; we'll see.", "3.14159 and 1,000,000", "ABC123def456"]
    corpus += SPECIAL + UNICODE + PUNCT
    pools = [WORDS] * 4 + [PUNCT, UNICODE, [str(i) for i in range(100)], SPECIAL]
    while len(corpus) < n:
        size = int(rng.choice([1, 3, 8, 20, 60, 150]))  # 60 and 150 words exceed 77 tokens
        parts = []
        for _ in range(size):
            pool = pools[rng.integers(len(pools))]
            parts.append(str(pool[rng.integers(len(pool))]))
        seps = rng.choice([" ", "", "  ", "\n", "\t"], size=size)
        text = "".join(p + s for p, s in zip(parts, seps))
        if rng.random() < 0.3:
            text = text.upper() if rng.random() < 0.5 else text.title()
        corpus.append(text)
    return corpus


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    folder = ClipTokenizer().save_pretrained(tmp_path_factory.mktemp("clip_tokenizer"))
    return transformers.CLIPTokenizer.from_pretrained(folder)


def _hf_ids(hf, texts, length):
    return np.array(hf(texts, padding="max_length", max_length=length,
                       truncation=True)["input_ids"])


@pytest.mark.parametrize("length", [77, 16])
def test_ids_equal_hugging_face_on_corpus(hf_tokenizer, length):
    corpus = make_corpus()
    assert len(corpus) >= 1000
    ours = ClipTokenizer()(corpus, length=length)
    ref = _hf_ids(hf_tokenizer, corpus, length)
    assert ours.dtype == np.int32 and ours.shape == (len(corpus), length)
    bad = [i for i in range(len(corpus)) if not np.array_equal(ours[i], ref[i])]
    assert not bad, f"{len(bad)} differ, first {corpus[bad[0]]!r}: {ours[bad[0]]} vs {ref[bad[0]]}"
    # The corpus really exercises truncation and unicode.
    full_lengths = [len(ids) for ids in hf_tokenizer(corpus)["input_ids"]]
    assert sum(n > length for n in full_lengths) > 100
    assert sum(not t.isascii() for t in corpus) > 100


def test_truncation_keeps_eot_and_empty_text():
    tok = ClipTokenizer()
    ids = tok(["word " * 200, ""])
    assert ids[0, 0] == 49406 and ids[0, -1] == 49407 and (ids[0, 1:-1] != 49407).all()
    assert list(ids[1, :3]) == [49406, 49407, 49407] and (ids[1, 1:] == 49407).all()


def test_known_openai_ids():
    # Ids of OpenAI CLIP's vocabulary: 'a</w>' 320, 'photo</w>' 1125, 'of</w>' 539, 'cat</w>' 2368.
    ids = ClipTokenizer()("a photo of a cat")[0]
    assert list(ids[:7]) == [49406, 320, 1125, 539, 320, 2368, 49407]


def test_vocabulary_layout():
    vocab, merges = load_bpe()
    assert len(vocab) == 49408 and len(merges) == 48894
    assert vocab["<|startoftext|>"] == 49406 and vocab["<|endoftext|>"] == 49407
    assert vocab["!"] == 0 and vocab["!</w>"] == 256


def test_single_string_and_bad_input():
    tok = ClipTokenizer()
    assert tok("a dog").shape == (1, 77)
    assert tok([], length=8).shape == (0, 8)
    assert tok.decode(tok("A Dog, running!")[0]) == "a dog , running !"
    with pytest.raises(TypeError, match="text 1 is NoneType"):
        tok(["ok", None])
    with pytest.raises(ValueError, match="length must leave room"):
        tok(["x"], length=1)
