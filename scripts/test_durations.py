"""Per-file test time from a pytest ``--durations`` listing, for tests/durations.json.

    python scripts/test_durations.py SUITE_LOG > tests/durations.json

SUITE_LOG is the output of a whole-suite run with ``--durations=0`` (or ``--durations=N``: files with no test in the
listing are left out). tests/conftest.py hands the files to the two test processes slowest first, so that they end
together; see its ``pytest_collection_modifyitems``.
"""

from __future__ import annotations

import collections
import json
import re
import sys

LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+?\.py)::")


def main(path: str) -> None:
    seconds: collections.Counter[str] = collections.Counter()
    with open(path) as log:
        for line in log:
            match = LINE.match(line)
            if match:
                seconds[match.group(2)] += float(match.group(1))
    json.dump({name: round(s) for name, s in seconds.most_common()}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main(sys.argv[1])
