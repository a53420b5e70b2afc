"""Formulas in iclab's docstrings, written in Unicode (``L(M_m) = trΛ − Σ_{d≤m} λ_d``), as TeX.

The docstrings stay readable in a terminal (``help()``, ``iclab show``); the site renders the same
formulas with KaTeX. :func:`mark_formulas` finds the formula runs of a line (a relation between
maths tokens, bounded by words of prose) and wraps each in ``\\( … \\)`` (pymdownx.arithmatex), TeX
produced by :func:`to_tex`. A run that cannot be delimited (unbalanced brackets) stays text. Every
converted formula starts with ``{}`` (TeX ignores it) so the renderer can tell it from hand-written maths:
a converted formula KaTeX rejects falls back to its Unicode text, a hand-written one fails the build.
"""

from __future__ import annotations

import re

AUTO = "{}"  # prefix of every converted formula

GREEK = {
    "α": "alpha", "β": "beta", "γ": "gamma", "δ": "delta", "ε": "varepsilon", "ϵ": "epsilon", "ζ": "zeta",
    "η": "eta", "θ": "theta", "ι": "iota", "κ": "kappa", "λ": "lambda", "μ": "mu", "ν": "nu", "ξ": "xi",
    "π": "pi", "ρ": "rho", "σ": "sigma", "τ": "tau", "υ": "upsilon", "φ": "varphi", "ϕ": "phi", "χ": "chi",
    "ψ": "psi", "ω": "omega", "Γ": "Gamma", "Δ": "Delta", "Θ": "Theta", "Λ": "Lambda", "Ξ": "Xi", "Π": "Pi",
    "Φ": "Phi", "Ψ": "Psi", "Ω": "Omega",
}
SYMBOLS = {
    "−": "-", "·": r"\cdot ", "×": r"\times ", "≤": r"\le ", "≥": r"\ge ", "≈": r"\approx ", "∝": r"\propto ",
    "⊗": r"\otimes ", "⊙": r"\odot ", "‖": r"\|", "∞": r"\infty ", "∈": r"\in ", "→": r"\to ", "←": r"\leftarrow ",
    "∂": r"\partial ", "∇": r"\nabla ", "⟨": r"\langle ", "⟩": r"\rangle ", "∫": r"\int ", "≠": r"\ne ",
    "±": r"\pm ", "∼": r"\sim ", "~": r"\sim ", "…": r"\dots ", "⋯": r"\cdots ", "′": "'", "∑": r"\sum ",
    "∏": r"\prod ", "ℝ": r"\mathbb{R}", "≪": r"\ll ", "≫": r"\gg ", "∘": r"\circ ", "⊤": r"\top ", "†": r"\dagger ",
    "∀": r"\forall ", "∧": r"\wedge ", "∨": r"\vee ", "⇒": r"\Rightarrow ", "≡": r"\equiv ", "ℓ": r"\ell ",
    "%": r"\%", "#": r"\#", "&": r"\&", "$": r"\$", "≔": ":=", "∅": r"\emptyset ", "⌊": r"\lfloor ",
    "⌋": r"\rfloor ", "⌈": r"\lceil ", "⌉": r"\rceil ", "∖": r"\setminus ", "∪": r"\cup ", "∩": r"\cap ",
    "⊆": r"\subseteq ", "⊂": r"\subset ", "°": r"^\circ ", "′′": "''", "∣": r"\mid ",
}
SUPER = dict(zip("⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺ᵀⁿⁱᵏʰᵗ⁽⁾ᐟ", "0123456789-+TnikhT()/"))
SUB = dict(zip("₀₁₂₃₄₅₆₇₈₉₋₊ᵢⱼₖₙₘₜₚₛₓₐₑₒₗₕᵣ", "0123456789-+ijknmtpsxaeolhr"))
ACCENTS = {"\u0302": "hat", "\u0304": "bar", "\u0303": "tilde", "\u0307": "dot", "\u0305": "bar", "\u20d7": "vec"}
FUNCTIONS = {"tr", "diag", "exp", "log", "ln", "det", "vec", "sign", "min", "max", "argmin", "argmax", "arctan",
             "sigmoid", "softmax", "relu", "Cov", "Var", "blockdiag", "mean", "sin", "cos", "tanh", "rank", "erf",
             "sup", "inf", "lim", "logit"}
