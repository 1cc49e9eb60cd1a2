"""The one way the bench scripts write their part of bench/RESULTS.md: a section between
`<!-- NAME:begin -->` and `<!-- NAME:end -->` is replaced in place (or appended), and the
rest of the file is left as it was."""

import os


def write_section(path, name, text):
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    old = open(path).read() if os.path.exists(path) else ""
    block = f"{begin}\n{text}\n{end}"
    if begin in old and end in old:
        new = old[:old.index(begin)] + block + old[old.index(end) + len(end):]
    else:
        new = old.rstrip() + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(new)
