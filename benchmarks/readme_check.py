"""Does the README's first length result still come out of its own commands? Run before committing a change to a
kernel, the model or an evaluation default.

Runs the README's "first length result" commands exactly as written (two micro models trained on
`synthetic:markov`, then `eval.py`), with their `runs/` folder moved to a fresh temporary one, then compares the
figures the README's next paragraph states (DeBERTa's loss at 1x and 8x, BERT's at 1x and 8x with its untrained
rows, the unigram floor and the oracle at 1x) with the ones `eval.py` wrote to its summary, and the wall time with
the README's. Prints one line per figure and exits 1 when any differs (by more than `--tolerance`, default 0: the
runs are deterministic on a CPU), with the sentence to paste in.

    .venv/bin/python benchmarks/readme_check.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SECTION = "A first length result"
# The paragraph after the commands, figure by figure: (name, pattern with one group, (summary row, column)).
FIGURES = [
    ("DeBERTa 1x", r"\((\d+\.\d+) at 1x, \d+\.\d+ at 8x\)", ("deberta-markov", "none", "1x")),
    ("DeBERTa 8x", r"\(\d+\.\d+ at 1x, (\d+\.\d+) at 8x\)", ("deberta-markov", "none", "8x")),
    ("BERT 1x", r"unigram floor \((\d+\.\d+) at 1x", ("bert-markov", "untrained", "1x")),
    ("unigram floor", r"against the floor's (\d+\.\d+)", ("unigram", "none", "1x")),
    ("BERT 8x (untrained rows)", r"(\d+\.\d+) at 8x untrained rows", ("bert-markov", "untrained", "8x")),
    ("oracle 1x", r"the oracle is at (\d+\.\d+)", ("oracle", "none", "1x")),
]
SECONDS = r"\((\d+) s for all three commands"


def readme_section(text: str) -> tuple[str, str, str]:
    """(the sentence that states the time, the commands, the paragraph of figures after them)."""
    start = text.index(SECTION)
    intro, rest = text[start:].split("```bash\n", 1)
    commands, rest = rest.split("```", 1)
    paragraph = rest.strip().split("\n\n", 1)[0]
    return intro, commands, " ".join(paragraph.split())


def summary_table(summary: str) -> dict[tuple[str, str, str], float]:
    """(model, policy, column) -> the mean of the chunked masked-token loss table in `eval.py`'s summary.md."""
    table = summary.split("chunked, masked-token loss", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in table.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    values = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        for column, cell in zip(header[3:], cells[3:]):
            if cell and cell != "–":
                values[cells[0], cells[1], column] = float(cell.split()[0])
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", default=None, help="run in this folder and keep it (default: a temporary one)")
    parser.add_argument("--tolerance", type=float, default=0.0, help="allowed difference per figure, in nats")
    args = parser.parse_args(argv)
    intro, commands, paragraph = readme_section((REPO / "README.md").read_text())
    folder = Path(args.keep or tempfile.mkdtemp(prefix="readme-check-"))
    folder.mkdir(parents=True, exist_ok=True)
    script = re.sub(r"\bruns/", f"{folder}/", commands)
    print(f"running the README's commands with runs/ in {folder}:\n{script}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(["bash", "-e", "-c", script], cwd=REPO)
    seconds = time.perf_counter() - start
    if done.returncode:
        print(f"the README's commands failed (exit {done.returncode})")
        return 1
    summary = next(folder.glob("*/summary.md")).read_text()
    measured = summary_table(summary)
    stated_seconds = re.search(SECONDS, " ".join(intro.split()))
    print(f"\n{'figure':<26} {'README':>8} {'now':>8}")
    wrong = []
    for name, pattern, key in FIGURES:
        found = re.search(pattern, paragraph)
        stated = float(found.group(1)) if found else None
        now = measured.get(key)
        same = stated is not None and now is not None and abs(stated - now) <= args.tolerance
        print(f"{name:<26} {stated if stated is not None else '?':>8} {now if now is not None else '?':>8}"
              f"{'' if same else '   DIFFERS'}")
        if not same:
            wrong.append(name)
    print(f"{'seconds, all three':<26} {stated_seconds.group(1) if stated_seconds else '?':>8} {seconds:>8.0f}"
          "   (machine-dependent: reported, not checked)")
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    if wrong:
        print(f"\nthe README states other figures than its commands give ({', '.join(wrong)}); its paragraph, "
              "with today's figures: DeBERTa's loss falling with length "
              f"({measured[FIGURES[0][2]]:.3f} at 1x, {measured[FIGURES[1][2]]:.3f} at 8x) while BERT stays at the "
              f"unigram floor ({measured[FIGURES[2][2]]:.3f} at 1x against the floor's {measured[FIGURES[3][2]]:.3f}, "
              f"{measured[FIGURES[4][2]]:.3f} at 8x untrained rows), ...; the oracle is at "
              f"{measured[FIGURES[5][2]]:.3f}.")
        return 1
    print("\nthe README's figures are what its commands give")
    return 0


if __name__ == "__main__":
    sys.exit(main())
