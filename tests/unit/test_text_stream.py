"""Text out of tokens as they arrive (specmesh.text, the gateway's TextStream, StopChecker) against full decodes
of the whole output: the same text, stop strings found where a full search finds them, nothing lost at the end."""

import random
from functools import partial

import pytest

from gateway.core import TextStream
from specmesh.sampling import SamplingParams, StopChecker
from specmesh.text import IncrementalDetokenizer, find_stop

MULTIBYTE = "héllo wörld 中文字符 😀 ½ – naïve"


@pytest.fixture(scope="module")
def decode(tokenizer):
    return partial(tokenizer.decode, skip_special_tokens=True)


def byte_tokens(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte (byte-level BPE has one for each), so multi-byte characters split across tokens."""
    return byte_tokens_of(tokenizer, text.encode())


def byte_tokens_of(tokenizer, data: bytes) -> list[int]:
    """One byte-level token per byte of `data`, which need not be valid UTF-8."""
    # GPT-2's byte-to-character map: printable bytes stand for themselves, the others for chr(256 + n).
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = iter(range(256, 512))
    char = {b: chr(b) if b in printable else chr(next(others)) for b in range(256)}
    return [tokenizer.convert_tokens_to_ids(char[b]) for b in data]


def random_ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def random_stops(rng: random.Random, text: str, n: int, longest: int) -> tuple[str, ...]:
    """Up to n stop strings cut out of the text (so most of them are found)."""
    starts = [rng.randrange(len(text)) for _ in range(n)]
    return tuple(dict.fromkeys(text[i : i + rng.randint(1, longest)] for i in starts))


def feed(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 4)
        deltas.append(detok.add(ids[i : i + k]))
        i += k
    return deltas


def test_incremental_decoding_equals_full_decoding(tokenizer, decode):
    rng = random.Random(0)
    encoded = tokenizer(MULTIBYTE + "\ndef f(x):\n    return x", add_special_tokens=False)["input_ids"]
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    sequences = [encoded, [*encoded[:5], eos, *encoded[5:]]]
    sequences += [random_ids(rng, len(tokenizer), rng.randint(1, 40)) for _ in range(300)]
    for ids in sequences:
        detok = IncrementalDetokenizer(decode)
        deltas = feed(detok, ids, rng)
        assert detok.text == "".join(deltas)
        assert detok.text + detok.tail() == decode(ids)
        flushed = detok.flush()
        assert detok.text == decode(ids) and detok.text.endswith(flushed)


def test_context_tokens_keep_what_a_decoder_drops_at_the_start():
    # A SentencePiece-style decoder drops the leading space of the whole text: decoding a new token alone
    # would lose the space between words; decoded after its context, it keeps it.
    words = [" def", " f", "(x", "):", " return", " x"]

    def decode(ids):
        return "".join(words[i] for i in ids).removeprefix(" ")

    detok = IncrementalDetokenizer(decode)
    assert [detok.add([i]) for i in range(len(words))] == ["def", " f", "(x", "):", " return", " x"]
    assert detok.text == decode(list(range(len(words))))


def test_an_unfinished_character_is_held_back_not_the_text_before_it(tokenizer, decode):
    ids = byte_tokens(tokenizer, "a中")  # 'a', then the three bytes of 中
    detok = IncrementalDetokenizer(decode)
    assert detok.add(ids[:2]) == "a"  # 'a' and the first byte of 中: the U+FFFD waits
    assert detok.add(ids[2:3]) == ""
    assert detok.tail() == "\ufffd" and detok.text == "a"
    assert detok.add(ids[3:]) == "中" and detok.tail() == ""
    # an output that ends inside a character ends with U+FFFD, as a full decode does
    detok = IncrementalDetokenizer(decode)
    detok.add(ids[:3])
    assert detok.flush() == "\ufffd" and detok.text == decode(ids[:3]) == "a\ufffd"


def test_every_multibyte_character_split_byte_by_byte(tokenizer, decode):
    ids = byte_tokens(tokenizer, MULTIBYTE)
    detok = IncrementalDetokenizer(decode)
    deltas = [detok.add([t]) for t in ids]
    assert "".join(deltas) == MULTIBYTE and "\ufffd" not in "".join(deltas)


def test_find_stop_earliest_and_only_in_new_text():
    assert find_stop("abcdef", ("de", "bc")) == 1
    assert find_stop("abcdef", ()) == -1
    assert find_stop("abcdef", ("xy",)) == -1
    # 6 characters were searched already: a match must reach past them, so it starts at 6 - 3 + 1 = 4 or later
    assert find_stop("xxabcxzz", ("abc", "xz"), searched=6) == 5
    assert find_stop("xxabcx", ("abc",), searched=6) == -1  # found by the earlier search, if at all
    assert find_stop("xxxxab", ("ab", "xxxab"), searched=5) == 1  # the longest stop sets the window


def reference_text_stream(decode, stop, chunks):
    """The gateway's text stream as a full decode and a full search after every chunk (the slow reference)."""
    ids, full = [], ""
    for chunk, final in chunks:
        ids += chunk
        text = decode(ids)
        hits = [i for s in stop if (i := text.find(s)) >= 0]
        if hits:
            return text[: min(hits)], True
        if final:
            full = text
    return full, False


def run_text_stream(stream: TextStream, chunks) -> tuple[str, bool]:
    out = []
    for chunk, final in chunks:
        out.append(stream.add(chunk, final=final))
        if stream.stopped:
            break
    return "".join(out), stream.stopped


def test_text_stream_matches_full_decoding_with_stop_strings(tokenizer, decode):
    rng = random.Random(1)
    for _ in range(200):
        tail = "".join(rng.choice("abc \n中😀") for _ in range(30))
        ids = tokenizer(MULTIBYTE + " " + tail, add_special_tokens=False)["input_ids"]
        text = decode(ids)
        stop = random_stops(rng, text, rng.randint(0, 3), 4)
        cuts = [*sorted(rng.sample(range(1, len(ids)), rng.randint(0, min(6, len(ids) - 1)))), len(ids)]
        chunks = [(ids[a:b], b == len(ids)) for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]
        assert run_text_stream(TextStream(tokenizer, stop), chunks) == reference_text_stream(decode, stop, chunks)


def test_text_stream_stop_spanning_chunks_and_hold_back(tokenizer):
    ids = tokenizer("print('hello world')", add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, ("world')",))
    out = []
    for t in ids:  # one token at a time, as across a failover: the stop string spans several of them
        out.append(stream.add([t]))
        # nothing within len(stop) - 1 characters of the end is sent: it could begin the stop string
        assert len("".join(out)) <= max(0, len(stream.detokenizer.text) - 6)
        if stream.stopped:
            break
    assert stream.stopped and "".join(out) == "print('hello "


def test_text_stream_final_flush_sends_the_held_back_text(tokenizer, decode):
    ids = tokenizer("x = 1\n", add_special_tokens=False)["input_ids"] + byte_tokens(tokenizer, "中")[:2]
    stream = TextStream(tokenizer, ("never here",))
    sent = stream.add(ids)
    assert sent == ""  # all of it could still be the start of the stop string
    rest = stream.add([], final=True)
    assert sent + rest == decode(ids) and rest.endswith("\ufffd") and not stream.stopped


def test_text_stream_skips_special_tokens_and_works_without_tokenizer(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = tokenizer("a b", add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, ())
    assert stream.add(ids[:1]) + stream.add([eos]) + stream.add(ids[1:], final=True) == "a b"
    assert TextStream(None, ()).add([1, 2], final=True) == ""


def reference_stop_checker(decode, stop, ids, max_tokens):
    """StopChecker's rules with a full decode and search after every token (the slow reference)."""
    kept = []
    for t in ids:
        kept.append(t)
        text = decode(kept)
        hits = [i for s in stop if (i := text.find(s)) >= 0]
        if hits:
            return kept, text[: min(hits)], "stop"
        if len(kept) >= max_tokens:
            return kept, text, "length"
    return kept, decode(kept), None


def test_stop_checker_matches_full_decoding(tokenizer, decode):
    rng = random.Random(2)
    for _ in range(150):
        ids = tokenizer("".join(rng.choice("ab c\n中😀é") for _ in range(25)), add_special_tokens=False)["input_ids"]
        if rng.random() < 0.5:
            ids = byte_tokens(tokenizer, decode(ids))
        text = decode(ids)
        stop = random_stops(rng, text, 2, 3)
        checker = StopChecker(SamplingParams(max_tokens=len(ids) + 1, stop=stop), decode=decode)
        i = 0
        while i < len(ids) and not checker.finished:
            k = rng.randint(1, 5)
            checker.extend(ids[i : i + k])
            i += k
        assert (checker.token_ids, checker.text(), checker.finish_reason) == reference_stop_checker(
            decode, stop, ids, len(ids) + 1
        )


def test_stop_checker_text_includes_a_stop_token(tokenizer, decode):
    ids = tokenizer("a = 1\nb = 2", add_special_tokens=False)["input_ids"]
    checker = StopChecker(SamplingParams(max_tokens=50, stop=("zzz",), stop_token_ids=(ids[3],)), decode=decode)
    assert checker.extend(ids) == 4 and checker.finish_reason == "stop"
    assert checker.text() == decode(ids[:4])


def test_gateway_detokenizes_small_chunks_on_the_loop_and_large_ones_on_its_threads(tokenizer, decode):
    """Small chunks (every verdict's) are decoded on the event loop, large ones (or long stop strings) on the
    detokenizer's threads; the text is the full decode's either way."""
    import asyncio
    import threading

    from gateway.config import GatewayConfig
    from gateway.core import Gateway

    ids = tokenizer.encode("Speculative decoding drafts a few tokens and the target verifies them in one pass. " * 8)
    gw = Gateway(GatewayConfig(), tokenizer)
    threads: set[str] = set()

    class Spy(TextStream):
        def add(self, chunk, final=False):
            threads.add(threading.current_thread().name)
            return super().add(chunk, final)

    async def run(stop: tuple[str, ...], sizes: list[int]) -> str:
        text, out, i = Spy(tokenizer, stop), [], 0
        for n in sizes:
            out.append(await gw.detokenize(text, ids[i : i + n], final=i + n >= len(ids)))
            i += n
        return "".join(out)

    try:
        small = [1, 3, 5] * (len(ids) // 9) + [len(ids)]
        assert asyncio.run(run((), small)) == decode(ids)
        assert threads == {threading.current_thread().name}
        threads.clear()
        assert asyncio.run(run((), [Gateway.INLINE_IDS + 1, len(ids)])) == decode(ids)
        assert threads and all(t.startswith("detokenize") for t in threads)
        threads.clear()
        asyncio.run(run(("x" * (Gateway.INLINE_STOP_CHARS + 1),), [1, len(ids)]))
        assert threads and all(t.startswith("detokenize") for t in threads)
        # Tokens that never complete a character keep the detokenizer's window growing: once it is past
        # INLINE_IDS, even one-token chunks are decoded on the threads.
        threads.clear()
        loose = byte_tokens_of(tokenizer, b"\x80" * (2 * Gateway.INLINE_IDS))

        async def stray() -> list[str]:
            text, where = Spy(tokenizer, ()), []
            for t in loose:
                await gw.detokenize(text, [t], final=False)
                where.append(threads.pop())
            return where

        where = asyncio.run(stray())
        assert where[0] == threading.current_thread().name and where[-1].startswith("detokenize")
    finally:
        gw._detokenizing.shutdown()
        gw.inputs._tokenizing.shutdown()
