"""Spawned workers run the user's script again: refuse, at once, to start them from its unguarded top level.

multiprocessing's spawn imports the `__main__` script in every new process (as `__mp_main__`), so
code at the script's top level runs once per worker. An engine created there would create itself again
in each worker, which then dies trying to start workers of its own ("worker rank 0 exited
unexpectedly"). Code under `if __name__ == "__main__":` does not run in the workers; neither does code
typed interactively, in a notebook or with `python -c` (no script file to re-run).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import FrameType

from llmplug.core.errors import StartupError

__all__ = ["check_main_guard"]


def check_main_guard(what: str) -> None:
    """StartupError when the caller runs in top-level code of the `__main__` script outside a main guard.

    `what` names what is being started, for the message (e.g. "2 worker processes").
    """
    found = unguarded_main_line()
    if found is None:
        return
    script, line = found
    raise StartupError(
        f"{script}, line {line}: this line runs at the top level of the script and starts {what} with "
        "multiprocessing's spawn, which runs the script again in each of them (and so this line again). "
        'Put the code that creates the engine under `if __name__ == "__main__":` (or in a function called '
        "from there); see https://docs.python.org/3/library/multiprocessing.html#the-spawn-and-forkserver-start-methods"
    )


def unguarded_main_line() -> tuple[str, int] | None:
    """(script, line) of the `__main__` top-level statement this call comes from, when it is outside an
    `if __name__ == "__main__":` block; None when the call does not come from there, or is guarded."""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if main is None or script is None:  # interactive, notebook, python -c: nothing is re-run
        return None
    frame = _top_level_frame(vars(main))
    if frame is None:
        return None
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):  # no readable source: cannot tell, let spawn decide
        return None
    return None if _is_guarded(tree, frame.f_lineno) else (script, frame.f_lineno)


def _top_level_frame(main_globals: dict) -> FrameType | None:
    """The frame running the main script's module-level code, if it is on the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals is main_globals and frame.f_code.co_name == "<module>":
            return frame
        frame = frame.f_back
    return None


def _is_guarded(tree: ast.Module, line: int) -> bool:
    """True when `line` lies in the body of an `if __name__ == "__main__":` block."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.body:
            if node.body[0].lineno <= line <= (node.body[-1].end_lineno or node.body[-1].lineno):
                return True
    return False


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    values = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and values == ["__main__"]
