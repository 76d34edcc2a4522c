"""Regenerate tests/data/api_spec.json from ../shared/API.md and ../shared/seeds/.

The JSON is committed so the public-surface test runs without the shared folder; when the folder
is present, tests/test_public_api.py checks the committed copy is current.

    python scripts/extract_api_spec.py [SHARED_DIR]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = {
    "T": "notebook_accel",
    "U": "notebook_accel.utils",
}


def _paths(cell: str) -> list[str]:
    out = []
    for part in re.split(r",\s*", cell.strip()):
        part = part.strip().strip("`")
        if part in PATHS:
            out.append(PATHS[part])
        elif part.startswith("notebook_accel"):
            out.append(part)
    return out


def parse_api_md(text: str) -> dict[str, list[str]]:
    """Return {name: [module paths]} from API.md's tables."""
    names: dict[str, list[str]] = {}
    for line in text.splitlines():
        if (
            not line.startswith("|")
            or line.startswith("| ---")
            or line.startswith("| name")
            or line.startswith("| group")
        ):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2:
            continue
        first, second = cells[0], cells[1]
        if _paths(second):  # "| name(s) | paths | notes |" tables
            for name in re.split(r",\s*", first):
                name = name.strip()
                if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                    names.setdefault(name, [])
                    for p in _paths(second):
                        if p not in names[name]:
                            names[name].append(p)
        else:  # "| group | names (all at U; those marked * also at T) |"
            cell = re.sub(r"\([^)]*\)", "", second)
            for raw in re.split(r",\s*", cell):
                raw = raw.strip()
                star = raw.endswith("*")
                name = raw.rstrip("*").strip()
                if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                    paths = names.setdefault(name, [])
                    for p in ["notebook_accel.utils"] + (["notebook_accel"] if star else []):
                        if p not in paths:
                            paths.append(p)
    return names


def _names_from_py_sig(sig: str) -> list[str]:
    sig = sig.strip()
    if sig.startswith("("):
        depth, end = 0, len(sig)
        for i, ch in enumerate(sig):
            depth += ch in "[({"
            depth -= ch in "])}"
            if depth == 0:
                end = i
                break
        sig = sig[1:end]
    # Drop defaults and annotations: a parameter name is a word at a token boundary followed by
    # ':' or '=' or the end, and not inside brackets.
    depth = 0
    cleaned = []
    for ch in sig:
        if ch in "[({<":
            if depth == 0 and cleaned and cleaned[-1] in " =":
                cleaned.append(" X ")  # a bracketed default value stands in as one token
            depth += 1
        elif ch in "])}>":
            depth -= 1
        elif depth == 0:
            cleaned.append(ch)
    tokens = "".join(cleaned).split()
    out: list[str] = []
    expect_name = True
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if expect_name and re.fullmatch(r"\*{0,2}[A-Za-z_][A-Za-z0-9_]*:?", tok):
            name = tok.rstrip(":")
            out.append(name)
            if tok.endswith(":"):
                expect_name = False  # annotation follows
            i += 1
            continue
        if tok == "=":
            i += 2  # skip default
            expect_name = True
            continue
        # annotation token
        expect_name = True
        i += 1
    return out


def parse_signatures(seeds: Path) -> dict[str, list[str]]:
    sigs: dict[str, list[str]] = {}
    # Older (0.27) Chinese page first, newer pages override.
    zh = next(seeds.glob("003_*.txt")).read_text(encoding="utf-8")
    current = None
    for line in zh.splitlines():
        m = re.match(r"^#{3,4} `(?:class )?(accelerate\.[A-Za-z0-9_.]+)`", line)
        if m:
            current = m.group(1)
            continue
        if current and line.startswith("( ") or (current and line.strip() == "( )"):
            sigs[current] = _names_from_py_sig(line)
            current = None
    for f in sorted(seeds.glob("00[01]_*.txt")):
        text = f.read_text(encoding="utf-8")
        for m in re.finditer(
            r"<name>(?:class )?(accelerate\.[A-Za-z0-9_.]+)</name>.*?<parameters>(\[.*?\])</parameters>", text
        ):
            sigs[m.group(1)] = [p["name"] for p in json.loads(m.group(2))]
        for m in re.finditer(r"^([a-z_]+)(accelerate\.[A-Za-z0-9_.]+)https://\S+?(\[\{.*\}\])$", text, re.M):
            sigs[m.group(2)] = [p["name"] for p in json.loads(m.group(3))]
    # Enum classes document the functional Enum API, not ours.
    return {k: v for k, v in sorted(sigs.items()) if v[:2] != ["value", "names"]}


def main() -> None:
    shared = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT.parent / "shared"
    spec = {
        "names": parse_api_md((shared / "API.md").read_text(encoding="utf-8")),
        "signatures": parse_signatures(shared / "seeds"),
    }
    out = ROOT / "tests" / "data" / "api_spec.json"
    out.write_text(json.dumps(spec, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {out}: {len(spec['names'])} names, {len(spec['signatures'])} signatures")


if __name__ == "__main__":
    main()
