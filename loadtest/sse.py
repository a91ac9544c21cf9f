"""Incremental Server-Sent Events parsing for OpenAI-style streams.

Network reads split events anywhere (mid-line, mid-CRLF, between the two
newlines that end an event), so bytes are buffered until a blank line ends
an event. Only `data:` fields matter for OpenAI streams; comments (`:` lines,
often keep-alive pings) and other fields are skipped. Multi-line data joins
with newlines, as the SSE spec says.
A UTF-8 character split across two reads is decoded once both halves are in.
"""

import codecs


class SSEParser:
    """Feed raw bytes, get the data payload of each completed event."""

    def __init__(self) -> None:
        self._buffer = ""
        self._data: list[str] = []
        self._pending_cr = False
        self._decoder = codecs.getincrementaldecoder("utf-8")()

    def feed(self, chunk: bytes | str) -> list[str]:
        text = self._decoder.decode(chunk) if isinstance(chunk, bytes) else chunk
        if self._pending_cr and text.startswith("\n"):
            # The CR that ended the previous read was the first half of a CRLF.
            text = text[1:]
        self._pending_cr = text.endswith("\r")
        self._buffer += text
        events: list[str] = []
        while True:
            line, sep, rest = _split_line(self._buffer)
            if not sep:
                break
            self._buffer = rest
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            if name == "data":
                self._data.append(value[1:] if value.startswith(" ") else value)
        return events

    def close(self) -> list[str]:
        """End of stream: an event not followed by a blank line still counts."""
        events = self.feed("\n\n") if (self._buffer or self._data) else []
        return events


def _split_line(buffer: str) -> tuple[str, str, str]:
    """First line of `buffer` and the rest; lines end with CRLF, LF or CR."""
    for index, char in enumerate(buffer):
        if char == "\n":
            return buffer[:index], "\n", buffer[index + 1 :]
        if char == "\r":
            if index + 1 < len(buffer) and buffer[index + 1] == "\n":
                return buffer[:index], "\r\n", buffer[index + 2 :]
            return buffer[:index], "\r", buffer[index + 1 :]
    return buffer, "", ""
