"""A tiny RGB canvas that saves itself as a PNG: rectangles and 5x7 bitmap text, stdlib only.

Why not matplotlib: the picture is a Gantt chart (rectangles and labels), which needs ~150 lines of
stdlib code, while matplotlib would add a ~40 MB dependency to every worker image for one CLI flag.
"""

from __future__ import annotations

import struct
import zlib

Color = tuple[int, int, int]

# Classic 5x7 font, column-major: 5 bytes per glyph, bit 0 is the top row. Lowercase has its own glyphs;
# anything else renders as '?'.
_GLYPHS: dict[str, str] = {
    " ": "0000000000", "!": "00005f0000", "#": "147f147f14", "%": "2313086462", "(": "001c224100",
    ")": "0041221c00", "*": "14083e0814", "+": "08083e0808", ",": "0050300000", "-": "0808080808",
    ".": "0060600000", "/": "2010080402", ":": "0036360000", "<": "0814224100", "=": "1414141414",
    ">": "4122140800", "?": "0201510906", "[": "007f414100", "]": "0041417f00", "_": "4040404040",
    "0": "3e5149453e", "1": "00427f4000", "2": "4261514946", "3": "2141454b31", "4": "1814127f10",
    "5": "2745454539", "6": "3c4a494930", "7": "0171090503", "8": "3649494936", "9": "064949291e",
    "A": "7e1111117e", "B": "7f49494936", "C": "3e41414122", "D": "7f4141221c", "E": "7f49494941",
    "F": "7f09090901", "G": "3e4149497a", "H": "7f0808087f", "I": "00417f4100", "J": "2040413f01",
    "K": "7f08142241", "L": "7f40404040", "M": "7f020c027f", "N": "7f0408107f", "O": "3e4141413e",
    "P": "7f09090906", "Q": "3e4151215e", "R": "7f09192946", "S": "4649494931", "T": "01017f0101",
    "U": "3f4040403f", "V": "1f2040201f", "W": "3f4038403f", "X": "6314081463", "Y": "0708700807",
    "Z": "6151494543", "a": "2054545478", "b": "7f48444438", "c": "3844444420", "d": "384444487f",
    "e": "3854545418", "f": "087e090102", "g": "0c5252523e", "h": "7f08040478", "i": "00447d4000",
    "j": "2040443d00", "k": "7f10284400", "l": "00417f4000", "m": "7c04180478", "n": "7c08040478",
    "o": "3844444438", "p": "7c14141408", "q": "081414187c", "r": "7c08040408", "s": "4854545420",
    "t": "043f444020", "u": "3c4040207c", "v": "1c2040201c", "w": "3c4030403c", "x": "4428102844",
    "y": "0c5050503c", "z": "4464544c44",
}

GLYPH_W = 6  # 5 columns and one of spacing
GLYPH_H = 8


class Canvas:
    """An RGB image in memory.

    Args:
        width: pixels.
        height: pixels.
        background: fill color.
    """

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)) -> None:
        self.width = width
        self.height = height
        self._px = bytearray(bytes(background) * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill the rectangle [x0, x1) x [y0, y1), clipped to the canvas."""
        x0, x1 = max(0, x0), min(self.width, x1)
        y0, y1 = max(0, y0), min(self.height, y1)
        if x1 <= x0 or y1 <= y0:
            return
        line = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            start = (y * self.width + x0) * 3
            self._px[start : start + len(line)] = line

    def text(self, x: int, y: int, s: str, color: Color = (0, 0, 0), scale: int = 1) -> int:
        """Draw ``s`` with its top-left corner at (x, y); return the x just after it."""
        for ch in s:
            cols = bytes.fromhex(_GLYPHS.get(ch, _GLYPHS["?"]))
            for cx, bits in enumerate(cols):
                for cy in range(7):
                    if bits >> cy & 1:
                        px, py = x + cx * scale, y + cy * scale
                        self.rect(px, py, px + scale, py + scale, color)
            x += GLYPH_W * scale
        return x

    def pixel(self, x: int, y: int) -> Color:
        """The color at (x, y)."""
        i = (y * self.width + x) * 3
        return (self._px[i], self._px[i + 1], self._px[i + 2])

    def png_bytes(self) -> bytes:
        """Encode as an 8-bit RGB PNG."""
        stride = self.width * 3
        raw = b"".join(b"\x00" + bytes(self._px[y * stride : (y + 1) * stride]) for y in range(self.height))
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(raw, 6))
            + _chunk(b"IEND", b"")
        )

    def save(self, path: str) -> None:
        """Write the PNG to ``path`` (OSError propagates)."""
        with open(path, "wb") as f:
            f.write(self.png_bytes())


def text_width(s: str, scale: int = 1) -> int:
    """Pixels :meth:`Canvas.text` advances for ``s``."""
    return len(s) * GLYPH_W * scale


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)
