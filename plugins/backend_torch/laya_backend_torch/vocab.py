"""A GGUF's or a Hugging Face folder's vocabulary as a ``tokenizers.Tokenizer``, with what
llama.cpp's load rules say about its tokens; tokenizer.py's ``HFTokenizer`` runs it.

The vocabulary comes from a GGUF file (``tokenizer.ggml.*``) or a Hugging Face folder
(tokenizer.json). A GGUF vocabulary becomes a ``tokenizers`` BPE with the pre-tokenizer
llama.cpp uses for its ``tokenizer.ggml.pre`` (llama-vocab.cpp's regexes, each an isolating
``Split``, applied one after another as unicode.cpp does), so a file gives the same ids under
both backends. Which tokens are special, end generation or render as nothing follows
llama.cpp's load rules, not only the file's token types: ``<reponame>`` ends generation
because llama.cpp takes it for the FIM-repo token.

Known difference from llama.cpp: characters new in Unicode 16 (Garay digits U+10D40..49,
Balinese U+1B4E..4F) have a category in llama.cpp's tables and none in Oniguruma's, so the
regexes split them differently. Every other code point, in context, gave llama.cpp's ids
under smollm, gpt-2, llama-bpe, qwen2 and default (checked on the embedded vocabulary).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

# llama.cpp's token types (enum llama_token_type; GGUF tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_SPECIAL_KINDS = (UNKNOWN, CONTROL, USER_DEFINED)  # what llama.cpp partitions out of the text

# unicode.cpp's regexes, as llama-vocab.cpp lists them per pre-tokenizer.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")


@attrs.frozen
class _Pre:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is a whole token skips the merges (Llama 3)
    add_bos: bool = False  # llama.cpp's default when the file does not say


_PRE_GROUPS: list[tuple[tuple[str, ...], _Pre]] = [
    (("default",), _Pre(_DEFAULT)),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     _Pre((r"\p{N}", _GPT2))),  # digits one by one, then GPT-2
    (("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "exaone4", "granite-docling"),
     _Pre((_GPT2,))),
    (("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
      "lfm2"), _Pre((_LLAMA3,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"), _Pre((_LLAMA3,))),
    (("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "solar-open", "kormo"),
     _Pre((_QWEN2,))),
]
PRE_TOKENIZERS: dict[str, _Pre] = {name: pre for names, pre in _PRE_GROUPS for name in names}

# Texts llama.cpp marks control and end-of-generation whatever the file says (llama-vocab.cpp,
# "maintain a list of tokens that cause end-of-generation").
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
# FIM tokens found by text when the file names none: pad, repo and file separator end
# generation; prefix, suffix and middle only become control tokens.
_FIM_TEXTS = {
    "pad": "<|fim_pad|> <fim-pad> <fim_pad> <PAD> [PAD]".split(),
    "rep": "<|fim_repo|> <|repo_name|> <fim-repo> <REPO> <reponame>".split(),
    "sep": ["<|file_sep|>"],
    **{role: f"<|fim_{word}|> <fim-{word}> <fim_{word}> <｜fim▁{ds}｜> <{up}> ▁<{up}> "
       f"<|code_{word}|> <|{word}|>".split() for role, word, ds, up in (
           ("pre", "prefix", "begin", "PRE"), ("suf", "suffix", "hole", "SUF"),
           ("mid", "middle", "end", "MID"))},
}
_ALWAYS_USER_DEFINED = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


# GPT-2's byte-to-unicode table, reversed: printable bytes stand for themselves, the other 68
# for U+0100 onwards.
_KEPT = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
BYTE_OF_CHAR = {chr(b): b for b in _KEPT} | {
    chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in _KEPT)}


@attrs.frozen
class TokenizerInfo:
    """What the backend needs to know about the vocabulary (ModelInfo's tokenizer fields).

    ``eog_token_ids``: tokens that end generation as llama.cpp decides them (eos, eot, eom,
    FIM pad/repo/separator and control tokens such as ``<|im_end|>``). ``special_tokens``: the
    control, user-defined and unknown texts that ``encode(..., parse_special=True)`` matches.
    """

    bos_id: int | None
    eos_id: int | None
    bos_token: str  # "" where the vocabulary has none
    eos_token: str
    eog_token_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    special_tokens: frozenset[str]
    chat_template: str | None


@attrs.frozen
class Vocabulary:
    """A built tokenizer and what ``HFTokenizer`` needs besides: ``texts[i]`` is token i's
    text as the vocabulary stores it, ``kinds[i]`` its llama.cpp token type after llama.cpp's
    load rules, ``byte_level`` whether the texts are GPT-2 byte-level (else SentencePiece)."""

    hf: tokenizers.Tokenizer
    info: TokenizerInfo
    texts: Sequence[str]
    kinds: bytes
    byte_level: bool


def read_vocabulary(path: Path) -> Vocabulary:
    """The vocabulary of a GGUF file (its metadata, read by gguf_checkpoint.read_metadata) or
    of a Hugging Face model folder (tokenizer.json)."""
    if path.is_dir():
        return _from_hf_dir(path)
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is neither a GGUF file nor a folder with tokenizer.json")
    from laya_backend_torch.checkpoint import CheckpointError
    from laya_backend_torch.gguf_checkpoint import read_metadata

    try:
        meta = read_metadata(path)
    except CheckpointError as e:
        raise ValueError(str(e)) from None
    return _from_gguf(path, meta)


def _apply_llama_rules(texts: Sequence[str], kinds: bytearray,
                       named: dict[str, int | None]) -> frozenset[int]:
    """llama.cpp's load rules: FIM and end-of-generation tokens found by their text become
    control tokens; returns the end-of-generation set. ``named``: ids the file gave (eos, eot,
    eom, fim_*); a FIM id the file left out is looked up by text (the lowest id that fits)."""
    index = {t: i for i, t in enumerate(texts)}
    for role, candidates in _FIM_TEXTS.items():
        found = [index[t] for t in candidates if t in index]
        if named.get(f"fim_{role}") is None and found:
            named[f"fim_{role}"] = min(found)
            kinds[min(found)] = CONTROL
    eog = {i for k in ("fim_pad", "fim_rep", "fim_sep") if (i := named.get(k)) is not None}
    for text in _EOG_TEXTS & index.keys():
        eog.add(index[text])
        kinds[index[text]] = CONTROL
    for text in _ALWAYS_USER_DEFINED & index.keys():
        kinds[index[text]] = USER_DEFINED  # gpt-oss: always rendered
    eog |= {i for k in ("eos", "eot", "eom") if (i := named.get(k)) is not None}
    eog_texts = {texts[i]: i for i in eog}
    has_call = "<|call|>" in eog_texts or "<|calls|>" in eog_texts
    if "<|end|>" in eog_texts and has_call and ({"<|return|>", "<|flush|>"} & eog_texts.keys()):
        eog.discard(end := eog_texts["<|end|>"])  # o200k_harmony, solar-open
        kinds[end] = USER_DEFINED
    return frozenset(eog)


def _from_gguf(path: Path, meta: dict[str, Any]) -> Vocabulary:
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{path} has no tokenizer.ggml.tokens: no vocabulary to load")
    # llama.cpp reads each text as a C string and names the empty ones.
    texts = [t.partition("\0")[0] or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(texts)
    kinds = bytearray(t if NORMAL <= t <= BYTE else 0 for t in types)
    pre_name = meta.get("tokenizer.ggml.pre") or "default"
    if model == "gpt2":
        pre = PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            raise ValueError(f"{path}: tokenizer.ggml.pre {pre_name!r} is not supported by the "
                             f"torch backend's tokenizer; known: {', '.join(PRE_TOKENIZERS)}")
        # "a b" at the first space after the first character, as llama.cpp splits them.
        merges = [(m[:i], m[i + 1:]) for m in meta.get("tokenizer.ggml.merges", [])
                  if (i := m.find(" ", 1)) > 0]
        hf = _byte_level_bpe(texts, merges, pre)
        defaults, add_bos = {"bos": 11, "eos": 11}, pre.add_bos
    elif model == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(texts)
        prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        hf = _sentencepiece_bpe(texts, kinds, scores, add_space_prefix=bool(prefix))
        defaults, add_bos = {"bos": 1, "eos": 2}, True
    else:
        raise ValueError(f"{path}: tokenizer.ggml.model {model!r} is not supported by the torch "
                         "backend's tokenizer (it reads 'gpt2' and 'llama' vocabularies)")
    named: dict[str, int | None] = {}
    for key in ["bos", "eos", "eot", "eom", *(f"fim_{role}" for role in _FIM_TEXTS)]:
        value = meta.get(f"tokenizer.ggml.{key}_token_id", defaults.get(key))
        named[key] = value if value is not None and 0 <= value < len(texts) else None
    eog = _apply_llama_rules(texts, kinds, named)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    info = _finish(hf, texts, kinds, named["bos"], named["eos"], eog, add_bos, add_eos,
                   meta.get("tokenizer.chat_template"))
    return Vocabulary(hf, info, texts, bytes(kinds), byte_level=model == "gpt2")


def _byte_level_bpe(texts: Sequence[str], merges: list[Any], pre: _Pre) -> tokenizers.Tokenizer:
    vocab = {t: i for i, t in enumerate(texts)}
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                         ignore_merges=pre.ignore_merges))
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    # A byte with no token (SmolLM has none for 0x04 or 0xF2) stays in llama.cpp's word as a
    # symbol that merges with nothing and yields no id; BPE here would drop it first and merge
    # its neighbours. Cutting the word there and dropping the byte is what llama.cpp does.
    missing = "".join(f"\\x{{{ord(c):X}}}" for c in BYTE_OF_CHAR if c not in vocab)
    if missing:
        steps.append(pre_tokenizers.Split(Regex(f"[{missing}]"), behavior="removed"))
    hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
    hf.decoder = decoders.ByteLevel()
    return hf


def _sentencepiece_bpe(texts: Sequence[str], kinds: bytes | bytearray, scores: Sequence[float],
                       *, add_space_prefix: bool) -> tokenizers.Tokenizer:
    """llama.cpp's SPM tokenizer as a BPE: merging any two symbols whose concatenation is a
    token, highest score first, is BPE with merges ranked by the merged token's score."""
    vocab = {t: i for i, t in enumerate(texts)}
    ranked = sorted(((-scores[i], i, t[:k], t[k:]) for i, t in enumerate(texts)
                     if kinds[i] != BYTE for k in range(1, len(t))
                     if t[:k] in vocab and t[k:] in vocab))
    unk = next((t for t, k in zip(texts, kinds, strict=True) if k == UNKNOWN), None)
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked],
                                         unk_token=unk, fuse_unk=True, byte_fallback=True))
    # The prefix space goes before every piece between special tokens, as llama.cpp adds it.
    spaces = normalizers.Replace(" ", "▁")
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) \
        if add_space_prefix else spaces
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    hf.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] * add_space_prefix)
    return hf


