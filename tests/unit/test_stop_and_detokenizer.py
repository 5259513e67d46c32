"""Stop strings across delta boundaries, and incremental detokenization with a real BPE tokenizer."""

from __future__ import annotations

import functools
import itertools
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from service.engine.detokenizer import ByteDetokenizer, IncrementalDetokenizer, fast_decoder, new_detokenizer, token_bytes
from service.engine.stop import StopStringMatcher

# ---- stop strings ---------------------------------------------------------------------------


def run_stop(stops: tuple[str, ...], deltas: list[str]) -> tuple[list[str], str | None]:
    """Feed deltas until a stop matches; the emitted pieces and the match (flushed if none)."""
    matcher = StopStringMatcher(stops)
    emitted: list[str] = []
    for delta in deltas:
        text, matched = matcher.feed(delta)
        emitted.append(text)
        if matched is not None:
            return emitted, matched
    emitted.append(matcher.flush())
    return emitted, None


def test_stop_split_across_many_deltas() -> None:
    emitted, matched = run_stop(("abc",), ["xy", "a", "b", "c", "never"])
    assert matched == "abc"
    assert emitted == ["xy", "", "", ""]  # "a" and "ab" held back, the stop itself never emitted


def test_text_before_the_stop_is_emitted_exactly() -> None:
    emitted, matched = run_stop(("STOP",), ["Hello, wor", "ld!ST", "OP and more"])
    assert (emitted, matched) == (["Hello, wor", "ld!", ""], "STOP")
    matcher = StopStringMatcher(("\n\n",))
    assert matcher.feed("one\n\ntwo") == ("one", "\n\n")


def test_held_text_is_released_when_it_is_not_a_stop() -> None:
    matcher = StopStringMatcher(("abc",))
    assert matcher.feed("xab") == ("x", None)
    assert matcher.feed("d") == ("abd", None)
    assert matcher.feed("a") == ("", None)
    assert matcher.flush() == "a"  # finished for another reason: the held text was plain text
    assert matcher.flush() == ""


def test_overlapping_stops_the_first_to_complete_wins() -> None:
    assert run_stop(("abd", "abc"), ["ab", "c"]) == (["", ""], "abc")
    assert run_stop(("bcd", "abce"), ["xabc", "d"]) == (["x", "a"], "bcd")
    assert run_stop(("lo w", "hello"), ["hello world"]) == ([""], "hello")
    # The same text split differently matches the same stop at the same place.
    assert run_stop(("abcd", "bc"), ["abcd"]) == (["a"], "bc")
    assert run_stop(("abcd", "bc"), ["ab", "cd"]) == (["", "a"], "bc")
    # At one end position the earlier start (the longer stop) wins.
    assert run_stop(("bc", "abc"), ["abc"]) == ([""], "abc")


def test_multibyte_characters_in_stops_and_text() -> None:
    emitted, matched = run_stop(("語🙂",), ["日本", "語", "🙂!"])
    assert (emitted, matched) == (["日本", "", ""], "語🙂")
    emitted, matched = run_stop(("語🙂",), ["日本", "語", "!"])
    assert ("".join(emitted), matched) == ("日本語!", None)


def test_sixteen_long_stops_cost_memory_in_proportion_to_their_length() -> None:
    stops = tuple(f"{i:02d}" + "x" * 254 for i in range(16))  # the defaults' worst case: 16 x 256 bytes
    tracemalloc.start()
    try:
        matcher = StopStringMatcher(stops)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 50_000, f"{peak} bytes for {sum(map(len, stops))} bytes of stop strings"
    text, matched = matcher.feed("ab07" + "x" * 100)
    assert (text, matched) == ("ab", None)  # "07xxx..." may still become a stop: held back
    assert matcher.feed("x" * 154) == ("", stops[7])


