"""The one way the bench scripts write their part of bench/RESULTS.md: a section between
`<!-- NAME:begin -->` and `<!-- NAME:end -->` is replaced in place (or appended), and the
rest of the file is left as it was."""

import os


def read_text(path, missing=""):
    """The file's text, or `missing` when there is no such file."""
    if not os.path.exists(path):
        return missing
    with open(path) as f:
        return f.read()


def write_section(path, name, text):
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    old = read_text(path)
    block = f"{begin}\n{text}\n{end}"
    if begin in old and end in old:
        new = old[:old.index(begin)] + block + old[old.index(end) + len(end):]
    else:
        new = old.rstrip() + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(new)