def _finish(hf: tokenizers.Tokenizer, texts: Sequence[str], kinds: bytes | bytearray,
            bos: int | None, eos: int | None, eog: frozenset[int], add_bos: bool,
            add_eos: bool, chat_template: str | None, *, bos_eos_template: bool = True,
            ) -> TokenizerInfo:
    """Registers the special tokens not yet added and (``bos_eos_template``) the BOS/EOS
    post-processor; the metadata."""
    added = {t.content for t in hf.get_added_tokens_decoder().values()}
    new = [(t, k) for t, k in zip(texts, kinds, strict=True) if t not in added]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, k in new if k in (UNKNOWN, CONTROL)])
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, k in new if k == USER_DEFINED])
    for flag, tid, what in ((add_bos, bos, "bos"), (add_eos, eos, "eos")):
        if flag and tid is None:
            raise ValueError(f"the tokenizer adds a {what.upper()} token but names none "
                             f"(add_{what}_token is true, {what}_token_id is missing)")
    named = {texts[i]: i for i in (bos, eos) if i is not None}
    single = ["$A"]
    if add_bos and bos is not None:
        single.insert(0, texts[bos])
    if add_eos and eos is not None:
        single.append(texts[eos])
    if bos_eos_template:
        hf.post_processor = processors.TemplateProcessing(
            single=single, pair=single + [s if s != "$A" else "$B:1" for s in single],
            special_tokens=list(named.items())) if len(single) > 1 else None
    return TokenizerInfo(
        bos_id=bos, eos_id=eos, bos_token=texts[bos] if bos is not None else "",
        eos_token=texts[eos] if eos is not None else "", eog_token_ids=eog,
        add_bos=add_bos, add_eos=add_eos, chat_template=chat_template,
        special_tokens=frozenset(t for t, k in zip(texts, kinds, strict=True)
                                 if k in _SPECIAL_KINDS and t))


