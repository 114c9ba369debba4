"""The one text cleaning (workloads/common/text.py), and workloads.data and workloads.embed
keeping and discarding documents by it alike. Before they shared it, embed embedded text that
data discarded as not UTF-8; each case below where they differed says what each did."""

from __future__ import annotations

import numpy as np
import pytest

from workloads.common.text import clean_text

LATIN1 = "Cr\u00e8me br\u00fbl\u00e9e, caf\u00e9 cr\u00e8me"

# name: (input, what data and embed both take as the document; "" = discarded)
CASES = {
    # The same before: UTF-8 bytes (a text file) and a plain string (JSON Lines, Parquet).
    "utf8-bytes": (LATIN1.encode(), LATIN1),
    "string": ("a sentence", "a sentence"),
    # data discarded it; embed embedded "Cr\ufffdme br\ufffdl\ufffde, ...".
    "latin-1": (LATIN1.encode("latin-1"), ""),
    # data discarded it; embed embedded "\ufffd\ufffdh\x00e\x00l\x00...".
    "utf-16": ("hello, world".encode("utf-16"), ""),
    # data discarded it; embed embedded the bytes, NULs and all.
    "binary": (b"\x7fELF\x02\x01\x01\x00\x00\x00" + b"x" * 200, ""),
    # One bad byte in UTF-8 text: data dropped it; embed kept the "\ufffd".
    "stray-bad-byte": (b"caf\xe9 au lait" + b", and more" * 20,
                       "caf au lait" + ", and more" * 20),
    "replacement-char": ("caf\ufffd au lait", "caf au lait"),   # likewise
    # data: "\n" newlines; embed kept the "\r"s.
    "crlf": (b"line one\r\nline two\rline three\r\n", "line one\nline two\nline three"),
    # data trained on the word "None"; embed had no document (as both do now).
    "null": (None, ""),
    # data kept the first line's indentation (code) and trailing spaces; embed stripped them
    # (all-MiniLM-L6-v2's tokenizer reads the same word pieces either way).
    "indented": ("\n\n    def f():\n        return 1  \n\n", "    def f():\n        return 1  "),
    # data kept it at --min-chars 0; embed had no document (as both do now).
    "whitespace": (" \t\n \r\n", ""),
}


@pytest.mark.parametrize("raw,cleaned", CASES.values(), ids=list(CASES))
def test_clean_text(raw, cleaned):
    assert clean_text(raw) == cleaned


def test_more_than_one_bad_byte_in_a_hundred_discards_the_document():
    # 300 characters: up to 3 undecodable bytes are strays, dropped; 4 say it is not UTF-8.
    assert clean_text(b"\xe9" * 3 + b"a" * 297) == "a" * 297
    assert clean_text(b"\xe9" * 4 + b"a" * 296) == ""
    # A short document may hold one stray, never two.
    assert clean_text(b"\xe9ok") == "ok"
    assert clean_text(b"\xe9\xe9ok") == ""
    # A NUL is never text, however long the rest.
    assert clean_text(b"a" * 10_000 + b"\x00") == ""


def test_data_keeps_each_document_as_the_cleaning_leaves_it():
    from workloads.data.pipeline import clean_batch

    raws = [raw for raw, _ in CASES.values()]
    # As Ray Data hands the stage a block; --min-chars 0 still drops a discarded document.
    kept = clean_batch({"text": np.array(raws, dtype=object)}, min_chars=0)["text"]
    assert kept.tolist() == [text + "\n" for _, text in CASES.values() if text]
    # What data drops on top, for training only: short documents and minified lines.
    kept = clean_batch({"text": np.array(["short", "x" * 1001, "long enough"], dtype=object)},
                       min_chars=6)["text"]
    assert kept.tolist() == ["long enough\n"]


def test_embed_keeps_each_document_as_the_cleaning_leaves_it():
    from workloads.embed.pipeline import MAX_TEXT_CHARS, clean

    for i, (raw, text) in enumerate(CASES.values()):
        assert clean({"id": i, "text": raw}) == {"id": str(i), "text": text}
    # Cut after cleaning, to what the model reads.
    row = clean({"id": "a.txt", "text": b"\r\n" + b"word " * 1000})
    assert row == {"id": "a.txt", "text": ("word " * 1000)[:MAX_TEXT_CHARS]}
