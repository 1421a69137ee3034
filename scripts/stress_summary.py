"""Summarise the runs of ``scripts/stress_test.sh``: each run's time and counts, then every
test that failed or errored in any run, with how often and the first line of its message.

    python scripts/stress_summary.py DIR     (DIR holds run_<i>.xml and run_<i>.seconds)
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path


def read_run(xml_path: Path) -> tuple[dict[str, int], dict[str, str]]:
    """(counts, failed test id -> first line of its message) of one JUnit XML file."""
    counts = {"tests": 0, "failure": 0, "error": 0, "skipped": 0}
    failed: dict[str, str] = {}
    for case in ElementTree.parse(xml_path).getroot().iter("testcase"):
        counts["tests"] += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for outcome in ("failure", "error", "skipped"):
            found = case.find(outcome)
            if found is None:
                continue
            counts[outcome] += 1
            if outcome != "skipped":
                message = (found.get("message") or found.text or "").strip().splitlines()
                failed[name] = message[0][:160] if message else outcome
    return counts, failed


def summarise(folder: Path) -> str:
    runs = sorted(folder.glob("run_*.xml"), key=lambda p: int(p.stem.split("_")[1]))
    if not runs:
        return f"no run_*.xml in {folder}: no run finished"
    lines = []
    failures: dict[str, list[int]] = defaultdict(list)
    messages: dict[str, str] = {}
    for path in runs:
        number = int(path.stem.split("_")[1])
        seconds_file = path.with_suffix(".seconds")
        seconds = seconds_file.read_text().strip() if seconds_file.exists() else "?"
        try:
            counts, failed = read_run(path)
        except ElementTree.ParseError as error:
            lines.append(f"run {number}: unreadable {path.name} ({error})")
            continue
        passed = counts["tests"] - counts["failure"] - counts["error"] - counts["skipped"]
        lines.append(f"run {number}: {passed} passed, {counts['failure']} failed, "
                     f"{counts['error']} errors, {counts['skipped']} skipped in {seconds} s")
        for name, message in failed.items():
            failures[name].append(number)
            messages.setdefault(name, message)
    if failures:
        lines.append(f"{len(failures)} test(s) failed in at least one of {len(runs)} run(s):")
        for name, numbers in sorted(failures.items(), key=lambda item: (-len(item[1]), item[0])):
            lines.append(f"  {len(numbers)}/{len(runs)}  {name}  (runs {numbers}): {messages[name]}")
    else:
        lines.append(f"no test failed in {len(runs)} run(s)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: stress_summary.py DIR (a folder written by scripts/stress_test.sh)", file=sys.stderr)
        return 2
    print(summarise(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
