"""A pytest plugin that prints the memory of the test run, one line per test module, so a regression shows in CI's log.

The machines CI runs on have 24 GiB for everything (issue 34: the suite once reached 20.8 GiB in pytest's own
process). After each module's last teardown (its module fixtures released) it writes, also under `-q`:

    rss tests/engine/test_llm.py  41.2 s  now 1.21 GB  peak 2.87 GB  children now 0.00 GB  peak 0.31 GB

- `now`: pytest's resident set after the module (what later modules inherit: session fixtures, caches, heap);
- `peak`: the highest resident set *during this module* — the kernel's high-water mark (VmHWM) is reset at each
  module's start by writing 5 to /proc/self/clear_refs, so it is this module's, not the run's so far;
- `children now`: the resident sets of pytest's live descendants (engine worker processes kept by fixtures);
- `children peak`: the largest child that has exited and been waited for, over the run so far (RUSAGE_CHILDREN
  cannot be reset); a `^` marks the module that raised it. A child forked from pytest counts the pages it still
  shares with pytest as its own, so a fork shows about pytest's size here without costing it twice.

At the end: the run's peak with its module, the ten modules of highest peak, and a warning when the peak is over
`rss_budget_gb` (pyproject's pytest settings). Off with `-p no:tests.rss_report`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import resource
import time

import pytest

GB = 1 << 30
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass(slots=True)
class ModuleMemory:
    """What one test module cost: wall time and pytest's resident set (bytes) after it and at its peak."""

    module: str
    seconds: float
    rss_now: int
    rss_peak: int
    children_now: int
    children_peak: int
    raised_children_peak: bool


def _status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM) in bytes; 0 where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return 0
    return int(match.group(1)) * 1024 if match else 0


def _reset_peak() -> bool:
    """Reset this process's high-water mark to its current RSS (Linux >= 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _peak_self() -> int:
    """This process's peak RSS since the last reset (VmHWM), or since its start (ru_maxrss, kB on Linux)."""
    return _status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_children() -> int:
    """The largest RSS of any waited-for descendant over the run (ru_maxrss of RUSAGE_CHILDREN, kB on Linux)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def _live_descendants_rss(root: int) -> int:
    """The summed RSS of `root`'s live descendants, read from /proc (0 where /proc is absent)."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                # the command name may hold spaces and parentheses: the fields start after its last ')'
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[pid] = int(fields[1])
        rss[pid] = int(fields[21]) * _PAGE
    total = 0
    for pid in parents:
        ancestor = parents[pid]
        while ancestor > 1 and ancestor != root:
            ancestor = parents.get(ancestor, 0)
        if ancestor == root:
            total += rss[pid]
    return total


def _gb(n: int) -> str:
    return f"{n / GB:.2f} GB"


class RssReport:
    """Measures each module from its first setup to its last teardown and writes one line for it."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.budget = float(config.getini("rss_budget_gb")) * GB
        self.modules: list[ModuleMemory] = []
        self.current: str | None = None
        self.started = 0.0
        self.run_started = time.monotonic()
        self.children_peak = _peak_children()
        self.can_reset = True

    @staticmethod
    def _module_of(item: pytest.Item | None) -> str | None:
        return None if item is None else item.nodeid.split("::", 1)[0]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        module = self._module_of(item)
        if module != self.current:
            self.current, self.started = module, time.monotonic()
            self.can_reset = _reset_peak()
        result = yield
        if self._module_of(nextitem) != module:
            self._module_done(module)
        return result

    def _module_done(self, module: str) -> None:
        children_peak = _peak_children()
        record = ModuleMemory(
            module=module,
            seconds=time.monotonic() - self.started,
            rss_now=_status_bytes("VmRSS"),
            rss_peak=_peak_self(),
            children_now=_live_descendants_rss(os.getpid()),
            children_peak=children_peak,
            raised_children_peak=children_peak > self.children_peak,
        )
        self.children_peak = children_peak
        self.modules.append(record)
        self._write(
            f"rss {record.module}  {record.seconds:.1f} s  now {_gb(record.rss_now)}  peak {_gb(record.rss_peak)}"
            f"  children now {_gb(record.children_now)}  peak {_gb(record.children_peak)}"
            + (" ^" if record.raised_children_peak else "")
        )

    def _write(self, line: str) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            # under -q the progress dots have no newline of their own (ensure_newline only ends a file-name line)
            if reporter._tw.width_of_current_line:
                reporter.write("\n")
            reporter.write_line(line)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.modules:
            return
        # a session fixture with params interleaves modules (pytest groups items by param): one row per module
        merged: dict[str, ModuleMemory] = {}
        for m in self.modules:
            seen = merged.get(m.module)
            merged[m.module] = m if seen is None else dataclasses.replace(
                m, seconds=seen.seconds + m.seconds, rss_peak=max(seen.rss_peak, m.rss_peak))
        modules = list(merged.values())
        worst = max(modules, key=lambda m: m.rss_peak)
        # without a per-module reset, each module's "peak" is the run's so far: the first to reach it is the culprit
        peak_kind = "per-module high-water marks" if self.can_reset else "run high-water mark (no per-module reset)"
        terminalreporter.section("memory (tests/rss_report.py)", sep="-")
        terminalreporter.write_line(f"highest module peaks ({peak_kind}):")
        for m in sorted(modules, key=lambda m: m.rss_peak, reverse=True)[:10]:
            terminalreporter.write_line(f"  {_gb(m.rss_peak):>9}  {m.seconds:7.1f} s  {m.module}")
        over = worst.rss_peak > self.budget
        terminalreporter.write_line(
            f"rss summary: pytest peak {_gb(worst.rss_peak)} in {worst.module}; children peak"
            f" {_gb(self.children_peak)}; {len(modules)} modules in {time.monotonic() - self.run_started:.0f} s;"
            f" budget {_gb(int(self.budget))}" + (" -- OVER BUDGET" if over else ""),
            red=over, bold=over,
        )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("rss_budget_gb", "peak RSS of pytest's process the suite must stay under (GB)", default="12")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(RssReport(config), "rss_report_state")
