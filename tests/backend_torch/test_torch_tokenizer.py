"""The torch backend's tokenizer gives llama.cpp's ids, bytes and metadata.

The reference is llama.cpp's own tokenizer: the embedded model through the llama.cpp plugin,
and, for the pre-tokenizers and the SentencePiece vocabulary the embedded model does not have,
vocabulary-only GGUF files derived from it here (its vocabulary under another
``tokenizer.ggml.pre``, or rewritten SentencePiece-style), loaded by llama.cpp with
``vocab_only`` and read through the plugin's ``LlamaTokenizer``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
import llama_cpp as ll
import pytest
import transformers
from gguf import GGUFValueType as T
from laya_backend_llamacpp.backend import LlamaCppBackend
from laya_backend_llamacpp.tokenizer import LlamaTokenizer
from laya_backend_torch.tokenizer import HFTokenizer, load_tokenizer

from laya_core.backend import ModelConfig, ModelInfo
from laya_core.builtin.model_paths import embedded_file

EMBEDDED = embedded_file("smollm2-135m-instruct")

TEXTS = [
    "", " ", "Hello world", "Hello world!", " leading space", "   three leading",
    "trailing spaces   ", "a  b   c    d", "tabs\tand\t\ttabs", "new\nlines\n\n\nand \n \n",
    "\r\n windows \r\n\r\n", " \t \n mixed \t\n", "\n\n\n", "    indented\n        more",
    "0", "7 42 1234 12345 1234567890123456789012345678901234567890", "3.14159 -2.5e-10 1,000,000",
    "+1 (555) 010-9999 #12 $4.99 50% 2024-05-31T12:00:00Z", "x1y22z333 v1.2.3",
    "don't can't I'm you're we've they'll she'd it's DON'T I'LL We'Re", "'s 't '' '",
    "Hello, world! How are you? (Fine.) [ok] {yes} <no> ... --- !!! ??? ;;; ::",
    "café naïve résumé coöperate Ångström façade", "Ωμέγα Привет мир Здравствуйте",
    "日本語の文章です。中文句子，还有标点！한국어 문장입니다.", "ｆｕｌｌｗｉｄｔｈ　ｓｐａｃｅ",
    "emoji 🚀🔥👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 1️⃣ ❤️", "مرحبا بالعالم עברית שלום", "हिन्दी ไทย ქართული",
    "e\u0301 a\u0308\u0301 n\u0303 Z\u0351\u0352\u0353 combining", "\u0301\u0302 alone",
    "\ufffd\ufffd \x00 \x01\x02\x03 !\x04! \x1f\x7f \u200b\u200d \u2028\u2029 \u00a0\u3000",
    "\ufeffBOM \U0010ffff \U000e0001 \ue000\ue000 \U000b9c42\U000b9c42 \u0378\u0378",
    "def f(x):\n    return {'a': [x, x ** 2]}  # comment\n\nif __name__ == '__main__':\n\tf(3)",
    "<div class=\"a\">&amp; &lt;tag&gt;</div> SELECT * FROM t WHERE id=1; -- sql",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|endoftext|><reponame>x<file_sep>",
    "text <|im_start|> inside <|im_end|>and<|endoftext|>", "<|im_start", "<|im_start|>>",
    "".join(chr(c) for c in range(32, 2000)),
    "The lighthouse keeper wrote in his diary, 12 times. " * 60,
]
CASES = [(t, special, parse) for t in TEXTS for special in (True, False) for parse in (True, False)]


def mismatches(ours: Any, reference: Any, texts: list[str] = TEXTS) -> list[tuple[Any, ...]]:
    """The cases where the two tokenizers disagree, with both answers."""
    out = []
    for text, special, parse in ((t, s, p) for t in texts for s in (True, False)
                                 for p in (True, False)):
        got = ours.encode(text, add_special=special, parse_special=parse)
        want = reference.encode(text, add_special=special, parse_special=parse)
        if got != want:
            out.append((text[:60], special, parse, got[:20], want[:20]))
    return out


@pytest.fixture(scope="module")
def reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(EMBEDDED)


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    return load_tokenizer(EMBEDDED)


@pytest.fixture(scope="module")
def llama() -> Iterator[tuple[LlamaTokenizer, ModelInfo]]:
    """llama.cpp's tokenizer and ModelInfo of the embedded model, from the llama.cpp plugin."""
    config = ModelConfig(name="m", backend="llamacpp", path=EMBEDDED, options={"n_threads": 1})
    backend = LlamaCppBackend(config)
    info = backend.load_weights()
    yield backend.tokenizer(), info
    backend.close()


def test_encode_matches_llamacpp(tok: HFTokenizer, llama: tuple[LlamaTokenizer, Any]) -> None:
    assert mismatches(tok, llama[0]) == []
    assert tok.encode("<|im_start|>user\nhi<|im_end|>", add_special=False) == \
        [1, 4093, 198, 6004, 2]


