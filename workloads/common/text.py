"""The one text cleaning of the kit: workloads.data applies it before tokenizing and
workloads.embed before embedding, so both keep, and both discard, the same documents."""

from __future__ import annotations


def clean_text(text: str | bytes | None) -> str:
    """A document's text: bytes decoded as UTF-8, newlines as "\\n", stray undecodable bytes
    dropped, blank lines at either end removed. "" when nothing usable is left: None, only
    whitespace, or bytes that are not UTF-8 text."""
    if text is None:
        return ""   # a null JSON / Parquet cell: no document, not the word "None"
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
        # A stray bad byte is dropped below; a document with more than 1% undecodable bytes
        # (or NULs) is not UTF-8 at all (latin-1, UTF-16, binary): discarded whole, instead of
        # training on or embedding its mangled remains.
        if text.count("\ufffd") > max(1, len(text) // 100) or "\x00" in text:
            return ""
    text = str(text).replace("\r\n", "\n").replace("\r", "\n").replace("\ufffd", "")
    # Only blank lines go: the first line's indentation is part of the document (code).
    text = text.strip("\n")
    return text if text.strip() else ""
