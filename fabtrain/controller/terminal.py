"""What a node or a program wrote, made safe to show on the user's terminal.

A training program's output (and so its log lines, and any event reason that
quotes them) may hold terminal control sequences: a title change, a screen
clear, an OSC 52 write to the clipboard, a cursor move that hides a line.
`fab logs`, `fab status` and `fab watch` show such text through `visible`,
which writes every control character as a visible escape (ESC as ``\\x1b``),
as the dashboard shows HTML as text. Tabs stay tabs.
"""
from __future__ import annotations

# C0 controls but tab, DEL, and the C1 controls (U+0080-U+009F: 0x9b is a CSI to some terminals).
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7f, *range(0x80, 0xa0)) if c != 0x09}


def visible(text: str) -> str:
    """text with every terminal control character written as a visible escape: one line, never a sequence."""
    return text.translate(_CONTROLS)


class VisibleLines:
    """A stream for lines (`fab logs`): each written line shown through `visible`, its newline kept."""

    def __init__(self, out):
        self.out = out

    def write(self, text: str) -> int:
        lines = text.split("\n")
        return self.out.write("\n".join(visible(line) for line in lines))

    def flush(self) -> None:
        self.out.flush()
