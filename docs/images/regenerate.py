"""Regenerate the README's pictures from the README's own commands.

    python docs/images/regenerate.py            # run them, copy the pictures here
    python docs/images/regenerate.py --dry-run  # only print the commands

The commands are read from ``README.md``: every ``partitioner`` line of its fenced bash
blocks (in order: the first plans the model the next ones draw) and every inline
```partitioner viz ...``` span. They run in a temporary folder with this checkout's
package; each picture the README shows (``docs/images/<name>``) is copied from the file a
command wrote, as :data:`PICTURES` maps them. A README picture that no command makes, or a
command output that is missing, stops the script with a message: the pictures never drift
from the commands beside them. PNG needs Graphviz (``apt-get install graphviz``).
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
IMAGES = ROOT / "docs" / "images"

#: Each picture the README shows, and the file (relative to the folder the commands run in)
#: that a README command writes it as.
PICTURES = {
    "gpt-graph.png": "out/gpt-graph.png",
    "gpt-timeline.png": "out/gpt-timeline.png",
    "gpt2-xl-graph.png": "xl.png",
}


def readme_commands(text: str) -> list[str]:
    """The README's ``partitioner`` commands: fenced bash lines, then inline spans."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        joined = block.replace("\\\n", " ")
        commands += [line.split("  #")[0].strip() for line in joined.splitlines()
                     if line.strip().startswith("partitioner ")]
    commands += re.findall(r"`(partitioner viz [^`]+)`", text)
    return list(dict.fromkeys(" ".join(c.split()) for c in commands))


def shown_pictures(text: str) -> set[str]:
    """The ``docs/images/`` files the README shows or links."""
    return set(re.findall(r"docs/images/([\w.-]+\.(?:png|svg))", text))


def check(text: str) -> list[str]:
    """What is wrong between the README and :data:`PICTURES` (empty when nothing)."""
    problems = [f"README shows docs/images/{name} but PICTURES does not say which command "
                "makes it; add it to PICTURES in docs/images/regenerate.py"
                for name in sorted(shown_pictures(text) - set(PICTURES))]
    outputs = " ".join(readme_commands(text))
    problems += [f"no README command writes {made} (for docs/images/{name}); change the "
                 "README's command or PICTURES" for name, made in PICTURES.items()
                 if made not in outputs]
    return problems


def regenerate(dry_run: bool = False) -> list[Path]:
    """Run the README's commands and copy the pictures into ``docs/images``."""
    text = README.read_text()
    problems = check(text)
    if problems:
        sys.exit("\n".join(problems))
    with tempfile.TemporaryDirectory(prefix="partitioner-images-") as folder:
        for command in readme_commands(text):
            print(f"+ {command}", flush=True)
            if not dry_run:
                words = shlex.split(command)
                subprocess.run([sys.executable, "-m", "partitioner.cli", *words[1:]],
                               cwd=folder, check=True)
        if dry_run:
            return []
        written = []
        for name, made in PICTURES.items():
            shutil.copyfile(Path(folder) / made, IMAGES / name)
            written.append(IMAGES / name)
            print(f"{IMAGES / name} <- {made}")
        return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="only print the commands")
    regenerate(parser.parse_args().dry_run)


if __name__ == "__main__":
    main()