def test_token_bytes_match_llamacpp_for_every_id(tok: HFTokenizer,
                                                 llama: tuple[LlamaTokenizer, Any]) -> None:
    ref = llama[0]
    assert tok.vocab_size == ref.vocab_size == 49152
    assert [i for i in range(tok.vocab_size) if tok.token_bytes(i) != ref.token_bytes(i)] == []
    assert tok.token_bytes(2) == b"" and tok.decode([19556, 905]) == "Hello world"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_bytes(tok.vocab_size)


def test_metadata_matches_the_llamacpp_backend(tok: HFTokenizer,
                                               llama: tuple[LlamaTokenizer, ModelInfo]) -> None:
    info, ref = tok.info, llama[1]
    assert info.eog_token_ids == ref.eog_token_ids == {0, 2, 4}
    assert (info.bos_id, info.bos_token, info.eos_id, info.eos_token) == \
        (1, ref.bos_token, 2, ref.eos_token) == (1, "<|im_start|>", 2, "<|im_end|>")
    assert info.add_bos is ref.add_bos is False and info.add_eos is False
    assert tok.special_tokens == info.special_tokens == ref.special_tokens
    assert info.chat_template == ref.chat_template and "<|im_start|>" in (info.chat_template or "")


def test_saved_folder_tokenizes_as_the_gguf(tok: HFTokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path, model_max_length=8192)
    back = load_tokenizer(tmp_path)
    assert back.info == tok.info
    assert mismatches(back, tok) == []
    assert all(back.token_bytes(i) == tok.token_bytes(i) for i in range(tok.vocab_size))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.chat_template == tok.info.chat_template and hf.model_max_length == 8192
    wrong = [(t, s, p) for t, s, p in CASES if tok.encode(t, add_special=s, parse_special=p)
             != hf.encode(t, add_special_tokens=s, split_special_tokens=not p)]
    assert wrong == []


def test_hf_folder_reads_chat_template_jinja_and_generation_stops(tok: HFTokenizer,
                                                                  tmp_path: Path) -> None:
    tok.save(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    (tmp_path / "chat_template.jinja").write_text(config.pop("chat_template"))
    config_path.write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    back = load_tokenizer(tmp_path)
    assert back.info.chat_template == tok.info.chat_template
    assert back.info.eog_token_ids == {0, 2, 4, 7}


def test_encoding_from_threads_matches_one_thread(tok: HFTokenizer) -> None:
    cases = CASES + [("Tell me a story. " * 20000, False, True)]  # long: leaves the GIL
    expected = [tok.encode(t, add_special=s, parse_special=p) for t, s, p in cases]
    pieces = [tok.token_bytes(i) for i in range(tok.vocab_size)]

    def work(worker: int) -> tuple[list[list[int]], list[bytes]]:
        # Its own piece cache, so the bytes are computed while the others encode.
        fresh = HFTokenizer(tok._hf, tok.info, tok._texts, tok._kinds, byte_level=True)
        got = [tok.encode(t, add_special=s, parse_special=p) for _ in range(2)
               for t, s, p in cases]
        return got, [fresh.token_bytes(i) for i in range(worker, tok.vocab_size, 4)]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, range(4)))
    for worker, (got, worker_pieces) in enumerate(results):
        assert got == expected * 2
        assert worker_pieces == pieces[worker::4]


# Vocabulary-only GGUF files derived from the embedded model's.