# Short words of prose that end a formula (single letters and two-letter symbols are maths).
PROSE = {"of", "to", "in", "is", "at", "on", "by", "or", "if", "as", "an", "be", "eq", "Eq", "no", "so", "we",
         "it", "up", "vs", "do", "e.g.", "i.e.", "cf.", "and", "the", "for"}
RELATIONS = ("=", "≈", "≤", "≥", "∝", "<", ">", "≠", "∈", "~", "∼", "≡", "→")
_WORD = re.compile(r"^[A-Za-z][A-Za-z'’\-]*[A-Za-z]$")


def _core(token: str) -> str:
    return token.strip("([{").rstrip(",.;:)]}!?")


def _is_math(token: str) -> bool:
    if any(c in token for c in "`\"“”§@") or "://" in token or token.startswith("'"):
        return False
    core = _core(token)
    if not core:
        return bool(token) and all(c in "()[]{}" for c in token)
    if core in PROSE:
        return False
    if core in FUNCTIONS:
        return True
    if len(core) >= 3 and _WORD.match(core):  # a word of prose (letters, hyphens, apostrophes)
        return False
    return True


def _balanced(text: str) -> bool:
    depth = {"(": 0, "[": 0, "{": 0}
    close = {")": "(", "]": "[", "}": "{"}
    stack = []
    for c in text:
        if c in depth:
            stack.append(c)
        elif c in close:
            if not stack or stack[-1] != close[c]:
                return False
            stack.pop()
    return not stack


def _trim(text: str) -> str:
    """Drops trailing punctuation and unmatched brackets at the ends."""
    for _ in range(8):
        old = text
        text = text.rstrip(",.;: ")
        if text.endswith((")", "]", "}")) and not _balanced(text):
            text = text[:-1]
        if text.startswith(("(", "[", "{")) and not _balanced(text):
            text = text[1:]
        if text == old:
            break
    return text


def mark_formulas(line: str) -> str:
    """The line with each formula run wrapped as ``\\({}TeX\\)``; code spans and prose untouched."""
    if "\\(" in line or "$" in line:
        return line
    # code spans are kept out of the tokeniser (``x`` and `x`)
    parts = re.split(r"(``.*?``|`[^`]*`)", line)
    return "".join(p if p.startswith("`") else _mark_text(p) for p in parts)


def _mark_text(text: str) -> str:
    pieces = re.split(r"(\s+)", text)
    tokens = pieces[0::2]
    out, i = [], 0
    while i < len(tokens):
        if not tokens[i] or not _is_math(tokens[i]):
            out.append((i, i + 1, None))
            i += 1
            continue
        j = i
        while j < len(tokens) and tokens[j] and _is_math(tokens[j]):
            j += 1
        out.append((i, j, True))
        i = j
    result = []
    for start, end, math in out:
        raw = "".join(pieces[2 * start: 2 * end - 1])
        if math:
            raw = _wrap(raw)
        result.append(raw)
        if 2 * end - 1 < len(pieces):
            result.append(pieces[2 * end - 1])
    return "".join(result)


def _wrap(run: str) -> str:
    """The run with its longest well-delimited formula wrapped (or unchanged)."""
    tokens = run.split(" ")
    for size in range(len(tokens), 0, -1):
        for first in range(0, len(tokens) - size + 1):
            inner = _trim(" ".join(tokens[first:first + size]))
            if _formula(inner):
                start = run.index(inner)
                try:
                    tex = to_tex(inner)
                except ValueError:
                    return run
                return run[:start] + "\\(" + AUTO + tex + "\\)" + run[start + len(inner):]
    return run


