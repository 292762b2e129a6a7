"""A terminal's screen as a PNG: docs/demo_run.png and docs/demo_status.png were drawn with it.

    tmux capture-pane -e -p -t SESSION > screen.ansi
    python3 tools/term_png.py screen.ansi picture.png

The escape codes of the capture (colours, bold) are read by Rich (`Text.from_ansi`) and each cell is
drawn in DejaVu Sans Mono (matplotlib ships it) by Pillow; trailing blank lines are dropped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont
from rich.color import Color
from rich.console import Console
from rich.style import Style
from rich.terminal_theme import MONOKAI
from rich.text import Text

FONT_SIZE = 15
PAD = 12


def _font(bold: bool) -> ImageFont.FreeTypeFont:
    import matplotlib

    name = "DejaVuSansMono-Bold.ttf" if bold else "DejaVuSansMono.ttf"
    return ImageFont.truetype(str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / name), FONT_SIZE)


def _rgb(color: Color | None, default: tuple[int, int, int]) -> tuple[int, int, int]:
    if color is None or color.is_default:
        return default
    return color.get_truecolor(MONOKAI).rgb


def render(ansi: str) -> Image.Image:
    lines = [Text.from_ansi(l) for l in ansi.rstrip("\n").split("\n")]
    while lines and not lines[-1].plain.strip():
        lines.pop()
    regular, bold = _font(False), _font(True)
    cell_w = regular.getbbox("M")[2]
    cell_h = int(FONT_SIZE * 1.35)
    cols = max((len(l.plain) for l in lines), default=1)
    bg, fg = MONOKAI.background_color.rgb, MONOKAI.foreground_color.rgb
    img = Image.new("RGB", (cols * cell_w + 2 * PAD, len(lines) * cell_h + 2 * PAD), bg)
    draw = ImageDraw.Draw(img)
    console = Console(width=cols + 1, color_system="truecolor")
    for row, line in enumerate(lines):
        y, col = PAD + row * cell_h, 0
        for seg in line.render(console):
            style: Style = seg.style or Style()
            for ch in seg.text:
                x = PAD + col * cell_w
                back = _rgb(style.bgcolor, bg)
                if back != bg:
                    draw.rectangle([x, y, x + cell_w, y + cell_h], fill=back)
                if ch != " ":
                    draw.text((x, y), ch, font=bold if style.bold else regular, fill=_rgb(style.color, fg))
                col += 1
    return img


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ansi", type=Path, help="a capture with escape codes (tmux capture-pane -e -p)")
    p.add_argument("png", type=Path)
    a = p.parse_args()
    render(a.ansi.read_text()).save(a.png, optimize=True)
    print(a.png)


if __name__ == "__main__":
    main()