def _from_hf_dir(path: Path) -> Vocabulary:
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"{path} has no tokenizer.json (the torch backend reads the fast "
                         "tokenizer's file, not a SentencePiece tokenizer.model)")
    hf = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    spec = json.loads(hf.to_str())
    config = _read_json(path / "tokenizer_config.json")
    decoder = json.dumps(spec.get("decoder"))
    byte_level = '"ByteLevel"' in decoder
    byte_fallback = bool(spec["model"].get("byte_fallback"))
    if not (byte_level or byte_fallback or "▁" in decoder or '"Metaspace"' in decoder):
        raise ValueError(f"{path}/tokenizer.json: neither a byte-level nor a SentencePiece "
                         "vocabulary; the torch backend cannot tell the bytes of its tokens")
    vocab = hf.get_vocab(with_added_tokens=True)
    texts = [f"[PAD{i}]" for i in range(max(vocab.values()) + 1)]  # ids nothing names
    kinds = bytearray([NORMAL]) * len(texts)
    for text, i in vocab.items():
        texts[i] = text
        if byte_fallback and _BYTE_TOKEN.fullmatch(text):
            kinds[i] = BYTE
    for i, token in hf.get_added_tokens_decoder().items():
        kinds[i] = CONTROL if token.special else USER_DEFINED
    # bos/eos: a string or a serialized AddedToken.
    bos, eos = (hf.token_to_id(t.get("content", "") if isinstance(t, dict) else t or "")
                for t in (config.get("bos_token"), config.get("eos_token")))
    # generation_config.json's eos_token_id (one or a list) is what HF stops on.
    stops = _read_json(path / "generation_config.json").get("eos_token_id")
    eog = _apply_llama_rules(texts, kinds, {"eos": eos})
    eog |= {s for s in (stops if isinstance(stops, list) else [stops]) if isinstance(s, int)}
    # transformers rebuilds the post-processor from these flags; so does _finish.
    flags = "add_bos_token" in config or "add_eos_token" in config
    if flags:
        add_bos, add_eos = bool(config.get("add_bos_token")), bool(config.get("add_eos_token"))
    else:  # what the file's post-processor adds
        added = hf.encode("", add_special_tokens=True).ids
        add_bos = added[:1] == [bos]
        add_eos = added[add_bos:][-1:] == [eos]
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    info = _finish(hf, texts, kinds, bos, eos, eog, add_bos, add_eos, template,
                   bos_eos_template=flags)
    return Vocabulary(hf, info, texts, bytes(kinds), byte_level=byte_level)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
