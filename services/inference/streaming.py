"""Incremental detokenisation for streamed completions.

A streamed reply must reassemble to exactly the text a non-streamed request returns. Two things can
break that if tokens are detokenised one at a time: a token that ends in the middle of a UTF-8
character (byte-level BPE) decodes to U+FFFD until the next token completes it, and a stop string is
cut from the final text, so text that turns out to be the start of a stop string must not have been
sent yet. :class:`IncrementalText` decodes the whole output each time, sends only text that can no
longer change: never text from a complete stop string on, and never the last
``len(longest stop string) - 1`` characters (a stop string may be starting there) until the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class IncrementalText:
    """Turns a growing list of token ids into text deltas.

    Args:
        decode: detokenises a list of ids (special tokens handled as the request asks).
        stop_strings: the request's stop strings (text from where one starts is never sent).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop_strings: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stops = [s for s in stop_strings if s]
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = []
        self.sent = ""

    def push(self, token_id: int) -> str:
        """Add one sampled token; returns the text that is now safe to send (possibly empty)."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""  # an incomplete character, or a decode that rewrote earlier text: wait
        # A stop string completed by this token: the final text ends before it (at the latest).
        cuts = [i for i in (text.find(stop) for stop in self._stops) if i >= 0]
        if cuts:
            text = text[: min(cuts)]
        safe = len(text) - self._holdback
        if safe <= len(self.sent):
            return ""
        delta = text[len(self.sent) : safe]
        self.sent += delta
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the non-streamed answer's text) after what was sent."""
        if not final_text.startswith(self.sent):
            # Cannot happen with the hold-back above; never send text twice if it somehow does.
            return ""
        delta = final_text[len(self.sent) :]
        self.sent = final_text
        return delta