def _formula(inner: str) -> bool:
    if not inner or not any(r in inner for r in RELATIONS) or not _balanced(inner):
        return False
    if inner.startswith(RELATIONS) or inner.endswith(RELATIONS):
        return False
    return len(inner.split()) >= 3 or bool(re.search(r"[=≈≤≥∝~∼]", inner))


def to_tex(text: str) -> str:
    """TeX for a Unicode formula: Greek letters, operators, super- and subscripts, accents, function names.

    Raises:
        ValueError: a character with no TeX form here.
    """
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in ACCENTS:  # a combining accent applies to the previous atom
            if not out:
                raise ValueError("accent without a base")
            out[-1] = f"\\{ACCENTS[c]}{{{out[-1]}}}"
            i += 1
            continue
        if c in SUPER:
            j = i
            while j < n and text[j] in SUPER:
                j += 1
            sup = "".join(SUPER[x] for x in text[i:j]).replace("T", r"\top ")
            out.append(f"^{{{sup}}}")
            i = j
            continue
        if c in SUB:
            j = i
            while j < n and text[j] in SUB:
                j += 1
            out.append("_{" + "".join(SUB[x] for x in text[i:j]) + "}")
            i = j
            continue
        if c in "_^":
            if i + 1 < n and text[i + 1] == "{":
                depth, j = 0, i + 1
                while j < n:
                    depth += {"{": 1, "}": -1}.get(text[j], 0)
                    if depth == 0:
                        break
                    j += 1
                out.append(c + "{" + to_tex(text[i + 2: j]) + "}")
                i = j + 1
                continue
            m = re.match(r"[A-Za-z0-9]+|[^\sA-Za-z0-9]", text[i + 1:])
            if not m:
                raise ValueError("empty script")
            out.append(c + "{" + to_tex(m.group(0)) + "}")
            i += 1 + len(m.group(0))
            continue
        if c == "√":
            if i + 1 < n and text[i + 1] == "(":
                depth, j = 0, i + 1
                while j < n:
                    depth += {"(": 1, ")": -1}.get(text[j], 0)
                    if depth == 0:
                        break
                    j += 1
                out.append(r"\sqrt{" + to_tex(text[i + 2: j]) + "}")
                i = j + 1
                continue
            m = re.match(r"[A-Za-z0-9.]+|[^\s]", text[i + 1:])
            if not m:
                raise ValueError("empty root")
            out.append(r"\sqrt{" + to_tex(m.group(0)) + "}")
            i += 1 + len(m.group(0))
            continue
        if c == "Σ":
            nxt = text[i + 1] if i + 1 < n else ""
            out.append(r"\sum " if nxt == "_" or nxt in SUB else r"\Sigma ")
            i += 1
            continue
        if c == "*" and i > 0 and text[i - 1] != " ":
            out.append("^{*}")
            i += 1
            continue
        if c in GREEK:
            out.append("\\" + GREEK[c] + " ")
            i += 1
            continue
        if c in SYMBOLS:
            out.append(SYMBOLS[c])
            i += 1
            continue
        if c.isascii() and c.isalpha():
            j = i
            while j < n and text[j].isascii() and text[j].isalpha():
                j += 1
            word = text[i:j]
            if len(word) == 1:
                out.append(word)
            elif word in FUNCTIONS:
                out.append(rf"\operatorname{{{word}}}")
            elif word.startswith("tr") and len(word) <= 3:  # trA, trΣ written without a space
                out.append(r"\operatorname{tr}" + " ".join(word[2:]))
            else:
                out.append(rf"\mathrm{{{word}}}")
            i = j
            continue
        if c.isascii() or c.isspace():
            out.append("\\" + c if c in "\\" else c)
            i += 1
            continue
        raise ValueError(f"no TeX for {c!r}")
    return "".join(out)
