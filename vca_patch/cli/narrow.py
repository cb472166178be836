"""Tables on narrow terminals: a table that rich would have to squeeze (a column dropped, a name folded into
slivers) is printed as a plain listing instead, one row a line, every cell whole.

rich lays a table out to the console's width and, below the table's minimum, narrows columns until some get one
character or none: at COLUMNS=20 `inspect` lost its module-name column, at COLUMNS=1 it printed one character a
line. The listing keeps every row and every name whole and lets the terminal wrap the long lines.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

MIN_WIDTH = 20  # narrower than this, text is laid out at this width (and tables listed); the terminal wraps it
PIPED_WIDTH = 160  # piped or captured without COLUMNS: no terminal to fit, so tables are not squeezed into 80
FOLD_MIN = 8  # a column narrower than its longest word, and narrower than this, no longer reads as a column


def console_width(columns: str | None, is_terminal: bool) -> int:
    """The width to lay output out at: COLUMNS when a positive number, else the terminal's width (a terminal) or
    PIPED_WIDTH (piped or captured); never below MIN_WIDTH. COLUMNS=0 or garbage means "not set", as in POSIX."""
    if columns and columns.isdigit() and int(columns) > 0:
        width = int(columns)
    elif is_terminal:
        width = shutil.get_terminal_size((80, 24)).columns  # skips a COLUMNS of 0 and reads the terminal itself
    else:
        width = PIPED_WIDTH
    return max(width, MIN_WIDTH)


def env_console_width(is_terminal: bool) -> int:
    """`console_width` for this process's COLUMNS."""
    return console_width(os.environ.get("COLUMNS"), is_terminal)


def floor_typer_width() -> None:
    """Give typer's own consoles (usage errors, --help) the same floor: they read COLUMNS themselves, and COLUMNS=0
    printed nothing, COLUMNS=1 one character a line. A COLUMNS that is fine, or TERMINAL_WIDTH, is left to typer."""
    import typer.rich_utils

    columns = os.environ.get("COLUMNS")
    if columns is None or "TERMINAL_WIDTH" in os.environ or (columns.isdigit() and int(columns) >= MIN_WIDTH):
        return
    typer.rich_utils.MAX_WIDTH = max(shutil.get_terminal_size((80, 24)).columns, MIN_WIDTH)


def fit_tables(console: Console, objects: Sequence[Any]) -> tuple[list[Any], bool]:
    """`objects` to print, each table too narrow for `console` replaced by its listing; and whether any was (the
    caller prints those with soft wrapping, so no listing line is folded or cut at the console's width)."""
    fitted = [listing(item) if isinstance(item, Table) and is_cramped(console, item) else item for item in objects]
    return fitted, any(new is not old for new, old in zip(fitted, objects, strict=True))


def is_cramped(console: Console, table: Table) -> bool:
    """Whether rich, laying `table` out at the console's width, would give some column less room than its longest
    word (a name folded) while also less than FOLD_MIN characters, or none at all.

    The column widths are rich's own layout (the private `_calculate_column_widths`, stable since rich 10; the
    narrow-terminal tests pin what it gives)."""
    if not table.columns:
        return False
    max_width = (table.width or console.width) - table._extra_width
    widths = table._calculate_column_widths(console, console.options.update_width(max(max_width, 1)))
    for index, (width, column) in enumerate(zip(widths, table.columns, strict=True)):
        room = width - table._get_padding_width(index)
        words = [_longest_word(cell) for cell in (column.header, *column.cells)]
        if room < min(max(words), FOLD_MIN):
            return True
    return False


def listing(table: Table) -> Text:
    """`table` as lines: its title, then one line per row. With a header, "header: value" for each non-empty cell
    (an empty one is left out; a row whose first cell is empty, the rest of a group, is indented under the group's
    first row); without one (a key/value table), "key: value; value"."""
    headers = [_flat(column.header) for column in table.columns]
    headed = table.show_header and any(header.plain for header in headers)
    lines = [_flat(table.title)] if table.title else []
    for row in zip(*(list(column.cells) for column in table.columns), strict=True):
        cells = [_flat(cell) for cell in row]
        if headed:
            named = [Text.assemble(name, ": ", cell) for name, cell in zip(headers, cells, strict=True) if cell.plain]
            lines.append(Text.assemble("" if cells[0].plain else "  ", Text("; ").join(named)))
        else:
            values = [cell for cell in cells[1:] if cell.plain]
            lines.append(Text.assemble(cells[0], ": " if values else "", Text("; ").join(values)))
    if table.caption:
        lines.append(_flat(table.caption))
    return Text("\n").join(lines)


def _flat(cell: Any) -> Text:
    """A cell as one line of (styled) text: markup read as rich reads it in a table, lines joined by a space."""
    if isinstance(cell, str):
        text = Text.from_markup(cell)
    elif isinstance(cell, Text):
        text = cell.copy()
    else:  # another renderable: its plain rendering
        sink = Console(file=io.StringIO(), width=10_000, color_system=None)
        with sink.capture() as captured:
            sink.print(cell)
        text = Text(captured.get())
    return Text(" ").join(line for line in text.split("\n") if line.plain.strip())


def _longest_word(cell: Any) -> int:
    words: Iterable[str] = _flat(cell).plain.split()
    return max((len(word) for word in words), default=0)