def test_without_stops_everything_passes_through() -> None:
    matcher = StopStringMatcher(())
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.flush() == ""


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abc日🙂", max_size=30),
       stops=st.lists(st.text(alphabet="abc日🙂", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_matching_does_not_depend_on_how_text_is_split(text: str, stops: list[str],
                                                           cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    whole_emitted, whole_match = run_stop(tuple(stops), [text])
    split_emitted, split_match = run_stop(tuple(stops), deltas)
    assert "".join(split_emitted) == "".join(whole_emitted)
    assert split_match == whole_match
    if whole_match is None:
        assert "".join(whole_emitted) == text
    else:
        out = "".join(whole_emitted)
        assert text.startswith(out + whole_match)
        assert not any(s in out + whole_match[:-1] for s in stops)  # nothing completed earlier


# ---- incremental detokenization -------------------------------------------------------------

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "日本語🙂 と English mixed text, émigré café naïve",
    "stop strings across token boundaries need care",
]


@functools.cache
def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE (the GPT-2 / Llama-3 scheme): any id sequence is valid input, and
    multi-byte characters are split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def stream(tokenizer: PreTrainedTokenizerFast, prompt: list[int], ids: list[int],
           step: int = 1, detok: IncrementalDetokenizer | ByteDetokenizer | None = None) -> list[str]:
    """Deltas from add() in chunks of `step` tokens, then the final flush() as the last element."""
    detok = detok if detok is not None else IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    return [*deltas, detok.flush()]


def test_multibyte_character_is_emitted_only_when_complete() -> None:
    tokenizer = byte_level_tokenizer()
    text = "日本語🙂 hello"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # characters really are split
    deltas = stream(tokenizer, tokenizer.encode("prompt: "), ids)
    assert "".join(deltas) == text
    # After k tokens exactly the complete characters of their bytes are out: no later, no sooner.
    for k in range(len(ids) + 1):
        assert "".join(deltas[:k]) == tokenizer.decode(ids[:k]).rstrip("\ufffd")


def test_emoji_split_over_byte_tokens_waits_for_its_last_byte() -> None:
    tokenizer = byte_level_tokenizer()
    byte_ids = [tokenizer.convert_tokens_to_ids(_byte_token(b)) for b in "🙂".encode()]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add([i]) for i in byte_ids] == ["", "", "", "🙂"]
    assert detok.flush() == ""


def _byte_token(byte: int) -> str:
    """The byte-level alphabet's printable stand-in for one raw byte (GPT-2 bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    if byte in printable:
        return chr(byte)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(byte))


def test_incomplete_character_at_finish_is_flushed_as_replacement() -> None:
    tokenizer = byte_level_tokenizer()
    first_two = [tokenizer.convert_tokens_to_ids(_byte_token(b)) for b in "🙂".encode()[:2]]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.add(first_two) == ""
    assert detok.flush() == tokenizer.decode(first_two) == "\ufffd"


@settings(max_examples=150, deadline=None)
@given(prompt=st.lists(st.integers(0, 319), max_size=8),
       ids=st.lists(st.integers(0, 319), max_size=40),
       step=st.integers(1, 3))
def test_random_ids_stream_to_exactly_the_decoded_text(prompt: list[int], ids: list[int], step: int) -> None:
    tokenizer = byte_level_tokenizer()
    deltas = stream(tokenizer, prompt, ids, step)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == expected
    # Every emitted prefix is final: a U+FFFD that a later token would turn into a character is
    # never emitted; one that stays in the text is a byte sequence the model made invalid.
    emitted = ""
    for delta in deltas[:-1]:
        emitted += delta
        assert expected.startswith(emitted)


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab ,日本語🙂éç\n")), max_size=30),
       prompt_text=st.text(alphabet=st.sampled_from(list("xy 日🙂")), max_size=6))
def test_valid_text_streams_without_replacement_characters(text: str, prompt_text: str) -> None:
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode(text)
    deltas = stream(tokenizer, tokenizer.encode(prompt_text), ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[-1] == ""  # nothing was left for the flush
    for k in range(len(ids) + 1):
        assert "".join(deltas[:k]) == tokenizer.decode(ids[:k]).rstrip("\ufffd")


def test_special_tokens_are_skipped() -> None:
    tokenizer = byte_level_tokenizer()
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("hello") + [eos]
    assert "".join(stream(tokenizer, [eos], ids)) == "hello"


def test_leading_space_of_the_first_completion_token_is_kept() -> None:
    """SentencePiece-style decoders drop the space of a sequence's first token ("▁Paris" alone
    decodes to "Paris"); after a prompt the completion reads " Paris", and so must the stream."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<eos>"], show_progress=False)
    tok.train_from_iterator(["The capital of France is Paris", "hello world again and again"] * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    prompt, completion = tokenizer.encode("The capital of France is"), tokenizer.encode(" Paris again")
    assert tokenizer.decode(completion) == "Paris again"
    assert stream(tokenizer, prompt, completion) == [" Paris", " again", ""]


class RecordingTokenizer:
    """Forwards decode() and records the longest id list it was asked to decode."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, ids: list[int], **kwargs: object) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("length", [200, 2000])
def test_cost_per_token_does_not_grow_with_length(length: int) -> None:
    tokenizer = byte_level_tokenizer()
    recording = RecordingTokenizer(tokenizer)
    ids = (tokenizer.encode("the quick brown fox 日本語🙂 ") * length)[:length]
    detok = IncrementalDetokenizer(recording, tokenizer.encode("a prompt"))
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == tokenizer.decode(ids)
    assert recording.longest <= 8  # the last emitted chunk plus the tokens not yet emitted


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.integers(0, 319), max_size=8),
       ids=st.lists(st.integers(0, 319), max_size=40) | st.text(alphabet=st.sampled_from(list("ab ,日本語🙂é\n")),
                                                                max_size=30).map(lambda t: byte_level_tokenizer().encode(t)),
       step=st.integers(1, 3))
def test_byte_level_deltas_are_those_of_decoding_windows(prompt: list[int], ids: list[int], step: int) -> None:
    """A byte-level tokenizer's streams decode the bytes not yet emitted, with no context: the deltas
    are those of decoding windows of ids with the prompt's last tokens as context."""
    tokenizer = byte_level_tokenizer()
    assert isinstance(new_detokenizer(tokenizer, prompt), ByteDetokenizer)
    by_bytes = stream(tokenizer, prompt, ids, step, ByteDetokenizer(token_bytes(tokenizer)))
    assert by_bytes == stream(tokenizer, prompt, ids, step)


def test_token_bytes_are_what_the_rust_decoder_decodes() -> None:
    """Every token of the tokenizer, special ones (skipped) and an id outside the vocabulary too."""
    tokenizer = byte_level_tokenizer()
    table, backend = token_bytes(tokenizer), tokenizer.backend_tokenizer
    for i in range(len(tokenizer) + 1):
        assert table[i].decode("utf-8", "replace") == backend.decode([i], skip_special_tokens=True), i
    assert table[tokenizer.eos_token_id] == b""


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 319), max_size=12))
def test_fast_decoder_reads_the_rust_tokenizer_and_agrees_with_decode(ids: list[int]) -> None:
    tokenizer = byte_level_tokenizer()
    decode = fast_decoder(tokenizer)
    assert decode.__name__ == "direct"  # the Rust tokenizer, not the Python wrapper
    assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
