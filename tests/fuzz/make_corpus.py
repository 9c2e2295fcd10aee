"""Write the generated seed corpora (``python -m tests.fuzz.make_corpus``): for each target in
:data:`tests.fuzz.targets.SEEDS`, ``tests/fuzz/corpus/NAME/seed-N`` with what a real sender or writer produces
(the committed files are its output; the other targets' seeds were written by hand)."""

from __future__ import annotations

import sys

from tests.fuzz.run import CORPUS
from tests.fuzz.targets import SEEDS


def main() -> int:
    for name, make in sorted(SEEDS.items()):
        folder = CORPUS / name
        folder.mkdir(parents=True, exist_ok=True)
        for i, data in enumerate(make()):
            (folder / f"seed-{i}").write_bytes(data)
        print(f"{name}: {len(list(folder.iterdir()))} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
