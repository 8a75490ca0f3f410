"""Control-token texts inside a chat prompt: which the template wrote, which a user typed.

A user who types ``<|im_start|>system`` in a message must get those characters, not the
control token (llama-server's rule for message content); the template's own markers must
become tokens. ``SpecialTexts.mark`` runs on each message's content before rendering and
``split`` on the rendered prompt (moeswap.tokenizer.Tokenizer.protect / encode_rendered).
"""

from __future__ import annotations

import re


class SpecialTexts:
    """Finds control-token texts in a string, each marked or not by ``MARK`` before it.

    ``mark`` puts MARK before every control-token text of a message's content (and doubles a
    MARK already there, so no text of the user's is lost); ``split`` cuts a rendered prompt at
    the unmarked ones (the template's own) and gives the text between them with the marks
    undone. Found by first character and length, not one regex of alternatives: a vocabulary
    can have thousands of control tokens.
    """

    MARK = "\ue000"  # a private-use character: no template writes one

    def __init__(self, ids: dict[str, int]):
        self.ids = ids
        self.lengths: dict[str, list[int]] = {}
        for text in ids:
            self.lengths.setdefault(text[0], []).append(len(text))
        for lengths in self.lengths.values():
            lengths.sort(reverse=True)  # the longest match wins, as in the tokenizer
        starts = re.escape("".join(self.lengths)) if self.lengths else ""
        self.candidates = re.compile(f"[{starts}{self.MARK}]")

    def _at(self, text: str, pos: int) -> str | None:
        for n in self.lengths.get(text[pos], ()):
            if text[pos:pos + n] in self.ids:
                return text[pos:pos + n]
        return None

    def mark(self, content: str) -> str:
        out, last, pos = [], 0, 0
        while (m := self.candidates.search(content, pos)) is not None:
            pos = m.start()
            found = self.MARK if content[pos] == self.MARK else self._at(content, pos)
            if found is not None:
                out += [content[last:pos], self.MARK]
                last = pos
            pos += len(found) if found else 1
        return "".join(out) + content[last:]

    def split(self, text: str) -> list[tuple[str, int | None]]:
        """[(text, id of the control token after it, or None at the end)]."""
        pieces, buffer, last, pos = [], [], 0, 0
        while (m := self.candidates.search(text, pos)) is not None:
            pos = m.start()
            if text[pos] == self.MARK:  # what follows is the user's text, whatever it is
                buffer.append(text[last:pos])
                marked = self._at(text, pos + 1) if pos + 1 < len(text) else None
                last, pos = pos + 1, pos + 1 + (len(marked) if marked else 1)
                continue
            special = self._at(text, pos)
            if special is None:
                pos += 1
                continue
            buffer.append(text[last:pos])
            pieces.append(("".join(buffer), self.ids[special]))
            buffer, last = [], pos + len(special)
            pos = last
        buffer.append(text[last:])
        pieces.append(("".join(buffer), None))
        return pieces
