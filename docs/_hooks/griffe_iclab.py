"""A griffe extension for the API reference: Unicode formulas of the docstrings become TeX
(:mod:`unicode_tex`), and Sphinx roles (``:func:`x```) and reST literals (````x````) become Markdown code."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import griffe

sys.path.insert(0, str(Path(__file__).parent))
from unicode_tex import mark_formulas  # noqa: E402

_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc|const):`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")
_SECTION = re.compile(r"^\s*(Args|Arguments|Returns|Raises|Yields|Attributes|Examples?|Notes?|Warns):\s*$")


def convert(text: str) -> str:
    """A docstring as Markdown with its formulas marked (not in code blocks, not in argument names)."""
    out, literal_block, fence, section = [], False, False, False
    section_kind, item_indent = "other", 10**6
    for line in text.splitlines():
        indented = line.startswith((" ", "\t"))
        if line.strip().startswith("```"):
            fence = not fence
        if literal_block and line.strip() and not indented:
            literal_block = False
        if fence or literal_block or line.strip().startswith("```"):
            out.append(line)
            continue
        if line.rstrip().endswith("::"):  # a reST literal block follows: Markdown shows it as code
            literal_block = True
            out.append(line[:-1] if line.rstrip().endswith(" ::") is False else line.rstrip()[:-3])
            continue
        line = _ROLE.sub(lambda m: f"`{m.group(1)}`", line)
        line = _LITERAL.sub(lambda m: f"`{m.group(1)}`", line)
        if _SECTION.match(line):
            section = True
            section_kind = "args" if _SECTION.match(line).group(1) in ("Args", "Arguments") else "other"
            item_indent = 10**6
        elif section and indented:
            item = re.match(r"^(\s+[\w*]+(?:,\s*[\w*]+)*(?:\s*\([^)]*\))?:\s)(.*)$", line)
            if item:
                line = item.group(1) + mark_formulas(item.group(2))
                item_indent = len(line) - len(line.lstrip())
            else:
                # a continuation written at the items' own indentation (Google style wants it deeper)
                if section_kind == "args" and item_indent < 10**6 and len(line) - len(line.lstrip()) <= item_indent:
                    line = " " * (item_indent + 4) + line.lstrip()
                line = mark_formulas(line)
        else:
            section = section and not line.strip() == "" and indented
            line = mark_formulas(line)
        out.append(line)
    return "\n".join(out)


class UnicodeMath(griffe.Extension):
    """Rewrites every docstring of a loaded package once (aliases share their target's docstring)."""

    def on_package(self, *, pkg, **kwargs) -> None:
        self._walk(pkg, set())

    def _walk(self, obj, seen: set) -> None:
        for member in obj.members.values():
            if member.is_alias or id(member) in seen:
                continue
            seen.add(id(member))
            if member.docstring is not None:
                member.docstring.value = convert(member.docstring.value)
            if member.is_module or member.is_class:
                self._walk(member, seen)