def _fields(reader: gguf.GGUFReader) -> dict[str, tuple[Any, T, T | None]]:
    return {name: (f.contents(), f.types[0], f.types[-1] if f.types[0] == T.ARRAY else None)
            for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def write_vocab(path: Path, fields: dict[str, tuple[Any, T, T | None]],
                drop: tuple[str, ...] = (), **changes: tuple[Any, T, T | None]) -> str:
    """A GGUF file of metadata only: ``fields`` with ``changes`` (dots as __) and no tensors."""
    merged = {**fields, **{k.replace("__", "."): v for k, v in changes.items()}}
    writer = gguf.GGUFWriter(str(path), merged.pop("general.architecture")[0])
    for name, (value, vtype, sub) in merged.items():
        if name not in drop:
            writer.add_key_value(name, value, vtype, sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def small_fields(reader: gguf.GGUFReader) -> dict[str, tuple[Any, T, T | None]]:
    """The embedded model's metadata with its vocabulary cut to the first 8000 tokens (and
    the merges among them), so that each derived file loads in well under a second."""
    fields = _fields(reader)
    tokens = fields["tokenizer.ggml.tokens"][0][:8000]
    kept = set(tokens)
    merges = [m for m in fields["tokenizer.ggml.merges"][0]
              if m.replace(" ", "", 1) in kept and all(p in kept for p in m.split(" ", 1))]
    fields["tokenizer.ggml.tokens"] = (tokens, T.ARRAY, T.STRING)
    fields["tokenizer.ggml.token_type"] = (fields["tokenizer.ggml.token_type"][0][:8000],
                                           T.ARRAY, T.INT32)
    fields["tokenizer.ggml.merges"] = (merges, T.ARRAY, T.STRING)
    return fields


@contextlib.contextmanager
def llama_vocab(path: str) -> Iterator[tuple[LlamaTokenizer, Any]]:
    """llama.cpp's tokenizer of a vocabulary-only file, through the plugin's LlamaTokenizer."""
    ll.llama_backend_init()
    params = ll.llama_model_default_params()
    params.vocab_only = True
    model = ll.llama_model_load_from_file(path.encode(), params)
    assert model, f"llama.cpp could not load {path}"
    vocab = ll.llama_model_get_vocab(model)
    ref = LlamaTokenizer(ll, vocab, ll.llama_vocab_n_tokens(vocab), frozenset())
    try:
        yield ref, vocab
    finally:
        ref.close()
        ll.llama_model_free(model)


def assert_same_as_llamacpp(path: str) -> HFTokenizer:
    tok = load_tokenizer(path)
    with llama_vocab(path) as (ref, vocab):
        assert mismatches(tok, ref) == []
        assert [i for i in range(ref.vocab_size) if tok.token_bytes(i) != ref.token_bytes(i)] \
            == []
        assert tok.info.eog_token_ids == {t for t in range(ref.vocab_size)
                                          if ll.llama_vocab_is_eog(vocab, t)}
        assert tok.info.add_bos == ll.llama_vocab_get_add_bos(vocab)
    return tok


@pytest.mark.parametrize("pre", ["smollm", "gpt-2", "llama-bpe", "qwen2", "default"])
def test_pre_tokenizers_match_llamacpp(pre: str, small_fields: dict[str, Any],
                                       tmp_path: Path) -> None:
    # Without add_bos_token in the file, llama.cpp's default for the pre-tokenizer applies
    # (true for llama-bpe).
    path = write_vocab(tmp_path / f"{pre}.gguf", small_fields,
                       drop=("tokenizer.ggml.add_bos_token",),
                       tokenizer__ggml__pre=(pre, T.STRING, None))
    tok = assert_same_as_llamacpp(path)
    assert tok.info.add_bos is (pre == "llama-bpe")


@pytest.fixture(scope="module")
def sentencepiece_file(small_fields: dict[str, Any], tok: HFTokenizer,
                       tmp_path_factory: pytest.TempPathFactory) -> str:
    """The cut vocabulary rewritten as a SentencePiece (Llama 2 style) one: <unk> <s> </s>,
    256 byte tokens, ``▁`` for spaces, scores falling with the id."""
    texts = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "<|im_end|>",
             "<tool>"]
    types = [2, 3, 3, *[6] * 256, 3, 4]
    for i, kind in enumerate(small_fields["tokenizer.ggml.token_type"][0]):
        with contextlib.suppress(UnicodeDecodeError):
            piece = tok.token_bytes(i).decode().replace(" ", "▁")
            if kind == 1 and piece and piece not in texts:
                texts.append(piece)
                types.append(1)
    scores = [-float(i) if kind == 1 else 0.0 for i, kind in enumerate(types)]
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    return write_vocab(
        path, small_fields,  # without add_space_prefix: llama.cpp's default, true
        drop=("tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.ggml.add_space_prefix"),
        tokenizer__ggml__model=("llama", T.STRING, None),
        tokenizer__ggml__tokens=(texts, T.ARRAY, T.STRING),
        tokenizer__ggml__scores=(scores, T.ARRAY, T.FLOAT32),
        tokenizer__ggml__token_type=(types, T.ARRAY, T.INT32),
        tokenizer__ggml__unknown_token_id=(0, T.UINT32, None),
        tokenizer__ggml__padding_token_id=(0, T.UINT32, None),
        tokenizer__ggml__add_bos_token=(True, T.BOOL, None))


def test_sentencepiece_vocabulary_matches_llamacpp(sentencepiece_file: str,
                                                   tmp_path: Path) -> None:
    tok = assert_same_as_llamacpp(sentencepiece_file)
    assert tok.info.add_bos and tok.info.bos_token == "<s>"
    for text in TEXTS:  # every text round-trips, behind the space llama.cpp puts first
        ids = tok.encode(text, add_special=False, parse_special=False)
        assert tok.decode(ids) == (" " + text if text else "")
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert mismatches(load_tokenizer(tmp_path), tok) == []
    assert [(t, s, p) for t, s, p in CASES if tok.encode(t, add_special=s, parse_special=p)
            != hf.encode(t, add_special_tokens=s, split_special_tokens=not p)] == []


def test_unsupported_vocabularies_are_named(small_fields: dict[str, Any],
                                            tmp_path: Path) -> None:
    path = write_vocab(tmp_path / "tekken.gguf", small_fields,
                       tokenizer__ggml__pre=("tekken", T.STRING, None))
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'tekken' is not supported"):
        load_tokenizer(path)
    path = write_vocab(tmp_path / "bert.gguf", small_fields,
                       tokenizer__ggml__model=("bert", T.STRING, None))
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'bert' is not supported"):
        load_tokenizer(path)
    with pytest.raises(ValueError, match="neither a GGUF file nor a folder"):
        load_tokenizer(__file__)
